"""The balancer simulation: each rule at its documented default drives MaxVio down to near the
sampling floor and stays there; the same check flags a rule run 100x too fast."""

import numpy as np
import pytest

from moebalance import balancing, simulate
from moebalance.metrics import load_stats

pytestmark = pytest.mark.usefixtures("optimised_programs")  # 800 steps: running, not compiling

SIM = simulate.Simulation(skew=0.5, seed=0)
STEPS = 800


def sampling_floor_maxvio(sim, draws=200):
    """MaxVio of perfectly balanced random routing of the same number of fresh tokens."""
    rng = np.random.default_rng(0)
    picks = [np.argsort(rng.random((sim.tokens, sim.num_experts)), 1)[:, : sim.k]
             for _ in range(draws)]
    counts = np.stack([np.bincount(p.ravel(), minlength=sim.num_experts) for p in picks])
    return float(load_stats(counts)["maxvio"].mean())


FLOOR = sampling_floor_maxvio(SIM)


def settled(out):
    """Balanced and steady over the last 100 steps: MaxVio within 2x the sampling floor. (Quantile
    Balancing refits each batch's own sampling noise, which doubles the load variance: its MaxVio
    settles near sqrt(2) x the floor. A rule that overshoots stays far above: 8x and more.)"""
    late = out["maxvio"][-100:]
    return late.mean() < 2.0 * FLOOR


@pytest.mark.parametrize("rule", simulate.RULES)
def test_each_rule_drives_maxvio_down_and_settles(rule):
    out = simulate.run(SIM, rule, steps=STEPS)
    start, late = out["maxvio"][0], out["maxvio"][-100:].mean()  # step 0: bias still zero
    assert start > 5 * FLOOR  # the stream really is skewed
    assert late < 0.2 * start
    assert settled(out), (late, FLOOR)
    # no overshoot: consecutive load errors are not strongly anti-correlated. Quantile Balancing
    # refits every batch's own noise, which alone makes the lag-1 correlation -0.5.
    assert simulate.overshoot(out["counts"][-200:]) > -0.6


@pytest.mark.parametrize("rule", sorted(balancing.DEFAULT_RATES))
def test_a_rate_100x_too_large_oscillates(rule):
    out = simulate.run(SIM, rule, rate=100 * balancing.DEFAULT_RATES[rule], steps=STEPS)
    assert not settled(out)


def test_simulation_is_deterministic_and_counts_are_exact():
    a = simulate.run(SIM, "sign", steps=20)
    b = simulate.run(SIM, "sign", steps=20)
    np.testing.assert_array_equal(a["counts"], b["counts"])
    assert a["counts"].dtype == np.int32
    assert (a["counts"].sum(1) == SIM.tokens * SIM.k).all()
    assert a["bias"].dtype == np.float32
    with pytest.raises(ValueError, match="unknown rule"):
        simulate.run(SIM, "bogus")


WINDOWS = simulate.Windows(num_experts=8, k=2, windows=2, window_tokens=64, domains=4,
                           hidden=8, skew=1.0, eval_windows=16)


def test_windows_runs_are_seeded_and_their_counts_exact():
    a = simulate.run_windows(WINDOWS, simulate.Recipe("sign", 1e-2), steps=12, seed=0)
    b = simulate.run_windows(WINDOWS, simulate.Recipe("sign", 1e-2), steps=12, seed=0)
    c = simulate.run_windows(WINDOWS, simulate.Recipe("sign", 1e-2), steps=12, seed=1)
    np.testing.assert_array_equal(a["bias"], b["bias"])
    assert not np.array_equal(a["bias"], c["bias"])  # another seed draws other batches
    assert a["bias"].shape == (12, 8) and a["maxvio"].shape == (12,)
    # the sign rule moves every bias by +-rate (or 0 at the mean) each step
    steps = np.abs(np.diff(a["bias"], axis=0))
    assert np.isin(np.round(steps / 1e-2, 5), (0.0, 1.0)).all()


def test_counts_of_several_steps_move_the_bias_once_per_several_steps():
    out = simulate.run_windows(WINDOWS, simulate.Recipe("sign", 1e-2, accumulate=4), steps=12)
    rows = out["bias"]  # the bias each step routed with: updated after steps 3 and 7 (and 11)
    changed = [t for t in range(1, 12) if not np.array_equal(rows[t], rows[t - 1])]
    assert changed == [4, 8] and not rows[0].any()


def test_the_populations_bias_balances_the_held_out_windows_better_than_none():
    skewed = simulate.held_out_maxvio(WINDOWS, np.zeros(8))
    balanced = simulate.held_out_maxvio(WINDOWS, simulate.population_bias(WINDOWS, windows=64))
    assert balanced < 0.5 * skewed
