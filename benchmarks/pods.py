"""DeepSeek-V4 at its real size on TPU pod slices, compiled here without them (issue 59): each
configuration's training step compiled by `moebalance plan --compile SLICE --json` (libtpu, no
chip), its record in benchmarks/results/pods.json: XLA's memory per device and whether it fits,
the compile time, the collectives per kind and mesh axis and the roofline of the step (a model,
not a measurement: docs/distributed.md).

    PYTHONPATH=LIBTPU_DIR python benchmarks/pods.py NAME [NAME ...] [--record FILE]

NAME is a key of RUNS. A configuration recorded again replaces its earlier record.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from moebalance.atomic import write_atomic

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
FLASH_BF16 = ["weight_dtype=bfloat16", "remat_policy=full"]
# name: (config, slice, device memory GiB, overrides)
RUNS = {
    "flash-v5p-256": ("deepseek4-flash", "v5p-256", 95,
                      ["ici_fsdp_parallelism=16", "ici_expert_parallelism=8", *FLASH_BF16]),
}


def compile_one(config: str, slice_: str, memory: float, overrides: list[str]) -> dict:
    """One configuration's plan --compile --json, its wall time, what the machine was."""
    command = [sys.executable, "-m", "moebalance.cli", "plan", config, *overrides, "--compile",
               slice_, "--device-memory", str(memory), "--no-compile-cache", "--json"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    plan = json.loads(done.stdout.strip().splitlines()[-1])
    compiled = plan["compiled"]
    memory_gib = {k: round(v / GIB, 2) for k, v in compiled["memory"].items()
                  if isinstance(v, int)}
    cost = compiled.get("cost") or {}
    return {"config": config, "slice": slice_, "overrides": overrides,
            "topology": compiled["topology"], "remat": compiled["remat"],
            "device_memory_gib": memory, "xla_gib": memory_gib,
            "fits": compiled["memory"]["needed"] <= memory * GIB,
            "plan_total_gib": round(plan["total"][compiled["remat"]] / GIB, 2),
            "compile_s": compiled["compile_s"], "wall_s": round(time.perf_counter() - start, 1),
            "collectives_gib": {k: round(v / GIB, 3) for k, v in
                                cost.get("collectives", {}).get("kind", {}).items()},
            "cost": cost,
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                     capture_output=True, text=True).stdout.strip(),
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, no "
                       "accelerator"}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+", choices=sorted(RUNS))
    parser.add_argument("--record", type=Path, default=ROOT / "benchmarks/results/pods.json")
    args = parser.parse_args(argv)
    for name in args.names:
        result = compile_one(*RUNS[name])
        record = json.loads(args.record.read_text()) if args.record.exists() else {}
        record[name] = result
        write_atomic(args.record,
                     lambda f: f.write((json.dumps(record, indent=1) + "\n").encode()))
        print(json.dumps({name: {k: result[k] for k in ("xla_gib", "fits", "compile_s")}}))


if __name__ == "__main__":
    main()
