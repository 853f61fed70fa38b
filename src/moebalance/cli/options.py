"""What several subcommands share: the options every one has, and CONFIG with its overrides."""

from __future__ import annotations

import argparse


def common() -> argparse.ArgumentParser:
    """Every subcommand's: -q / -v (how much goes to stderr besides results and errors) and
    --no-compile-cache."""
    common = argparse.ArgumentParser(add_help=False)
    level = common.add_mutually_exclusive_group()
    level.add_argument("-q", "--quiet", action="store_true",
                       help="only results and errors: no progress bar, no progress notes")
    level.add_argument("-v", "--verbose", action="store_true", help="also debugging notes")
    common.add_argument("--no-compile-cache", dest="compile_cache", action="store_false",
                        help="compile every program afresh and keep none: no persistent "
                             "compilation cache ($MOEBALANCE_CACHE_DIR, default "
                             "~/.cache/moebalance/xla)")
    return common


def config_command(sub, name: str, common: argparse.ArgumentParser, example: str, help: str,
                   overrides: str = "key=value overrides") -> argparse.ArgumentParser:
    """Subcommand `name` of a config: CONFIG, a preset (e.g. `example`) or a YAML path, then its
    key=value overrides (`overrides` says what they apply to)."""
    parser = sub.add_parser(name, parents=[common], help=help)
    parser.add_argument("config", help=f"a preset name (e.g. {example}) or a YAML path")
    parser.add_argument("overrides", nargs="*", help=overrides)
    return parser
