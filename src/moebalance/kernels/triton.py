"""`moe_kernel: pallas`: the grouped matmul on blocked rows as Pallas kernels (Triton on GPUs).

The blocked layout (model/dispatch.py) holds the routed rows as [nb, b, K] blocks of one expert each,
blocks sorted by expert (`block_expert` [nb], non-decreasing). An expert layer's forward and backward
passes are three grouped matmuls over it, with w [E, K, N]:

    forward      y[n]  = x[n] @ w[e(n)]                         [nb, b, K] -> [nb, b, N]
    input grad   dx[n] = dy[n] @ w[e(n)]^T                       the forward kernel reading w^T
    weight grad  dw[e] = sum over blocks n of e: x[n]^T @ dy[n]  -> [E, K, N]

Each kernel program reads its expert's weight tiles where they lie in w. The XLA path
(ops.py) first copies every block's weights ([nb, K, N], nb / E times the weights, again in the
backward pass) and gets the weight gradient through the transpose of that copy.
Tiles: `TILE_M` rows of a block, `TILE_K` of the contraction, `TILE_N` of the output, accumulated
in float32. Off a GPU the kernels run in Pallas' interpret mode (exact, slow: for tests), which
cannot run under shard_map, so expert parallelism with these kernels needs GPUs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from moebalance.kernels.backend import platform

TILE_M, TILE_K, TILE_N = 64, 64, 128
MIN_TILE = 16  # the smallest matmul tile Triton compiles
NUM_WARPS, NUM_STAGES = 4, 3


def _tile(dim: int, preferred: int) -> int:
    """The largest power of two <= preferred that divides dim."""
    tile = 1
    while tile * 2 <= preferred and dim % (tile * 2) == 0:
        tile *= 2
    return tile


def _tiles(rows: int, k: int, n: int, interpret: bool) -> tuple[int, int, int]:
    tiles = _tile(rows, TILE_M), _tile(k, TILE_K), _tile(n, TILE_N)
    if not interpret and min(tiles) < MIN_TILE:
        raise ValueError(
            f"moe_kernel=pallas needs expert blocks, model width and expert width divisible by "
            f"{MIN_TILE}; got blocks of {rows} rows, K={k}, N={n} (tiles {tiles}). Raise "
            f"moe_block_size or the tokens per step, or use moe_kernel=xla")
    return tiles


def _out(like, shape, dtype):
    """The kernel output's type, varying over the mesh axes `like` varies over under shard_map."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).manual_axis_type)


def _interpret(x) -> bool:
    """Whether the kernels run interpreted (off a GPU), which Pallas cannot do under shard_map."""
    interpret = platform() != "gpu"
    if interpret and jax.typeof(x).manual_axis_type.varying:
        raise NotImplementedError(
            "moe_kernel=pallas under expert parallelism runs on GPUs only (off a GPU the kernels "
            "run in Pallas' interpret mode, which fails JAX's shard_map type checks); use "
            "moe_kernel=xla here")
    return interpret


def _params(interpret: bool):
    return None if interpret else pl_triton.CompilerParams(num_warps=NUM_WARPS,
                                                           num_stages=NUM_STAGES)


def _matmul_kernel(expert_ref, x_ref, w_ref, y_ref, *, transpose_w, tile_k, tile_n):
    """One [tile_m, tile_n] output tile of one chunk of rows: x chunk @ w[expert] (or w^T)."""
    chunk, col = pl.program_id(0), pl.program_id(1)
    e = expert_ref[chunk]
    cols = pl.ds(col * tile_n, tile_n)

    def step(i, acc):
        ks = pl.ds(i * tile_k, tile_k)
        x = x_ref[0, :, ks]  # [tile_m, tile_k]
        if transpose_w:  # w [E, N, K]
            w, dims = w_ref[e, cols, ks], (((1,), (1,)), ((), ()))
        else:  # w [E, K, N]
            w, dims = w_ref[e, ks, cols], (((1,), (0,)), ((), ()))
        return acc + jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)

    acc = jnp.zeros((x_ref.shape[1], tile_n), jnp.float32)
    acc = jax.lax.fori_loop(0, x_ref.shape[2] // tile_k, step, acc)
    y_ref[0] = acc.astype(y_ref.dtype)


def _chunks(x, chunk_expert_of_block, tile_m):
    """[nb, b, K], [nb] -> [nb * b / tile_m, tile_m, K] row chunks and each chunk's expert."""
    nb, b, k = x.shape
    return x.reshape(nb * b // tile_m, tile_m, k), jnp.repeat(chunk_expert_of_block, b // tile_m)


def block_matmul(x, w, block_expert, *, transpose_w: bool = False):
    """y[n] = x[n] @ w[block_expert[n]]: [nb, b, K] x [E, K, N] -> [nb, b, N] in x's dtype
    (transpose_w: w is [E, N, K] and y[n] = x[n] @ w[e]^T)."""
    nb, b, k = x.shape
    n = w.shape[1] if transpose_w else w.shape[2]
    interpret = _interpret(x)
    tile_m, tile_k, tile_n = _tiles(b, k, n, interpret)
    chunks, chunk_expert = _chunks(x, block_expert, tile_m)
    kernel = functools.partial(_matmul_kernel, transpose_w=transpose_w, tile_k=tile_k,
                               tile_n=tile_n)
    y = pl.pallas_call(
        kernel,
        out_shape=_out(chunks, (chunks.shape[0], tile_m, n), x.dtype),
        grid=(chunks.shape[0], n // tile_n),
        in_specs=[
            pl.BlockSpec(chunk_expert.shape, lambda c, j: (0,)),
            pl.BlockSpec((1, tile_m, k), lambda c, j: (c, 0, 0)),
            pl.BlockSpec(w.shape, lambda c, j: (0, 0, 0)),
        ],
        out_specs=pl.BlockSpec((1, tile_m, tile_n), lambda c, j: (c, 0, j)),
        compiler_params=_params(interpret),
        interpret=interpret,
        name="expert_block_matmul",
    )(chunk_expert.astype(jnp.int32), chunks, w.astype(x.dtype))
    return y.reshape(nb, b, n)


def _weight_grad_kernel(start_ref, stop_ref, x_ref, dy_ref, dw_ref, *, tile_k, tile_n):
    """One [tile_k, tile_n] tile of dw[e]: the sum of x^T dy over expert e's row chunks."""
    e, row, col = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ks, cols = pl.ds(row * tile_k, tile_k), pl.ds(col * tile_n, tile_n)

    def step(c, acc):
        return acc + jax.lax.dot_general(x_ref[c, :, ks], dy_ref[c, :, cols],
                                         (((0,), (0,)), ((), ())),
                                         preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(start_ref[e], stop_ref[e], step,
                            jnp.zeros((tile_k, tile_n), jnp.float32))
    dw_ref[0] = acc.astype(dw_ref.dtype)


def expert_weight_grad(x, dy, block_expert, num_experts: int):
    """dw[e] = sum over the blocks n of expert e of x[n]^T @ dy[n]: [nb, b, K], [nb, b, N], [nb]
    sorted -> [E, K, N] in x's dtype (zeros for an expert without blocks)."""
    nb, b, k = x.shape
    n = dy.shape[2]
    interpret = _interpret(x)
    tile_m, tile_k, tile_n = _tiles(b, k, n, interpret)
    x_chunks, chunk_expert = _chunks(x, block_expert, tile_m)
    dy_chunks, _ = _chunks(dy, block_expert, tile_m)
    experts = jnp.arange(num_experts, dtype=chunk_expert.dtype)
    start = jnp.searchsorted(chunk_expert, experts, side="left").astype(jnp.int32)
    stop = jnp.searchsorted(chunk_expert, experts, side="right").astype(jnp.int32)
    kernel = functools.partial(_weight_grad_kernel, tile_k=tile_k, tile_n=tile_n)
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731
    return pl.pallas_call(
        kernel,
        out_shape=_out(x_chunks, (num_experts, k, n), x.dtype),
        grid=(num_experts, k // tile_k, n // tile_n),
        in_specs=[whole(start), whole(stop), whole(x_chunks), whole(dy_chunks)],
        out_specs=pl.BlockSpec((1, tile_k, tile_n), lambda e, i, j: (e, i, j)),
        compiler_params=_params(interpret),
        interpret=interpret,
        name="expert_weight_grad",
    )(start, stop, x_chunks, dy_chunks.astype(x.dtype))


def grouped_matmul(x, w, block_expert):
    """y[n] = x[n] @ w[block_expert[n]] for the blocked layout, with its backward pass as the
    kernels above: [nb, b, K] x [E, K, N], [nb] int32 sorted -> [nb, b, N] in x's dtype.

    Under shard_map the operands are first made to vary over the same mesh axes (autodiff of that
    step sums each gradient over the axes its operand did not vary on)."""
    return _grouped_matmul(*_vary_alike(x, w, block_expert))


def _vary_alike(*arrays):
    axes = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in arrays))
    return [a if not (missing := axes - jax.typeof(a).manual_axis_type.varying)
            else jax.lax.pcast(a, tuple(sorted(missing)), to="varying") for a in arrays]


@jax.custom_vjp
def _grouped_matmul(x, w, block_expert):
    return block_matmul(x, w, block_expert)


def _grouped_matmul_fwd(x, w, block_expert):
    return block_matmul(x, w, block_expert), (x, w, block_expert)


def _grouped_matmul_bwd(res, dy):
    x, w, block_expert = res
    dx = block_matmul(dy, w, block_expert, transpose_w=True)
    dw = expert_weight_grad(x, dy, block_expert, w.shape[0]).astype(w.dtype)
    return dx.astype(x.dtype), dw, None


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)
