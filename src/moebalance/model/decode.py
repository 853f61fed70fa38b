"""Cached decoding of DeepSeek-V4: one prefill of the prompt, then one position per step.

    prefill(model, tokens [B, L], length) -> (logits [B, V] after tokens[:, :length], Cache)
    step(model, cache, token [B])         -> (logits [B, V] after `token`, the Cache with it)

What a position reads of earlier ones, per layer (`LayerCache`):

    window      [B, W, hd]   the shared key/value head of the last W positions (p in slot p % W)
    compressor  (r > 0)      the compressed entries so far [B, L // r, hd] (row i once positions up
                             to (i+1)r - 1 are in; zeros after), and the wkv / wgate (+ ape)
                             projections of the unfinished block, preceded on r = 4 layers by those
                             of the previous block (an entry there pools two blocks)
    indexer     (r = 4)      the same for the lightning indexer's own compressor: its keys

and nothing else: the hyper-connections, the norms and the MoE (routing included; hash-routed layers
route by the token's id) work position by position; a step's MoE gathers just the K chosen experts.
MTP is not used. The buffers have fixed shapes
for L positions (layers whose ratio exceeds L keep no compressor state) and `Cache.length` counts
the positions in, so under jax.jit each of prefill and step compiles once per L and batch size.

Prefill runs the training path's attention over the padded prompt (positions from `length` on are
padding; everything is causal, so they change nothing before them) and fills the cache from the
same attention inputs. A step runs the same pieces of `Attention` (queries, keys, the compressed
part with its indexer top-k, the output) and `Compressor.pool` on one position against the cache:
the uncached forward's logits up to float32 rounding (the matmuls have other shapes).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from moebalance.model.attention import Attention, Compressor, dense_part
from moebalance.model.layers import precision_scope, rope_angles
from moebalance.model.moe import MoE, swiglu
from moebalance.model.transformer import DeepSeekV4, Stack


class CompressorCache(NamedTuple):
    entries: jax.Array  # [B, L // r, d] float32
    kv: jax.Array  # [B, (r +) r, w] float32 wkv projections of the (previous and) unfinished block
    score: jax.Array  # [B, (r +) r, w] their wgate projections + ape; -inf before position 0


class LayerCache(NamedTuple):
    window: jax.Array  # [B, W, hd] in the compute dtype (Attention.keys)
    compressor: CompressorCache | None  # None: no compressed entries (r = 0 or r > L)
    indexer: CompressorCache | None  # None: not a CSA layer (or r > L)


class Cache(NamedTuple):
    length: jax.Array  # [] int32: the positions in, i.e. the next one
    layers: list  # per model segment a LayerCache; for a scanned Stack, one per block of its unit
    # with a leading axis over the unit's repeats


def prefill(model: DeepSeekV4, tokens: jax.Array, length) -> tuple[jax.Array, Cache]:
    """tokens [B, L] (the prompt in the first `length` >= 1 columns, then any padding) ->
    (the logits [B, V] at position length - 1, the Cache of positions 0 .. length - 1)."""
    with precision_scope(model.matmul_precision):
        return _prefill(model, tokens, length)


def step(model: DeepSeekV4, cache: Cache, token: jax.Array) -> tuple[jax.Array, Cache]:
    """token [B] at position cache.length -> (its logits [B, V], the cache with it). The cache
    must have room: cache.length < L."""
    with precision_scope(model.matmul_precision):
        return _step(model, cache, token)


def _prefill(model: DeepSeekV4, tokens, length):
    b, size = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(size), (b, size))
    segment_ids = jnp.zeros((b, size), jnp.int32)

    def layer(block, h, _):
        def attend(x):
            return (block.attn(x, positions, segment_ids, block.freqs),
                    _fill(block.attn, x, positions, length, block.freqs))

        h, _, cache = block.sublayers(h, attend, lambda x: block.ffn(x, token_ids=tokens))
        return h, cache

    h, caches = _run_layers(model, model.streams(tokens), layer, None)
    return _head(model, h[:, :, length - 1]), Cache(jnp.asarray(length, jnp.int32), caches)


def _step(model: DeepSeekV4, cache: Cache, token):
    t = cache.length
    tokens = token[:, None]

    def layer(block, h, layer_cache):
        h, _, layer_cache = block.sublayers(
            h, lambda x: _attend(block.attn, x, layer_cache, t, block.freqs),
            lambda x: (_chosen_experts(block.ffn, x, tokens), None))
        return h, layer_cache

    h, caches = _run_layers(model, model.streams(tokens), layer, cache.layers)
    return _head(model, h[:, :, 0]), Cache(t + 1, caches)


def _head(model: DeepSeekV4, h):
    return model.logits(model.norm(model.hc_head(h)))


def _run_layers(model: DeepSeekV4, h, layer, caches):
    """h through every block in order: layer(block, h, its cache or None) -> (h, its new cache),
    with `caches` as in Cache.layers or None; scanned Stacks stay scanned -> (h, new caches)."""
    out = []
    for i, seg in enumerate(model.segments):
        cache = None if caches is None else caches[i]
        if isinstance(seg, Stack):
            graphdef, state = nnx.split(seg.units)

            def body(h, xs, graphdef=graphdef):
                unit_state, unit_cache = xs
                new = []
                for j, block in enumerate(nnx.merge(graphdef, unit_state).blocks):
                    h, block_cache = layer(block, h, None if unit_cache is None else unit_cache[j])
                    new.append(block_cache)
                return h, new

            h, cache = jax.lax.scan(body, h, (state, cache))
        else:
            h, cache = layer(seg, h, cache)
        out.append(cache)
    return h, out


def _chosen_experts(moe: MoE, x, token_ids):
    """The MoE layer on x [B, 1, D] (token_ids [B, 1]) -> [B, 1, D], reading only the chosen
    experts' weights: the layer's blocked dispatch picks them by a one-hot matmul over every
    expert, which at one token a step costs a quarter of the step (deepseek4-tiny)."""
    c = moe.config
    xt = x.reshape(-1, c.emb_dim).astype(moe.dtype)  # [T, D]
    rec = moe.route(xt, token_ids, None)
    w1, w3, w2 = (w[...][rec.indices].astype(moe.dtype) for w in (moe.w1, moe.w3, moe.w2))
    h = swiglu(jnp.einsum("td,tkdf->tkf", xt, w1), jnp.einsum("td,tkdf->tkf", xt, w3),
               c.swiglu_limit)  # [T, K, F]
    h = (h * rec.weights[..., None]).astype(moe.dtype)
    y = jnp.einsum("tkf,tkfd->tkd", h, w2).sum(1, dtype=jnp.float32)
    if moe.shared is not None:
        y = y + moe.shared(xt).astype(jnp.float32)
    return y.astype(moe.dtype).reshape(x.shape)


def _slot_positions(t, window: int) -> jax.Array:
    """[W]: the position each window slot holds once position t is in (negative: none yet)."""
    return t - (t - jnp.arange(window)) % window


def _previous(comp: Compressor) -> int:
    """Slots of the previous block ahead of the unfinished one in a CompressorCache."""
    return comp.ratio if comp.overlap else 0


def _project(comp: Compressor, x, positions):
    """x [B, S, D] at positions [S] (or one position) -> (kv, score + ape) [B, S, w] float32."""
    x32 = x.astype(jnp.float32)
    return x32 @ comp.wkv[...], x32 @ comp.wgate[...] + comp.ape[...][positions % comp.ratio]


def _fill(attn: Attention, x, positions, n, freqs) -> LayerCache:
    """The cache of positions 0 .. n-1 from the attention's input x [B, L, D]."""
    c = attn.dims
    x = x.astype(jnp.dtype(c.dtype))
    kv = attn.keys(x, *rope_angles(positions, freqs))  # [B, L, hd]
    slots = _slot_positions(n - 1, c.window)
    window = jnp.where((slots >= 0)[:, None], kv[:, jnp.maximum(slots, 0)], 0.0)
    if attn.compressor is None or x.shape[1] < c.ratio:
        return LayerCache(window, None, None)
    return LayerCache(window, _fill_compressor(attn.compressor, x, n, freqs),
                      None if attn.indexer is None else
                      _fill_compressor(attn.indexer.compressor, x, n, freqs))


def _fill_compressor(comp: Compressor, x, n, freqs) -> CompressorCache:
    r, prev = comp.ratio, _previous(comp)
    entries = comp(x, freqs)  # [B, L // r, d]: rows below n // r pool prompt positions only
    entries = jnp.where((jnp.arange(entries.shape[1]) < n // r)[:, None], entries, 0.0)
    kv, score = _project(comp, x, jnp.arange(x.shape[1]))
    pad = ((0, 0), (prev, r), (0, 0))  # -inf scores before position 0: block 0 has no previous
    start = n // r * r  # row of the previous block (overlap) or the unfinished one, once padded
    kv, score = (jax.lax.dynamic_slice_in_dim(jnp.pad(a, pad, constant_values=fill), start,
                                              prev + r, axis=1)
                 for a, fill in ((kv, 0.0), (score, -jnp.inf)))
    return CompressorCache(entries, kv, score)


def _attend(attn: Attention, x, cache: LayerCache, t, freqs):
    """Attention of position t (x [B, 1, D]) over the cache -> (output [B, 1, D], new cache)."""
    c = attn.dims
    x = x.astype(jnp.dtype(c.dtype))
    b = x.shape[0]
    cos, sin = rope_angles(jnp.full((b, 1), t), freqs)
    qr, q = attn.queries(x, cos, sin)
    window = jax.lax.dynamic_update_slice_in_dim(cache.window, attn.keys(x, cos, sin),
                                                 t % c.window, axis=1)
    visible = (_slot_positions(t, c.window) >= 0)[None, None]
    parts = [dense_part(q, window, visible, c.head_dim ** -0.5)]
    compressor = indexer = None
    if cache.compressor is not None:
        compressor = _compress(attn.compressor, cache.compressor, x, t, freqs)
        n = compressor.entries.shape[1]
        visible = jnp.broadcast_to(jnp.arange(n) < (t + 1) // c.ratio, (b, 1, n))
        if cache.indexer is not None:
            indexer = _compress(attn.indexer.compressor, cache.indexer, x, t, freqs)
        parts.append(attn.compressed_part(x, qr, q, cos, sin, compressor.entries,
                                          None if indexer is None else indexer.entries, visible))
    return attn.output(parts, cos, sin), LayerCache(window, compressor, indexer)


def _overlap_slots(a: jax.Array, r: int, d: int) -> jax.Array:
    """a [B, 2r, 2d] (the previous block's r slots, then this block's) -> [B, 2r, d]: the previous
    block's first d channels, then this block's last d, the slots an overlapping entry pools.

    A select, not jnp.concatenate([a[:, :r, :d], a[:, r:, d:]], 1): XLA compiles that
    concatenation wrong for a TPU v5e (JAX 0.10.2; values from other slots and channels, found by
    bisecting cached decoding on the chip, docs/distributed.md); the select is the same array."""
    return jnp.where((jnp.arange(2 * r) < r)[:, None], a[..., :d], a[..., d:])


def _compress(comp: Compressor, cache: CompressorCache, x, t, freqs) -> CompressorCache:
    """Position t (x [B, 1, D]) into the unfinished block; when it is the block's last, the block's
    entry is written and (overlapping compressor) the block becomes the previous one."""
    r, d, prev = comp.ratio, comp.dim, _previous(comp)
    kv, score = (jax.lax.dynamic_update_slice_in_dim(state, new, prev + t % r, axis=1)
                 for state, new in zip((cache.kv, cache.score), _project(comp, x, t)))
    pooled = [_overlap_slots(a, r, d) for a in (kv, score)] if comp.overlap else [kv, score]
    entry = comp.pool(pooled[0][:, None], pooled[1][:, None], (t // r * r)[None], freqs)
    done = (t + 1) % r == 0
    entries = jnp.where(done, jax.lax.dynamic_update_slice_in_dim(cache.entries, entry, t // r,
                                                                  axis=1), cache.entries)
    if prev:
        kv, score = (jnp.where(done, jnp.roll(a, -r, axis=1), a) for a in (kv, score))
    return CompressorCache(entries, kv, score)
