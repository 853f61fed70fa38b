"""Fault injection on the smoke config: each fault ends in a one-line error with its exit code, or
recovers by itself; afterwards every saved checkpoint is finite, metrics rows are unique and in
order, and a run another process writes is left intact."""

import json
import os
import shutil
import signal
import stat

import numpy as np
import pytest

from moebalance import cli
from moebalance.atomic import write_atomic
from moebalance.config import load_config
from moebalance.rundir import RunDir
from moebalance.training import checkpoint
from moebalance.training.hooks import Hook
from moebalance.training.loop import build
from moebalance.training.sharding import make_mesh

SMOKE = ["steps=3", "max_target_length=16", "per_device_batch_size=2", "checkpoint_period=1",
         "probe_batches=1", "probe_refit_batches=0"]  # the faults are the training's, not the probe's


def run_cli(capsys, *argv) -> tuple[int, str]:
    """Exit code and stderr of `moebalance argv`; stderr must be at most one line, no traceback."""
    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


def error_line(err: str) -> str:
    """The one `moebalance: ...` line of stderr (warnings may precede it)."""
    lines = [line for line in err.splitlines() if line.startswith("moebalance: ")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A 3-step smoke run with a checkpoint after each step (copy it before changing it)."""
    out = tmp_path_factory.mktemp("faults") / "run"
    assert cli.main(["train", "deepseek4-smoke", *SMOKE, "--out", str(out), "-q"]) == 0
    return out


def copy_of(finished, tmp_path):
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


def steps_logged(run) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def saved_states_are_finite(run) -> list[int]:
    """The steps of the run's checkpoints, each checked to load whole and finite."""
    cfg = RunDir(run).config()
    model, optimizer = build(cfg, make_mesh(cfg))
    mgr = checkpoint.manager(RunDir(run).checkpoints)
    for step in mgr.all_steps():
        assert checkpoint.load(mgr, step, model, optimizer) == step
        assert checkpoint.non_finite(model, optimizer) is None, step
    return sorted(mgr.all_steps())


def test_divergence_stops_before_a_non_finite_state_is_saved(tmp_path, capsys):
    """A learning rate far too high: a step whose loss or gradient norm is not finite stops the
    run with one line; the checkpoints before it are finite and nothing after it is saved."""
    run = tmp_path / "run"
    code, err = run_cli(capsys, "train", "deepseek4-smoke", *SMOKE, "steps=4",
                        "learning_rate=1e30", "warmup_steps_fraction=0", "--out", run)
    assert code == 2
    line = error_line(err)
    assert "is nan" in line or "is inf" in line or "non-finite" in line, line
    steps = saved_states_are_finite(run)
    assert steps_logged(run) == list(range(len(steps)))  # no row for the step that diverged
    code, err = run_cli(capsys, "eval", run, "--batches", "1", "--json")
    assert code == 0  # the latest checkpoint is a good one


def test_checkpoint_save_refuses_a_non_finite_state(tmp_path):
    cfg = load_config("deepseek4-smoke", SMOKE)
    model, optimizer = build(cfg, make_mesh(cfg))
    mgr = checkpoint.manager(tmp_path / "checkpoints")
    checkpoint.save(mgr, 1, model, optimizer)
    model.embed[...] = model.embed[...].at[0, 0].set(np.nan)
    with pytest.raises(FloatingPointError, match=r"step 2: .*embed.*non-finite"):
        checkpoint.save(mgr, 2, model, optimizer)
    assert mgr.all_steps() == [1]


def test_a_second_writer_is_refused_naming_the_first(finished, tmp_path, capsys):
    run = copy_of(finished, tmp_path)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"}
    with RunDir(run).writing():  # the first writer, still at work
        for flag in ("--overwrite", "--resume"):
            code, err = run_cli(capsys, "train", "deepseek4-smoke", *SMOKE, "--out", run, flag)
            assert code == 2
            assert f"is being written by process {os.getpid()}" in error_line(err)
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"}
    assert after == before
    code, _ = run_cli(capsys, "train", "deepseek4-smoke", *SMOKE, "--out", run, "--resume",
                      "-q")  # the lock went with the first writer; the run was finished
    assert code == 0 and steps_logged(run) == [0, 1, 2]


def test_a_torn_last_metrics_line_is_dropped_on_resume(finished, tmp_path, capsys):
    run = copy_of(finished, tmp_path)
    shutil.rmtree(run / "checkpoints" / "3")  # the crash came before the step's checkpoint
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 5.')
    code, err = run_cli(capsys, "train", "deepseek4-smoke", *SMOKE, "--out", run, "--resume",
                        "-q")
    assert code == 0, err
    assert "metrics.jsonl: dropped its last line" in err
    assert steps_logged(run) == [0, 1, 2]
    with open(run / "metrics.jsonl", "r+") as f:  # damage in the middle is not guessed away
        lines = f.read().splitlines()
        f.seek(0)
        f.write("\n".join([lines[0], "{oops", *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2, is not JSON"):
        RunDir(run).metrics()


def test_an_interrupted_set_up_can_be_resumed(tmp_path, capsys, monkeypatch):
    """Ctrl-C before the first step (here: while the model is built): exit 130, one line; the
    run directory holds the config but no checkpoint, and --resume starts it over."""
    from moebalance.training import loop

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(loop, "build", interrupted)
        code, err = run_cli(capsys, "train", "deepseek4-smoke", *SMOKE, "--out", run)
    assert code == 130 and error_line(err) == "moebalance: interrupted"
    assert (run / "config.yaml").is_file() and not RunDir(run).has_checkpoint()
    code, err = run_cli(capsys, "train", "deepseek4-smoke", *SMOKE, "--out", run, "--resume",
                        "-q")
    assert code == 0, err
    assert steps_logged(run) == [0, 1, 2] and saved_states_are_finite(run) == [1, 2, 3]


class SendSignal(Hook):
    def __init__(self, signum):
        self.signum = signum

    def step(self, record, counts):
        if record["step"] == 0:
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_with_a_checkpoint_and_the_shell_exit_code(tmp_path, capsys, monkeypatch,
                                                                  signum, code):
    from moebalance.training import hooks

    run = tmp_path / "run"
    monkeypatch.setattr(hooks, "terminal", lambda console=None, bar=True: [SendSignal(signum)])
    got, err = run_cli(capsys, "train", "deepseek4-smoke", *SMOKE, "steps=5", "--out", run)
    assert got == code
    assert error_line(err) == (f"moebalance: stopped by signal {int(signum)} after step 0; "
                               "checkpoint saved, continue with --resume")
    assert steps_logged(run) == [0] and saved_states_are_finite(run) == [1]


@pytest.mark.parametrize("argv, message", [
    (["demo", "--k", "20"], "top-k must satisfy 1 <= k <= num_experts"),
    (["demo", "--experts", "0"], "num_experts >= 1"),
    (["demo", "--tokens", "0"], "tokens >= 1"),
    (["train", "deepseek4-smoke", "--out", "/sys/moebalance-test/run"], "cannot be written"),
])
def test_common_mistakes_end_in_one_line(capsys, argv, message):
    code, err = run_cli(capsys, *argv)
    assert code == 2 and message in error_line(err)


def test_an_output_path_under_a_file_is_named(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    code, err = run_cli(capsys, "train", "deepseek4-smoke", "--out", tmp_path / "notes.txt" / "run")
    assert code == 2 and "notes.txt is not a directory" in error_line(err)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_corrupt_run_tokenizer_is_named(finished, tmp_path, capsys):
    run = copy_of(finished, tmp_path)
    (run / "tokenizer.json").write_text("{not a tokenizer")
    code, err = run_cli(capsys, "generate", run, "--prompt", "x")
    assert code == 2 and "tokenizer.json is not a tokenizer the run can use" in error_line(err)


@pytest.mark.parametrize("files, over, message", [
    ({"train.bin": b"\x01\x00\x02", "meta.json": b'{"dtype": "uint16", "eot_id": 0}'}, [],
     "3 bytes is not a whole number of uint16 tokens"),
    ({"train.bin": b"\x01\x00\x02\x00", "meta.json": b"{dtype: uint16"}, [], "meta.json: not JSON"),
    ({"train.bin": b"\x01\x00\x02\x00", "meta.json": b'{"dtype": "uint16", "eot_id": 300}'}, [],
     "eot_id 300 is outside the vocabulary [0, 256)"),
    ({"a.txt": b"some text"}, ["dataset_type=text", "tokenizer_path={root}/a.txt"],
     "cannot load"),
])
def test_bad_data_ends_in_one_line_before_the_run_directory_exists(tmp_path, capsys, files, over,
                                                                  message):
    root = tmp_path / "data"
    root.mkdir()
    for name, content in files.items():
        (root / name).write_bytes(content)
    over = [o.format(root=root) for o in over] or ["dataset_type=tokens", f"dataset_path={root}"]
    code, err = run_cli(capsys, "train", "deepseek4-smoke", *SMOKE, *over, "--out",
                        tmp_path / "run")
    assert code == 2 and message in error_line(err)
    assert not (tmp_path / "run").exists()


def test_eval_of_a_non_finite_checkpoint_fails(finished, tmp_path, capsys, monkeypatch):
    """A checkpoint with NaN weights (as older versions could write) is named, not evaluated to
    a loss of nan with exit code 0."""
    run = copy_of(finished, tmp_path)
    cfg = RunDir(run).config()
    model, optimizer = build(cfg, make_mesh(cfg))
    mgr = checkpoint.manager(RunDir(run).checkpoints)
    checkpoint.load(mgr, 3, model, optimizer)
    model.embed[...] = model.embed[...] * np.nan
    shutil.rmtree(run / "checkpoints" / "3")
    mgr.reload()
    monkeypatch.setattr(checkpoint, "non_finite", lambda *state: None)  # the older versions
    checkpoint.save(mgr, 3, model, optimizer)
    code, err = run_cli(capsys, "eval", run, "--batches", "1")
    assert code == 2 and "its weights are not finite" in error_line(err)


@pytest.mark.parametrize("umask", [0o022, 0o077], ids=["022", "077"])
def test_an_atomic_write_gets_open_s_mode_and_a_failed_one_leaves_the_file_as_it_was(tmp_path,
                                                                                     umask):
    old = os.umask(umask)
    try:
        write_atomic(tmp_path / "atomic", lambda f: f.write(b"whole"))
        with open(tmp_path / "opened", "wb"):
            pass
    finally:
        os.umask(old)
    modes = {stat.S_IMODE((tmp_path / name).stat().st_mode) for name in ("atomic", "opened")}
    assert modes == {0o666 & ~umask}

    def torn(f):
        f.write(b"par")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(tmp_path / "atomic", torn)
    assert (tmp_path / "atomic").read_bytes() == b"whole"
    assert sorted(os.listdir(tmp_path)) == ["atomic", "opened"]
