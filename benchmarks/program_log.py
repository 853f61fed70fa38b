"""Where a moebalance command's start-up time goes, program by program: run the command in this
process with JAX's own timing log lines captured (DEBUG level, so nothing else changes), and
print one JSON object: the wall time, and per phase (tracing, lowering to MLIR, XLA compilation or
a load from the persistent cache) the total and the slowest programs by name (a name's count,
total, longest, and the times since the command's start at which its first and last such
events ended); and the command's timeline: when each of the functions in WATCHED ran (seconds
since the start), and the process's start and end times (epoch seconds: the caller's own clock
around the process then tells how long the interpreter took to start and to exit).

    python3 benchmarks/program_log.py [--json FILE] [--top N] -- ab deepseek4-tiny --out /tmp/ab

The command runs as the installed `moebalance` runs it (huge-page malloc, the compilation cache
on). "XLA compilation" is JAX's timing of compile-or-load: for a program found in the compilation
cache it is the load (`cache_hits` counts those). A function traced inside another (a jnp helper
under jit) is also inside its parent's tracing time, so tracing has no total, only its slowest.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import re
import time

PHASES = {  # JAX's message -> phase
    r"Finished tracing (?P<name>.+) for jit in (?P<s>[0-9.]+) sec": "trace",
    r"Finished jaxpr to MLIR module conversion (?P<name>.+) in (?P<s>[0-9.]+) sec": "lower",
    r"Finished XLA compilation of (?P<name>.+) in (?P<s>[0-9.]+) sec": "compile",
}
HIT = re.compile(r"Persistent compilation cache hit for '(?P<name>[^']+)'")
# module:function, each replaced in its module by a timed wrapper (callers that look it up there
# see it): the A/B's phases around its programs
WATCHED = ("moebalance.training.sharding:make_mesh", "moebalance.data:batches",
           "moebalance.training.loop:probe_set", "moebalance.training.loop:build",
           "moebalance.training.loop:_compiled_steps", "moebalance.training.loop:probe_counts",
           "moebalance.training.calibration:calibrate_biases",
           "moebalance.training.calibration:refit_biases",
           "moebalance.training.loop:_measure_final", "moebalance.training.checkpoint:save",
           "moebalance.training.hooks:Hooks.end", "moebalance.report:ab_report")


class Recorder(logging.Handler):
    """Collects (phase, program, seconds, seconds since the start when it ended) from JAX's
    timing lines, and the cache hits."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.events, self.hits = [], collections.Counter()
        self.start = time.perf_counter()
        self.patterns = [(re.compile(p), phase) for p, phase in PHASES.items()]

    def emit(self, record):
        message = record.getMessage()
        hit = HIT.match(message)
        if hit:
            self.hits[hit["name"]] += 1
            return
        for pattern, phase in self.patterns:
            found = pattern.match(message)
            if found:
                self.events.append((phase, found["name"], float(found["s"]),
                                    time.perf_counter() - self.start))
                return


def watch(timeline: list, start: list[float]) -> None:
    """Wrap each WATCHED function so that its calls append [name, start, end] to timeline, in
    seconds since start[0] (set when the command starts)."""
    import functools
    import importlib

    for entry in WATCHED:
        module_name, path = entry.split(":")
        owner = importlib.import_module(module_name)
        *outer, name = path.split(".")
        for attr in outer:
            owner = getattr(owner, attr)
        original = getattr(owner, name)

        def timed(*args, _original=original, _name=path, **kwargs):
            begun = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                timeline.append([_name, round(begun - start[0], 2),
                                 round(time.perf_counter() - start[0], 2)])

        setattr(owner, name, functools.wraps(original)(timed))


def summary(events, hits, wall_s: float, top: int) -> dict:
    """The phases' totals over programs, their `top` slowest entries, and the cache hits."""
    out = {"wall_s": round(wall_s, 1), "cache_hits": sum(hits.values()), "phases": {}}
    for phase in dict.fromkeys(PHASES.values()):
        rows = [(name, s, end) for p, name, s, end in events if p == phase]
        per_name = collections.defaultdict(list)
        for name, s, end in rows:
            per_name[name].append((s, end))
        slowest = sorted(per_name.items(), key=lambda kv: -sum(s for s, _ in kv[1]))[:top]
        out["phases"][phase] = {
            "count": len(rows),
            **({} if phase == "trace" else {"total_s": round(sum(s for _, s, _ in rows), 2)}),
            "slowest": [{"program": name, "count": len(each),
                         "s": round(sum(s for s, _ in each), 2),
                         "longest_s": round(max(s for s, _ in each), 2),
                         "first_ended_at": round(each[0][1], 1),
                         "last_ended_at": round(each[-1][1], 1)} for name, each in slowest]}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the summary to this file")
    parser.add_argument("--top", type=int, default=12, help="programs listed per phase")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the moebalance command and its arguments, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the moebalance command after --, e.g. -- ab deepseek4-tiny --out DIR")
    from moebalance.runtime import reexec_with_hugepage_malloc

    reexec_with_hugepage_malloc()
    recorder = Recorder()
    for name in ("jax._src.dispatch", "jax._src.compiler", "jax._src.pjit",
                 "jax._src.interpreters.pxla"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG)
        logger.addHandler(recorder)
        logger.propagate = False  # JAX's debug lines go to the recorder, not the terminal

    from moebalance.cli import main as moebalance

    timeline, start = [], [0.0]
    from moebalance.training import sharding

    opening = sharding.open_devices_early

    def open_then_watch(cfg):  # the watched modules imported where the command imports them
        thread = opening(cfg)
        watch(timeline, start)
        return thread

    sharding.open_devices_early = open_then_watch
    started = time.time()
    recorder.start = start[0] = time.perf_counter()
    code = moebalance(command, compile_cache=True)
    wall = time.perf_counter() - recorder.start
    result = summary(recorder.events, recorder.hits, wall, args.top)
    result.update(command=" ".join(command), timeline=timeline, started_epoch=round(started, 2),
                  ended_epoch=round(time.time(), 2))
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return code


if __name__ == "__main__":
    from moebalance.runtime import exit_at_once

    exit_at_once(main())  # as the installed command ends
