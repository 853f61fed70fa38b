"""The `moebalance` command line: the parser, logging and main (the exit codes) here; each group
of subcommands in a module of its own, which adds its parsers:

    training.py     train, eval, generate
    experiment.py   ab, study, report, demo
    configs.py      params, plan, keys
    checkpoints.py  convert, export
    options.py      what several subcommands share: -q / -v, --no-compile-cache, CONFIG

`moebalance.cli:entry` is the installed command; `python -m moebalance.cli` runs it too.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import re
import sys

from moebalance import __version__
from moebalance.cli import checkpoints, configs, experiment, options, training


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose "invalid choice" error also says which choice was meant."""

    def error(self, message: str):
        wrong = re.match(r"argument \S+: invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if wrong:
            choices = [choice.strip(" '") for choice in wrong[2].split(",")]
            close = difflib.get_close_matches(wrong[1], choices, n=1)
            message += f"; did you mean {close[0]}?" if close else ""
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    """The `moebalance` parser: the subcommands of each group module (cli/*.py)."""
    parser = _Parser(
        prog="moebalance",
        description="DeepSeek-V4-style MoE training with first-class expert load balancing.",
    )
    parser.add_argument("--version", action="version", version=f"moebalance {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    common = options.common()
    for group in (training, experiment, configs, checkpoints):
        group.add_parsers(sub, common)
    return parser


class _WarnOnce(logging.Filter):
    """Passes a warning the first time only: `ab` builds both runs' hash tables from the same
    data, and one uneven table is one problem, not two."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        message = record.getMessage()
        first = message not in self.seen
        self.seen.add(message)
        return first


def setup_logging(level: int) -> None:
    """Our progress notes (data building, sampling) on stderr, each once: the `moebalance` logger
    gets one handler and does not pass records on to the root logger, which libraries imported
    here (orbax, tensorboardX) give a handler of their own; a warning repeated within the command
    is shown once."""
    log = logging.getLogger("moebalance")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_WarnOnce())
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(level)


def main(argv: list[str] | None = None, *, compile_cache: bool = False) -> int:
    """Run one subcommand; every error the user can fix ends in one line on stderr and exit code
    2, a run stopped by SIGINT / SIGTERM in 130 / 143 (its checkpoint saved), Ctrl-C elsewhere in
    130. compile_cache: turn on the persistent compilation cache (runtime) unless the command line
    says --no-compile-cache (the installed command does; tests calling main leave it off)."""
    from moebalance.config import ConfigError
    from moebalance.rundir import RunStopped
    from moebalance.runtime import enable_compilation_cache

    args = build_parser().parse_args(argv)
    if compile_cache and args.compile_cache:
        enable_compilation_cache()
    setup_logging(logging.WARNING if args.quiet else logging.DEBUG if args.verbose
                  else logging.INFO)
    try:
        return args.func(args)
    except RunStopped as stop:
        print(f"moebalance: {stop}", file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:
        print("moebalance: interrupted", file=sys.stderr)
        return 130
    except (ConfigError, OSError, FloatingPointError, ValueError) as err:
        print(f"moebalance: {err}", file=sys.stderr)
        return 2


def entry() -> None:
    """The installed `moebalance` command: main() in a process with huge-page malloc and the
    compilation cache on, which ends as soon as main returns (runtime)."""
    from moebalance.runtime import exit_at_once, reexec_with_hugepage_malloc

    reexec_with_hugepage_malloc()
    exit_at_once(main(compile_cache=True))
