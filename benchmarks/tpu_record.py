"""The parts of the TPU record (benchmarks/results/tpu-v5e.json) that model_step.py's runs do not
write, for benchmarks/tpu.sh:

    peer  MaxText's step lines on the same chip (shared/peers/maxtext-tpu/run.sh's log: "completed
          step: N, seconds: S, TFLOP/s/device: F, Tokens/s/device: T"), steps 0 (compilation)
          and 2 (its timer there reads an asynchronous dispatch) left out -> the record's "peer"
    ab    `moebalance ab`'s result on the chip (the experiment directory's table.json "total" row)
          and the command's wall time, the first run's and, where given, the same run's again
          with the compilation cache warm, dated -> the record's "ab"; the result it replaces
          goes into its "earlier" list (wall times, date, notes), and what other parts added
          to it (the profile) stays
    tests a `pytest --device-tests` run's JUnit XML (one part of the selection; a device call
          holds about half of it) -> the record's "tests": each test counted once, by the latest
          of its "parts" that ran it, a part replacing an earlier one of the same test files

Each is written into the record atomically, its other keys kept (a record that does not exist
yet is created with this part alone; model_step.py's first run adds the device and the stack).

    python benchmarks/tpu_record.py peer RECORD MAXTEXT_LOG [--config TEXT]
    python benchmarks/tpu_record.py ab RECORD EXPERIMENT_DIR DATE FIRST_S [SECOND_S]
    python benchmarks/tpu_record.py tests RECORD JUNIT_XML DATE

and, for the device call that finishes a selection another call began:

    left  the tests of a selection (`pytest --device-tests --collect-only` here on ARGS) that a
          run's JUnit XML lacks, one id a line, into FILE, for `tpu.sh tests @FILE`

    python benchmarks/tpu_record.py left JUNIT_XML FILE [ARGS...]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from moebalance.atomic import write_atomic

STEP = re.compile(r"completed step: (\d+), seconds: ([\d.]+), TFLOP/s/device: ([\d.]+), "
                  r"Tokens/s/device: ([\d.]+)")
SKIPPED = {0, 2}  # compilation; an asynchronous dispatch's time


def maxtext_run(log: str, config: str) -> dict:
    """A peer run from MaxText's log: the median step of the steps kept, and each of them."""
    steps = [(int(m[1]), float(m[2]), float(m[3]), float(m[4])) for m in STEP.finditer(log)]
    kept = [s for s in steps if s[0] not in SKIPPED]
    if not kept:
        raise ValueError(f"no step lines beyond steps {sorted(SKIPPED)} in MaxText's log")
    step_s = statistics.median(s[1] for s in kept)
    return {"system": "MaxText", "config": config, "step_s": round(step_s, 4),
            "tokens_per_s": round(statistics.median(s[3] for s in kept), 1),
            "model_tflops": round(statistics.median(s[2] for s in kept), 2),
            "steps": [{"step": n, "step_s": s, "tflops": f, "tokens_per_s": t}
                      for n, s, f, t in kept]}


def ab_result(experiment: Path, first_s: float, second_s: float | None = None) -> dict:
    """The A/B experiment's summary: the wall times, its table.json "total" row."""
    total = json.loads((Path(experiment) / "table.json").read_text())["total"]
    times = {"first_s": round(first_s, 1)}
    if second_s is not None:
        times["second_s"] = round(second_s, 1)
    return {**times, **{k: v for k, v in total.items() if k not in ("layer", "routing")}}


EARLIER = ("first_s", "second_s", "date", "notes")  # what "ab"'s history keeps of a result


def merge_ab(ab: dict | None, result: dict, date: str) -> dict:
    """The record's "ab" with `result` (ab_result's) as the latest, dated: the result it replaces
    appended to "earlier" (its EARLIER keys), the keys no result has (a profile) kept."""
    ab = ab or {}
    earlier = [*ab.get("earlier", []), *([{k: ab[k] for k in EARLIER if k in ab}]
                                         if "first_s" in ab else [])]
    kept = {k: v for k, v in ab.items() if k not in result and k not in EARLIER
            and k != "earlier"}
    return {**result, "date": date, **kept, **({"earlier": earlier} if earlier else {})}


OUTCOMES = ("passed", "failed", "skipped")


def _suite(junit_xml: str) -> tuple:
    """A JUnit XML's test suite and its test cases (an interruption's case has no class)."""
    suite = ET.fromstring(junit_xml)
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    return suite, [c for c in suite.findall("testcase") if c.get("classname")]


def tests_part(junit_xml: str, date: str) -> dict:
    """One pytest run from its JUnit XML: its test files, outcome counts, wall time and date, the
    failed tests' ids and every test's outcome by id."""
    suite, cases = _suite(junit_xml)
    outcomes = {f"{c.get('classname')}::{c.get('name')}":
                "failed" if c.find("failure") is not None or c.find("error") is not None
                else "skipped" if c.find("skipped") is not None else "passed" for c in cases}
    counts = collections.Counter(outcomes.values())
    files = sorted({c.get("classname").rsplit(".", 1)[-1] + ".py" for c in cases})
    return {"files": files, **{k: counts[k] for k in OUTCOMES},
            "wall_s": round(float(suite.get("time")), 1), "date": date,
            "failures": [t for t, o in outcomes.items() if o == "failed"], "outcomes": outcomes}


def test_ids(junit_xml: str) -> set[str]:
    """The pytest ids (tests/test_x.py::name[params]) of the tests a JUnit XML reports."""
    return {f"{c.get('classname').replace('.', '/')}.py::{c.get('name')}"
            for c in _suite(junit_xml)[1]}


def left(junit_xml: str, args: list[str]) -> list[str]:
    """The ids of the `--device-tests` selection on args, in pytest's order, that the XML lacks
    (the project's addopts give -q: one id a line)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-n", "0",
                           "--device-tests", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, check=True)
    ran = test_ids(junit_xml)
    return [line for line in done.stdout.splitlines() if "::" in line and line not in ran]


def merge_tests(tests: dict | None, part: dict) -> dict:
    """The record's "tests" with `part` in place of any earlier part of the same files: each test
    counted once, by its latest part's outcome; the parts' device time; the latest date. Parts
    recorded before outcomes were (no "outcomes") cannot be told apart by test: the record's
    totals, checked by hand, then stay as they were."""
    tests = tests or {}
    parts = [p for p in tests.get("parts", []) if p["files"] != part["files"]] + [part]
    merged = {**tests, "parts": parts}
    if all("outcomes" in p for p in parts):
        latest = {t: o for p in parts for t, o in p["outcomes"].items()}
        counts = collections.Counter(latest.values())
        merged.update({k: counts[k] for k in OUTCOMES},
                      wall_s=round(sum(p["wall_s"] for p in parts), 1))
    return {**merged, "date": max(p["date"] for p in parts)}


def set_part(path: Path, key: str, value) -> dict:
    """record[key] = value (a list key: appended to), written atomically."""
    path = Path(path)
    record = json.loads(path.read_text()) if path.exists() else {}
    record[key] = [*record.get(key, []), value] if key == "peer" else value
    write_atomic(path, lambda f: f.write((json.dumps(record, indent=1) + "\n").encode()))
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="part", required=True)
    peer = sub.add_parser("peer")
    peer.add_argument("record", type=Path)
    peer.add_argument("log", type=Path)
    peer.add_argument("--config", default="shared/peers/maxtext-tpu/run.sh defaults (d1024 "
                      "width, 9 layers, 2 x 2048 tokens, bf16 weights, full remat)")
    ab = sub.add_parser("ab")
    ab.add_argument("record", type=Path)
    ab.add_argument("experiment", type=Path)
    ab.add_argument("date")
    ab.add_argument("first_s", type=float)
    ab.add_argument("second_s", type=float, nargs="?")
    tests = sub.add_parser("tests")
    tests.add_argument("record", type=Path)
    tests.add_argument("junit", type=Path)
    tests.add_argument("date")
    rest = sub.add_parser("left")
    rest.add_argument("junit", type=Path)
    rest.add_argument("file", type=Path)
    rest.add_argument("args", nargs="*")
    args = parser.parse_args(argv)
    if args.part == "left":
        ids = left(args.junit.read_text(), args.args)
        args.file.write_text("".join(f"{i}\n" for i in ids))
        print(f"{len(ids)} tests left -> {args.file}")
        return
    record = json.loads(args.record.read_text()) if args.record.exists() else {}
    if args.part == "peer":
        set_part(args.record, "peer", maxtext_run(args.log.read_text(), args.config))
    elif args.part == "ab":
        set_part(args.record, "ab", merge_ab(record.get("ab"), ab_result(
            args.experiment, args.first_s, args.second_s), args.date))
    else:
        set_part(args.record, "tests", merge_tests(record.get("tests"),
                                                   tests_part(args.junit.read_text(), args.date)))


if __name__ == "__main__":
    main()
