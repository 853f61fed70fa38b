"""Compile time and training-step throughput of a DeepSeek-V4 config (default deepseek4-tiny).

One step = the trainer's jitted step (forward, losses, backward, AdamW, bias update) on the
config's data (text for deepseek4-tiny; the tokenizer is built once and cached). Prints one JSON
line per dtype: model and data init time, compile time (first call), mean step time over the next
`--steps` calls and the CPU seconds they took (all threads), tokens/s, the bytes of the parameters
and optimizer state, the process's peak resident memory (ru_maxrss, compilation included) and, on
an accelerator, the device allocator's peak (of the whole process so far), beside what
`moebalance plan` estimates for the config on this many devices (`plan_gb`, the config's remat).

Model FLOPs per step: `moebalance.training.roofline.model_flops`. `mfu` divides the achieved
model FLOP/s by the device's datasheet peak for the dtype (`PEAK_FLOPS`; null where the table
has none, e.g. on a CPU); `of_dense_gemm` by a dense square GEMM of the step's dtype timed in the same run (8192^3 on an
accelerator, 1024^3 on a CPU): what this machine's matmul unit really delivers.

`--kernels xla,pallas` (`xla,megablox` on a TPU) runs each expert-matmul kernel (`moe_kernel`) in
turn in this process (the device peak is the process's so far: run the larger first).
`--record PATH` appends each run to a JSON record (created if missing; see `append_record`), the
form of benchmarks/results/h200.json.

    python benchmarks/model_step.py [--config deepseek4-tiny] [--batch 4] [--seq 256]
                                    [--steps 5] [--dtypes float32,bfloat16]
                                    [--kernels xla,pallas]
                                    [--record PATH] [--notes TEXT] [key=value ...]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import itertools
import json
import logging
import resource
import sys
import time
from pathlib import Path

import flax
import jax
import numpy as np
from flax import nnx

from moebalance import kernels
from moebalance.atomic import write_atomic
from moebalance.config import load_config
from moebalance.data import batches
from moebalance.model.moe import resolve_dispatch
from moebalance.runtime import reexec_with_hugepage_malloc
from moebalance.training import plan, sharding
from moebalance.training.compiled import resolve_remat
from moebalance.training.loop import build
from moebalance.training.roofline import model_flops
from moebalance.training.step import make_train_step


def dense_gemm_gflops(dtype: str = "float32", size: int | None = None, repeats: int = 10) -> float:
    """GFLOP/s of a jitted [size, size] @ [size, size] product in `dtype` (default size: 1024 on a
    CPU, 8192 on an accelerator), mean of `repeats` after one warm-up call."""
    size = size or (1024 if jax.default_backend() == "cpu" else 8192)
    a = jax.random.normal(jax.random.key(0), (size, size), dtype)
    matmul = jax.jit(lambda a: a @ a)
    jax.block_until_ready(matmul(a))
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(matmul(a))
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e9


# Dense datasheet peaks in FLOP/s by device kind (jax's `device_kind`) and compute dtype.
PEAK_FLOPS = {
    "NVIDIA H200": {"bfloat16": 989e12},
    "NVIDIA H100 80GB HBM3": {"bfloat16": 989e12},
    "TPU v5 lite": {"bfloat16": 197e12},  # TPU v5e
}


def peak_flops(device_kind: str, dtype: str) -> float | None:
    """The datasheet's dense peak of a device for a dtype, None where the table has none."""
    return PEAK_FLOPS.get(device_kind, {}).get(dtype)


def mfu(flops_per_step: float, step_s: float, device_kind: str, dtype: str) -> float | None:
    """Model FLOP/s over the device's datasheet peak for the dtype; None where that is unknown."""
    peak = peak_flops(device_kind, dtype)
    return round(flops_per_step / step_s / peak, 4) if peak else None


def expert_layout(cfg) -> str:
    """The expert layout the step runs (model/moe.py: `auto` is ragged on a TPU, else blocked) and
    the kernel of its matmuls (kernels.resolve: what `auto` runs on this backend)."""
    kernel = f"{kernels.resolve(cfg.moe_kernel)} matmuls"
    if cfg.capacity_factor > 0:
        return f"capacity (factor {cfg.capacity_factor}), {kernel}"
    if resolve_dispatch(cfg.moe_dispatch) == "ragged":  # megablox tiles its rows by the block size
        tiles = f", {cfg.moe_block_size}-row tiles" if "megablox" in kernel else ""
        return f"ragged, {kernel}{tiles}"
    return f"blocked, {cfg.moe_block_size} rows per block, {kernel}"


def moment_dtype(optimizer) -> str:
    """The dtype of most of AdamW's first-moment (mu) elements: the parameters' storage dtype
    (optax keeps the moments in it); the router's float32 moments are a small part."""
    sizes = collections.Counter()
    for path, v in nnx.to_flat_state(nnx.state(optimizer)):
        if "mu" in path:
            sizes[str(v.dtype)] += int(np.prod(v.shape))
    return sizes.most_common(1)[0][0]


def record_run(result: dict, notes: str = "") -> dict:
    """One run of a record (benchmarks/results/h200.json, tpu-v5e.json) from a `bench` result."""
    flops = result["model_flops"]
    micro = f"{result['accumulation']} x " if result["accumulation"] > 1 else ""
    note = (f"{result['layers']} layers, {micro}{result['batch']} x {result['seq']} tokens, "
            f"{result['dtype']}; model TFLOP per step {flops['total'] / 1e12:.4g} (parameters "
            f"{flops['parameters'] / 1e12:.4g}, attention {flops['attention'] / 1e12:.4g}, "
            f"indexer {flops['indexer'] / 1e12:.4g})")
    if result["overrides"]:
        note += "; " + " ".join(result["overrides"])
    return {
        "config": result["config"], "layers": result["layers"],
        "tokens_per_step": result["tokens_per_step"], "step_s": result["step_s"],
        "tokens_per_s": result["tokens_per_s"],
        "model_tflops": float(f"{flops['total'] / result['step_s'] / 1e12:.4g}"),
        "mfu": result["mfu"], "compile_s": result["compile_s"],
        "device_peak_gib": result["device_peak_gb"], "plan_gib": result["plan_gb"],
        "expert_layout": result["expert_layout"],
        "weight_dtype": result["weight_dtype"], "optimizer_dtype": result["optimizer_dtype"],
        "remat": result["remat"], "notes": f"{note}; {notes}" if notes else note,
    }


def append_record(path: Path, run: dict, *, device: str, date: str, jax_version: str,
                  flax_version: str) -> dict:
    """Append `run` to the record at `path` (created if missing) and write it atomically:
    {"device", "date" (of the latest run), "jax", "flax", "runs": [...]}, any other key of the
    record kept as it was (tpu_record.py's "peer" and "ab"). A record holds one device and
    software stack: appending a run of another raises ValueError."""
    path = Path(path)
    head = {"device": device, "jax": jax_version, "flax": flax_version}
    record = json.loads(path.read_text()) if path.exists() else {}
    clash = {k: (record[k], v) for k, v in head.items() if k in record and record[k] != v}
    if clash:
        raise ValueError(f"{path} records another device or stack: {clash}")
    record = {"device": device, "date": date, "jax": jax_version, "flax": flax_version,
              "runs": [*record.get("runs", []), run],
              **{k: v for k, v in record.items() if k not in (*head, "date", "runs")}}
    write_atomic(path, lambda f: f.write((json.dumps(record, indent=1) + "\n").encode()))
    return record


def progress(line: str) -> None:
    """A line on stderr as the run goes: a run stopped at its time limit still says how far it
    came (a d1024 process spends minutes initialising and compiling before its first step)."""
    print(f"[model_step {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def time_step(step, model, optimizer, inputs, steps):
    """-> (first call's seconds (compile + run), mean seconds of the next `steps`, their mean CPU
    seconds (all threads: the work done, which a busy or shared machine does not inflate the way
    it does wall time), last metrics)."""
    start = time.perf_counter()
    jax.block_until_ready(step(model, optimizer, *inputs))
    compile_s = time.perf_counter() - start
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        metrics = step(model, optimizer, *inputs)
    jax.block_until_ready(metrics)
    return (compile_s, (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps,
            metrics)


def bench(config, overrides, batch, seq, steps, dtype):
    cfg = load_config(config, [*overrides, f"dtype={dtype}", f"max_target_length={seq}",
                               f"per_device_batch_size={batch // jax.device_count()}"])
    start = time.perf_counter()
    mesh = sharding.make_mesh(cfg)
    cfg = resolve_remat(cfg, mesh)  # remat_policy=auto: compiles the candidates first
    data = batches(cfg)  # text configs: the cached tokenizer and streams
    model, optimizer = build(cfg, mesh, data)
    init_s = time.perf_counter() - start
    progress(f"{config} {batch} x {seq}, {dtype}: model and data ready in {init_s:.1f} s; "
             "compiling the step")
    step = make_train_step(cfg, model, mesh)
    tokens, mask, segment_ids = data.batch(0)
    compile_s, step_s, cpu_s, metrics = time_step(
        step, model, optimizer, sharding.global_batch(mesh, tokens, mask, segment_ids), steps)
    progress(f"compiled and ran once in {compile_s:.1f} s; {steps} steps of {step_s:.3f} s")
    flops = model_flops(cfg, segment_ids)
    tokens = int(np.prod(np.shape(segment_ids)))  # [A, B, S]: every micro-batch of the step
    model_gflop = flops["total"] / 1e9
    gemm = dense_gemm_gflops(dtype)
    device = jax.devices()[0]
    stats = device.memory_stats()  # an accelerator's allocator; None on a CPU
    return {
        "config": config, "overrides": overrides, "layers": cfg.base_num_decoder_layers,
        "dtype": dtype, "weight_dtype": cfg.weight_dtype,
        "optimizer_dtype": moment_dtype(optimizer), "remat": cfg.remat_policy, "batch": batch,
        "seq": seq,
        "accumulation": cfg.gradient_accumulation_steps, "tokens_per_step": tokens,
        "init_s": round(init_s, 2), "compile_s": round(compile_s, 2), "step_s": round(step_s, 3),
        "step_cpu_s": round(cpu_s, 3), "tokens_per_s": round(tokens / step_s, 1),
        "loss": round(float(metrics["loss"]), 4),
        "model_flops": flops, "model_gflop_per_step": round(model_gflop, 1),
        "model_gflops": round(model_gflop / step_s, 1), "dense_gemm_gflops": round(gemm, 1),
        "of_dense_gemm": round(model_gflop / step_s / gemm, 4),
        "mfu": mfu(flops["total"], step_s, device.device_kind, dtype),
        "expert_layout": expert_layout(cfg),
        "state_gb": round(sum(x.nbytes for x in jax.tree.leaves(nnx.state((model, optimizer))))
                          / 2**30, 3),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        "device_peak_gb": round(stats["peak_bytes_in_use"] / 2**30, 3)
        if stats and "peak_bytes_in_use" in stats else None,
        "plan_gb": round(plan.plan(cfg, jax.device_count()).total(cfg.remat_policy) / 2**30, 3),
        "backend": jax.default_backend(), "device": device.device_kind,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deepseek4-tiny")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--kernels", default="",
                        help="comma-separated moe_kernel values to run one after the other "
                             "(default: the config's)")
    parser.add_argument("--record", type=Path,
                        help="append each run to this JSON record (benchmarks/results/h200.json)")
    parser.add_argument("--notes", default="", help="a note for the record's runs")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    # the library's own progress lines (remat_policy=auto's compiles) on stderr as they come
    log = logging.getLogger("moebalance")
    log.setLevel(logging.INFO)
    log.addHandler(logging.StreamHandler(sys.stderr))
    reexec_with_hugepage_malloc()
    kernels = [[f"moe_kernel={k}"] for k in args.kernels.split(",")] if args.kernels else [[]]
    for kernel, dtype in itertools.product(kernels, args.dtypes.split(",")):
        result = bench(args.config, [*args.overrides, *kernel], args.batch, args.seq, args.steps,
                       dtype)
        print(json.dumps(result), flush=True)
        if args.record:
            append_record(args.record, record_run(result, args.notes), device=result["device"],
                          date=datetime.date.today().isoformat(), jax_version=jax.__version__,
                          flax_version=flax.__version__)


if __name__ == "__main__":
    main()
