"""Load-balancing maths: expert counts, bias-update rules, Quantile Balancing and balance losses.

Pure functions with explicit arguments; they never read a config, and the losses are returned
unweighted (callers multiply by their coefficient). Formulas: docs/load_balancing.md sections 4
(bias rules), 5 (Quantile Balancing) and 6 (balance losses and z-loss).

Bias rules (applied after the optimizer step, outside autodiff, with counts c [E] summed over the
whole global batch of the step):

    sign          b += rate * sign(mean(c) - c)                    DeepSeek-V3/V4, rate 1e-3
    proportional  b += rate * (mean(c) - c)        (raw counts)    arXiv 2408.15664
    fraction      b += rate * (1/E - c / sum(c))   (load shares)   LongCat-Flash
    center=True   subtract the mean of the update (torchtitan), so the bias stays zero-mean

Quantile Balancing sets the bias directly from the batch's scores (`quantile_bias`). Any rule's
bias can also be averaged over the last steps (`average_bias`, Polyak averaging).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moebalance.routing import check_topk


def _valid(mask, shape) -> jax.Array:
    """The token mask as float32 of `shape` (all ones when mask is None)."""
    if mask is None:
        return jnp.ones(shape, jnp.float32)
    return jnp.broadcast_to(mask, shape).astype(jnp.float32)


def expert_counts(indices: jax.Array, num_experts: int, mask: jax.Array | None = None) -> jax.Array:
    """Exact int32 assignments per expert.

    Args:
      indices: [..., K] chosen experts.
      mask: [...] bool, True for tokens that count (padding excluded), or None for all.

    Returns:
      [E] int32, summing to K * (number of valid tokens).

    Counted by comparing every choice with every expert id (one fused [N*K, E] pass), not by a
    scatter-add, which a TPU runs one update at a time (~0.4 ms a layer at 24,576 choices).
    """
    hits = (indices[..., None] == jnp.arange(num_experts)).astype(jnp.int32)  # [..., K, E]
    if mask is not None:
        hits = hits * jnp.broadcast_to(mask, indices.shape[:-1])[..., None, None].astype(jnp.int32)
    return hits.reshape(-1, num_experts).sum(0)


def _sign_of_mean_minus(counts: jax.Array) -> jax.Array:
    """sign(mean(c) - c) computed exactly in int32, with no E * c product that could overflow.

    mean = q + r/E with q, r = divmod(sum(c), E): c < mean iff c < q, or c == q and r > 0;
    c > mean iff c > q.
    """
    num_experts = counts.shape[-1]
    q, r = jnp.divmod(counts.sum(-1, keepdims=True), num_experts)
    below = (counts < q) | ((counts == q) & (r > 0))
    above = counts > q
    return below.astype(jnp.float32) - above.astype(jnp.float32)


def _proportional(counts):
    c = counts.astype(jnp.float32)
    return c.mean(-1, keepdims=True) - c


def _fraction(counts):
    c = counts.astype(jnp.float32)
    total = jnp.maximum(c.sum(-1, keepdims=True), 1.0)
    return 1.0 / counts.shape[-1] - c / total


BIAS_RULES = {"sign": _sign_of_mean_minus, "proportional": _proportional, "fraction": _fraction}

# Documented default rates, tested not to oscillate (tests/test_simulation.py). 'proportional' uses
# raw counts, so its rate scales inversely with the per-expert load: 1e-4 is for ~512 assignments
# per expert per step (use 0.05 / (N*K/E) in general). 'sign' is DeepSeek-V3/V4's gamma.
# 'quantile' moves the bias this fraction of the way to the batch's quantile fit (damped_quantile):
# 1.0 is Quantile Balancing as published.
DEFAULT_RATES = {"sign": 1e-3, "proportional": 1e-4, "fraction": 1.0, "quantile": 1.0}


def update_bias(
    bias: jax.Array, counts: jax.Array, *, rule: str, rate, center: bool = False
) -> jax.Array:
    """One aux-loss-free bias step.

    Args:
      bias: [..., E] float32 bias (leading axes, e.g. layers, are independent).
      counts: [..., E] int32 assignment counts of the step's whole global batch.
      rule: 'sign', 'proportional' or 'fraction' (see the module docstring).
      rate: step size gamma/u (>= 0; 0 leaves the bias unchanged). May be a traced scalar.
      center: subtract the update's mean over experts.

    Returns:
      the new float32 bias.
    """
    if rule not in BIAS_RULES:
        raise ValueError(f"unknown bias update rule {rule!r}; choose one of {sorted(BIAS_RULES)}")
    check_rate(rate)
    delta = jnp.asarray(rate, jnp.float32) * BIAS_RULES[rule](counts)
    if center:
        delta = delta - delta.mean(-1, keepdims=True)
    return (bias.astype(jnp.float32) + delta).astype(jnp.float32)


def check_rate(rate) -> None:
    if isinstance(rate, (int, float)) and rate < 0:
        raise ValueError(f"the bias update rate must be >= 0, got {rate}")


def rate_schedule(rate: float, freeze_after: int | None = None, *, decay_steps: int | None = None,
                  final_fraction: float = 1.0):
    """step -> rate. Constant (final_fraction 1), or a cosine from `rate` at step 0 to
    rate * final_fraction at step `decay_steps` (held after it): late in training the router
    moves slowly, and a smaller step averages the bias over more batches instead of chasing the
    last ones. From step `freeze_after` on the rate is 0 (DeepSeek-V3 froze the bias for its last
    500B tokens). Works on Python ints and traced int steps."""
    check_rate(rate)
    if freeze_after is not None and freeze_after < 0:
        raise ValueError(f"freeze_after must be >= 0, got {freeze_after}")
    if not 0 <= final_fraction <= 1:
        raise ValueError(f"final_fraction must be in [0, 1], got {final_fraction}")
    if final_fraction != 1 and not decay_steps:
        raise ValueError("a decaying bias rate (final_fraction < 1) needs decay_steps >= 1")

    def schedule(step):
        value = jnp.float32(rate)
        if final_fraction != 1:
            progress = jnp.minimum(jnp.asarray(step, jnp.float32) / decay_steps, 1.0)
            cosine = 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
            value = value * (final_fraction + (1.0 - final_fraction) * cosine)
        if freeze_after is not None:
            value = jnp.where(step < freeze_after, value, jnp.float32(0.0))
        return value.astype(jnp.float32)

    return schedule


def average_start(steps: int, fraction: float) -> int:
    """The first step whose bias enters the running mean of the last `fraction` of `steps`
    steps: steps - max(1, round(fraction * steps)) (fraction > 0)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"the averaged fraction of the steps must be in (0, 1], got {fraction}")
    return steps - max(1, round(fraction * steps))


def average_bias(average: jax.Array, bias: jax.Array, step, start: int) -> jax.Array:
    """Polyak averaging of the bias: the running mean of the biases after steps start .. step,

        average = bias                                       step < start
        average += (bias - average) / (step - start + 1)     step >= start

    in float32 (`bias` the bias after step `step`'s update; `step` may be traced). The online
    bias keeps steering training; the mean stops following one batch's noise, which the bias
    then carries with a weight of 1/(steps averaged) instead of the rate's."""
    average, bias = average.astype(jnp.float32), bias.astype(jnp.float32)
    n = jnp.maximum(jnp.asarray(step, jnp.int32) - start + 1, 1).astype(jnp.float32)
    return jnp.where(jnp.asarray(step) >= start, average + (bias - average) / n, bias)


def quantile_bias(
    scores: jax.Array,
    bias: jax.Array,
    k: int,
    *,
    mask: jax.Array | None = None,
    center: bool = False,
    rate=1.0,
) -> jax.Array:
    """Quantile Balancing (docs/load_balancing.md section 5): the bias that would give every
    expert ~N*K/E of this batch's tokens.

    No step size. For token t and expert i, with the other experts' current biases fixed, t picks i
    iff s[t,i] + b_i exceeds thr[t,i], the K-th largest biased score among the OTHER experts: the
    token's (K+1)-th biased score when i is among its current top-K, its K-th otherwise. With the
    margin m[t,i] = s[t,i] - thr[t,i], expert i receives #{t : m[t,i] + b_i > 0} tokens, so

        b_i = -quantile(m[:, i], 1 - K/E)          (over the valid tokens)

    leaves about N*K/E margins above zero. The quantile interpolates linearly between order
    statistics, so when N*K/E is not an integer the target falls between two neighbouring margins
    and the expert receives floor or ceil of N*K/E. Tied margins at the quantile are all on one
    side of it: such an expert may receive more or fewer than the target by the size of the tie.
    All experts move at once (a Jacobi step), so the result is balanced for the batch only
    approximately; repeated over steps it converges without a step size to tune.

    Args:
      scores: [..., E] float32 unbiased scores of the step's batch; [L, ..., E] with a bias per
        layer (bias [L, E]): every layer fitted at once, as one fused computation.
      bias: [E] float32 current bias (its values decide the current top-K and thresholds), or
        [L, E] for L layers.
      k: experts per token. With k == E every expert is always chosen and the bias is returned.
      mask: [...] bool valid tokens (the same for every layer), or None.
      center: subtract the mean of the new bias.
      rate: move this fraction of the way from `bias` to the fit (1.0: Quantile Balancing as
        published; smaller values average the fit over about 1/rate batches, so the bias stops
        chasing one batch's sampling noise; 0 keeps the bias).

    Returns:
      float32 new bias, bias's shape.
    """
    num_experts = scores.shape[-1]
    check_topk(k, num_experts)
    bias = bias.astype(jnp.float32)
    if k == num_experts:
        return bias
    layers = bias.reshape(-1, num_experts)  # [L, E]
    scores = scores.reshape(layers.shape[0], -1, num_experts).astype(jnp.float32)  # [L, T, E]
    biased = scores + layers[:, None]
    # top-k of a 2-D array: XLA's CPU runs it as a top-k kernel, a 3-D one as a full sort (~10x)
    top = jax.lax.top_k(biased.reshape(-1, num_experts), k + 1)[0].reshape(*biased.shape[:2], -1)
    kth, k1th = top[..., k - 1 : k], top[..., k : k + 1]  # [L, T, 1], descending order
    chosen = biased >= kth  # [L, T, E]: i in the token's top-K (ties at the K-th count as chosen)
    margins = scores - jnp.where(chosen, k1th, kth)  # [L, T, E]
    valid = None if mask is None else mask.reshape(-1).astype(bool)
    fit = -jax.vmap(lambda m: column_quantile(m, 1.0 - k / num_experts, valid))(margins)  # [L, E]
    new_bias = layers + rate * (fit - layers)
    if center:
        new_bias = new_bias - new_bias.mean(-1, keepdims=True)
    return new_bias.reshape(bias.shape)


def quantile_fixed_point(
    scores: jax.Array, bias: jax.Array, k: int, *, mask: jax.Array | None = None,
    rate: float = 0.7, iterations: int = 8,
) -> jax.Array:
    """Towards the bias at which `quantile_bias` on these scores changes nothing but a common
    shift (which routes no token otherwise), where each expert receives ~N*K/E of these tokens
    at the others' final biases (the bounds of `quantile_bias`). One fit moves every expert at
    once against the others' old biases (a Jacobi step), and at rate 1 the experts overshoot in
    turn; this moves `rate` of the way each time, the common shift removed (the bias keeps its
    mean), until nothing moves, at most `iterations` times. deepseek4-tiny's 40 top-k blocks
    on 65,536 tokens (docs/performance.md): within 3 tokens of N*K/E = 16,384 after 8, within 1
    after 16 (63 ms of CPU each on [65536, 16]). Arguments as quantile_bias's; returns float32,
    bias's shape."""
    def unsettled(state):
        done, _, moved = state
        return moved & (done < iterations)

    def fit(state):
        done, current, _ = state
        step = quantile_bias(scores, current, k, mask=mask) - current
        step = rate * (step - step.mean(-1, keepdims=True))
        return done + 1, current + step, jnp.any(step != 0)

    start = (jnp.int32(0), bias.astype(jnp.float32), jnp.bool_(True))
    return jax.lax.while_loop(unsettled, fit, start)[1]


def _flip_negatives(bits: jax.Array) -> jax.Array:
    """float32 bits (as int32) <-> int32 keys with the floats' order: negative floats have their
    magnitude bits flipped. Its own inverse."""
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _sortable(x: jax.Array) -> jax.Array:
    """float32 -> int32 with the same order."""
    return _flip_negatives(jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32))


def _order_statistic(keys: jax.Array, rank: jax.Array) -> jax.Array:
    """keys [T, E] int32 (`_sortable`), rank [R, E] int32 -> [R, E] float32: the rank-th smallest
    (0-based) key of each column, as a float.

    A bisection over the int32 range: 32 halvings of [min int32, max int32] leave one key, the
    smallest v with #{keys <= v} > rank. Exact like a sort, and on XLA's CPU ~20x faster than
    sorting the columns (sorting [40 layers, 2048, 16] scores took 200 ms a step)."""

    def halve(_, bounds):
        lo, hi = bounds  # the answer lies in [lo, hi]
        mid = (lo & hi) + ((lo ^ hi) >> 1)  # floor((lo + hi) / 2) without overflow
        enough = (keys[None] <= mid[:, None]).sum(1) > rank  # [R, E]
        return jnp.where(enough, lo, mid + 1), jnp.where(enough, mid, hi)

    info = jnp.iinfo(jnp.int32)
    start = (jnp.full(rank.shape, info.min, jnp.int32), jnp.full(rank.shape, info.max, jnp.int32))
    key, _ = jax.lax.fori_loop(0, 32, halve, start)
    return jax.lax.bitcast_convert_type(_flip_negatives(key), jnp.float32)


def column_quantile(x: jax.Array, q: float, valid: jax.Array | None = None) -> jax.Array:
    """[T, E] -> [E]: the q-quantile of each column over the rows where `valid` [T] (all when
    None), interpolating linearly between order statistics (NumPy's default method); NaN for a
    column without a valid row. Equal to numpy.nanquantile with the invalid rows set to NaN."""
    n = x.shape[0] if valid is None else valid.sum(dtype=jnp.int32)
    keys = _sortable(x)
    if valid is not None:  # invalid rows rank after every valid one
        keys = jnp.where(valid[:, None], keys, jnp.iinfo(jnp.int32).max)
    position = q * (jnp.maximum(n, 1) - 1).astype(jnp.float32)
    below = jnp.floor(position)
    rank = below.astype(jnp.int32)
    ranks = jnp.stack([rank, jnp.minimum(rank + 1, jnp.maximum(n, 1) - 1)])  # [2]
    lower, upper = _order_statistic(keys, jnp.broadcast_to(ranks[:, None], (2, x.shape[1])))
    out = lower + (upper - lower) * (position - below)
    return jnp.where(n > 0, out, jnp.nan)


# ---------------------------------------------------------------------------------------------
# Balance losses (unweighted)


def _normalized_probs(scores: jax.Array) -> jax.Array:
    """P's per-token term s[t,i] / sum_j s[t,j] (a no-op for softmax scores)."""
    scores = scores.astype(jnp.float32)
    return scores / jnp.maximum(scores.sum(-1, keepdims=True), 1e-20)


def _topk_onehot_sum(scores: jax.Array, k: int) -> jax.Array:
    """[..., E] -> [..., E] float32, 1 where the expert is in the token's top-K of `scores`."""
    _, idx = jax.lax.top_k(scores, k)
    return jax.nn.one_hot(idx, scores.shape[-1], dtype=jnp.float32).sum(-2)


def _dense_segment_index(segment_ids: jax.Array) -> jax.Array:
    """[B, S] arbitrary segment ids -> [B, S] ids in [0, B*S): row b's distinct ids, in sorted
    order, become b*S + 0, 1, 2, ... (so any id values work, including non-contiguous ones)."""
    batch, seq = segment_ids.shape
    order = jnp.argsort(segment_ids, axis=1, stable=True)
    ordered = jnp.take_along_axis(segment_ids, order, axis=1)
    starts = jnp.concatenate([jnp.ones((batch, 1), bool), ordered[:, 1:] != ordered[:, :-1]], 1)
    run = jnp.cumsum(starts, axis=1) - 1  # [B, S] dense id of each sorted position
    dense = jnp.put_along_axis(jnp.zeros_like(run), order, run, axis=1, inplace=False)
    return dense + jnp.arange(batch)[:, None] * seq


@jax.named_scope("balance_loss")
def sequence_balance_loss(
    scores: jax.Array,
    num_experts: int,
    k: int,
    *,
    segment_ids: jax.Array | None = None,
    mask: jax.Array | None = None,
    mode: str = "deepseek",
    bias: jax.Array | None = None,
    indices: jax.Array | None = None,
) -> jax.Array:
    """Sequence-wise balance loss (DeepSeek-V3 Eqs. 17-20), unweighted (docs/load_balancing.md
    sections 6.1 and 6.2).

    mode='deepseek' (the paper): per sequence -- or per packed segment when `segment_ids` is given --
    of T valid tokens,
        f_i = E / (K*T) * #{t : i in top-K of s[t, :]}     (UNBIASED scores; no gradient)
        P_i = 1/T * sum_t s[t,i] / sum_j s[t,j]
        loss = mean over segments of sum_i f_i * P_i       (1.0 when perfectly balanced)
    Padding (mask False) is excluded from T, f and P; a segment with no valid token is skipped.

    mode='maxtext' (MaxText's DeepSeek-V4 loss, for comparison): per row of the batch,
        density_i = mean_t onehot(indices)[t, i]   (the actual, biased selection)
        density_prob_i = mean_t softmax(s + b)[t, i]
        loss = E^2 * mean over (rows, experts) of density * density_prob  (= K * paper when b = 0
        and the scores are softmax); padding and packing are not handled, as in MaxText, so
        `segment_ids`/`mask` are refused. MaxText averages the per-layer values over layers.

    Args:
      scores: [B, S, E] unbiased scores.
      segment_ids: [B, S] int ids of packed documents (any values; equal ids in a row = one segment).
      mask: [B, S] bool valid tokens.
      bias: [E] (maxtext mode) the selection bias; indices: [B, S, K] (maxtext mode) the selection.
    """
    check_topk(k, num_experts)
    if scores.ndim != 3 or scores.shape[-1] != num_experts:
        raise ValueError(f"scores must be [B, S, E={num_experts}], got {scores.shape}")
    if mode == "maxtext":
        return _maxtext_sequence_loss(scores, num_experts, segment_ids, mask, bias, indices)
    if mode != "deepseek":
        raise ValueError(f"unknown sequence loss mode {mode!r}; choose 'deepseek' or 'maxtext'")
    batch, seq, _ = scores.shape
    valid = _valid(mask, (batch, seq))  # [B, S]
    if segment_ids is None:
        segment_ids = jnp.zeros((batch, seq), jnp.int32)
    seg = _dense_segment_index(segment_ids).reshape(-1)  # [T]
    n_seg = batch * seq

    v = valid.reshape(-1, 1)  # [T, 1]
    hits = _topk_onehot_sum(scores, k).reshape(-1, num_experts) * v  # [T, E]
    probs = _normalized_probs(scores).reshape(-1, num_experts) * v  # [T, E]
    tokens = jax.ops.segment_sum(v[:, 0], seg, n_seg)  # [n_seg]
    hit_sum = jax.lax.stop_gradient(jax.ops.segment_sum(hits, seg, n_seg))  # [n_seg, E]
    prob_sum = jax.ops.segment_sum(probs, seg, n_seg)  # [n_seg, E]
    t = jnp.maximum(tokens, 1.0)[:, None]
    f = num_experts / (k * t) * hit_sum
    p = prob_sum / t
    per_segment = (f * p).sum(-1)  # [n_seg]
    present = tokens > 0
    return jnp.where(present, per_segment, 0.0).sum() / jnp.maximum(present.sum(), 1)


def _maxtext_sequence_loss(scores, num_experts, segment_ids, mask, bias, indices):
    if segment_ids is not None or mask is not None:
        raise ValueError(
            "mode='maxtext' reproduces MaxText, which ignores padding and packing; "
            "drop segment_ids/mask or use mode='deepseek'"
        )
    if indices is None:
        raise ValueError("mode='maxtext' needs `indices` [B, S, K], the routed (biased) selection")
    biased = scores.astype(jnp.float32) + (0.0 if bias is None else bias.astype(jnp.float32))
    density = jax.nn.one_hot(indices, num_experts, dtype=jnp.float32).sum(-2).mean(1)  # [B, E]
    density_prob = jax.nn.softmax(biased, axis=-1).mean(1)  # [B, E]
    return jnp.mean(density * density_prob) * num_experts**2


@jax.named_scope("balance_loss")
def global_balance_loss(
    scores: jax.Array,
    num_experts: int,
    k: int,
    *,
    mask: jax.Array | None = None,
    counts: jax.Array | None = None,
) -> jax.Array:
    """Global-batch / Switch balance loss, unweighted: E * sum_i f_i * P_i over the whole batch
    (docs/load_balancing.md section 6.3).

    f_i = counts_i / (K * N) is the share of assignments (from `counts` when given, e.g. the routed
    and globally summed counts; otherwise the top-K of the unbiased scores), P_i the mean normalised
    score over the N valid tokens. 1.0 when perfectly balanced. Switch uses alpha = 1e-2.

    Args:
      scores: [..., E] unbiased scores; mask: [...] valid tokens; counts: [E] int assignments.
    """
    check_topk(k, num_experts)
    flat = scores.reshape(-1, num_experts)
    v = _valid(mask, scores.shape[:-1]).reshape(-1, 1)  # [T, 1]
    n = jnp.maximum(v.sum(), 1.0)
    if counts is None:
        hits = (_topk_onehot_sum(flat, k) * v).sum(0)  # [E]
    else:
        hits = counts.astype(jnp.float32)
    f = jax.lax.stop_gradient(hits) / (k * n)
    p = (_normalized_probs(flat) * v).sum(0) / n
    return num_experts * (f * p).sum()


@jax.named_scope("balance_loss")
def z_loss(logits: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Router z-loss (ST-MoE), unweighted: mean over valid tokens of logsumexp_i(z[t, i])^2
    (docs/load_balancing.md section 6.4)."""
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)  # [...]
    v = _valid(mask, lse.shape)
    return (lse**2 * v).sum() / jnp.maximum(v.sum(), 1.0)
