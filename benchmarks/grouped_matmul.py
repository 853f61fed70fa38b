"""The experts' grouped matmul alone on a TPU, forward and forward + backward: XLA's
`jax.lax.ragged_dot` (the model's `moe_kernel: auto`) against tokamax's TPU ragged dot (Google's
kernel library: megablox's Pallas kernel behind a table of tuned tiles) at tiles given to it, and
tokamax's own choice. Not a project dependency: tpu_wheels.sh brings tokamax 0.0.12 and what it
imports for the TPU machine.

Shapes: the d1024 MoE's two (64 experts, 4,096 tokens top-6 = 24,576 rows; 1024 -> 512 for the
gate and up projections, 512 -> 1024 for the down projection), bf16, group sizes drawn from a
seeded Dirichlet (a router's uneven load). Per candidate one JSON line: milliseconds and TFLOP/s
(forward 2MKN, forward + backward 3x that), the largest difference from ragged_dot's forward, and
the ratio of ragged_dot's time to the candidate's (> 1: the candidate is faster).

    python benchmarks/grouped_matmul.py OUT.json [--repeats 10]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import tokamax
from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu

SHAPES = ((24576, 1024, 512, 64), (24576, 512, 1024, 64))  # rows M, K, N, groups G
# (tile_m, tile_k, tile_n, input buffers): tokamax's default, megablox's default and larger
TILES = ((128, 128, 128, 2), (256, 512, 512, 2), (512, 512, 512, 2), (512, 1024, 512, 2),
         (512, 1024, 512, 3), (256, 1024, 512, 3), (512, 512, 1024, 2), (256, 512, 1024, 3),
         (1024, 1024, 512, 2))


def group_sizes(rows: int, groups: int, seed: int = 0) -> jax.Array:
    """[G] int32 summing to rows, as uneven as a router's load."""
    share = np.random.default_rng(seed).dirichlet(np.full(groups, 4.0))
    sizes = np.floor(share * rows).astype(np.int32)
    sizes[0] += rows - sizes.sum()
    return jnp.asarray(sizes)


def seconds(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def candidates(k: int, n: int) -> dict:
    """name -> matmul(x, w, sizes), the tiles that fit the shape (a tile no larger than K or N)."""
    out = {"ragged_dot": jax.lax.ragged_dot,
           "tokamax own choice": lambda x, w, s: tokamax.ragged_dot(x, w, s,
                                                                    implementation="mosaic")}
    for tm, tk, tn, buffers in TILES:
        if tk > k or tn > n:
            continue
        op = pallas_mosaic_tpu.PallasMosaicTpuRaggedDot(config=pallas_mosaic_tpu.Config(
            tile_m=tm, tile_k=tk, tile_n=tn, input_buffer_count=buffers))
        out[f"tokamax {tm}x{tk}x{tn} b{buffers}"] = (
            lambda op: lambda x, w, s: tokamax.ragged_dot(x, w, s, implementation=[op]))(op)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    rows = []
    for m, k, n, g in SHAPES:
        x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
        w = jax.random.normal(jax.random.key(1), (g, k, n), jnp.bfloat16)
        sizes = group_sizes(m, g)
        flop = 2 * m * k * n
        reference, base = None, None
        for name, matmul in candidates(k, n).items():
            forward = jax.jit(lambda x, w, mm=matmul: mm(x, w, sizes))
            both = jax.jit(jax.value_and_grad(
                lambda x, w, mm=matmul: (mm(x, w, sizes).astype(jnp.float32) ** 2).sum(),
                argnums=(0, 1)))
            fwd_s = seconds(forward, x, w, repeats=args.repeats)
            both_s = seconds(both, x, w, repeats=args.repeats)
            y = forward(x, w).astype(jnp.float32)
            reference = y if reference is None else reference
            base = (fwd_s, both_s) if base is None else base
            row = {"shape": {"rows": m, "k": k, "n": n, "groups": g}, "kernel": name,
                   "forward_ms": round(fwd_s * 1e3, 3), "forward_backward_ms": round(both_s * 1e3, 3),
                   "forward_tflops": round(flop / fwd_s / 1e12, 1),
                   "forward_backward_tflops": round(3 * flop / both_s / 1e12, 1),
                   "max_abs_difference": float(jnp.abs(y - reference).max()),
                   "speed_vs_ragged_dot": {"forward": round(base[0] / fwd_s, 3),
                                           "forward_backward": round(base[1] / both_s, 3)}}
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                   "tokamax": tokamax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
