"""The averaged bias (routed_bias_average_fraction, balancing.average_bias): the mean of the
online bias over the last steps against NumPy's mean of the same biases, in the step against a
NumPy replay of the sign rule, kept after the last step, saved and restored bit for bit, never
the optimizer's, and left out of the DeepSeek export."""

import numpy as np
import pytest
from flax import nnx

import reference as ref
from moebalance import balancing
from moebalance.config import ConfigError, load_config
from moebalance.experiment import without_balancing
from moebalance.hf.checkpoint import deepseek_tensors
from moebalance.model.moe import RouterBiasAverage
from moebalance.model.transformer import DeepSeekV4, get_biases, routed_layers
from moebalance.study import arms_from
from moebalance.training import checkpoint
from moebalance.training.step import make_train_step, new_optimizer, shared_programs
from test_train_step import ONE_TOPK, batch

STEPS = 6
OVER = dict(max_target_length=16, steps=STEPS, routed_bias_update_rule="sign",
            routed_bias_update_rate=1e-2, routed_bias_average_fraction=0.5)


@pytest.mark.parametrize("steps, fraction, start", [
    (2000, 0.25, 1500), (300, 0.1, 270), (6, 0.5, 3), (10, 0.01, 9), (7, 1.0, 0)])
def test_average_start_by_hand(steps, fraction, start):
    assert balancing.average_start(steps, fraction) == start


def test_average_start_refuses_no_fraction():
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        balancing.average_start(10, 0.0)


def test_average_bias_is_numpys_mean_of_the_biases_since_its_start():
    biases = np.random.default_rng(0).normal(size=(40, 3, 8)).astype(np.float32)
    start = 30
    average = np.zeros((3, 8), np.float32)
    for step, bias in enumerate(biases):
        average = np.asarray(balancing.average_bias(average, bias, step, start))
        if step < start:  # before its start the mean is the bias itself
            np.testing.assert_array_equal(average, bias)
        else:
            np.testing.assert_allclose(average, biases[start:step + 1].astype(np.float64).mean(0),
                                       rtol=0, atol=4e-7)


def test_the_config_refuses_a_fraction_outside_0_1_and_without_a_bias():
    with pytest.raises(ConfigError, match="routed_bias_average_fraction"):
        load_config("deepseek4-smoke", {"routed_bias_average_fraction": 1.5})
    with pytest.raises(ConfigError, match="routed_bias_average_fraction"):
        load_config("deepseek4-smoke", ["routed_bias=false", "routed_bias_average_fraction=0.25"])


def test_a_study_arm_may_average():
    [arm] = arms_from([["sign-avg", "routed_bias=true", "routed_bias_average_fraction=0.25"]])
    assert arm.overrides == ("routed_bias=true", "routed_bias_average_fraction=0.25")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """STEPS steps of the smoke model averaging its last half: after each step the online bias
    (the metrics' until the last), the model's bias and mean; a checkpoint after step 5 (steps 3 and 4 averaged)."""
    cfg = load_config("deepseek4-smoke", OVER)
    model = DeepSeekV4(cfg, rngs=nnx.Rngs(0))
    opt = new_optimizer(cfg, model)
    step = make_train_step(cfg, model)
    where = tmp_path_factory.mktemp("checkpoints")
    mgr = checkpoint.manager(where)
    out = {"counts": [], "bias": [], "average": [], "cfg": cfg, "model": model, "opt": opt}
    for i in range(STEPS):
        metrics = step(model, opt, *batch(1, 2, seed=i))
        out["counts"].append(np.asarray(metrics["counts"]))
        out["bias"].append(np.asarray(get_biases(model)))
        out["average"].append(np.asarray(get_biases(model, "bias_average")))
        if i == 4:
            checkpoint.save(mgr, i + 1, model, opt)
    out["checkpoints"] = where
    return out


def online_replay(trained) -> np.ndarray:
    """[STEPS, L, E]: the sign rule replayed in NumPy from zero on each step's counts."""
    layers = routed_layers(trained["model"])
    bias = np.zeros((len(layers), trained["cfg"].num_experts))
    out = []
    for counts in trained["counts"]:
        bias = np.stack([ref.update_bias(b, counts[layer], "sign", 1e-2)
                         for b, layer in zip(bias, layers)])
        out.append(bias)
    return np.stack(out)


def test_the_step_averages_the_online_bias_and_keeps_the_mean_after_the_last_step(trained):
    online = online_replay(trained)
    start = 3  # the last half of 6 steps
    for i in range(STEPS - 1):  # the online bias keeps steering
        np.testing.assert_allclose(trained["bias"][i], online[i], rtol=0, atol=1e-6)
    for i in range(STEPS):
        want = online[i] if i < start else online[start:i + 1].mean(0)
        np.testing.assert_allclose(trained["average"][i], want, rtol=0, atol=1e-6, err_msg=str(i))
    assert np.abs(trained["average"][STEPS - 1] - online[STEPS - 1]).max() > 1e-3  # a real mean
    # after the last step the bias the run keeps is the mean, bit for bit
    np.testing.assert_array_equal(trained["bias"][STEPS - 1], trained["average"][STEPS - 1])


def test_the_optimizer_never_holds_or_moves_the_mean(trained):
    opt_paths = [path for path, _ in nnx.to_flat_state(nnx.state(trained["opt"]))]
    assert opt_paths and not any("bias_average" in map(str, path) for path in opt_paths)
    means = nnx.to_flat_state(nnx.state(trained["model"], RouterBiasAverage))
    assert len(means) == len(routed_layers(trained["model"]))  # one per top-k block
    assert not nnx.to_flat_state(nnx.state(trained["model"], nnx.All(nnx.Param,
                                                                     RouterBiasAverage)))


def test_a_checkpoint_restores_the_mean_and_the_online_bias_bit_for_bit(trained):
    cfg = trained["cfg"]
    model = DeepSeekV4(cfg, rngs=nnx.Rngs(1))
    opt = new_optimizer(cfg, model)
    assert not get_biases(model, "bias_average").any()
    assert checkpoint.load(checkpoint.manager(trained["checkpoints"]), 5, model, opt) == 5
    mean, bias = trained["average"][4], trained["bias"][4]
    assert not np.array_equal(mean, bias)  # mid-average: two different states
    np.testing.assert_array_equal(get_biases(model, "bias_average"), mean)
    np.testing.assert_array_equal(get_biases(model), bias)


def test_the_export_has_the_same_tensors_with_and_without_a_mean():
    names = []
    for fraction in (0.0, 0.5):
        cfg = load_config("deepseek4-smoke", {**OVER, "routed_bias_average_fraction": fraction})
        names.append(sorted(deepseek_tensors(DeepSeekV4(cfg, rngs=nnx.Rngs(0)))))
    assert names[0] == names[1]


def test_the_ab_runs_an_averaging_run_b_and_its_run_a_on_one_program():
    """Run A keeps Run B's model (a mean beside each bias, never moved: its bias rate is 0), so
    it runs on Run B's compiled step; a study arm that averages compiles its own (another
    model)."""
    run_b = load_config("deepseek4-smoke", OVER)
    run_a = without_balancing(run_b)
    assert run_a.routed_bias_average_fraction == 0.5
    assert shared_programs([run_a, run_b]) == [run_b, run_b]
    plain = load_config("deepseek4-smoke", {**OVER, "routed_bias_average_fraction": 0.0})
    programs = shared_programs([plain, run_b])
    assert programs[0] != programs[1]


def test_the_chain_of_segment_programs_averages_as_the_one_program():
    """step_programs=segments (a TPU's auto) updates the mean in its last program: two steps
    of each, the mean and the kept bias the same."""
    over = {**OVER, **ONE_TOPK, "steps": 2}
    runs = []
    for programs in ("one", "segments"):
        cfg = load_config("deepseek4-smoke", {**over, "step_programs": programs})
        model = DeepSeekV4(cfg, rngs=nnx.Rngs(0))
        opt = new_optimizer(cfg, model)
        step = make_train_step(cfg, model)
        for i in range(2):
            step(model, opt, *batch(1, 2, seed=i))
        runs.append((np.asarray(get_biases(model, "bias_average")), np.asarray(get_biases(model))))
    (mean, kept), (chain_mean, chain_kept) = runs
    assert np.abs(mean).max() > 0
    np.testing.assert_allclose(chain_mean, mean, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(chain_kept, chain_mean)
    np.testing.assert_array_equal(kept, mean)
