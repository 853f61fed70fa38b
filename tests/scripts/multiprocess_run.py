"""Multi-process training on one machine, checked against a single-process run.

    python tests/scripts/multiprocess_run.py [--processes 2] [--devices 2] [--steps 4] [--keep DIR]

P local processes with D simulated CPU devices each (XLA_FLAGS) join by `jax.distributed` (CPU
collectives: gloo, JAX's default) through the launch variables MOEBALANCE_COORDINATOR /
MOEBALANCE_NUM_PROCESSES / MOEBALANCE_PROCESS_ID, and train deepseek4-smoke with every device on
the `expert` axis, so each expert all-to-all crosses processes. The same config then trains in one
process with P * D devices (the same mesh and global batch). Checked:

    1. every step's expert counts and biases of the multi-process run equal the single-process
       run's exactly; its metrics (loss, CE, balance losses, gradient norm) and checkpoints
       (weights, optimizer state; one per step) to TOLERANCE (gloo sums gradients in another
       order, and AdamW magnifies round-off on near-zero gradients);
    2. only process 0 writes the logs: `steps` lines in metrics.jsonl, one TensorBoard file;
    3. resume across processes: the multi-process run with its checkpoints after step steps/2
       deleted but the first, whose largest file is cut in half, resumed by all processes with
       --resume (launch keys given as config keys this time): process 0 alone sets the damaged
       one aside, every process resumes from step steps/2, and the run ends with the same logs
       and checkpoints as the uninterrupted multi-process run, bit for bit.

Prints one line per check and exits 1 on the first mismatch. It takes 5-7 minutes on two cores
(five process starts, each compiling the step); run it after touching the trainer, the sharding
or the checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

OVERRIDES = ("max_target_length=32", "per_device_batch_size=2", "gradient_accumulation_steps=2",
             "ici_fsdp_parallelism=1", "ici_expert_parallelism=-1", "checkpoint_period=1",
             "load_balance_loss_weight=1e-3", "router_z_loss_weight=1e-4",
             "probe_refit_batches=2")
VARYING = ("tokens_per_s",)  # wall-clock, not a result
# Across processes the gradients are all-reduced by gloo, in another order than one process's
# in-process all-reduce, so floats differ by round-off; Adam turns a round-off difference in a
# near-zero gradient into up to a learning rate (3e-4) per step. Counts (integers) and the biases
# (a function of the counts for the sign rule) stay exact.
TOLERANCE = 3e-4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: Path, devices: int, processes: int, steps: int, *extra: str,
           by_keys: bool = False) -> None:
    """`moebalance train` in `processes` processes of `devices` CPU devices each, joined through
    the launch variables (or, `by_keys`, the launch config keys); waits for all and raises with
    the output of a process that failed."""
    args = [sys.executable, "-m", "moebalance.cli", "train", "deepseek4-smoke", f"steps={steps}",
            f"max_num_checkpoints_to_keep={steps}", *OVERRIDES]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
           + f" --xla_force_host_platform_device_count={devices}"}
    address = f"127.0.0.1:{free_port()}"
    procs = []
    for i in range(processes):
        joined = {"coordinator": address, "num_processes": processes, "process_id": i}
        keys = [f"distributed_{k}={v}" for k, v in joined.items()] + [
            "jax_distributed_initialization=true"]
        variables = {f"MOEBALANCE_{k.upper()}": str(v) for k, v in joined.items()}
        procs.append(subprocess.Popen(
            [*args, *(keys if by_keys and processes > 1 else []), "--out", str(out), *extra],
            env={**env, **(variables if not by_keys and processes > 1 else {})},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for i, (p, output) in enumerate(zip(procs, outputs)):
        if p.returncode:
            raise RuntimeError(f"process {i} of {processes} failed ({p.returncode}):\n{output}")


def metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in VARYING} for row in rows]


def checkpoint_arrays(run: Path, step: int) -> dict[str, np.ndarray]:
    """Every array of checkpoint `step`, by its path (read without a model: plain NumPy)."""
    import jax
    import orbax.checkpoint as ocp
    from absl import logging

    logging.set_verbosity(logging.ERROR)  # not a warning per checkpoint about its metadata file

    path = run / "checkpoints" / str(step) / "state"
    reader = ocp.PyTreeCheckpointer()
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                            reader.metadata(path).item_metadata.tree)
    state = reader.restore(path, restore_args=as_numpy)
    return {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}


def flat(value) -> np.ndarray:
    """A metric (a number, or the per-layer list of dicts) as one float vector."""
    if not isinstance(value, list):
        return np.asarray(value, float)
    numbers = []
    for row in value:
        for _, v in sorted(row.items()):
            numbers += v if isinstance(v, list) else [] if isinstance(v, str) else [v]
    return np.asarray(numbers, float)


def compare(run: Path, reference: Path, steps: int, tolerance: float) -> tuple[list[str], float]:
    """How two run directories differ: the expert counts, integer arrays and router biases
    exactly; metrics and the floats of every checkpoint within `tolerance` (0: bit for bit).
    -> (the differences, the largest float difference in the checkpoints)."""
    problems = []
    if (run / "expert_counts.i32").read_bytes() != (reference / "expert_counts.i32").read_bytes():
        problems.append("expert_counts.i32 differs")
    for step, (got, want) in enumerate(zip(metrics(run), metrics(reference), strict=True)):
        differ = [k for k in want if not np.allclose(flat(got[k]), flat(want[k]), rtol=tolerance,
                                                     atol=tolerance)]
        if differ:
            problems.append(f"metrics of step {step} differ in {differ}")
    worst = 0.0
    for step in range(1, steps + 1):
        got, want = checkpoint_arrays(run, step), checkpoint_arrays(reference, step)
        if got.keys() != want.keys():
            problems.append(f"checkpoint {step} holds other arrays")
            continue
        for key, value in want.items():
            if value.dtype.kind == "f" and "bias" not in key:
                worst = max(worst, float(np.max(np.abs(got[key] - value), initial=0.0)))
            elif not np.array_equal(got[key], value):
                problems.append(f"checkpoint {step}: {key} differs")
    if worst > tolerance:
        problems.append(f"checkpoint floats differ by up to {worst:.1e} > {tolerance:.0e}")
    return problems, worst


def single_writer(run: Path, steps: int, sessions: int) -> list[str]:
    """What a second writing process would have left: duplicated log lines, more TensorBoard
    event files than training sessions (each start or resumption opens one)."""
    problems = []
    lines = (run / "metrics.jsonl").read_text().splitlines()
    if [json.loads(line)["step"] for line in lines] != list(range(steps)):
        problems.append(f"metrics.jsonl holds {len(lines)} lines for {steps} steps")
    events = list((run / "tensorboard").glob("events.*"))
    if len(events) != sessions:
        problems.append(f"{len(events)} TensorBoard event files for {sessions} sessions")
    return problems


def report(name: str, problems: list[str], start: float) -> None:
    print(f"{'ok  ' if not problems else 'FAIL'} {name} ({time.perf_counter() - start:.0f} s)")
    for problem in problems:
        print(f"     {problem}")
    if problems:
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2, help="simulated devices per process")
    parser.add_argument("--steps", type=int, default=4, help="steps (even: resumed at the half)")
    parser.add_argument("--keep", type=Path, help="keep the run directories here")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="multiprocess_run-"))
    p, d, steps = args.processes, args.devices, args.steps
    single, multi, resumed = root / "single", root / "multi", root / "resumed"
    start = time.perf_counter()
    launch(multi, d, p, steps, "--overwrite")
    launch(single, p * d, 1, steps, "--overwrite")
    problems, worst = compare(multi, single, steps, TOLERANCE)
    report(f"{p} processes x {d} devices = 1 process x {p * d} devices over {steps} steps: counts "
           f"and biases exact, floats to {worst:.1e}", problems, start)
    report("only process 0 wrote the logs", single_writer(multi, steps, sessions=1), start)
    shutil.rmtree(resumed, ignore_errors=True)
    shutil.copytree(multi, resumed)
    for step in range(steps // 2 + 2, steps + 1):
        shutil.rmtree(resumed / "checkpoints" / str(step))
    damaged = resumed / "checkpoints" / str(steps // 2 + 1)
    largest = max((f for f in damaged.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    os.truncate(largest, largest.stat().st_size // 2)
    launch(resumed, d, p, steps, "--resume", by_keys=True)
    problems, _ = compare(resumed, multi, steps, tolerance=0.0)
    if not damaged.with_name(f"{damaged.name}.damaged").is_dir():
        problems.append(f"{damaged} was not set aside")
    report(f"resumed in {p} processes from step {steps // 2}, the damaged checkpoint after it set "
           "aside: bit for bit the uninterrupted run",
           problems + single_writer(resumed, steps, sessions=2), start)
    if not args.keep:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
