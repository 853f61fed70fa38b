"""MoE layer forward+backward throughput against a dense SwiGLU of the same useful FLOPs.

For each shape, in one run: the dropless MoE layer (routed experts, no shared expert) on T tokens,
and a dense SwiGLU of width K*F on the same T tokens (the FLOPs the routed experts usefully do),
both jitted, forward + backward w.r.t. input and weights. Prints one JSON object per line and a
summary line; `ratio` = MoE tokens/s / dense tokens/s (1.0 = routing and dispatch are free).
`--dispatch blocked,ragged` times both expert layouts in one run (`auto` is what the model picks:
ragged rows on a TPU, blocked elsewhere), `--kernels xla,megablox,pallas` the experts' grouped
matmuls (`moe_kernel`, kernels/ops.py; a Pallas kernel off its backend runs interpreted: slow;
pallas takes blocked rows only), each at every `--block-sizes` value where the block matters (the
blocked layout's rows per block; megablox's row tile on ragged rows), megablox at every
`--col-tiles` value (its contraction and output columns per tile, kernels/megablox.py's TILE, set
for the run); `--shapes 64:6:1024:512` adds shapes. The TPU run of issue 35 (megablox's row
tiles against ragged_dot):

    python benchmarks/moe_layer.py --tokens 16384 --dtype bfloat16 --dispatch ragged
        --kernels xla,megablox --block-sizes 128,256,512
        --shapes 64:6:1024:512,16:6:4096:2048 --only-shapes

    python benchmarks/moe_layer.py [--tokens 4096] [--repeats 5] [--block-sizes 128,256]
                                   [--dispatch auto] [--kernels auto] [--dtype float32]
                                   [--shapes E:K:D:F,...] [--only-shapes]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time

import jax
import jax.numpy as jnp
from flax import nnx

from moebalance import kernels
from moebalance.kernels import megablox
from moebalance.model.moe import MoE, MoEConfig, SwiGLU, resolve_dispatch

SHAPES = [  # (E, K, D, F)
    (16, 4, 64, 64),
    (16, 4, 128, 128),
    (16, 4, 256, 256),
    (64, 6, 128, 128),
]
DEFAULT_COL_TILE = megablox.TILE


def _time(fn, *args, repeats):
    jax.block_until_ready(fn(*args))  # compile + warm up
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / repeats


def _fwd_bwd(module):
    graphdef, state = nnx.split(module)

    def loss(state, x):
        out = nnx.merge(graphdef, state)(x)
        out = out[0] if isinstance(out, tuple) else out
        return jnp.sum(out.astype(jnp.float32) ** 2)

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    return step, state


@functools.cache
def _dense_time(dim, width, tokens, dtype, repeats):
    """Seconds per forward + backward of a dense SwiGLU D -> width -> D on T tokens (timed once
    per shape in a run: every layout and tile of that shape is compared with the same figure)."""
    x = jax.random.normal(jax.random.key(0), (tokens, dim), dtype)
    dense = SwiGLU(dim, width, limit=0.0, dtype=jnp.dtype(dtype), weight_dtype=jnp.float32,
                   rngs=nnx.Rngs(1))
    return _time(*_fwd_bwd(dense), x, repeats=repeats)


def bench_shape(experts, k, dim, hidden, tokens, repeats, block_size, dispatch, dtype, kernel,
                col_tile=None):
    x = jax.random.normal(jax.random.key(0), (tokens, dim), dtype)
    cfg = MoEConfig(emb_dim=dim, num_experts=experts, num_experts_per_tok=k, moe_mlp_dim=hidden,
                    shared_experts=0, block_size=block_size or MoEConfig.block_size,
                    dispatch=dispatch, kernel=kernel, dtype=dtype)
    moe_step, moe_state = _fwd_bwd(MoE(cfg, rngs=nnx.Rngs(0)))
    megablox.TILE = col_tile or DEFAULT_COL_TILE  # read when the first call traces the step
    try:
        t_moe = _time(moe_step, moe_state, x, repeats=repeats)
    finally:
        megablox.TILE = DEFAULT_COL_TILE
    t_dense = _dense_time(dim, k * hidden, tokens, dtype, repeats)
    useful_flops = 3 * 2 * tokens * k * 3 * dim * hidden  # fwd+bwd, three matmuls per expert
    return {
        "experts": experts, "k": k, "d_model": dim, "d_ff": hidden, "tokens": tokens,
        "dtype": dtype, "dispatch": resolve_dispatch(dispatch), "kernel": kernels.resolve(kernel),
        "block_size": block_size, "col_tile": col_tile,
        "moe_tokens_per_s": round(tokens / t_moe, 1),
        "dense_tokens_per_s": round(tokens / t_dense, 1),
        "moe_gflops": round(useful_flops / t_moe / 1e9, 2),
        "dense_gflops": round(useful_flops / t_dense / 1e9, 2),
        "ratio": round(t_dense / t_moe, 3),
    }


def configurations(dispatches, kernel_names, block_sizes, col_tiles=(None,)):
    """The (dispatch, kernel, block size, column tile) runs: every layout with every kernel that
    takes its rows (pallas takes blocks only), at every block size where the block matters
    (blocks; megablox's row tile on ragged rows), else once with the block None, and megablox at
    every column tile (others once, with None)."""
    for dispatch, kernel in itertools.product(dispatches, kernel_names):
        ragged = resolve_dispatch(dispatch) == "ragged"
        if ragged and kernels.resolve(kernel) == "pallas":
            continue
        mega = kernels.resolve(kernel) == "megablox"
        for block in (block_sizes if not ragged or mega else [None]):
            for col in (col_tiles if mega else [None]):
                yield dispatch, kernel, block, col


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block-sizes", default="256", help="comma-separated block sizes")
    parser.add_argument("--dispatch", default="auto",
                        help="comma-separated expert layouts: auto | blocked | ragged")
    parser.add_argument("--kernels", default="auto",
                        help="comma-separated kernels (moe_kernel): auto | xla | megablox | pallas")
    parser.add_argument("--col-tiles", default="",
                        help=f"comma-separated megablox column tiles (default {DEFAULT_COL_TILE})")
    parser.add_argument("--dtype", default="float32", help="activation and matmul dtype")
    parser.add_argument("--shapes", default="",
                        help="comma-separated E:K:D:F shapes to add to the default ones")
    parser.add_argument("--only-shapes", action="store_true", help="time --shapes alone")
    args = parser.parse_args()
    extra = [tuple(int(n) for n in shape.split(":")) for shape in args.shapes.split(",") if shape]
    rows = []
    block_sizes = [int(b) for b in args.block_sizes.split(",")]
    col_tiles = [int(t) for t in args.col_tiles.split(",") if t] or [None]
    runs = list(configurations(args.dispatch.split(","), args.kernels.split(","), block_sizes,
                               col_tiles))
    for experts, k, dim, hidden in (extra if args.only_shapes else SHAPES + extra):
        for dispatch, kernel, block, col in runs:
            row = bench_shape(experts, k, dim, hidden, args.tokens, args.repeats, block,
                              dispatch, args.dtype, kernel, col)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({"summary": "moe_vs_dense_ratio", "backend": jax.default_backend(),
                      "min_ratio": min(r["ratio"] for r in rows),
                      "max_ratio": max(r["ratio"] for r in rows)}))


if __name__ == "__main__":
    main()
