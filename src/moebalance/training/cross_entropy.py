"""Cross-entropy over a large vocabulary without materialising the [T, V] logits.

    logits[t] = h[t] @ head                       [V] float32, one block of vocabulary at a time
    lse[t]    = log sum_v exp(logits[t, v])
    ce[t]     = lse[t] - logits[t, target[t]]

Forward and backward walk the vocabulary in blocks of `chunk` columns, so at most [T, chunk]
logits exist at once (32 MiB by default, against 2 GiB of float32 logits for 4,096 tokens x
V = 129,280, which the plain formula writes and reads several times). Walking the vocabulary
rather than the tokens reads the head once per pass and writes each block of its gradient once;
walking the tokens re-read the whole [D, V] head for every chunk of tokens and accumulated a
[D, V] float32 gradient once per chunk, 36 % of a d1024 step on a TPU v5e (docs/performance.md).

The forward keeps a running log-sum-exp per token (the running maximum m and sum of exp(logit - m),
rescaled when m grows). The backward recomputes each block's logits (one more [T, D] x [D, chunk]
matmul) instead of storing them:

    d logits[t] = (g_ce[t] + g_lse[t]) * softmax(logits[t]) - g_ce[t] * onehot(target[t])
    d head[:, block] = h^T d logits[:, block]     written once
    d h            += d logits[:, block] head[:, block]^T   [T, D] float32

On several devices (`jax.set_mesh`) h's tokens are split over every device and the head is split
as training/sharding.py splits parameters: by fsdp on V (`vocab_axis`), else on D. A block then
takes chunk / shards columns from each of the head's `shards` vocabulary slices (the order of the
vocabulary does not matter to a sum), so every device's part of a block is a slice of its own
slice of the head, and the block is gathered whole, one block at a time: the head crosses the
mesh once per pass. Sizing blocks from the global token count, or slicing the split vocabulary
by column, gathered the whole head on every trip (Flash on a v5p-256: ~8,000 GiB a device and
step, docs/distributed.md). The gradient's blocks are written into the slices they came from.

Both per-token outputs are differentiable, so a logit z-loss (mean lse^2) costs nothing extra.
`precision` is the matmuls' (jax.lax.Precision or None: the backend's default), given explicitly
because the backward is traced outside any precision context its caller sets.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moebalance.model.expert_parallel import active_mesh

CHUNK_BYTES = 32 * 2**20  # float32 logits of one block of the vocabulary
LANES = 128  # block widths are whole multiples of the TPU's 128 lanes (unless V is smaller)


def default_chunk(num_tokens: int, vocab_size: int, shards: int = 1) -> int:
    """Vocabulary columns per block for `num_tokens` tokens a device: [T, chunk] float32 logits
    fit in CHUNK_BYTES, in as few blocks as that allows; chunk / shards columns from each of
    `shards` vocabulary slices, each a multiple of LANES (at least one; at most the slice)."""
    vocab = vocab_size // shards
    widest = max(LANES, CHUNK_BYTES // (4 * num_tokens * shards) // LANES * LANES)
    blocks = -(-vocab // widest)  # ceiling divisions
    width = -(-vocab // blocks)
    return shards * min(vocab, -(-width // LANES) * LANES)


def token_cross_entropy(h: jax.Array, head: jax.Array, targets: jax.Array,
                        chunk: int | None = None,
                        precision: jax.lax.Precision | None = None,
                        vocab_axis: str | None = None) -> tuple[jax.Array, jax.Array]:
    """h [T, D] (any float dtype), head [D, V] float32, targets [T] int ->
    (ce [T], lse [T]) float32: each token's cross-entropy and log-partition. chunk: vocabulary
    columns per block (default_chunk of the tokens a device holds); vocab_axis: the mesh axis
    that splits the head's V, if one does."""
    mesh = active_mesh()
    shards = mesh.shape[vocab_axis] if mesh is not None and vocab_axis else 1
    if head.shape[1] % shards:
        raise ValueError(f"the head's {head.shape[1]} vocabulary columns do not split over the "
                         f"{shards} devices of mesh axis {vocab_axis!r}")
    devices = mesh.size if mesh is not None else 1
    chunk = chunk or default_chunk(max(1, h.shape[0] // devices), head.shape[1], shards)
    if chunk % shards:
        raise ValueError(f"chunk={chunk} columns do not split over {shards} vocabulary slices")
    layout = _Layout(head.shape[1], chunk // shards, shards,
                     vocab_axis if shards > 1 else None, mesh is not None)
    return _token_cross_entropy(h, head, layout.target_ids(targets.astype(jnp.int32)), layout,
                                precision)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How the loops walk the head (static): the head [D, V] viewed as [shards, D, V / shards],
    each slice padded with zero columns to `padded` = `blocks` x `width`; block i is columns
    [i * width, (i + 1) * width) of every slice. (The slices lead: a size-1 axis between D and
    V would be a TPU tile's minor pair and cost each block a copy on one device.)"""
    vocab: int
    width: int  # columns per block from each slice
    shards: int
    axis: str | None  # the mesh axis that splits the slices (None: not split)
    sharded: bool  # traced under a multi-device mesh

    @property
    def blocks(self) -> int:
        return -(-self.vocab // self.shards // self.width)

    @property
    def padded(self) -> int:
        """Columns of a padded slice."""
        return self.blocks * self.width

    def slices(self, head):
        """[D, V] -> [shards, D, padded] float32, each slice padded with zero columns."""
        sliced = head.reshape(head.shape[0], self.shards, -1).transpose(1, 0, 2)
        pad = self.padded - sliced.shape[2]
        return self.keep_split(jnp.pad(sliced, ((0, 0), (0, 0), (0, pad))))

    def keep_split(self, x):
        """x [shards, ...] kept split as the head is (a no-op on one device)."""
        if self.axis is None:
            return x
        return jax.lax.with_sharding_constraint(x, P(self.axis))

    def block(self, slices, i):
        """Block i [D, chunk] of the padded slices, whole on every device."""
        part = self.keep_split(
            jax.lax.dynamic_slice_in_dim(slices, i * self.width, self.width, axis=2))
        if self.sharded:
            part = jax.lax.with_sharding_constraint(part, P())
        return part.transpose(1, 0, 2).reshape(part.shape[1], -1)

    def ids(self, i):
        """Block i's columns' ids in the padded layout (slice s, column c: s * padded + c) [chunk]
        and which are the vocabulary's, not padding."""
        offset = i * self.width + jnp.arange(self.width)
        ids = jnp.arange(self.shards)[:, None] * self.padded + offset
        return ids.ravel(), jnp.tile(offset < self.vocab // self.shards, self.shards)

    def target_ids(self, targets):
        """Vocabulary ids [T] -> their columns' ids in the padded layout."""
        if self.shards == 1:  # the same numbers
            return targets
        per_slice = self.vocab // self.shards
        return targets // per_slice * self.padded + targets % per_slice

    def put(self, d_slices, d_block, i):
        """d_slices with block i's gradient d_block [D, chunk] written into its columns."""
        d_block = d_block.reshape(d_block.shape[0], self.shards, self.width).transpose(1, 0, 2)
        return jax.lax.dynamic_update_slice_in_dim(d_slices, self.keep_split(d_block),
                                                   i * self.width, 2)

    def unslice(self, d_slices):
        """[shards, D, padded] -> [D, V] without the padding columns."""
        real = d_slices[:, :, :self.vocab // self.shards]
        return real.transpose(1, 0, 2).reshape(d_slices.shape[1], self.vocab)


def _block_logits(h32, slices, layout, i, precision):
    """Block i's logits [T, chunk] float32, its columns' ids and which are real (layout.ids)."""
    logits = jnp.matmul(h32, layout.block(slices, i), precision=precision)
    return logits, *layout.ids(i)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _token_cross_entropy(h, head, targets, layout, precision):
    return _forward(h, head, targets, layout, precision)[0]


def _forward(h, head, targets, layout, precision):
    slices, h32 = layout.slices(head), h.astype(jnp.float32)

    def one(carry, i):
        peak, total, picked = carry  # [T] each: running max, sum of exp(logit - max), target logit
        logits, ids, real = _block_logits(h32, slices, layout, i, precision)
        logits = jnp.where(real, logits, -jnp.inf)
        new_peak = jnp.maximum(peak, logits.max(axis=-1))
        total = total * jnp.exp(peak - new_peak) + jnp.exp(logits - new_peak[:, None]).sum(-1)
        picked = picked + jnp.where(ids == targets[:, None], logits, 0.0).sum(-1)
        return (new_peak, total, picked), None

    num_tokens = h.shape[0]
    start = (jnp.full(num_tokens, -jnp.inf), jnp.zeros(num_tokens), jnp.zeros(num_tokens))
    (peak, total, picked), _ = jax.lax.scan(one, start, jnp.arange(layout.blocks))
    lse = peak + jnp.log(total)
    return (lse - picked, lse), (h, head, targets, lse)


def _backward(layout, precision, residuals, cotangents):
    h, head, targets, lse = residuals
    g_ce, g_lse = cotangents
    slices, h32 = layout.slices(head), h.astype(jnp.float32)

    def one(carry, i):
        d_h, d_slices = carry
        logits, ids, real = _block_logits(h32, slices, layout, i, precision)
        probs = jnp.where(real, jnp.exp(logits - lse[:, None]), 0.0)
        d_logits = ((g_ce + g_lse)[:, None] * probs
                    - jnp.where(ids == targets[:, None], g_ce[:, None], 0.0))  # [T, chunk]
        d_h = d_h + jnp.matmul(d_logits, layout.block(slices, i).T, precision=precision)
        d_block = jnp.matmul(h32.T, d_logits, precision=precision)  # [D, chunk]
        return (d_h, layout.put(d_slices, d_block, i)), None

    start = (jnp.zeros(h.shape, jnp.float32), layout.keep_split(jnp.zeros_like(slices)))
    (d_h, d_slices), _ = jax.lax.scan(one, start, jnp.arange(layout.blocks))
    return d_h.astype(h.dtype), layout.unslice(d_slices), None


_token_cross_entropy.defvjp(_forward, _backward)
