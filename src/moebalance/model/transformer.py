"""The DeepSeek-V4 model: embedding -> hyper-connected blocks -> head, plus optional MTP.

    h = repeat(embed(tokens), m)                         [m, B, S, D]   m = hc_mult streams
    for each block:  h = hc(attention(attn_norm(.)))     sliding window + compressed KV
                     h = hc(moe(ffn_norm(.)))            hash-routed in the first blocks
    logits = head(norm(hc_head(h)))                      [B, S, V] float32, untied

Blocks differ by compress ratio and routing kind. Runs of a repeating kind pattern (e.g. the
[128, 4] pairs of V4) have their parameters stacked and run under `jax.lax.scan`, so a 43-layer
model compiles like a handful of blocks; `scan_layers=False` unrolls everything (same maths).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moebalance import routing
from moebalance.config import Config, ConfigError
from moebalance.model.attention import Attention, AttentionDims
from moebalance.model.hyper import HyperConnection, HyperHead
from moebalance.model.layers import (RMSNorm, dense_init, init_normal, matmul_precision,
                                     precision_scope, rope_frequencies, stack)
from moebalance.model.moe import MoE, MoEConfig
from moebalance.routing import RoutingRecord


class ModelOutput(NamedTuple):
    logits: jax.Array  # [B, S, V] float32
    routing: RoutingRecord  # every field with a leading layer axis L (block order)
    mtp_logits: jax.Array | None  # [B, S, V] float32: position t predicts token t+2
    mtp_routing: RoutingRecord | None
    hidden: jax.Array  # [B, S, D] the head's input (logits = hidden @ head): what a fused loss
    mtp_hidden: jax.Array | None  # needs; under jit, logits nobody reads are never computed


def attention_dims(cfg: Config, ratio: int) -> AttentionDims:
    return AttentionDims(
        emb_dim=cfg.base_emb_dim, heads=cfg.base_num_query_heads, head_dim=cfg.head_dim,
        rope_dim=cfg.qk_rope_head_dim, q_lora_rank=cfg.q_lora_rank, o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank, window=cfg.sliding_window_size, ratio=ratio,
        index_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk, eps=cfg.normalization_layer_epsilon, dtype=cfg.dtype,
        weight_dtype=cfg.weight_dtype,
    )


def layer_freqs(cfg: Config, ratio: int):
    """RoPE frequencies: rope theta on uncompressed layers, compress theta (+ YaRN) otherwise."""
    if ratio == 0:
        return rope_frequencies(cfg.qk_rope_head_dim, cfg.rope_max_timescale)
    return rope_frequencies(
        cfg.qk_rope_head_dim, cfg.compress_rope_theta, yarn_factor=cfg.rope_factor,
        original_length=cfg.original_max_position_embeddings, beta_fast=cfg.beta_fast,
        beta_slow=cfg.beta_slow,
    )


def _saves_matmuls(prim, *_, **params) -> bool:
    """Remat policy `save_experts`: keep the weight matmuls' outputs (no batch dimension) and the
    routed experts' grouped matmuls' (jax.lax.ragged_dot, Pallas kernels)."""
    if prim is jax.lax.dot_general_p:
        return not params["dimension_numbers"][1][0]
    return prim.name in ("ragged_dot_general", "pallas_call")


# What a block keeps for its backward pass under each `remat_policy` (config.REMAT_POLICIES);
# the rest is recomputed from the block's inputs. `none` runs no jax.checkpoint at all.
REMAT_POLICIES = {
    # nothing: the whole block's forward runs again
    "full": jax.checkpoint_policies.nothing_saveable,
    # MaxText's `minimal`: every matmul with weights (projections, router, shared expert, hyper-
    # connection maps); the attention scores and the routed experts are recomputed
    "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # `minimal` and the routed experts' gate, up and down outputs: only elementwise work, the
    # attention scores and the dispatch's gathers run again
    "save_experts": _saves_matmuls,
}


class Block(nnx.Module):
    """One transformer block: hyper-connected attention, then hyper-connected MoE."""

    def __init__(self, cfg: Config, ratio: int, hash_table, *, rngs: nnx.Rngs):
        d, m, eps = cfg.base_emb_dim, cfg.hc_mult, cfg.normalization_layer_epsilon
        hc = dict(iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps, norm_eps=eps, rngs=rngs)
        self.freqs = tuple(float(f) for f in layer_freqs(cfg, ratio))
        if cfg.remat_policy == "auto":
            raise ConfigError("remat_policy auto is chosen per run, on its devices "
                              "(training.compiled.resolve_remat): give none, save_experts, "
                              "minimal or full to build a model directly")
        self.remat = cfg.remat_policy
        self.attn_hc = HyperConnection(d, m, **hc)
        self.attn_norm = RMSNorm(d, eps)
        self.attn = Attention(attention_dims(cfg, ratio), rngs)
        self.ffn_hc = HyperConnection(d, m, **hc)
        self.ffn_norm = RMSNorm(d, eps)
        self.ffn = MoE(MoEConfig.from_config(cfg), hash_table=hash_table, rngs=rngs)

    def forward(self, h, token_ids, positions, segment_ids, mask):
        """h [m, B, S, D] -> (h [m, B, S, D], RoutingRecord)."""
        return self.sublayers(
            h, lambda x: (self.attn(x, positions, segment_ids, self.freqs), None),
            lambda x: self.ffn(x, token_ids=token_ids, mask=mask))[:2]

    def sublayers(self, h, attend, feed_forward):
        """The block around attend(x) -> (output, extra) and feed_forward(x) -> (output, record),
        each given its norm's output x [B, S, D]: h [m, B, S, D] -> (h, record, extra)."""
        y, post, comb = self.attn_hc.pre(h)
        out, extra = attend(self.attn_norm(y))
        h = HyperConnection.post(out, h, post, comb)
        y, post, comb = self.ffn_hc.pre(h)
        out, record = feed_forward(self.ffn_norm(y))
        return HyperConnection.post(out, h, post, comb), record, extra

    def __call__(self, h, token_ids, positions, segment_ids, mask):
        if self.remat == "none":
            return self.forward(h, token_ids, positions, segment_ids, mask)
        # jax.checkpoint over the split state, not nnx.remat: under a layer scan the parameters
        # and the hash table are traced at different levels, which nnx.remat refuses
        graphdef, state = nnx.split(self)

        def forward(state, *args):
            return nnx.merge(graphdef, state).forward(*args)

        return jax.checkpoint(forward, policy=REMAT_POLICIES[self.remat])(
            state, h, token_ids, positions, segment_ids, mask)


def layer_kinds(cfg: Config) -> list[tuple[int, bool]]:
    """(compress ratio, hash-routed) of every block."""
    return [(cfg.compress_ratios[i], i < cfg.first_num_hash_layers)
            for i in range(cfg.base_num_decoder_layers)]


def segments(kinds: list, max_period: int = 2) -> list[tuple[int, int, int]]:
    """Split blocks into (start, period, repeats) runs: the longest run of a repeating pattern of
    up to `max_period` kinds starting at each point (repeats >= 2), else a single block."""
    out, i = [], 0
    while i < len(kinds):
        best = (1, 1)
        for p in range(1, max_period + 1):
            n = 1
            while kinds[i + n * p: i + (n + 1) * p] == kinds[i: i + p] and i + (n + 1) * p <= len(
                    kinds):
                n += 1
            if n >= 2 and n * p > best[0] * best[1]:
                best = (p, n)
        out.append((i, *best))
        i += best[0] * best[1]
    return out


class Unit(nnx.Module):
    """`period` consecutive blocks: the body of one scan step."""

    def __init__(self, cfg: Config, kinds, tables, *, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(cfg, ratio, table, rngs=rngs)
                                for (ratio, _), table in zip(kinds, tables)])

    def __call__(self, h, token_ids, positions, segment_ids, mask):
        records = []
        for block in self.blocks:
            h, record = block(h, token_ids, positions, segment_ids, mask)
            records.append(record)
        return h, records


class Stack(nnx.Module):
    """`repeats` Units with stacked parameters, run under jax.lax.scan."""

    def __init__(self, cfg: Config, kinds, tables, repeats: int, *, rngs: nnx.Rngs):
        # Built one by one and stacked on the host (not with nnx.vmap) so that initialisation
        # stays NumPy-only: see layers.init_normal.
        units = [Unit(cfg, kinds, tables[r], rngs=rngs) for r in range(repeats)]
        graphdef, _ = nnx.split(units[0])
        stacked = jax.tree.map(lambda *xs: stack(xs), *[nnx.state(u) for u in units])
        self.units = nnx.merge(graphdef, stacked)

    def __call__(self, h, token_ids, positions, segment_ids, mask):
        # A plain lax.scan over the split state: unlike nnx.scan it does not mind variables
        # traced at different levels (parameters under grad, the rest closed over).
        graphdef, state = nnx.split(self.units)

        def body(h, unit_state):
            return nnx.merge(graphdef, unit_state)(h, token_ids, positions, segment_ids, mask)

        h, records = jax.lax.scan(body, h, state)  # [period] records of [n, ...] arrays
        # block order (unit 0's blocks, unit 1's blocks, ...) with a leading layer axis; kept
        # stacked: slicing out single layers would make the backward pad every one to [n, ...]
        stacked = jax.tree.map(lambda *r: jnp.stack(r, axis=1), *records)  # [n, period, ...]
        return h, jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), stacked)


def build_hash_tables(cfg: Config, tables=None) -> list:
    """One [V, K] table per hash-routed block (None for the others)."""
    n = cfg.first_num_hash_layers
    if tables is not None:
        if len(tables) != n:
            raise ConfigError(f"got {len(tables)} hash tables for first_num_hash_layers={n}")
        return list(tables) + [None] * (cfg.base_num_decoder_layers - n)
    if n and cfg.hash_table == "balanced":
        raise ConfigError("config key `hash_table`: 'balanced' needs token counts; build the tables "
                          "with moebalance.routing.build_hash_table and pass hash_tables=")
    built = [routing.build_hash_table(cfg.vocab_size, cfg.num_experts, cfg.num_experts_per_tok,
                                      cfg.hash_table, seed=cfg.hash_table_seed + i)
             for i in range(n)]
    return built + [None] * (cfg.base_num_decoder_layers - n)


class MTP(nnx.Module):
    """Multi-token prediction: one more block on [embed(next token), h], its own hc head and norm."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        d, eps, wd = cfg.base_emb_dim, cfg.normalization_layer_epsilon, cfg.weight_dtype
        self.enorm, self.hnorm, self.norm = RMSNorm(d, eps), RMSNorm(d, eps), RMSNorm(d, eps)
        self.e_proj = nnx.Param(dense_init(rngs, (d, d), wd))
        self.h_proj = nnx.Param(dense_init(rngs, (d, d), wd))
        ratios = cfg.compress_ratios
        ratio = ratios[cfg.base_num_decoder_layers] if len(ratios) > cfg.base_num_decoder_layers else 0
        self.block = Block(cfg, ratio, None, rngs=rngs)
        self.hc_head = HyperHead(d, cfg.hc_mult, eps=cfg.hc_eps, norm_eps=eps, rngs=rngs)


class DeepSeekV4(nnx.Module):
    def __init__(self, cfg: Config, *, hash_tables=None, rngs: nnx.Rngs):
        # the shapes __call__ needs, not the whole config: the model's static structure stays the
        # same for runs that differ only in training keys (they share compiled steps)
        self.vocab_size, self.hc_mult, self.emb_dim = cfg.vocab_size, cfg.hc_mult, cfg.base_emb_dim
        d, v, wd = cfg.base_emb_dim, cfg.vocab_size, cfg.weight_dtype
        self.dtype = jnp.dtype(cfg.dtype)
        self.matmul_precision = matmul_precision(cfg.matmul_precision, cfg.dtype)
        self.embed = nnx.Param(init_normal(rngs, (v, d), wd, 1.0))
        tables = build_hash_tables(cfg, hash_tables)
        kinds = layer_kinds(cfg)
        # (first block, blocks per unit, units) of each entry of self.segments
        self.layout = tuple(segments(kinds) if cfg.scan_layers
                            else [(i, 1, 1) for i in range(len(kinds))])
        self.segments = nnx.List()
        for start, period, repeats in self.layout:
            if repeats == 1:
                self.segments.append(Block(cfg, kinds[start][0], tables[start], rngs=rngs))
                continue
            unit_kinds = kinds[start:start + period]
            unit_tables = [tables[start + r * period: start + (r + 1) * period]
                           for r in range(repeats)]
            self.segments.append(Stack(cfg, unit_kinds, unit_tables, repeats, rngs=rngs))
        self.hc_head = HyperHead(d, cfg.hc_mult, eps=cfg.hc_eps,
                                 norm_eps=cfg.normalization_layer_epsilon, rngs=rngs)
        self.norm = RMSNorm(d, cfg.normalization_layer_epsilon)
        self.head = nnx.Param(dense_init(rngs, (d, v), jnp.float32))  # untied, float32
        self.mtp = MTP(cfg, rngs=rngs) if cfg.mtp_num_layers else None

    def streams(self, tokens):
        """tokens [B, S] -> the residual streams h [m, B, S, D]: the embedding, m times."""
        with jax.named_scope("embed"):
            x = jnp.take(self.embed[...], tokens, axis=0).astype(self.dtype)  # [B, S, D]
        return jnp.broadcast_to(x, (self.hc_mult, *tokens.shape, self.emb_dim))

    @jax.named_scope("head")
    def logits(self, y):
        return jnp.matmul(y.astype(jnp.float32), self.head[...], precision=self.matmul_precision)

    def __call__(self, tokens, *, positions=None, segment_ids=None, mask=None,
                 mtp_tokens=None) -> ModelOutput:
        """tokens [B, S] int; positions [B, S] (default 0..S-1); segment_ids [B, S] (packed
        documents: attention stays within a segment; default one segment); mask [B, S] valid
        tokens (for the routing counts); mtp_tokens [B, S]: the token after each position, which
        the MTP layer (if any) needs; without them the output has no MTP part."""
        with precision_scope(self.matmul_precision):
            return self._forward(tokens, positions, segment_ids, mask, mtp_tokens)

    def _forward(self, tokens, positions, segment_ids, mask, mtp_tokens) -> ModelOutput:
        routing.check_token_ids(tokens, self.vocab_size)
        positions, segment_ids = self.defaults(tokens, positions, segment_ids)
        h = self.streams(tokens)
        records = []
        for seg in self.segments:
            h, rec = run_segment(seg, h, tokens, positions, segment_ids, mask)
            records.append(rec)
        return self.outputs(h, records, positions, segment_ids, mask, mtp_tokens)

    @staticmethod
    def defaults(tokens, positions, segment_ids):
        """The positions 0..S-1 and the one segment of [B, S] tokens where none are given."""
        b, s = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s), (b, s))
        if segment_ids is None:
            segment_ids = jnp.zeros((b, s), jnp.int32)
        return positions, segment_ids

    def outputs(self, h, records, positions, segment_ids, mask, mtp_tokens) -> ModelOutput:
        """The model's output from the last block's streams h [m, B, S, D] and each segment's
        record (run_segment's): the head's, and the MTP layer's where mtp_tokens are given."""
        stacked = jax.tree.map(lambda *r: jnp.concatenate(r), *records)
        hidden = self.norm(self.hc_head(h))
        if self.mtp is None or mtp_tokens is None:  # inference and evaluation skip MTP
            return ModelOutput(self.logits(hidden), stacked, None, None, hidden, None)
        mtp = self.mtp
        e = mtp.enorm(jnp.take(self.embed[...], mtp_tokens, axis=0).astype(self.dtype))
        hm = e @ mtp.e_proj[...].astype(self.dtype) + mtp.hnorm(h) @ mtp.h_proj[...].astype(
            self.dtype)  # [m, B, S, D]: the embedding's projection added to every stream
        hm, mtp_record = mtp.block(hm, mtp_tokens, positions, segment_ids, mask)
        mtp_hidden = mtp.norm(mtp.hc_head(hm))
        return ModelOutput(self.logits(hidden), stacked, self.logits(mtp_hidden), mtp_record,
                           hidden, mtp_hidden)


def run_segment(seg: Block | Stack, h, tokens, positions, segment_ids, mask):
    """One entry of DeepSeekV4.segments on the streams h [m, B, S, D] -> (h, its blocks' record
    with a leading layer axis)."""
    h, rec = seg(h, tokens, positions, segment_ids, mask)
    return h, rec if isinstance(seg, Stack) else jax.tree.map(lambda x: x[None], rec)


def placeholder_hash_tables(cfg: Config) -> list[np.ndarray]:
    """All-zero [V, K] tables for the hash blocks of a model whose real tables come from elsewhere
    (a checkpoint) or do not matter (shapes only): building the real ones is slow and moot."""
    return [np.zeros((cfg.vocab_size, cfg.num_experts_per_tok), np.int32)
            ] * cfg.first_num_hash_layers


def parameter_counts(cfg: Config) -> dict[str, int]:
    """Parameter counts by abstract evaluation (nothing is allocated).

    total: every parameter of the main model (the MTP layer is counted apart, as DeepSeek does);
    active: those one token uses: all but the embedding table (a lookup, not a matmul) and the
    routed experts it does not choose (K of E per MoE layer); mtp: the MTP layer's parameters.
    """
    model = nnx.eval_shape(lambda: DeepSeekV4(cfg, hash_tables=placeholder_hash_tables(cfg),
                                              rngs=nnx.Rngs(0)))
    total = mtp = inactive = 0
    unused = 1.0 - cfg.num_experts_per_tok / cfg.num_experts
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        size = int(np.prod(var.shape))
        routed = path[-2:] in (("ffn", "w1"), ("ffn", "w2"), ("ffn", "w3"))  # not ffn.shared.w*
        if path[0] == "mtp":
            mtp += size
            continue
        total += size
        if routed:
            inactive += size * unused
        if path == ("embed",):
            inactive += size
    return {"total": total, "active": int(round(total - inactive)), "mtp": mtp}


def _bias_slots(model: DeepSeekV4, which: str = "bias"):
    """(layer, variable, index into its stacked leading axis or None) per top-k block: its
    RouterBias (`which` 'bias') or its RouterBiasAverage ('bias_average')."""
    for seg, (start, period, repeats) in zip(model.segments, model.layout):
        if repeats == 1:
            if seg.ffn.bias is not None:
                yield start, getattr(seg.ffn, which), None
            continue
        for b, block in enumerate(seg.units.blocks):
            if block.ffn.bias is not None:
                for r in range(repeats):
                    yield start + r * period + b, getattr(block.ffn, which), r


def routed_layers(model: DeepSeekV4) -> list[int]:
    """Indices of the top-k routed blocks (those with a bias), in order."""
    return sorted(layer for layer, _, _ in _bias_slots(model))


def averages_biases(model: DeepSeekV4) -> bool:
    """Whether the top-k blocks keep a running mean of their biases (`routed_bias_average_fraction`
    > 0): get_biases(model, 'bias_average')."""
    return any(var is not None for _, var, _ in _bias_slots(model, "bias_average"))


def _bias_rows(model: DeepSeekV4, which: str = "bias"):
    """(variable, its rows of get_biases' [L_routed, E] array in stacked order) per variable: one
    row for a single block's [E] bias, `repeats` rows for a scanned unit's."""
    slots = sorted(_bias_slots(model, which), key=lambda s: s[0])
    rows = {}
    for row, (_, var, _) in enumerate(slots):
        rows.setdefault(id(var), (var, []))[1].append(row)
    return list(rows.values())


def get_biases(model: DeepSeekV4, which: str = "bias") -> jax.Array:
    """[L_routed, E] float32 biases of the top-k blocks, in block order (`which` 'bias_average':
    their running means, where averages_biases)."""
    groups = _bias_rows(model, which)
    # a few array operations whatever the depth: one per variable and one reordering (eager
    # calls cost ~1.4 ms each on a TPU's host, and the refit reads and writes the biases often)
    parts = [var[...].reshape(len(rows), -1) for var, rows in groups]
    stacked = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    order = np.argsort(np.concatenate([rows for _, rows in groups]))
    return stacked if np.array_equal(order, np.arange(len(order))) else stacked[order]


@contextlib.contextmanager
def fitting_biases(model: DeepSeekV4):
    """Inside the block, each top-k block of `model` routes the tokens it is given with the bias
    that balances them (balancing.quantile_fixed_point from its own bias), fitted on their
    scores as the earlier blocks, with theirs, pass them on; its record's `bias` is that bias.
    The blocks' own biases are not changed. A change of the model's structure: a step traced
    inside the block compiles a program of its own."""
    model.set_attributes(MoE, fit_bias=True)
    try:
        yield
    finally:
        model.set_attributes(MoE, fit_bias=False)


def set_biases(model: DeepSeekV4, biases: jax.Array, which: str = "bias") -> None:
    """Write [L_routed, E] biases back (the inverse of get_biases); works under jit."""
    for var, rows in _bias_rows(model, which):
        new = biases[np.asarray(rows)].astype(jnp.float32).reshape(var.shape)
        if isinstance(new, jax.core.Tracer):
            # under jit, not var[...] = new: nnx's indexed write compares the value's and the
            # variable's `sharding`, and each such read of a tracer builds an error message
            # walking the whole traced program (2 of the ~9 s it took to lower deepseek4-tiny's
            # step on a 2-core CPU)
            var.set_value(new)
        else:
            var[...] = new  # keeps the variable's placement if the value's differs
