"""Compile time and training-step throughput of a DeepSeek-V4 config (default deepseek4-tiny).

One step = the trainer's jitted step (forward, losses, backward, AdamW, bias update) on the
config's data (text for deepseek4-tiny; the tokenizer is built once and cached). Prints one JSON
line per dtype: model and data init time, compile time (first call), mean step time over the next
`--steps` calls and the CPU seconds they took (all threads), tokens/s, the bytes of the parameters
and optimizer state, and the process's peak resident memory (ru_maxrss, compilation included).

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
from moebalance.runtime import reexec_with_hugepage_malloc
from moebalance.training import sharding
from moebalance.training.loop import build
from moebalance.training.step import make_train_step


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
    return {
        "config": config, "layers": cfg.base_num_decoder_layers, "dtype": dtype,
        "batch": batch, "seq": seq, "init_s": round(init_s, 2),
        "compile_s": round(compile_s, 2), "step_s": round(step_s, 3), "step_cpu_s": round(cpu_s, 3),
        "tokens_per_s": round(batch * seq / step_s, 1), "loss": round(float(metrics["loss"]), 4),
        "state_gb": round(sum(x.nbytes for x in jax.tree.leaves(nnx.state((model, optimizer))))
                          / 2**30, 3),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
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
