"""Compile time and training-step throughput of a DeepSeek-V4 config (default deepseek4-tiny).

One jitted step = forward, cross-entropy, backward, Adam update. Prints one JSON line per dtype:
model init time, compile time (first call), mean step time over the next `--steps` calls and
tokens/s.

    python benchmarks/model_step.py [--config deepseek4-tiny] [--batch 4] [--seq 256]
                                    [--steps 5] [--dtypes float32,bfloat16] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import optax
from flax import nnx

from moebalance.config import load_config
from moebalance.model.transformer import DeepSeekV4


def bench(config, overrides, batch, seq, steps, dtype):
    cfg = load_config(config, [*overrides, f"dtype={dtype}", f"max_target_length={seq}"])
    start = time.perf_counter()
    model = DeepSeekV4(cfg, rngs=nnx.Rngs(0))
    init_s = time.perf_counter() - start
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    tokens = jax.random.randint(jax.random.key(0), (batch, seq + 1), 0, cfg.vocab_size)

    @nnx.jit
    def step(model, opt, tokens):
        def loss_fn(model):
            logits = model(tokens[:, :-1]).logits
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    start = time.perf_counter()
    jax.block_until_ready(step(model, opt, tokens))
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        loss = step(model, opt, tokens)
    jax.block_until_ready(loss)
    step_s = (time.perf_counter() - start) / steps
    return {
        "config": config, "layers": cfg.base_num_decoder_layers, "dtype": dtype,
        "batch": batch, "seq": seq, "init_s": round(init_s, 2),
        "compile_s": round(compile_s, 2), "step_s": round(step_s, 3),
        "tokens_per_s": round(batch * seq / step_s, 1), "loss": round(float(loss), 4),
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
    for dtype in args.dtypes.split(","):
        print(json.dumps(bench(args.config, args.overrides, args.batch, args.seq, args.steps,
                               dtype)), flush=True)


if __name__ == "__main__":
    main()
