"""`moe_kernel: megablox`: the grouped matmul on ragged rows as JAX's Pallas kernels for TPUs.

Megablox (jax.experimental.pallas.ops.tpu.megablox, in JAX itself) computes, for rows sorted by
group and w [G, K, N]:

    forward      y  = gmm(x, w, sizes)                    y[i] = x[i] @ w[g(i)]
    input grad   dx = gmm(dy, w, sizes, transpose_rhs)    the forward kernel reading w^T
    weight grad  dw = tgmm(x^T, dy, sizes)                dw[g] = sum over g's rows of x^T dy

(its `gmm` carries that backward pass as a custom VJP). A kernel program is one tile of
`row_tile` rows x TILE_N columns accumulated over TILE_K of the contraction in float32; a row tile
that straddles two groups is visited once per group, masked, so smaller row tiles waste less on
many small groups (64 experts of a few hundred rows each) and larger ones feed the MXU longer.
Off a TPU the kernels run in Pallas' interpret mode (exact, slow: for tests). Not inside shard_map
(expert parallelism, any multi-device mesh): JAX 0.10.2's megablox leaves its output's variance
over the mesh axes unset, which shard_map's type check refuses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import gmm

TILE_K = TILE_N = 512  # untuned: the device run sweeps only the row tile (docs/performance.md)


def grouped_matmul(x, w, group_sizes, row_tile: int):
    """y[i] = x[i] @ w[g(i)]: [M, K] sorted by group x [G, K, N], [G] int32 -> [M, N] in x's
    dtype; rows past sum(group_sizes) give zeros, and so does their input gradient."""
    if jax.typeof(x).manual_axis_type.varying:
        raise NotImplementedError(
            "moe_kernel=megablox cannot run inside shard_map (a multi-device mesh): JAX's megablox "
            "leaves its output's mesh variance unset; use moe_kernel=xla or auto here")
    m, k = x.shape
    pad = -m % row_tile  # megablox takes whole row tiles
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
    # The rows past the groups' sum form one more group without weights: megablox zeroes the
    # rows of groups beyond w's (its way of running a shard of the experts), forward and input
    # gradient alike, where they would otherwise be left unwritten.
    sizes = jnp.append(group_sizes.astype(jnp.int32), m + pad - group_sizes.sum(dtype=jnp.int32))
    tiling = (row_tile, min(TILE_K, k), min(TILE_N, w.shape[2]))
    y = gmm(x, w.astype(x.dtype), sizes, x.dtype, tiling,
            interpret=jax.default_backend() != "tpu")
    return y[:m] if pad else y
