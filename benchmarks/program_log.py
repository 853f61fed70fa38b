"""Where a moebalance command's start-up time goes, program by program: run the command in this
process with JAX's own timing log lines captured (DEBUG level, so nothing else changes), and
print one JSON object: the wall time, and per phase (tracing, lowering to MLIR, XLA compilation or
a load from the persistent cache) the total and the slowest programs by name (a name's count,
total, longest, and the times since the command's start at which its first and last such
events ended).

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
import sys
import time

PHASES = {  # JAX's message -> phase
    r"Finished tracing (?P<name>.+) for jit in (?P<s>[0-9.]+) sec": "trace",
    r"Finished jaxpr to MLIR module conversion (?P<name>.+) in (?P<s>[0-9.]+) sec": "lower",
    r"Finished XLA compilation of (?P<name>.+) in (?P<s>[0-9.]+) sec": "compile",
}
HIT = re.compile(r"Persistent compilation cache hit for '(?P<name>[^']+)'")


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

    recorder.start = time.perf_counter()
    code = moebalance(command, compile_cache=True)
    wall = time.perf_counter() - recorder.start
    result = summary(recorder.events, recorder.hits, wall, args.top)
    result["command"] = " ".join(command)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
