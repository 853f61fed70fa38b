"""Routing: which K of E experts each token uses, and with what weight.

DeepSeek-V3/V4 gate (docs/load_balancing.md section 2), in float32 whatever the model dtype:

    1. scores  s = score_fn(logits)                  softmax (V2) | sigmoid (V3) | sqrtsoftplus (V4)
    2. select  top-K of (s + b)                      the bias b steers the choice and nothing else
       (optionally group-limited first, DeepSeek-V3: keep the best `topk_groups` of `n_groups`)
    3. weigh   w = s at the chosen experts           the UNBIASED scores
               w = w / sum(w)  (if normalize)        softmax keeps raw probabilities by default (V2)
               w = w * route_scale

Hash routing (V4's first layers) replaces step 2 by a frozen table lookup `tid2eid[token_id]`
(docs/load_balancing.md section 3, which also describes the tables `build_hash_table` makes).

Ties in top-K go to the lower expert index (the rule of `jax.lax.top_k`), which the NumPy
references in the tests reproduce with a stable sort.
"""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

# A hash table whose expected MaxVio on the token counts it was built for is above this gets a
# warning: its busiest expert takes more than 10% over its share on average, an imbalance the
# table builds in and no bias corrects (hash routing has none). Sampling alone shows half that on
# a well-spread table: deepseek4-tiny's hash rows have MaxVio 0.049 on their 2048-token probe with
# a 'balanced' table whose expected MaxVio is 0.0000. Below it nothing is logged.
HASH_MAXVIO_WARNING = 0.1

SCORE_FNS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "softmax": lambda z: jax.nn.softmax(z, axis=-1),
    "sigmoid": jax.nn.sigmoid,
    "sqrtsoftplus": lambda z: jnp.sqrt(jax.nn.softplus(z)),
}

# A floor for the weight normaliser: sigmoid scores of hugely negative logits underflow to 0, and
# 0/0 would poison the whole step. Far below any score a trained router produces.
_MIN_WEIGHT_SUM = 1e-20


class RoutingRecord(NamedTuple):
    """Everything a routed layer decided, from which losses, bias updates and metrics are computed.

    Leading axes `...` are the token axes of the layer input (e.g. [B, S]).
    """

    indices: jax.Array  # [..., K] int32, chosen experts
    weights: jax.Array  # [..., K] f32, combine weights (unbiased scores, normalised, scaled)
    scores: jax.Array  # [..., E] f32, unbiased affinities s = score_fn(logits)
    logits: jax.Array  # [..., E] f32, raw router logits (for the z-loss)
    counts: jax.Array  # [E] int32, assignments per expert over the valid tokens (before any drop)
    dropped: jax.Array  # [] int32, assignments dropped by a capacity limit (0 when dropless)
    bias: jax.Array  # [E] f32, the selection bias the layer routed with (0 on a hash layer)


def check_topk(k: int, num_experts: int) -> None:
    if not 1 <= k <= num_experts:
        raise ValueError(
            f"top-k must satisfy 1 <= k <= num_experts, got k={k} with num_experts={num_experts}; "
            "lower `num_experts_per_tok` or raise `num_experts`"
        )


def check_score_fn(score_fn: str) -> None:
    if score_fn not in SCORE_FNS:
        raise ValueError(f"unknown score_fn {score_fn!r}; choose one of {sorted(SCORE_FNS)}")


def check_groups(num_experts: int, k: int, n_groups: int, topk_groups: int) -> None:
    """Validate DeepSeek-V3 group-limited routing arguments (n_groups=0 means off)."""
    if n_groups == 0:
        if topk_groups != 0:
            raise ValueError(f"topk_groups={topk_groups} needs n_groups > 0 (group routing is off)")
        return
    if n_groups < 0 or num_experts % n_groups:
        raise ValueError(
            f"n_groups={n_groups} must be a positive divisor of num_experts={num_experts}"
        )
    if not 1 <= topk_groups <= n_groups:
        raise ValueError(f"topk_groups={topk_groups} must be in [1, n_groups={n_groups}]")
    if k > topk_groups * (num_experts // n_groups):
        raise ValueError(
            f"k={k} experts cannot be chosen from topk_groups={topk_groups} groups of "
            f"{num_experts // n_groups} experts; raise topk_groups"
        )


def compute_scores(logits: jax.Array, score_fn: str) -> jax.Array:
    """[..., E] logits -> [..., E] float32 affinities."""
    check_score_fn(score_fn)
    return SCORE_FNS[score_fn](logits.astype(jnp.float32))


def select_experts(
    biased: jax.Array, k: int, *, n_groups: int = 0, topk_groups: int = 0
) -> jax.Array:
    """Top-K experts of `biased` [..., E] -> [..., K] int32, optionally group-limited.

    Group-limited routing (DeepSeek-V3): split E into G groups, score each group by the sum of its
    top-m biased scores (m = K // topk_groups, at least 1, at most the group size), keep the best
    `topk_groups` groups, and pick the top-K among their experts only.
    """
    num_experts = biased.shape[-1]
    if n_groups > 0:
        group_size = num_experts // n_groups
        m = min(max(1, k // topk_groups), group_size)
        grouped = biased.reshape(*biased.shape[:-1], n_groups, group_size)  # [..., G, E/G]
        group_scores = jax.lax.top_k(grouped, m)[0].sum(-1)  # [..., G]
        _, kept = jax.lax.top_k(group_scores, topk_groups)  # [..., topk_groups]
        keep = jnp.zeros(group_scores.shape, bool)
        keep = jnp.put_along_axis(keep, kept, True, axis=-1, inplace=False)  # [..., G]
        grouped = jnp.where(keep[..., None], grouped, -jnp.inf)
        biased = grouped.reshape(biased.shape)  # [..., E]
    _, indices = jax.lax.top_k(biased, k)
    return indices.astype(jnp.int32)


def combine_weights(
    scores: jax.Array, indices: jax.Array, *, route_scale: float, normalize: bool
) -> jax.Array:
    """Weights of the chosen experts from the unbiased scores: [..., E], [..., K] -> [..., K] f32.
    Picked by comparison with every expert id ([..., K, E] in one fused pass, exact: the other
    terms are zeros; compiled for a v5e it stays a select and a reduce, no matmul), not a gather:
    a TPU's gather and its scatter-add gradient cost ~3 ms a d1024 step."""
    onehot = indices[..., None] == jnp.arange(scores.shape[-1])  # [..., K, E]
    weights = jnp.where(onehot, scores[..., None, :], 0.0).sum(-1)
    if normalize:
        weights = weights / jnp.maximum(weights.sum(-1, keepdims=True), _MIN_WEIGHT_SUM)
    return weights * route_scale


def route(
    logits: jax.Array,
    bias: jax.Array | None = None,
    *,
    k: int,
    score_fn: str,
    route_scale: float = 1.0,
    n_groups: int = 0,
    topk_groups: int = 0,
    normalize: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-K routing with a selection-only bias.

    Args:
      logits: [..., E] router logits (any dtype; the maths runs in float32).
      bias: [E] float32 aux-loss-free bias, or None. Changes which experts are chosen, never weights.
      k: experts per token.
      score_fn: 'softmax', 'sigmoid' or 'sqrtsoftplus'.
      route_scale: multiplies the weights (V3 2.5, V4-Flash 1.5).
      n_groups, topk_groups: DeepSeek-V3 group-limited routing; 0 = off.
      normalize: renormalise the weights over the chosen experts. None = the DeepSeek default:
        True for sigmoid/sqrtsoftplus, False for softmax (V2 keeps raw probabilities).

    Returns:
      indices [..., K] int32, weights [..., K] float32, scores [..., E] float32 (unbiased).
    """
    num_experts = logits.shape[-1]
    check_score_fn(score_fn)
    check_topk(k, num_experts)
    check_groups(num_experts, k, n_groups, topk_groups)
    if normalize is None:
        normalize = score_fn != "softmax"
    scores = compute_scores(logits, score_fn)
    biased = scores if bias is None else scores + bias.astype(jnp.float32)
    indices = select_experts(biased, k, n_groups=n_groups, topk_groups=topk_groups)
    weights = combine_weights(scores, indices, route_scale=route_scale, normalize=normalize)
    return indices, weights, scores


def check_token_ids(token_ids, vocab_size: int) -> None:
    """Raise if concrete token ids fall outside [0, vocab_size). Traced ids cannot be checked here;
    the data pipeline checks them before training starts."""
    if isinstance(token_ids, jax.core.Tracer):
        return
    ids = np.asarray(token_ids)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(
            f"token ids must lie in [0, {vocab_size}) (the hash table's vocabulary), found "
            f"min={ids.min()} max={ids.max()}; check the tokenizer's vocab size against `vocab_size`"
        )


def hash_route(
    token_ids: jax.Array,
    tid2eid: jax.Array,
    scores: jax.Array,
    *,
    route_scale: float = 1.0,
    normalize: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Hash routing (DeepSeek-V4's first layers): experts from a frozen table, weights from the gate.

    Args:
      token_ids: [...] int token ids.
      tid2eid: [V, K] int32 table.
      scores: [..., E] float32 unbiased gate scores.

    Returns:
      indices [..., K] int32, weights [..., K] float32.
    """
    check_token_ids(token_ids, tid2eid.shape[0])
    indices = jnp.take(tid2eid, token_ids, axis=0).astype(jnp.int32)  # [..., K]
    weights = combine_weights(scores, indices, route_scale=route_scale, normalize=normalize)
    return indices, weights


# ---------------------------------------------------------------------------------------------
# Hash tables


def check_hash_table(table, num_experts: int, *, distinct: bool = True) -> None:
    """Raise unless `table` [V, K] holds expert ids in [0, E), distinct within each row. (A traced
    table, e.g. inside nnx.vmap, cannot be checked here; its concrete source was.)"""
    if isinstance(table, jax.core.Tracer):
        return
    table = np.asarray(table)
    if table.ndim != 2:
        raise ValueError(f"a hash table must be [vocab, k], got shape {table.shape}")
    if table.size and (table.min() < 0 or table.max() >= num_experts):
        raise ValueError(
            f"hash table holds expert ids outside [0, {num_experts}): "
            f"min={table.min()} max={table.max()}"
        )
    if distinct and table.shape[1] > 1:
        ordered = np.sort(table, axis=1)
        bad = np.nonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))[0]
        if bad.size:
            raise ValueError(
                f"hash table row {bad[0]} (token id {bad[0]}) repeats an expert: {table[bad[0]]}; "
                "each token must pick k distinct experts (only the 'zeros' table may repeat)"
            )


def _zeros_table(vocab_size, num_experts, k, token_counts, seed):
    return np.zeros((vocab_size, k), np.int32)


def _round_robin_table(vocab_size, num_experts, k, token_counts, seed):
    t = np.arange(vocab_size, dtype=np.int64)[:, None]
    j = np.arange(k, dtype=np.int64)[None, :]
    return ((t * k + j) % num_experts).astype(np.int32)


def _random_table(vocab_size, num_experts, k, token_counts, seed):
    rng = np.random.default_rng(seed)
    keys = rng.random((vocab_size, num_experts))
    return np.argsort(keys, axis=1)[:, :k].astype(np.int32)  # a uniform random k-subset per row


def _balanced_table(vocab_size, num_experts, k, token_counts, seed):
    """Greedy largest-first (LPT) assignment: the most frequent token first, each to the k experts
    with the least expected load so far (ties: fewer tokens, then lower id). Tokens never seen carry
    no expected load; they are spread round-robin so unseen text still spreads evenly."""
    if token_counts is None:
        raise ValueError("the 'balanced' hash table needs token_counts (token frequencies, [vocab])")
    counts = np.asarray(token_counts, dtype=np.float64)
    if counts.shape != (vocab_size,) or (counts < 0).any():
        raise ValueError(f"token_counts must be non-negative with shape ({vocab_size},)")
    table = np.empty((vocab_size, k), np.int32)
    load = np.zeros(num_experts)
    n_tokens = np.zeros(num_experts, np.int64)
    expert_ids = np.arange(num_experts)
    seen = np.nonzero(counts > 0)[0]
    for t in seen[np.argsort(-counts[seen], kind="stable")]:
        chosen = np.lexsort((expert_ids, n_tokens, load))[:k]
        table[t] = chosen
        load[chosen] += counts[t]
        n_tokens[chosen] += 1
    unseen = np.nonzero(counts == 0)[0]
    j = np.arange(k)[None, :]
    table[unseen] = (np.arange(unseen.size)[:, None] * k + j) % num_experts
    return table


HASH_TABLES = {
    "zeros": _zeros_table,
    "round_robin": _round_robin_table,
    "random": _random_table,
    "balanced": _balanced_table,
}


def expected_load(table, token_counts, num_experts: int) -> np.ndarray:
    """Expected assignments per expert [E] when token t occurs token_counts[t] times."""
    table = np.asarray(table)
    weights = np.repeat(np.asarray(token_counts, np.float64), table.shape[1])
    return np.bincount(table.reshape(-1), weights=weights, minlength=num_experts)


def build_hash_table(
    vocab_size: int,
    num_experts: int,
    k: int,
    method: str,
    *,
    token_counts=None,
    seed: int = 0,
) -> np.ndarray:
    """A [vocab_size, k] int32 token -> experts table.

    Methods: 'zeros' (MaxText's from-scratch table: every token -> expert 0, k times; the one table
    that repeats experts, kept to reproduce the seed experiment), 'round_robin' (NeMo:
    (t*k + j) mod E), 'random' (a seeded uniform k-subset per token), 'balanced' (greedy
    largest-first on `token_counts`). With `token_counts`, a table whose expected MaxVio on them
    is above HASH_MAXVIO_WARNING is logged as a warning.
    """
    if method not in HASH_TABLES:
        raise ValueError(f"unknown hash table method {method!r}; choose one of {sorted(HASH_TABLES)}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    check_topk(k, num_experts)
    table = HASH_TABLES[method](vocab_size, num_experts, k, token_counts, seed)
    check_hash_table(table, num_experts, distinct=method != "zeros")
    if token_counts is not None:
        load = expected_load(table, token_counts, num_experts)
        mean = load.mean()
        maxvio = (load.max() - mean) / mean if mean > 0 else 0.0
        if maxvio > HASH_MAXVIO_WARNING:
            log.warning("hash table %r: expected MaxVio %.4f on the given token counts, above "
                        "%g: its busiest expert gets that much more than its share, an imbalance "
                        "no bias corrects", method, maxvio, HASH_MAXVIO_WARNING)
    return table
