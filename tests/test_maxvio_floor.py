"""The validation's floor (metrics.maxvio_floor): the MaxVio of a perfectly balanced router on N
independent tokens, against an exact enumeration and a brute-force simulation of tokens that
each pick K distinct experts; and the study report's floor column."""

import itertools

import numpy as np
import pytest

from moebalance.metrics import balanced_counts, load_stats, maxvio_floor
from moebalance.report.study import floor, format_markdown, table_rows


def brute_force_counts(tokens, k, experts, draws, seed):
    """[draws, E]: every token's K distinct experts drawn as the first K of a random order."""
    rng = np.random.default_rng(seed)
    picks = np.argsort(rng.random((draws, tokens, experts)), -1)[..., :k]
    return np.stack([np.bincount(p.ravel(), minlength=experts) for p in picks])


def maxvios_of_two_tokens(experts):
    """The MaxVio of every equally likely pair of 2-expert choices of 2 tokens."""
    subsets = list(itertools.combinations(range(experts), 2))
    return np.array([load_stats(np.bincount(a + b, minlength=experts))["maxvio"]
                     for a, b in itertools.product(subsets, repeat=2)])


def test_the_floor_of_two_tokens_is_the_exact_mean_over_every_choice():
    """2 tokens, each 2 of 4 experts (mean load 1): only a token's complement (6 of the 36
    pairs) leaves every expert at 1, any other pair puts 2 on one, (2 - 1) / 1: 5/6 by hand.
    With 5 experts the enumeration's mean, to the Monte Carlo's error."""
    assert maxvios_of_two_tokens(4).mean() == pytest.approx(5 / 6)
    draws = 40_000
    for experts in (4, 5):
        exact = maxvios_of_two_tokens(experts)
        error = 4 * exact.std() / np.sqrt(draws)
        assert abs(maxvio_floor(2, 2, experts, draws=draws) - exact.mean()) < error


def test_balanced_counts_are_the_brute_force_simulations():
    tokens, k, experts, draws = 100, 3, 8, 20_000
    fast = balanced_counts(tokens, k, experts, draws, np.random.default_rng(0))
    slow = brute_force_counts(tokens, k, experts, draws, seed=1)
    assert (fast.sum(1) == tokens * k).all()  # every token placed all K picks
    assert fast.max() <= tokens  # an expert at most once per token
    # the exact covariance of a balanced router's counts: N p (1 - p) on the diagonal,
    # N (K (K-1) / (E (E-1)) - p^2) off it, p = K/E
    p = k / experts
    want = np.full((experts, experts), tokens * (k * (k - 1) / (experts * (experts - 1)) - p * p))
    np.fill_diagonal(want, tokens * p * (1 - p))
    for counts in (fast, slow):
        np.testing.assert_allclose(np.cov(counts.T), want, atol=0.06 * want[0, 0])
    a, b = load_stats(fast)["maxvio"], load_stats(slow)["maxvio"]
    se = np.sqrt(a.var() / draws + b.var() / draws)
    assert abs(a.mean() - b.mean()) < 4 * se, (a.mean(), b.mean(), se)


def test_the_floor_is_seeded_and_falls_with_the_tokens():
    assert maxvio_floor(4096, 4, 16, draws=500, seed=3) == maxvio_floor(4096, 4, 16, draws=500,
                                                                        seed=3)
    floors = [maxvio_floor(n, 6, 32, draws=500) for n in (8_192, 65_536, 393_216)]
    assert floors[0] > floors[1] > floors[2] > 0
    # MaxVio ~ (a few standard deviations of a count) / its mean: ~ 1 / sqrt(N)
    assert floors[0] / floors[2] == pytest.approx(np.sqrt(393_216 / 8_192), rel=0.15)


def _arm(name, tokens):
    spread = {key: [0.1, 0.2] for key in ("val_loss", "val_ppl", "maxvio_global",
                                          "maxvio_batch")}
    return {"name": name, "overrides": [], "finished": True, "val_loss": 6.0, "val_ppl": 400.0,
            "maxvio_global": 0.2, "maxvio_batch": 0.5, "train_loss": 6.1, "tokens_per_s": 1e3,
            "val_tokens": tokens, "spread": spread}


def test_the_study_report_shows_the_floor_beside_each_arm():
    study = {"config": "c", "overrides": [], "steps": 10, "tokens_per_step": 2048,
             "eval_period": 5, "eval_batches": 2, "seeds": None, "experts": 16, "k": 4,
             "arms": [_arm("none", 4096), _arm("loss-free", 4096)]}
    want = f"{maxvio_floor(4096, 4, 16):.3f}"
    assert [row[5] for row in table_rows(study)] == [want, want]
    assert "floor: the mean MaxVio_global of a perfectly balanced router" in format_markdown(study)
    old = {key: value for key, value in study.items() if key not in ("experts", "k")}
    assert floor(old, old["arms"][0]) is None  # a study.json from before: no floor to show
    assert [row[5] for row in table_rows(old)] == ["-", "-"]
