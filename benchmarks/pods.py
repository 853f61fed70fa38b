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
BF16_FULL = ["weight_dtype=bfloat16", "remat_policy=full"]
# A step's 4,096 tokens a device as micro-batches of 512, 1,024 or 2,048 tokens where one sequence
# of 4,096 does not fit: the step's scan over micro-batches holds one micro-batch's activations
BY_512 = ["max_target_length=512", "gradient_accumulation_steps=8"]
BY_1024 = ["max_target_length=1024", "gradient_accumulation_steps=4"]
BY_2048 = ["max_target_length=2048", "gradient_accumulation_steps=2"]
# The mesh 1 x fsdp x 8 on 64, 256 and 512 devices (a device is a chip on v5p, v5e and v6e)
CHIPS_64 = ["ici_fsdp_parallelism=8", "ici_expert_parallelism=8", *BF16_FULL]
CHIPS_256 = ["ici_fsdp_parallelism=32", "ici_expert_parallelism=8", *BF16_FULL]
CHIPS_512 = ["ici_fsdp_parallelism=64", "ici_expert_parallelism=8", *BF16_FULL]
# name: (config, slice, device memory GiB, overrides)
RUNS = {
    "flash-v5p-256": ("deepseek4-flash", "v5p-256", 95,
                      ["ici_fsdp_parallelism=16", "ici_expert_parallelism=8", *BF16_FULL]),
    "flash-v5p-128": ("deepseek4-flash", "v5p-128", 95, [*CHIPS_64, *BY_1024]),
    "flash-v5p-128-2048": ("deepseek4-flash", "v5p-128", 95, [*CHIPS_64, *BY_2048]),
    "flash-v6e-256": ("deepseek4-flash", "v6e-256", 32, [*CHIPS_256, *BY_512]),
    "flash-v5e-256": ("deepseek4-flash", "v5e-256", 16, [*CHIPS_256, *BY_512]),
    "pro-v5p-1024": ("deepseek4-pro", "v5p-1024", 95, [*CHIPS_512, *BY_512]),
    "pro-v5p-1024-1024": ("deepseek4-pro", "v5p-1024", 95, [*CHIPS_512, *BY_1024]),
    "pro-v5p-512": ("deepseek4-pro", "v5p-512", 95, [*CHIPS_256, *BY_512]),
}


def tokens_per_device(config: str, overrides: list[str]) -> int:
    """Tokens one device trains on in a step: its sequences times their length, every
    micro-batch."""
    from moebalance.config import load_config

    cfg = load_config(config, overrides)
    return cfg.per_device_batch_size * cfg.max_target_length * cfg.gradient_accumulation_steps


def compile_one(config: str, slice_: str, memory: float, overrides: list[str]) -> dict:
    """One configuration's plan --compile --json, its wall time, what the machine was; a step the
    compiler refused for want of memory does not fit, and its record keeps what it said."""
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
    refused = compiled["memory"].get("refused")
    return {"config": config, "slice": slice_, "overrides": overrides,
            "topology": compiled["topology"], "remat": compiled["remat"],
            "tokens_per_device": tokens_per_device(config, overrides),
            "device_memory_gib": memory, "xla_gib": memory_gib,
            "fits": not refused and compiled["memory"]["needed"] <= memory * GIB,
            **({"refused": refused} if refused else {}),
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
