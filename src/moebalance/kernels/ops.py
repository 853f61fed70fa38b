"""The kernels' face: one function per operation, choosing its implementation by the `moe_kernel`
config key, beside the operation's plain XLA path (the reference of the tests).

    grouped_matmul   y[i] = x[i] @ w[g(i)] over rows sorted by group: the MoE layer's experts

Implementations (KERNELS; `auto` is the XLA path, the fastest measured on every backend: on an
H200 blocks ran at 0.42 of a dense SwiGLU, the Triton kernels untimed; on a TPU v5e ragged_dot at or
above megablox at every row and column tile, and the d1024 step as fast and 24 s quicker to compile;
docs/performance.md):

    xla       ragged rows: jax.lax.ragged_dot; blocked rows: each block's weights picked by a
              one-hot matmul, then one batched matmul. Any backend.
    megablox  JAX's Pallas grouped matmul for TPUs, gmm / tgmm (megablox.py).
    pallas    Triton kernels for NVIDIA GPUs, blocked rows only (triton.py).

Off its own platform a Pallas kernel runs in interpret mode: exact and slow, for the tests. The
platform is the one a program is traced for (backend.platform: the mesh's, `jax.set_mesh`), so a
step compiled on the CPU for a TPU topology runs the chip's kernels (training/compiled.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moebalance.kernels import megablox, triton

KERNELS = ("xla", "megablox", "pallas")


def resolve(kernel: str) -> str:
    """The implementation a `moe_kernel` value runs (`auto`: the XLA path, on every backend)."""
    if kernel == "auto":
        return "xla"
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; choose auto or one of {KERNELS}")
    return kernel


def grouped_matmul(x, w, groups, *, kernel: str = "auto", row_tile: int = 256):
    """y[i] = x[i] @ w[g(i)] with w [G, K, N], differentiable in x and w, in x's dtype.

    ragged rows   x [M, K], groups [G] int32: the group sizes, group g the next groups[g] rows;
                  rows past their sum give zeros (the ragged layout) -> [M, N]
    blocked rows  x [nb, b, K], groups [nb] int32 non-decreasing: every row of block n is in
                  group groups[n] (the blocked and capacity layouts) -> [nb, b, N]

    kernel: a KERNELS entry or `auto`. row_tile: rows per megablox tile on ragged rows; on blocked
    rows its tile is the block (megablox rounds either up to whole 128 lanes).
    """
    kernel = resolve(kernel)
    if x.ndim == 3:
        nb, b, k = x.shape
        if kernel == "pallas":
            return triton.grouped_matmul(x, w, groups)
        if kernel == "megablox":
            sizes = jnp.zeros(w.shape[0], jnp.int32).at[groups].add(b)  # [G] rows per group
            return megablox.grouped_matmul(x.reshape(nb * b, k), w, sizes, b).reshape(nb, b, -1)
        return jnp.einsum("nbk,nkf->nbf", x, _pick(groups, w))
    if kernel == "pallas":
        raise ValueError("moe_kernel=pallas (Triton) takes blocked rows only: set "
                         "moe_dispatch=blocked, or choose moe_kernel=xla | megablox")
    if kernel == "megablox":
        return megablox.grouped_matmul(x, w, groups, row_tile)
    return jax.lax.ragged_dot(x, w, groups)


def _pick(block_group, w):
    """Each block's weights, [nb], [G, ...] -> [nb, ...], as a one-hot matmul: G / b of the block
    matmul's FLOPs, faster than a gather on CPU, and its transpose (the weight gradient) is a
    matmul rather than a scatter-add. The MoE layer recomputes it in the backward pass rather than
    keep it: kept, it costs nb / G times the weights per layer."""
    return jnp.einsum("ne,e...->n...", jax.nn.one_hot(block_group, w.shape[0], dtype=w.dtype), w)
