"""`moe_kernel: megablox`: the grouped matmul on ragged rows as JAX's Pallas kernels for TPUs.

Megablox (jax.experimental.pallas.ops.tpu.megablox, in JAX itself) computes, for rows sorted by
group and w [G, K, N]:

    forward      y  = gmm(x, w, sizes)                    y[i] = x[i] @ w[g(i)]
    input grad   dx = gmm(dy, w, sizes, transpose_rhs)    the forward kernel reading w^T
    weight grad  dw = tgmm(x^T, dy, sizes)                dw[g] = sum over g's rows of x^T dy

(its `gmm` carries that backward pass as a custom VJP). A kernel program is one tile of
`row_tile` rows x TILE output columns accumulated over TILE of the contraction in float32; a row
tile that straddles two groups is visited once per group, masked, so smaller row tiles waste less
on many small groups (64 experts of a few hundred rows each) and larger ones feed the MXU longer.
On a TPU a tile's minor dimension comes in whole 128 lanes, and K, N and the rows each are one in
some of the three kernels, so the row tile is rounded up to a multiple of LANES and K and N are
zero-padded to multiples of it (exact: the padding adds zero products). Off a TPU the kernels
run in Pallas' interpret mode (exact, slow: for tests). Not inside shard_map (expert parallelism,
any multi-device mesh): JAX 0.10.2's megablox leaves its output's variance over the mesh axes
unset, which shard_map's type check refuses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import gmm

from moebalance.kernels.backend import platform

TILE = 512  # contraction and output columns per tile (on a v5e 512 beat 256 by 1.2-1.9x and
# matched 1024: docs/performance.md)
LANES = 128  # a TPU tiles an array's minor dimension in whole 128 lanes


def grouped_matmul(x, w, group_sizes, row_tile: int):
    """y[i] = x[i] @ w[g(i)]: [M, K] sorted by group x [G, K, N], [G] int32 -> [M, N] in x's
    dtype; rows past sum(group_sizes) give zeros, and so does their input gradient. row_tile is
    rounded up to a multiple of LANES; K and N are zero-padded to multiples of it."""
    if jax.typeof(x).manual_axis_type.varying:
        raise NotImplementedError(
            "moe_kernel=megablox cannot run inside shard_map (a multi-device mesh): JAX's megablox "
            "leaves its output's mesh variance unset; use moe_kernel=xla or auto here")
    (m, k), n = x.shape, w.shape[2]
    row_tile = -(-row_tile // LANES) * LANES
    pad = -m % row_tile  # megablox takes whole row tiles
    pad_k, pad_n = -k % LANES, -n % LANES
    if pad or pad_k:
        x = jnp.pad(x, ((0, pad), (0, pad_k)))
    if pad_k or pad_n:
        w = jnp.pad(w, ((0, 0), (0, pad_k), (0, pad_n)))
    # The rows past the groups' sum form one more group without weights: megablox zeroes the
    # rows of groups beyond w's (its way of running a shard of the experts), forward and input
    # gradient alike, where they would otherwise be left unwritten.
    sizes = jnp.append(group_sizes.astype(jnp.int32), m + pad - group_sizes.sum(dtype=jnp.int32))
    tile = min(TILE, k + pad_k, n + pad_n)  # one size for K and N: they swap in the input gradient
    tiling = (row_tile, tile, tile)
    y = gmm(x, w.astype(x.dtype), sizes, x.dtype, tiling,
            interpret=platform() != "tpu")
    return y[:m, :n] if pad or pad_n else y
