"""Token dispatch for the MoE layer: assignments -> per-expert buffer rows -> back to tokens.

An assignment is one of token t's K chosen experts, j (A = T*K of them), numbered token-major,
a = t*K + j, or on a TPU slot-major, a = j*T + t (`slot_major`): there [T, K, D] puts K on the
second-minor axis of the chip's tiles, padded from 6 to 8 and re-tiled at every reshape (~25 ms of
the d1024 step), while slot-major [A, D] rows are [K, T, D] without moving data; on the CPU the
slot-major step ran ~10 % slower (deepseek4-tiny, five alternating pairs). A dispatch plan maps
each assignment to one row of an expert buffer [P, D] whose rows are grouped by expert (within
an expert, rows follow the tokens in either numbering), and back:

    dest    [A]  buffer row of each assignment; P when it has no row (dropped or padding)
    row_src [P]  assignment held by each buffer row; A when the row is empty

Three layouts, all with static shapes under jit:

    blocked   dropless; each expert's rows padded to a multiple of `block`, so the buffer is
              [P/block, block, D] with one expert per block (P <= A + E*(block-1)). Block matmuls
              run at near-dense speed on CPU and GPU, where `jax.lax.ragged_dot` is ~300x
              (CPU) and ~25x (H200) slower.
    capacity  at most C rows per expert ([E, C, D]); the overflow is dropped by policy: 'probs'
              keeps the highest-weight assignments, 'position' the earliest tokens.
    ragged    dropless, unpadded rows sorted by expert, for `jax.lax.ragged_dot` (TPU).

Both directions are row gathers through an injective index, so their gradients are gathers through
the inverse index (`gather_rows`); XLA's scatter-add, slow on CPU, never runs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moebalance.kernels.backend import platform



@jax.custom_vjp
def gather_rows(x: jax.Array, idx: jax.Array, inv: jax.Array) -> jax.Array:
    """y[i] = x[idx[i]] (zeros where idx[i] == len(x)), for idx injective and inv its inverse
    (inv[r] = i with idx[i] = r, or len(y) when row r is not gathered)."""
    return _with_zero_row(x)[idx]


def _with_zero_row(x):
    return jnp.concatenate([x, jnp.zeros((1, *x.shape[1:]), x.dtype)])


def _gather_rows_fwd(x, idx, inv):
    return gather_rows(x, idx, inv), (idx, inv)


def _gather_rows_bwd(res, g):
    idx, inv = res
    return _with_zero_row(g)[inv], None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


class DispatchPlan(NamedTuple):
    dest: jax.Array  # [A] int32
    row_src: jax.Array  # [P] int32
    counts: jax.Array  # [E] int32, valid assignments per expert (before any drop)
    dropped: jax.Array  # [] int32, valid assignments without a buffer row
    block_expert: jax.Array  # [P / block] int32, the expert of each block (blocked, capacity)
    block: int  # rows per block (capacity: C)
    slot_major: bool  # assignments numbered a = j*T + t, else t*K + j

    def per_assignment(self, x: jax.Array, k: int) -> jax.Array:
        """A token's rows [T, ...] -> [A, ...], each once per assignment, in the plan's numbering."""
        if self.slot_major:
            return jnp.tile(x, (k, *(1,) * (x.ndim - 1)))
        return jnp.repeat(x, k, axis=0)

    def flat(self, v: jax.Array) -> jax.Array:
        """Per-assignment values [T, K] -> [A] in the plan's numbering."""
        return (v.T if self.slot_major else v).reshape(-1)

    def token_sum(self, y: jax.Array, k: int) -> jax.Array:
        """Assignment rows [A, D] -> [T, D] float32: each token's K rows summed."""
        if self.slot_major:
            return y.reshape(k, -1, y.shape[-1]).sum(0, dtype=jnp.float32)
        return y.reshape(-1, k, y.shape[-1]).sum(1, dtype=jnp.float32)


def slot_major_here() -> bool:
    """Whether plans number assignments slot-major where this program runs: on a TPU."""
    return platform() == "tpu"


# Above this many [A, E+1] one-hot cells, ranks come from a sort instead of a prefix count.
COUNTING_RANK_MAX_CELLS = 2**24


def _rank_within_expert(key, weights, num_experts, by_weight, starts):
    """Each assignment's rank among the assignments of its expert (key E = padding, its own group).

    by_weight: highest weight first (ties: earlier first), else earlier first. Earlier-first ranks
    are a prefix count over a one-hot [A, E+1] (XLA's CPU sort takes ~5 ms for 16k keys, the count
    ~0.6 ms); by weight, or past COUNTING_RANK_MAX_CELLS, a stable sort.
    """
    num_assign = key.shape[0]
    if not by_weight and num_assign * (num_experts + 1) <= COUNTING_RANK_MAX_CELLS:
        onehot = (key[:, None] == jnp.arange(num_experts + 1)).astype(jnp.int32)  # [A, E+1]
        before = jax.lax.associative_scan(jnp.add, onehot, axis=0) - onehot
        return (before * onehot).sum(1)  # each row's own expert's count: no gather
    order = jnp.lexsort((-weights, key)) if by_weight else jnp.argsort(key, stable=True)
    rank_sorted = jnp.arange(num_assign, dtype=jnp.int32) - starts[key[order]]
    return jnp.zeros(num_assign, jnp.int32).at[order].set(rank_sorted)


def plan_dispatch(
    indices: jax.Array,
    weights: jax.Array,
    valid: jax.Array,
    counts: jax.Array,
    *,
    layout: str,
    block: int = 256,
    capacity: int = 0,
    drop_policy: str = "probs",
    slot_major: bool = False,
) -> DispatchPlan:
    """Build the dispatch plan of [T, K] assignments (numbered slot-major if `slot_major`).

    valid: [T] bool, padding False; counts: [E] int32 valid assignments per expert (the routing
    record's counts, computed once by the router). Within an expert, rows follow the tokens
    (earlier tokens first: the `position` drop policy's order).
    """
    (num_tokens, k), num_experts = indices.shape, counts.shape[0]
    num_assign = num_tokens * k
    key = jnp.where(valid[:, None], indices, num_experts).reshape(-1)  # [T*K] token-major, E pads
    starts = jnp.append(jnp.cumsum(counts) - counts, counts.sum())  # [E+1]
    by_weight = layout == "capacity" and drop_policy == "probs"
    rank = _rank_within_expert(key, weights.reshape(-1), num_experts, by_weight, starts)
    in_use = key < num_experts
    e = jnp.minimum(key, num_experts - 1)
    if layout == "blocked":
        block = max(1, min(block, 1 << max(0, (num_assign // num_experts - 1).bit_length())))
        num_rows = -(-(num_assign + num_experts * (block - 1)) // block) * block
        padded = -(-counts // block) * block
        padded_end = jnp.cumsum(padded)
        dest = jnp.where(in_use, padded_end[e] - padded[e] + rank, num_rows)
        block_starts = jnp.arange(num_rows // block) * block
        block_expert = jnp.searchsorted(padded_end, block_starts, side="right")
        block_expert = jnp.minimum(block_expert, num_experts - 1).astype(jnp.int32)
    elif layout == "capacity":
        block, num_rows = capacity, capacity * num_experts
        in_use = in_use & (rank < capacity)
        dest = jnp.where(in_use, e * capacity + rank, num_rows)
        block_expert = jnp.arange(num_experts, dtype=jnp.int32)
    elif layout == "ragged":
        num_rows = num_assign
        dest = jnp.where(in_use, starts[e] + rank, num_rows)
        block_expert = jnp.zeros((0,), jnp.int32)
    else:
        raise ValueError(f"unknown dispatch layout {layout!r}")
    if slot_major:
        dest = dest.reshape(num_tokens, k).T.reshape(-1)
    dest = dest.astype(jnp.int32)
    row_src = jnp.full(num_rows, num_assign, jnp.int32)
    row_src = row_src.at[dest].set(jnp.arange(num_assign, dtype=jnp.int32), mode="drop")
    dropped = counts.sum() - in_use.sum(dtype=jnp.int32)
    return DispatchPlan(dest, row_src, counts, dropped, block_expert, block, slot_major)
