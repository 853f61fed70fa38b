"""MoE layer forward+backward throughput against a dense SwiGLU of the same useful FLOPs.

For each shape, in one run: the dropless MoE layer (routed experts, no shared expert) on T tokens,
and a dense SwiGLU of width K*F on the same T tokens (the FLOPs the routed experts usefully do),
both jitted, forward + backward w.r.t. input and weights. Prints one JSON object per line and a
summary line; `ratio` = MoE tokens/s / dense tokens/s (1.0 = routing and dispatch are free).
`--dispatch blocked,ragged` times both expert layouts in one run (`auto` is what the model picks:
`jax.lax.ragged_dot` on a TPU, blocked elsewhere), `--kernels xla,pallas` both kernels of the
blocks' matmuls (`moe_kernel`; pallas is interpreted off a GPU: slow); `--shapes 64:6:1024:512`
adds shapes.

    python benchmarks/moe_layer.py [--tokens 4096] [--repeats 5] [--block-sizes 128,256]
                                   [--dispatch auto] [--kernels xla] [--dtype float32]
                                   [--shapes E:K:D:F,...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import jax
import jax.numpy as jnp
from flax import nnx

from moebalance.model.moe import MoE, MoEConfig, SwiGLU

SHAPES = [  # (E, K, D, F)
    (16, 4, 64, 64),
    (16, 4, 128, 128),
    (16, 4, 256, 256),
    (64, 6, 128, 128),
]


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


def bench_shape(experts, k, dim, hidden, tokens, repeats, block_size, dispatch, dtype, kernel):
    x = jax.random.normal(jax.random.key(0), (tokens, dim), dtype)
    cfg = MoEConfig(emb_dim=dim, num_experts=experts, num_experts_per_tok=k, moe_mlp_dim=hidden,
                    shared_experts=0, block_size=block_size, dispatch=dispatch, kernel=kernel,
                    dtype=dtype)
    moe_step, moe_state = _fwd_bwd(MoE(cfg, rngs=nnx.Rngs(0)))
    dense = SwiGLU(dim, k * hidden, limit=0.0, dtype=jnp.dtype(dtype), weight_dtype=jnp.float32,
                   rngs=nnx.Rngs(1))
    dense_step, dense_state = _fwd_bwd(dense)
    t_moe = _time(moe_step, moe_state, x, repeats=repeats)
    t_dense = _time(dense_step, dense_state, x, repeats=repeats)
    useful_flops = 3 * 2 * tokens * k * 3 * dim * hidden  # fwd+bwd, three matmuls per expert
    return {
        "experts": experts, "k": k, "d_model": dim, "d_ff": hidden, "tokens": tokens,
        "dtype": dtype, "dispatch": dispatch,
        "block_size": block_size if dispatch != "ragged" else None,
        "kernel": kernel if dispatch != "ragged" else None,
        "moe_tokens_per_s": round(tokens / t_moe, 1),
        "dense_tokens_per_s": round(tokens / t_dense, 1),
        "moe_gflops": round(useful_flops / t_moe / 1e9, 2),
        "dense_gflops": round(useful_flops / t_dense / 1e9, 2),
        "ratio": round(t_dense / t_moe, 3),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block-sizes", default="256", help="comma-separated block sizes")
    parser.add_argument("--dispatch", default="auto",
                        help="comma-separated expert layouts: auto | blocked | ragged")
    parser.add_argument("--kernels", default="xla",
                        help="comma-separated expert-matmul kernels of the blocks: xla | pallas")
    parser.add_argument("--dtype", default="float32", help="activation and matmul dtype")
    parser.add_argument("--shapes", default="",
                        help="comma-separated E:K:D:F shapes to add to the default ones")
    parser.add_argument("--only-shapes", action="store_true", help="time --shapes alone")
    args = parser.parse_args()
    extra = [tuple(int(n) for n in shape.split(":")) for shape in args.shapes.split(",") if shape]
    rows = []
    for experts, k, dim, hidden in (extra if args.only_shapes else SHAPES + extra):
        for dispatch in args.dispatch.split(","):
            blocked = dispatch != "ragged"  # ragged_dot has no blocks
            blocks = [int(b) for b in args.block_sizes.split(",")] if blocked else [1]
            kernels = args.kernels.split(",") if blocked else ["xla"]
            for block, kernel in itertools.product(blocks, kernels):
                row = bench_shape(experts, k, dim, hidden, args.tokens, args.repeats, block,
                                  dispatch, args.dtype, kernel)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(json.dumps({"summary": "moe_vs_dense_ratio", "backend": jax.default_backend(),
                      "min_ratio": min(r["ratio"] for r in rows),
                      "max_ratio": max(r["ratio"] for r in rows)}))


if __name__ == "__main__":
    main()
