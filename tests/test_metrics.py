import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as ref
from moebalance import metrics


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=64).filter(lambda c: sum(c) > 0))
def test_load_stats_matches_reference(counts):
    got = metrics.load_stats(np.array(counts, np.int32))
    want = ref.load_stats(counts)
    assert set(got) == set(metrics.STAT_NAMES)
    for name in metrics.STAT_NAMES:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-9, atol=1e-9, err_msg=name)


def test_seed_table_rows():
    # docs/seed_experiment.md section 4: all 2048 tokens x 4 picks on expert 0 of 16
    # -> N^2 (E-1)/E^2.
    hash_row = metrics.load_stats(np.array([8192] + [0] * 15))
    assert hash_row["variance"] == 3932160.0
    assert hash_row["maxvio"] == 15.0 and hash_row["dead_fraction"] == 15 / 16
    assert hash_row["entropy"] == pytest.approx(1 / 16)
    balanced = metrics.load_stats(np.full(16, 512))
    assert balanced["variance"] == 0.0 and balanced["maxvio"] == 0.0
    assert balanced["entropy"] == pytest.approx(1.0)


def test_load_stats_is_per_layer_and_handles_empty_layers():
    stats = metrics.load_stats(np.array([[1, 3], [0, 0]]))
    np.testing.assert_allclose(stats["variance"], [1.0, 0.0])
    np.testing.assert_allclose(stats["maxvio"], [0.5, 0.0])
    np.testing.assert_allclose(stats["cv"], [0.5, 0.0])
    np.testing.assert_allclose(stats["entropy"], [np.exp(-(0.25 * np.log(0.25) + 0.75 *
                                                           np.log(0.75))) / 2, 0.0])


def test_variance_is_exact_for_large_counts():
    c = np.array([2**30 + 1, 2**30 - 1], np.int64)
    assert metrics.load_stats(c)["variance"] == 1.0


def test_sampling_floor_matches_simulated_random_routing():
    rng = np.random.default_rng(0)
    n, k, e = 2048, 4, 16
    variances = []
    for _ in range(400):
        picks = np.argsort(rng.random((n, e)), axis=1)[:, :k]
        variances.append(metrics.load_stats(np.bincount(picks.ravel(), minlength=e))["variance"])
    floor = metrics.sampling_floor(n, k, e)
    assert floor == pytest.approx(2048 * 0.25 * 0.75)
    # mean of 400 draws: standard error ~ floor * sqrt(2/15) / 20 ~ 1.8%
    assert np.mean(variances) == pytest.approx(floor, rel=0.06)


def test_maxvio_global_accumulates():
    batches = np.array([[4, 0], [0, 4]])  # each batch MaxVio 1.0, together perfectly balanced
    assert metrics.maxvio_global(batches) == 0.0
    assert metrics.maxvio_global(np.array([[3, 1], [3, 1]])) == pytest.approx(0.5)
