"""Resuming a run with another `steps`: extending it (also after it ended) on schedules recomputed
for the new total, equal to a run started with that total exactly where the schedules allow;
fewer steps than done, and any other key that differs, refused by name."""

import dataclasses
import os
import shutil
import signal

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moebalance import cli
from moebalance.config import load_config
from moebalance.rundir import RunDir, RunStopped
from moebalance.training.checkpoint import restore_model
from moebalance.training.hooks import Hook
from moebalance.training.loop import train
from moebalance.training.objective import lr_schedule
from moebalance.training.step import schedule_changes

# 4 steps, 1 of them warm-up (also of 6: int(0.25 * 6) = 1); the default cosine to 0.1 x lr
SMALL = dict(steps=4, max_target_length=16, per_device_batch_size=2, warmup_steps_fraction=0.25,
             probe_batches=2, probe_refit_batches=0)


class Notes(Hook):
    def __init__(self):
        self.texts = []

    def note(self, text):
        self.texts.append(text)


class StopAfter(Hook):
    """Ctrl-C during step `step`: the run stops after it, its checkpoint saved."""

    def __init__(self, step):
        self.last = step

    def step(self, record, counts):
        if record["step"] == self.last:
            os.kill(os.getpid(), signal.SIGINT)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 4-step smoke run on the cosine, its biases calibrated after the last step
    (copy it before changing it)."""
    out = tmp_path_factory.mktemp("resume") / "run"
    train(load_config("deepseek4-smoke", {**SMALL, "routed_bias_calibration_batches": 1}), out)
    return out


def logs(run) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in RunDir(run).metrics()]


def test_schedule_changes_name_the_rates_a_new_total_changes_on_the_steps_done():
    cosine = load_config("deepseek4-smoke", {"steps": 20})  # warm-up 2 steps, cosine to 0.1
    constant = dataclasses.replace(cosine, cosine_learning_rate_final_fraction=1.0)
    decaying_bias = dataclasses.replace(constant, routed_bias_update_rate_final_fraction=0.5)
    assert schedule_changes(cosine, dataclasses.replace(cosine, steps=25), 10) == [
        "learning rate"]
    assert schedule_changes(constant, dataclasses.replace(constant, steps=25), 10) == []
    # a constant rate after a warm-up of another length (int(0.1 * 30) = 3 steps)
    assert schedule_changes(constant, dataclasses.replace(constant, steps=30), 10) == [
        "learning rate"]
    assert schedule_changes(decaying_bias, dataclasses.replace(decaying_bias, steps=25), 10) == [
        "bias rate"]
    assert schedule_changes(cosine, dataclasses.replace(cosine, steps=25), 0) == []  # none done


def test_extending_a_constant_after_warm_up_run_equals_a_run_started_with_the_new_total(
        tmp_path):
    """4 steps, then resumed to 6, against 6 from the start: the same metrics, counts, probe and
    weights, bit for bit."""
    short = load_config("deepseek4-smoke", {**SMALL, "cosine_learning_rate_final_fraction": 1.0})
    long = dataclasses.replace(short, steps=6)
    extended, straight = tmp_path / "extended", tmp_path / "straight"
    train(short, extended)
    notes = Notes()
    train(long, extended, resume=True, hooks=[notes])
    train(long, straight)
    assert notes.texts == ["steps 4 -> 6 (config.yaml updated): the schedules are recomputed "
                           "for 6 steps from step 4 on; the same as a run started with steps=6"]
    assert logs(extended) == logs(straight)
    lrs = [r["lr"] for r in logs(straight)]
    assert lrs[0] == 0 and set(lrs[1:]) == {np.float32(short.learning_rate)}  # warm-up, then constant
    np.testing.assert_array_equal(np.fromfile(extended / "expert_counts.i32", np.int32),
                                  np.fromfile(straight / "expert_counts.i32", np.int32))
    assert RunDir(extended).probe()["set"]["counts"]["6"] == (
        RunDir(straight).probe()["set"]["counts"]["6"])
    states = [nnx.to_flat_state(nnx.state(restore_model(long, RunDir(run).checkpoints, 6)[0]))
              for run in (extended, straight)]
    for (path, a), (_, b) in zip(*states):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))


def test_extending_a_finished_cosine_run_recomputes_the_schedule_and_records_it(finished,
                                                                                tmp_path):
    run = shutil.copytree(finished, tmp_path / "run")
    short = RunDir(run).config()
    long = dataclasses.replace(short, steps=6)
    notes = Notes()
    train(long, run, resume=True, hooks=[notes])
    assert notes.texts[0] == (
        "steps 4 -> 6 (config.yaml updated): the schedules are recomputed for 6 steps from step 4 "
        "on; unlike a run started with steps=6, steps 0-3 had the 4-step learning rate and the "
        "biases were calibrated after step 4")
    assert RunDir(run).config() == long
    assert (run / "config.yaml").read_text().startswith(
        "# steps: 4 -> 6 on resume after step 4\nmodel_name: deepseek4-smoke\n")
    lrs = [r["lr"] for r in logs(run)]
    assert len(lrs) == 6
    assert lrs[:4] == pytest.approx(np.asarray(lr_schedule(short)(jnp.arange(4))).tolist())
    assert lrs[4:] == pytest.approx(np.asarray(lr_schedule(long)(jnp.arange(4, 6))).tolist())
    assert lrs[4:] != pytest.approx(np.asarray(lr_schedule(short)(jnp.arange(4, 6))).tolist())
    assert RunDir(run).finished(6) and RunDir(run).finished(4)  # the earlier end's probe is kept
    assert sorted(int(p.name) for p in RunDir(run).checkpoints.iterdir()) == [4, 6]


def test_config_yaml_keeps_every_change_of_steps(tmp_path):
    cfg = load_config("deepseek4-smoke", SMALL)
    with RunDir(tmp_path / "run").writing() as run:
        run.create(cfg, overwrite=False)
        run.change_steps(6, 4)
        run.change_steps(9, 5)
    assert run.config() == dataclasses.replace(cfg, steps=9)
    assert (run.path / "config.yaml").read_text().startswith(
        "# steps: 4 -> 6 on resume after step 4\n# steps: 6 -> 9 on resume after step 5\n")


def resume_cli(capsys, run, *overrides) -> str:
    """The one error line of `moebalance train ... --resume` on `run`, which must fail."""
    args = {**SMALL, **dict(o.split("=") for o in overrides)}
    code = cli.main(["train", "deepseek4-smoke", *[f"{k}={v}" for k, v in args.items()],
                     "--out", str(run), "--resume", "-q"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    return err.strip()


def test_a_resume_with_other_keys_is_refused_naming_each_with_both_values(tmp_path, capsys,
                                                                          moebalance_logger):
    with RunDir(tmp_path / "run").writing() as run:
        run.create(load_config("deepseek4-smoke", SMALL), overwrite=False)
    before = (run.path / "config.yaml").read_text()
    saved = run.path / "config.yaml"
    assert resume_cli(capsys, run.path, "learning_rate=0.002", "seed=3", "steps=9") == (
        f"moebalance: {run.path} was started with another config (learning_rate: 0.0003 in "
        f"{saved}, 0.002 given; seed: 0 in {saved}, 3 given); resume it with its own "
        "config.yaml (only `steps` may change)")
    assert (run.path / "config.yaml").read_text() == before


def test_fewer_steps_than_done_are_refused(finished, tmp_path, capsys, moebalance_logger):
    run = shutil.copytree(finished, tmp_path / "run")
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"}
    assert resume_cli(capsys, run, "routed_bias_calibration_batches=1", "steps=3") == (
        f"moebalance: steps: 4 in {run}/config.yaml, 3 given, but {run} has already done 4 "
        "steps (checkpoints/4); resume it with steps > 4")
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"}
    assert after == before


def test_an_unfinished_run_can_end_sooner_but_after_the_steps_done(tmp_path, capsys,
                                                                   moebalance_logger):
    planned = load_config("deepseek4-smoke", {**SMALL, "steps": 8})
    run = tmp_path / "run"
    with pytest.raises(RunStopped):
        train(planned, run, hooks=[StopAfter(3)])
    assert resume_cli(capsys, run, "steps=4") == (
        f"moebalance: steps: 8 in {run}/config.yaml, 4 given, but {run} has already done 4 "
        "steps (checkpoints/4); resume it with steps > 4")
    notes = Notes()
    train(dataclasses.replace(planned, steps=6), run, resume=True, hooks=[notes])
    assert notes.texts == ["steps 8 -> 6 (config.yaml updated): the schedules are recomputed "
                           "for 6 steps from step 4 on; unlike a run started with steps=6, steps "
                           "0-3 had the 8-step learning rate"]
    assert [r["step"] for r in RunDir(run).metrics()] == list(range(6))
    assert RunDir(run).finished(6) and RunDir(run).config().steps == 6
