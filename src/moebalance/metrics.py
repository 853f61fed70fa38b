"""Per-layer load statistics from integer expert counts (docs/load_balancing.md section 7).

Host-side NumPy on purpose: counts leave the jitted step as exact int32 values and only the trainer
reduces them. Moments are computed from integer sums (int64), so the variance of integer counts is
exact up to the final division: the seed table's 3932160.00 comes out exactly.
"""

from __future__ import annotations

import numpy as np

STAT_NAMES = ("variance", "std", "cv", "maxvio", "min", "max", "dead_fraction", "entropy")


def load_stats(counts) -> dict[str, np.ndarray]:
    """Statistics of counts [..., E] over the expert axis, each of shape [...] (floats).

    variance       population variance (ddof=0) of the counts: the seed table's metric
    std, cv        its square root, and std / mean (coefficient of variation)
    maxvio         (max - mean) / mean (arXiv 2408.15664 Eq. 4)
    min, max       least and most loaded expert
    dead_fraction  share of experts with zero assignments
    entropy        exp(H) / E of the load distribution p = c / sum(c): 1 = perfectly even,
                   1/E = everything on one expert (the effective share of experts in use)

    Statistics that divide by the mean are 0 for an all-zero layer.
    """
    c = np.asarray(counts).astype(np.int64)
    num_experts = c.shape[-1]
    total = c.sum(-1)
    sum_sq = (c * c).sum(-1)
    variance = (num_experts * sum_sq - total * total) / num_experts**2
    mean = total / num_experts
    std = np.sqrt(variance)
    safe_mean = np.where(mean > 0, mean, 1.0)
    p = c / np.where(total > 0, total, 1)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    entropy = np.where(total > 0, np.exp(-plogp.sum(-1)) / num_experts, 0.0)
    return {
        "variance": variance.astype(np.float64),
        "std": std,
        "cv": np.where(mean > 0, std / safe_mean, 0.0),
        "maxvio": np.where(mean > 0, (c.max(-1) - mean) / safe_mean, 0.0),
        "min": c.min(-1).astype(np.float64),
        "max": c.max(-1).astype(np.float64),
        "dead_fraction": (c == 0).mean(-1),
        "entropy": entropy,
    }


def sampling_floor(num_tokens: int, k: int, num_experts: int) -> float:
    """Expected population variance of counts under perfectly balanced random routing.

    Each of N tokens picks K distinct experts uniformly, so an expert's count is Binomial(N, K/E);
    the mean N*K/E is fixed, so the expected ddof=0 variance over experts is exactly
    N * (K/E) * (1 - K/E). A balancer cannot be asked to beat it on fresh tokens.
    """
    p = k / num_experts
    return num_tokens * p * (1.0 - p)


def balanced_counts(num_tokens: int, k: int, num_experts: int, draws: int,
                    rng: np.random.Generator) -> np.ndarray:
    """[draws, E] int64 expert counts of `num_tokens` tokens that each pick K distinct experts
    uniformly at random (a perfectly balanced router), drawn exactly, without drawing a token:
    expert by expert, the tokens with r of their K picks still to place among the m experts left
    take this one with probability r/m, a binomial draw per group (K+1 groups, E steps)."""
    left = np.zeros((draws, k + 1), np.int64)  # tokens by their picks still to place
    left[:, k] = num_tokens
    counts = np.zeros((draws, num_experts), np.int64)
    for expert in range(num_experts):
        m = num_experts - expert
        took = rng.binomial(left, np.minimum(np.arange(k + 1) / m, 1.0))  # [draws, K+1]
        counts[:, expert] = took.sum(1)
        left = left - took
        left[:, :-1] += took[:, 1:]  # a token that took one has one pick fewer to place
    return counts


def maxvio_floor(num_tokens: int, k: int, num_experts: int, draws: int = 2000,
                 seed: int = 0) -> float:
    """The mean MaxVio of a perfectly balanced router on `num_tokens` independent tokens
    (seeded Monte Carlo over `draws` exact draws of balanced_counts): what MaxVio_global reads
    on that many tokens when no expert is favoured, so no bias can read lower on average. Real
    tokens come in documents, whose experts are not independent: their floor is higher."""
    counts = balanced_counts(num_tokens, k, num_experts, draws, np.random.default_rng(seed))
    return float(load_stats(counts)["maxvio"].mean())


def summed_variance_spread(batch_counts, layers) -> dict[str, float]:
    """The judge over many batches: per batch the variance summed over `layers` (e.g. the top-k
    ones), from counts [num_batches, L, E]; its mean, std (ddof=0), min and max over the batches."""
    summed = load_stats(batch_counts)["variance"][:, list(layers)].sum(-1)
    return {"mean": float(summed.mean()), "std": float(summed.std()),
            "min": float(summed.min()), "max": float(summed.max())}

def maxvio_global(batch_counts) -> np.ndarray:
    """MaxVio of counts accumulated over many batches: [num_batches, ..., E] -> [...]."""
    return load_stats(np.asarray(batch_counts).astype(np.int64).sum(0))["maxvio"]


def rank_loads(counts, ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """The per-device view under expert parallelism: counts [..., E] with the experts split in
    order over `ranks` expert-parallel ranks (E/R each) -> (load [..., R] int64 assignments each
    rank's experts receive, imbalance [...] = max / mean load: the step waits for the busiest
    rank, 1.0 = even; 0.0 for an all-zero layer)."""
    c = np.asarray(counts).astype(np.int64)
    num_experts = c.shape[-1]
    if ranks < 1 or num_experts % ranks:
        raise ValueError(f"{num_experts} experts do not split over {ranks} expert-parallel ranks")
    load = c.reshape(*c.shape[:-1], ranks, num_experts // ranks).sum(-1)
    mean = load.mean(-1)
    return load, np.where(mean > 0, load.max(-1) / np.where(mean > 0, mean, 1.0), 0.0)
