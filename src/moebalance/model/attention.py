"""DeepSeek-V4 hybrid attention: a causal sliding window on every layer, plus compressed KV.

Per layer with compress ratio r (0 = window only):

    q   = per-head RMS(wq_b(q_norm(wq_a x)))      [B, S, H, hd], RoPE on the last rd dims
    kv  = rope(kv_norm(wkv x))                     [B, S, hd], one head shared as K and V
    ckv = Compressor_r(x)                          [B, n = S // r, hd] (r > 0)
    o   = softmax over {window keys} + {visible compressed keys} + a per-head sink logit
    out = wo_b(grouped wo_a(inverse-rope(o)))

Causality, exactly: query t sees window keys t-W+1 .. t, and compressed entry i only once every
token it summarises is in the past or present, i.e. t >= (i+1)*r - 1. Packed documents: a query
sees only keys and entries all of whose tokens lie in its own segment (segments are contiguous, so
an entry qualifies iff the first token it pools does). On r = 4 layers (CSA) the
lightning indexer keeps the `index_topk` best of those entries per query; on other ratios (HCA,
r = 128) all visible entries are attended.

Cost: the window is computed in chunks of W queries against their own and the previous chunk
([S, 2W] logits, not [S, S]); CSA layers attend the indexer's top-k entries per query, densely
with the others masked ([S, S/4]) up to S/4 = 4k entries, else gathered ([S, k]); HCA layers
attend their S/r entries densely ([S, S/r]). Only the indexer scores all [S, S/4]
entries (as in DeepSeek's design). Long-context kernels are future work. Cached decoding runs
the same pieces (queries, keys, compressed_part, output, Compressor.pool) one position at a time
against a KV cache: model/decode.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moebalance.model.layers import RMSNorm, apply_rope, constant, dense_init, rms, rope_angles

NEG_INF = -1e30  # finite, so fully masked rows stay NaN-free (the sink keeps the softmax defined)
# CSA attends all n compressed entries with the unchosen masked, rather than gathering the chosen
# k per query, while n <= DENSE_TOPK * k (Attention.compressed_part)
DENSE_TOPK = 4


@dataclasses.dataclass(frozen=True)
class AttentionDims:
    emb_dim: int
    heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    ratio: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    eps: float
    dtype: str
    weight_dtype: str


def visible_entries(num_queries: int, num_entries: int, ratio: int) -> jax.Array:
    """[S, n] bool: compressed entry i is visible to query t iff t >= (i+1)*ratio - 1."""
    t = jnp.arange(num_queries)[:, None]
    i = jnp.arange(num_entries)[None, :]
    return i < (t + 1) // ratio


def entry_segments(segment_ids: jax.Array, num_entries: int, ratio: int) -> jax.Array:
    """[B, S] -> [B, n]: the segment of the first token compressed entry i pools (token (i-1)*r
    for the overlapping r = 4 compressor, whose entry i also pools block i-1; else i*r)."""
    first = jnp.arange(num_entries) * ratio
    if ratio == 4:
        first = jnp.maximum(first - ratio, 0)
    return segment_ids[:, first]


def _chunks(x: jax.Array, size: int, fill) -> jax.Array:
    """[B, S, ...] -> [B, S'/size, size, ...], padded with `fill` up to a multiple of size."""
    pad = -x.shape[1] % size
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return x.reshape(x.shape[0], -1, size, *x.shape[2:])


def _with_previous(chunks: jax.Array, fill) -> jax.Array:
    """[B, C, W, ...] -> [B, C, 2W, ...]: each chunk preceded by the one before it."""
    previous = jnp.pad(chunks[:, :-1], [(0, 0), (1, 0)] + [(0, 0)] * (chunks.ndim - 2),
                       constant_values=fill)
    return jnp.concatenate([previous, chunks], axis=2)


@jax.named_scope("window")
def _window_part(q, kv, segment_ids, window: int, scale: float):
    """Sliding-window logits, computed per chunk of `window` queries against that chunk and the
    one before (the only keys a window can reach): q [B, S, H, hd], kv [B, S, hd] in the
    compute dtype -> (logits [B, H, S, 2W] float32 with invisible keys at NEG_INF,
    probs [B, H, S, 2W] -> [B, S, H, hd] float32)."""
    b, s, h, _ = q.shape
    w = window
    qc = _chunks(q, w, 0.0)  # [B, C, W, H, hd]
    keys = _with_previous(_chunks(kv, w, 0.0), 0.0)  # [B, C, 2W, hd]
    seg_q = _chunks(segment_ids, w, -1)  # [B, C, W]
    seg_k = _with_previous(seg_q, -2)  # [B, C, 2W]; -1 / -2 never match a real segment
    offset = jnp.arange(w)[:, None] + w - jnp.arange(2 * w)[None, :]  # t - j within a chunk pair
    visible = ((offset >= 0) & (offset < w))[None, None] & (
        seg_q[..., :, None] == seg_k[..., None, :])  # [B, C, W, 2W]
    logits = jnp.einsum("bcqhd,bckd->bhcqk", qc, keys, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(visible[:, None], logits, NEG_INF)
    logits = logits.reshape(b, h, -1, 2 * w)[:, :, :s]  # [B, H, S, 2W]

    @jax.named_scope("window")
    def combine(probs):
        p = _chunks(probs.transpose(0, 2, 1, 3).astype(kv.dtype), w, 0.0)  # [B, C, W, H, 2W]
        return jnp.einsum("bcqhk,bckd->bcqhd", p, keys, preferred_element_type=jnp.float32).reshape(
            b, -1, h, kv.shape[-1])[:, :s]

    return logits, combine


class Compressor(nnx.Module):
    """Softmax-gated pooling of every r tokens into one KV entry (float32).

    r == 4 overlaps: entry i pools 2r tokens (blocks i-1 and i) with separate projections for the
    previous block (channels :d) and its own (channels d:); block 0 has no previous block. Each
    channel has its own softmax over the pooled slots, with a learned per-slot bias `ape`.
    """

    def __init__(self, emb_dim: int, dim: int, ratio: int, rope_dim: int, eps: float,
                 rngs: nnx.Rngs):
        self.ratio, self.dim, self.rope_dim = ratio, dim, rope_dim
        self.overlap = ratio == 4
        width = dim * (2 if self.overlap else 1)
        self.wkv = nnx.Param(dense_init(rngs, (emb_dim, width), jnp.float32))
        self.wgate = nnx.Param(dense_init(rngs, (emb_dim, width), jnp.float32))
        self.ape = nnx.Param(constant(0.0, (ratio, width)))
        self.norm = RMSNorm(dim, eps)

    @jax.named_scope("compressor")
    def __call__(self, x: jax.Array, freqs) -> jax.Array:
        """x [B, S, D] -> [B, S // r, d] float32, RoPE'd at each entry's first position."""
        b, s, _ = x.shape
        r, d = self.ratio, self.dim
        n = s // r
        x32 = x[:, : n * r].astype(jnp.float32)
        kv = (x32 @ self.wkv[...]).reshape(b, n, r, -1)  # [B, n, r, w]
        score = (x32 @ self.wgate[...]).reshape(b, n, r, -1) + self.ape[...]
        if self.overlap:
            prev_kv = jnp.pad(kv[:, :-1, :, :d], ((0, 0), (1, 0), (0, 0), (0, 0)))
            prev_score = jnp.pad(score[:, :-1, :, :d], ((0, 0), (1, 0), (0, 0), (0, 0)),
                                 constant_values=-jnp.inf)
            kv = jnp.concatenate([prev_kv, kv[..., d:]], axis=2)  # [B, n, 2r, d]
            score = jnp.concatenate([prev_score, score[..., d:]], axis=2)
        return self.pool(kv, score, jnp.arange(n) * r, freqs)

    def pool(self, kv: jax.Array, score: jax.Array, starts: jax.Array, freqs) -> jax.Array:
        """kv, score [B, n, slots, d] (the gate's scores with `ape` added) -> [B, n, d] entries:
        the softmax-weighted sum over the slots, normalised, RoPE'd at positions starts [n]."""
        pooled = (kv * jax.nn.softmax(score, axis=2)).sum(2)  # [B, n, d]
        pooled = self.norm(pooled)
        cos, sin = rope_angles(starts, freqs)
        return apply_rope(pooled, cos, sin)


class Indexer(nnx.Module):
    """The lightning indexer: score_s = sum_h w_h * relu(q_h . k_s), keep the top-k visible entries.

    Top-k is discrete, so (as in DeepSeek's released code) no gradient reaches the indexer through
    the selection; its output is a mask.
    """

    def __init__(self, dims: AttentionDims, rngs: nnx.Rngs):
        self.dims = dims
        self.wq_b = nnx.Param(dense_init(rngs, (dims.q_lora_rank, dims.index_heads *
                                                dims.index_head_dim), dims.weight_dtype))
        self.weights_proj = nnx.Param(dense_init(rngs, (dims.emb_dim, dims.index_heads),
                                                 dims.weight_dtype))
        self.compressor = Compressor(dims.emb_dim, dims.index_head_dim, dims.ratio,
                                     dims.rope_dim, dims.eps, rngs)

    @jax.named_scope("indexer")
    def __call__(self, x, qr, cos, sin, keys, visible) -> jax.Array:
        """keys [B, n, dh] (this indexer's compressor's entries), visible [B, S, n] (causality and
        segments) -> indices [B, S, k] int32 of the entries each query attends (where fewer than
        k are visible, the rest are invisible ones: mask them with `visible`)."""
        c = self.dims
        b, s, _ = x.shape
        q = (qr @ self.wq_b[...].astype(qr.dtype)).reshape(b, s, c.index_heads, c.index_head_dim)
        q = apply_rope(q.astype(jnp.float32), cos[:, :, None], sin[:, :, None])
        w = (x @ self.weights_proj[...].astype(x.dtype)).astype(jnp.float32)
        w = w * (c.index_head_dim * c.index_heads) ** -0.5  # [B, S, h]
        score = jnp.einsum("bshd,bnd->bshn", q, keys)
        score = jnp.einsum("bsh,bshn->bsn", w, jax.nn.relu(score))  # [B, S, n]
        return top_entries(score, visible, min(c.index_topk, keys.shape[1]))


def top_entries(score: jax.Array, visible: jax.Array, k: int) -> jax.Array:
    """The k best visible entries per query: score, visible [B, S, n] -> indices [B, S, k].

    Ties go to the lower index, and every zero counts as +0 first: top_k orders floats by their
    bits, +0 above -0, and a score is exactly zero whenever every head's relu is (often, with few
    index heads), its sign then the product's and sum's way of rounding a zero, which differs
    between the ways XLA may compute the same einsum (a batched pass, one query at a time)."""
    score = jnp.where(visible, jnp.where(score == 0.0, 0.0, score), -jnp.inf)
    return jax.lax.top_k(jax.lax.stop_gradient(score), k)[1]


def dense_part(q, keys, visible, scale: float):
    """Attention logits of queries q [B, S, H, hd] over all of keys [B, n, hd] (both in the
    compute dtype; visible [B, S, n], the others at NEG_INF) -> (logits [B, H, S, n] float32,
    probs [B, H, S, n] -> [B, S, H, hd] float32)."""
    logits = jnp.einsum("bshd,bnd->bhsn", q, keys, preferred_element_type=jnp.float32) * scale
    return (jnp.where(visible[:, None], logits, NEG_INF),
            lambda p: jnp.einsum("bhsn,bnd->bshd", p.astype(keys.dtype), keys,
                                 preferred_element_type=jnp.float32))


class Attention(nnx.Module):
    def __init__(self, dims: AttentionDims, rngs: nnx.Rngs):
        c = self.dims = dims
        wd = c.weight_dtype
        self.wq_a = nnx.Param(dense_init(rngs, (c.emb_dim, c.q_lora_rank), wd))
        self.q_norm = RMSNorm(c.q_lora_rank, c.eps)
        self.wq_b = nnx.Param(dense_init(rngs, (c.q_lora_rank, c.heads * c.head_dim), wd))
        self.wkv = nnx.Param(dense_init(rngs, (c.emb_dim, c.head_dim), wd))
        self.kv_norm = RMSNorm(c.head_dim, c.eps)
        self.attn_sink = nnx.Param(constant(0.0, (c.heads,)))
        group_in = c.heads * c.head_dim // c.o_groups
        self.wo_a = nnx.Param(dense_init(rngs, (c.o_groups, group_in, c.o_lora_rank), wd,
                                         fan_in=group_in))
        self.wo_b = nnx.Param(dense_init(rngs, (c.o_groups * c.o_lora_rank, c.emb_dim), wd))
        self.compressor = (Compressor(c.emb_dim, c.head_dim, c.ratio, c.rope_dim, c.eps, rngs)
                           if c.ratio else None)
        self.indexer = Indexer(dims, rngs) if c.ratio == 4 else None

    @jax.named_scope("attention")
    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array,
                 freqs) -> jax.Array:
        """x [B, S, D] (the attention norm's output), positions, segment_ids [B, S] -> [B, S, D]."""
        c = self.dims
        s = x.shape[1]
        x = x.astype(jnp.dtype(c.dtype))
        cos, sin = rope_angles(positions, freqs)  # [B, S, rd/2]
        qr, q = self.queries(x, cos, sin)
        kv = self.keys(x, cos, sin)
        # per part: logits [B, H, S, keys] and how to combine its probabilities
        parts = [_window_part(q, kv, segment_ids, c.window, c.head_dim ** -0.5)]
        with jax.named_scope("compressed"):
            if self.compressor is not None and s >= c.ratio:  # else no entry is complete yet
                ckv = self.compressor(x, freqs)  # [B, n, hd]
                n = ckv.shape[1]
                visible = visible_entries(s, n, c.ratio)[None] & (
                    segment_ids[:, :, None] == entry_segments(segment_ids, n, c.ratio)[:, None])
                index_keys = None if self.indexer is None else self.indexer.compressor(x, freqs)
                parts.append(self.compressed_part(x, qr, q, cos, sin, ckv, index_keys, visible))
        return self.output(parts, cos, sin)

    def queries(self, x, cos, sin):
        """x [B, S, D] in the compute dtype -> (qr [B, S, q_lora], the indexer's input too;
        q [B, S, H, hd] in the compute dtype, each head RMS-normalised and RoPE'd in float32).

        The attention's operands (q, keys, entries, probabilities) are in the compute dtype and
        its dots accumulate in float32, as a TPU computes float32 operands at its default
        precision anyway (rounded to bfloat16): with bfloat16 compute this halves what is stored
        and moved, e.g. the CSA layers' gathered [B, S, k, hd] entries."""
        c = self.dims
        dt = x.dtype
        qr = self.q_norm(x @ self.wq_a[...].astype(dt))  # [B, S, q_lora]
        q = (qr @ self.wq_b[...].astype(dt)).reshape(*x.shape[:2], c.heads, c.head_dim)
        return qr, apply_rope(rms(q, c.eps), cos[:, :, None], sin[:, :, None]).astype(dt)

    def keys(self, x, cos, sin):
        """x [B, S, D] in the compute dtype -> the shared key/value head [B, S, hd] in it
        (normalised and RoPE'd in float32)."""
        return apply_rope(self.kv_norm(x @ self.wkv[...].astype(x.dtype)), cos, sin).astype(
            x.dtype)

    def compressed_part(self, x, qr, q, cos, sin, ckv, index_keys, visible):
        """The compressed entries ckv [B, n, hd] as one attention part (logits, combine): on CSA
        layers the indexer's top-k of the visible [B, S, n] ones (scored against index_keys
        [B, n, dh]), else every visible one.

        CSA attends its k chosen entries either densely, all n entries with the unchosen masked
        (n <= DENSE_TOPK * k: no gather, [S, n] logits), or by gathering them per query ([S, k]
        logits, [B, S, k, hd] entries): the same softmax either way. A TPU's gathers and their
        scatter-add gradients cost more than the 4x larger matmuls (docs/performance.md)."""
        scale = self.dims.head_dim ** -0.5
        ckv = ckv.astype(x.dtype)  # the entries are float32 (cached so in decoding)
        if self.indexer is None:  # HCA: every visible entry
            return dense_part(q, ckv, visible, scale)
        top = self.indexer(x, qr, cos, sin, index_keys, visible)  # [B, S, k]
        n = ckv.shape[1]
        if n <= DENSE_TOPK * top.shape[-1]:
            chosen = (top[..., None] == jnp.arange(n)).any(-2)  # [B, S, n]
            return dense_part(q, ckv, chosen & visible, scale)
        valid = jnp.take_along_axis(visible, top, axis=-1)  # [B, S, k]
        entries = jax.vmap(lambda e, i: e[i])(ckv, top)  # [B, S, k, hd]
        clogits = jnp.einsum("bshd,bskd->bhsk", q, entries,
                             preferred_element_type=jnp.float32) * scale
        return (jnp.where(valid[:, None], clogits, NEG_INF),
                lambda p: jnp.einsum("bhsk,bskd->bshd", p.astype(entries.dtype), entries,
                                     preferred_element_type=jnp.float32))

    def output(self, parts, cos, sin) -> jax.Array:
        """One softmax over the parts' logits and the sink logit, each part's probabilities
        combined with its values, then the output projection -> [B, S, D]."""
        c = self.dims
        dt = jnp.dtype(c.dtype)
        b, _, s, _ = parts[0][0].shape
        sink = jnp.broadcast_to(self.attn_sink[...][None, :, None, None], (b, c.heads, s, 1))
        probs = jax.nn.softmax(jnp.concatenate([*(logits for logits, _ in parts), sink],
                                               axis=-1), axis=-1)
        widths = np.cumsum([logits.shape[-1] for logits, _ in parts])[:-1]
        o = sum(combine(p) for (_, combine), p in zip(parts, jnp.split(probs[..., :-1], widths,
                                                                       axis=-1)))  # [B,S,H,hd]
        o = apply_rope(o, cos[:, :, None], sin[:, :, None], inverse=True).astype(dt)
        o = o.reshape(b, s, c.o_groups, -1)  # [B, S, G, H/G * hd]
        o = jnp.einsum("bsgk,gkr->bsgr", o, self.wo_a[...].astype(dt)).reshape(b, s, -1)
        return o @ self.wo_b[...].astype(dt)  # [B, S, D]
