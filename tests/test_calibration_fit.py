"""The refit's one fitted forward pass (refit_biases) against a slow sequential reference, the
balance it reaches, and the A/B's probe before the first step measured once."""

import inspect
import json

import numpy as np
import pytest

from moebalance import balancing
from moebalance.config import load_config
from moebalance.data import batches
from test_train_step import ONE_TOPK

# 4 top-k blocks: layers 2-5, two of them single blocks' kinds repeated under a scan (a Stack of
# 2 units of 2 blocks), after 2 hash-routed blocks; 3 batches of 4 x 64 tokens: N = 768
SMALL = dict(base_num_decoder_layers=6, compress_ratios=[0, 0, 4, 0, 4, 0],
             max_target_length=64, per_device_batch_size=4)
FIRST, BATCHES = 5, 3


def numpy_quantile_fit(scores: np.ndarray, bias: np.ndarray, k: int):
    """Quantile Balancing once, in NumPy (sort and np.quantile): scores [N, E], bias [E] ->
    (the new bias [E], the margins [N, E] it was taken from)."""
    biased = scores + bias
    top = -np.sort(-biased, axis=1)
    kth, k1th = top[:, k - 1:k], top[:, k:k + 1]
    margins = scores - np.where(biased >= kth, k1th, kth)
    return -np.quantile(margins, 1 - k / scores.shape[1], axis=0).astype(np.float32), margins


def numpy_fit(scores: np.ndarray, bias: np.ndarray, k: int):
    """As balancing.quantile_fixed_point fits one layer (its rate and number of iterations):
    each time numpy_quantile_fit's step less its mean, scaled by the rate; -> (the bias, the
    margins of the last fit)."""
    defaults = inspect.signature(balancing.quantile_fixed_point).parameters
    rate, iterations = defaults["rate"].default, defaults["iterations"].default
    for _ in range(iterations):
        new, margins = numpy_quantile_fit(scores, bias, k)
        step = rate * ((new - bias) - (new - bias).mean())
        if not step.any():
            break
        bias = (bias + step).astype(np.float32)
    return bias, margins


def small_model(programs: str):
    """A model of SMALL with random biases (a fit far from its start), its mesh and data."""
    from moebalance.model.transformer import get_biases, set_biases
    from moebalance.training import sharding
    from moebalance.training.loop import build

    cfg = load_config("deepseek4-smoke", {**SMALL, "step_programs": programs})
    mesh = sharding.make_mesh(cfg)
    source = batches(cfg)
    model, _ = build(cfg, mesh, source)
    start = np.random.default_rng(0).normal(0.0, 0.2, get_biases(model).shape)
    set_biases(model, np.asarray(start, np.float32))
    return cfg, model, mesh, source


def micro_batches(mesh, source):
    from moebalance.training import sharding

    found = []
    for i in range(FIRST, FIRST + BATCHES):
        tokens, mask, segment_ids = sharding.global_batch(mesh, *source.batch(i))
        found += [(tokens[a], mask[a], segment_ids[a]) for a in range(tokens.shape[0])]
    return found


@pytest.mark.parametrize("programs", ["one", "segments"])
def test_refit_is_the_sequential_fixed_point_of_every_layer(programs):
    """The slow way, layer by layer: with the earlier top-k blocks at their fitted biases, a
    whole forward pass (the score step) gives the block's scores on all the fit tokens, and
    Quantile Balancing stepped in NumPy as quantile_fixed_point steps it gives its bias (sort
    and np.quantile against a bisection, layer after layer against one pass). refit_biases' pass
    gives the same biases (float32: both take quantiles of the same margins, |b| < 2, to a few
    ulps); at them every block gives each expert N*K/E of the fit tokens, up to one for the
    rounding of the quantile or the size of a tie of margins at it. The model's biases are left
    as they were."""
    from moebalance.model.transformer import get_biases
    from moebalance.training.calibration import biases_set_to, refit_biases
    from moebalance.training.step import bind_model, make_eval_step, make_score_step

    cfg, model, mesh, source = small_model(programs)
    start = np.asarray(get_biases(model))
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    found = micro_batches(mesh, source)
    score_step = bind_model(make_score_step(cfg, model, mesh), model)
    expected, ties = start.copy(), []
    for layer in range(len(start)):
        with biases_set_to(model, expected):
            scores = np.concatenate([np.asarray(score_step(t, s))[layer] for t, _, s in found])
        expected[layer], margins = numpy_fit(scores, start[layer], k)
        at = np.quantile(margins, 1 - k / e, axis=0, method="lower"), np.quantile(
            margins, 1 - k / e, axis=0, method="higher")
        ties.append(max((margins == side).sum(0).max() for side in at))

    fitted = np.asarray(refit_biases(cfg, model, mesh, source, FIRST, BATCHES))
    np.testing.assert_array_equal(np.asarray(get_biases(model)), start)
    np.testing.assert_allclose(fitted, expected, rtol=0, atol=1e-6)

    eval_step = make_eval_step(cfg, model, mesh)
    with biases_set_to(model, fitted):
        counts = sum(np.asarray(eval_step(model, *batch)["counts"]) for batch in found)
    target = len(found) * found[0][0].shape[0] * cfg.max_target_length * k / e
    off = np.abs(counts[cfg.first_num_hash_layers:] - target).max(-1)
    assert (off <= np.maximum(1, ties)).all(), (off, ties)


def test_run_b_takes_run_a_s_probe_before_the_first_step(tmp_path, monkeypatch):
    """The A/B measures the probe set before the first step once: Run B starts from Run A's draw
    with the same zero biases; what it records is what its own config, drawn and measured alone,
    gives."""
    from moebalance.experiment import ab
    from moebalance.training import loop, sharding
    from moebalance.training.calibration import probe_counts
    from moebalance.training.step import make_eval_step

    measured = []
    monkeypatch.setattr(loop, "probe_counts",
                        lambda *args: measured.append(1) or probe_counts(*args))
    cfg = load_config("deepseek4-smoke", dict(steps=1, max_target_length=16,
                                              per_device_batch_size=2, probe_batches=2,
                                              routed_bias_calibration_batches=1,
                                              probe_refit_batches=1, **ONE_TOPK))
    ab(cfg, tmp_path / "ab")
    assert len(measured) == 1
    mesh = sharding.make_mesh(cfg)
    model, _ = loop.build(cfg, mesh)
    alone = probe_counts(make_eval_step(cfg, model, mesh), model, loop.probe_set(cfg, mesh))
    for run in ("run_a", "run_b"):
        recorded = json.loads((tmp_path / "ab" / run / "probe_counts.json").read_text())
        np.testing.assert_array_equal(recorded["set"]["counts"]["0"], alone)
