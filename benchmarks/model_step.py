"""Compile time and training-step throughput of a DeepSeek-V4 config (default deepseek4-tiny).

One step = the trainer's jitted step (forward, losses, backward, AdamW, bias update) on the
config's data (text for deepseek4-tiny; the tokenizer is built once and cached). Prints one JSON
line per dtype: model and data init time, compile time (first call), mean step time over the next
`--steps` calls and the CPU seconds they took (all threads), tokens/s, the bytes of the parameters
and optimizer state, the process's peak resident memory (ru_maxrss, compilation included) and, on
an accelerator, the device allocator's peak.

Model FLOPs are 6 x active parameters x tokens (`parameter_counts`: every matmul a token runs, the
head included, the embedding lookup and unchosen experts not; the attention scores, a few percent
at these shapes, and an MTP layer are not counted). `mfu` divides the achieved model FLOP/s by a
dense square GEMM of the step's dtype timed in the same run (8192^3 on an accelerator, 1024^3 on a
CPU): the utilisation of what this machine's matmul unit really delivers, not of a datasheet peak.

    python benchmarks/model_step.py [--config deepseek4-tiny] [--batch 4] [--seq 256]
                                    [--steps 5] [--dtypes float32,bfloat16] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import jax
from flax import nnx

from moebalance.config import load_config
from moebalance.data import batches
from moebalance.model.transformer import parameter_counts
from moebalance.runtime import reexec_with_hugepage_malloc
from moebalance.training import sharding
from moebalance.training.loop import build
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
    data = batches(cfg)  # text configs: the cached tokenizer and streams
    model, optimizer = build(cfg, mesh, data)
    init_s = time.perf_counter() - start
    step = make_train_step(cfg, model, mesh)
    compile_s, step_s, cpu_s, metrics = time_step(step, model, optimizer,
                                                  sharding.global_batch(mesh, *data.batch(0)), steps)
    model_gflop = 6 * parameter_counts(cfg)["active"] * batch * seq / 1e9
    gemm = dense_gemm_gflops(dtype)
    stats = jax.devices()[0].memory_stats()  # an accelerator's allocator; None on a CPU
    return {
        "config": config, "layers": cfg.base_num_decoder_layers, "dtype": dtype,
        "batch": batch, "seq": seq, "init_s": round(init_s, 2),
        "compile_s": round(compile_s, 2), "step_s": round(step_s, 3), "step_cpu_s": round(cpu_s, 3),
        "tokens_per_s": round(batch * seq / step_s, 1), "loss": round(float(metrics["loss"]), 4),
        "model_gflop_per_step": round(model_gflop, 1),
        "model_gflops": round(model_gflop / step_s, 1), "dense_gemm_gflops": round(gemm, 1),
        "mfu": round(model_gflop / step_s / gemm, 4),
        "state_gb": round(sum(x.nbytes for x in jax.tree.leaves(nnx.state((model, optimizer))))
                          / 2**30, 3),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        "device_peak_gb": round(stats["peak_bytes_in_use"] / 2**30, 3) if stats else None,
        "backend": jax.default_backend(),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deepseek4-tiny")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    reexec_with_hugepage_malloc()
    for dtype in args.dtypes.split(","):
        print(json.dumps(bench(args.config, args.overrides, args.batch, args.seq, args.steps,
                               dtype)), flush=True)


if __name__ == "__main__":
    main()
