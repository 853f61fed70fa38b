"""Cut the TPU trace fixture of tests/test_benchmarks.py (tests/fixtures/tpu-trace/) from the trace
of one step on a TPU and the optimized HLO of that step, as profile_step.py takes them.

    python tools/make_tpu_trace_fixture.py TRACE.json.gz HLO.txt[.gz] [--first N] [--count N]

Writes tests/fixtures/tpu-trace/trace.json.gz: the metadata events (process and thread names), the
device's events on its `Steps` and `XLA Modules` threads, `--count` events of its `XLA Ops`
thread from the `--first`-th in time order, and the `while` events that hold any of them; every
event with only the fields profile_step.op_times reads on a TPU (its `args` dropped). And
step.hlo.txt: the HLO lines those events name, each cut to what profile_step.parse_hlo reads
(name, shape, opcode, operands, the computations it calls, its custom call target, the op_name of
its metadata).

The committed fixture is the d1024 2 x 2048 step on a TPU v5e (docs/performance.md), events 12786
to 13070: the end of a layer's Sinkhorn backward, the router's top-k, the dispatch and the grouped
matmul's searchsorted loops (six `while` events of 28 body events each), all inside the backward
layer loop's `while` (one event spanning 100 ms, of which only this window is kept).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tpu-trace"
KEPT_FIELDS = ("ph", "pid", "tid", "ts", "dur", "name")
# the attributes parse_hlo reads besides the metadata: the computations an instruction calls and
# a custom call's target
ATTRIBUTES = re.compile(r", ((?:condition|body|to_apply|calls|branch_computations|"
                        r"custom_call_target)=(?:\{[^}]*\}|[^,]*))")


def _read(path: str) -> str:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return f.read()


def cut_events(events: list, first: int, count: int) -> list:
    """The metadata, `Steps` and `XLA Modules` events, and `count` `XLA Ops` events from the
    `first`-th with the containers (`while` events) that hold any of them."""
    meta = [e for e in events if e.get("ph") == "M"]
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in meta
               if e["name"] == "thread_name"}
    device = {e["pid"] for e in meta if e["name"] == "process_name"
              and e["args"]["name"].startswith("/device:TPU:")}

    def on(thread):
        return [e for e in events if e.get("ph") == "X" and e["pid"] in device
                and threads.get((e["pid"], e.get("tid"))) == thread]

    ops = sorted(on("XLA Ops"), key=lambda e: (e["ts"], -e["dur"]))
    window = ops[first:first + count]
    start = window[0]["ts"]
    # events nest: one that starts before the window and ends after its start holds its first event
    holders = [e for e in ops[:first] if e["ts"] + e["dur"] > start]
    kept = [{k: e[k] for k in KEPT_FIELDS if k in e}
            for e in on("Steps") + on("XLA Modules") + holders + window]
    return meta + kept


def cut_hlo(text: str, names: set) -> str:
    """The lines of the instructions `names`, without backend configs and metadata other than
    the op_name."""
    lines = []
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line)
        if not m or m.group(1) not in names:
            continue
        head = re.match(r".*?\)(?=, |$)", line[m.end():])  # shape, opcode and operands
        op_name = re.search(r'op_name="[^"]*"', line)
        lines.append("  " + line.strip().split(" = ")[0] + " = " + head.group(0)
                     + "".join(", " + c for c in ATTRIBUTES.findall(line))
                     + (", metadata={" + op_name.group(0) + "}" if op_name else ""))
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("hlo")
    parser.add_argument("--first", type=int, default=12786)
    parser.add_argument("--count", type=int, default=285)
    args = parser.parse_args()
    events = cut_events(json.loads(_read(args.trace))["traceEvents"], args.first, args.count)
    names = {e["name"] for e in events if e["ph"] == "X"}
    OUT.mkdir(parents=True, exist_ok=True)
    trace = json.dumps({"traceEvents": events}, separators=(",", ":")).encode()
    (OUT / "trace.json.gz").write_bytes(gzip.compress(trace, mtime=0))  # the same bytes each time
    (OUT / "step.hlo.txt").write_text(cut_hlo(_read(args.hlo), names))


if __name__ == "__main__":
    main()
