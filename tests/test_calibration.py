"""The biases at the final weights: refit_biases and the calibration after the last step."""

import json

import numpy as np
import pytest

from moebalance.config import ConfigError, load_config
from moebalance.data import batches
from moebalance.metrics import load_stats
from moebalance.rundir import RunDir
from moebalance.training import checkpoint
from moebalance.training.loop import train

SMALL = dict(steps=3, max_target_length=16, per_device_batch_size=2,
             load_balance_loss_weight=1e-3, router_z_loss_weight=1e-4)


def test_calibration_refits_the_final_biases_on_fresh_training_batches(tmp_path):
    """Two runs equal but for the calibration: the calibrated run saves the biases that
    calibrated_biases fits at the final weights on the next 5 training batches (3-7, none
    trained on), and its probe keeps the online bias's counts, which are the other run's final
    counts."""
    from moebalance.model.transformer import get_biases
    from moebalance.training import sharding
    from moebalance.training.calibration import (biases_set_to, calibrated_biases, probe_counts,
                                                 refit_biases)
    from moebalance.training.loop import build, probe_set
    from moebalance.training.step import make_eval_step

    plain = {**SMALL, "probe_refit_batches": 0}
    online_cfg = load_config("deepseek4-smoke", plain)
    calibrated_cfg = load_config("deepseek4-smoke", {**SMALL, "probe_refit_batches": 2,
                                                     "routed_bias_calibration_batches": 5})
    train(online_cfg, tmp_path / "online")
    train(calibrated_cfg, tmp_path / "calibrated")
    mesh = sharding.make_mesh(online_cfg)
    source = batches(online_cfg)
    model, optimizer = build(online_cfg, mesh, source)
    checkpoint.restore_latest(RunDir(tmp_path / "online").checkpoints, model, optimizer)
    expected = calibrated_biases(online_cfg, model, mesh, source, first=3, batches=5)
    checkpoint.restore_latest(RunDir(tmp_path / "calibrated").checkpoints, model, optimizer)
    np.testing.assert_array_equal(np.asarray(get_biases(model)), np.asarray(expected))
    # the probe's refit, which judges the calibration, fits batches 8-9: after the calibration's
    with biases_set_to(model, refit_biases(calibrated_cfg, model, mesh, source, 8, 2)):
        refit = probe_counts(make_eval_step(calibrated_cfg, model, mesh), model,
                             probe_set(calibrated_cfg, mesh))
    online, calibrated = (json.loads((tmp_path / run / "probe_counts.json").read_text())
                          for run in ("online", "calibrated"))
    assert "online" not in online
    assert calibrated["online"]["3"] == online["counts"]["3"] != calibrated["counts"]["3"]
    assert calibrated["set"]["refit"]["3"] == refit.tolist()
    with pytest.raises(ConfigError, match="routed_bias_calibration_batches.*>= 0"):
        load_config("deepseek4-smoke", {"routed_bias_calibration_batches": -1})


@pytest.mark.parametrize("programs", ["one", "segments"])
def test_a_bound_step_sees_the_biases_set_between_its_calls(programs):
    """bind_model (the refit's and the probes' loops): the bound step gives the unbound step's
    counts, before and after the biases change under it; also as a chain of programs, whose
    bound step holds the model split once."""
    from moebalance.model.transformer import get_biases, set_biases
    from moebalance.training import sharding
    from moebalance.training.loop import build
    from moebalance.training.step import bind_model, make_eval_step

    cfg = load_config("deepseek4-smoke", dict(max_target_length=16, per_device_batch_size=2,
                                              step_programs=programs))
    mesh = sharding.make_mesh(cfg)
    source = batches(cfg)
    model, _ = build(cfg, mesh, source)
    eval_step = make_eval_step(cfg, model, mesh)
    bound = bind_model(eval_step, model)
    batch = [x[0] for x in sharding.global_batch(mesh, *source.batch(0))]

    def counts(step, *args):
        return np.asarray(step(*args, *batch)["counts"])

    before = counts(bound)
    np.testing.assert_array_equal(before, counts(eval_step, model))
    set_biases(model, get_biases(model).at[:, 0].set(1.0))  # expert 0 wins in every top-k block
    after = counts(bound)
    np.testing.assert_array_equal(after, counts(eval_step, model))
    assert (after[2:, 0] > before[2:, 0]).all()


def test_refit_biases_balance_the_fit_batches_and_leave_the_model_alone():
    from moebalance.model.transformer import get_biases, set_biases
    from moebalance.training import sharding
    from moebalance.training.calibration import refit_biases
    from moebalance.training.loop import build
    from moebalance.training.step import make_eval_step

    cfg = load_config("deepseek4-smoke", dict(max_target_length=64, per_device_batch_size=4))
    mesh = sharding.make_mesh(cfg)
    source = batches(cfg)
    model, _ = build(cfg, mesh, source)
    skewed = get_biases(model).at[:, 0].set(1.0)  # expert 0 wins nearly every token
    set_biases(model, skewed)
    eval_step = make_eval_step(cfg, model, mesh)

    def fit_batch_maxvio():  # [L] MaxVio of the counts summed over the 4 fit batches
        counts = sum(np.asarray(eval_step(model, *(x[0] for x in sharding.global_batch(
            mesh, *source.batch(i))))["counts"]) for i in range(5, 9))
        return load_stats(counts)["maxvio"][2:]

    before = fit_batch_maxvio()
    fit = refit_biases(cfg, model, mesh, source, first=5, batches=4)
    np.testing.assert_array_equal(np.asarray(get_biases(model)), np.asarray(skewed))
    set_biases(model, fit)
    after = fit_batch_maxvio()
    assert (before > 1.5).all(), before
    assert (after < 0.04).all(), after  # 1024 tokens x K=2 / 8 experts = 256 per expert


def test_probe_set_is_the_first_held_out_micro_batches(tmp_path):
    """probe_counts.json's set holds `probe_batches` micro-batches of the held-out split in order
    (two per held-out batch under gradient accumulation), recounted here with the initial
    weights; the probe of the seed's table is the first; the final set is measured with the
    run's final biases, and refitted ones."""
    from moebalance.training import sharding
    from moebalance.training.loop import build
    from moebalance.training.step import make_eval_step

    cfg = load_config("deepseek4-smoke", {**SMALL, "probe_batches": 3,
                                          "gradient_accumulation_steps": 2})
    train(cfg, tmp_path / "run")
    probe = json.loads((tmp_path / "run" / "probe_counts.json").read_text())
    mesh = sharding.make_mesh(cfg)
    model, _ = build(cfg, mesh, batches(cfg))
    eval_step = make_eval_step(cfg, model, mesh)
    held_out = batches(cfg, "eval")
    expected = []
    for i in range(2):
        tokens, mask, segment_ids = sharding.global_batch(mesh, *held_out.batch(i))
        expected += [np.asarray(eval_step(model, tokens[a], mask[a], segment_ids[a])["counts"])
                     for a in range(2)]
    np.testing.assert_array_equal(probe["set"]["counts"]["0"], expected[:3])
    assert probe["counts"]["0"] == probe["set"]["counts"]["0"][0]
    for key in ("counts", "refit"):
        final = np.asarray(probe["set"][key]["3"])
        assert final.shape == (3, cfg.base_num_decoder_layers, cfg.num_experts)
        assert probe[key]["3"] == final[0].tolist()
        assert (final.sum(-1) == 2 * 16 * cfg.num_experts_per_tok).all()
    with pytest.raises(ConfigError, match="probe_batches.*>= 1"):
        load_config("deepseek4-smoke", {"probe_batches": 0})
