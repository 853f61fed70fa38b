"""A damaged checkpoint and one that cannot be read for another reason (issues 61, 62): the
first is set aside in one plain line and the one before is used, by every command that reads a
run; the second stops the command with its cause, and nothing is moved. On the smoke run of
test_faults (its `finished` fixture)."""

import gc
import shutil

import jax
import numpy as np
import pytest

import conftest
from moebalance import cli
from moebalance.rundir import RunDir
from moebalance.training import checkpoint
from moebalance.training.loop import build
from moebalance.training.sharding import make_mesh
from test_faults import (SMOKE, copy_of, finished, run_cli,  # noqa: F401 (finished: a fixture)
                         saved_states_are_finite, steps_logged)


def damage(run, how: str, step: int = 3) -> str:
    """Damage checkpoint `step` of run as a crash mid-write or a full disk does, its largest
    file 'cut' in half or 'missing'; -> that file's path within the checkpoint."""
    files = [p for p in (run / "checkpoints" / str(step)).rglob("*") if p.is_file()]
    largest = max(files, key=lambda p: p.stat().st_size)
    if how == "cut":
        with open(largest, "r+b") as f:
            f.truncate(largest.stat().st_size // 2)
    else:
        largest.unlink()
    return str(largest.relative_to(run / "checkpoints" / str(step)))


def damage_said(run, how: str, name: str) -> str:
    """How the line of checkpoint 3, its file `name` cut or missing, begins."""
    where = run / "checkpoints" / "3"
    said = (f"{name} is missing" if how == "missing" else
            f"the file {name} is {(where / name).stat().st_size:,} bytes, shorter than the ")
    return f"checkpoint {where} is damaged: {said}"


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before(finished, tmp_path, capsys):
    run = copy_of(finished, tmp_path)
    said = damage_said(run, "cut", damage(run, "cut"))
    code, err = run_cli(capsys, "train", "deepseek4-smoke", *SMOKE, "--out", run, "--resume",
                        "-q")
    gc.collect()  # what a failed read left behind, finalised now: an error of the test
    assert code == 0 and err.startswith(said) and err.count("\n") == 1, err
    assert err.endswith("; moved to 3.damaged; resuming from step 2\n"), err
    assert steps_logged(run) == [0, 1, 2]
    assert (run / "checkpoints" / "3.damaged").is_dir()  # kept for a post-mortem, out of the way
    assert saved_states_are_finite(run) == [1, 2, 3]


def orbax_read_error(key: str, status: str, why: str) -> Exception:
    """What Orbax 0.12 raises when TensorStore fails to read `key`: its own Exception, whose
    message carries the TensorStore spec, caused by TensorStore's ValueError."""
    err = Exception("Encountered error while reading array index: (slice(0, 2, 1),). See full "
                    "TensorStore details: <bound method pybind11_detail_function_record_v1_"
                    "system_libstdcpp_gxx_abi_1xxx.spec>")
    err.__cause__ = ValueError(f'{status}: Error reading "{key}" in OCDBT database at local '
                               f'file "/r/checkpoints/3/state/": {why}')
    return err


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_data_that_does_not_decode_is_damage_in_tensorstore_s_own_words(finished, tmp_path,
                                                                       capsys, monkeypatch):
    """Bytes overwritten in place (the files' sizes whole) fail only when read: TensorStore's
    status for stored data that does not decode makes it damage, said in one line without
    the TensorStore spec that Orbax's error wraps around it."""
    run, load = copy_of(finished, tmp_path), checkpoint.load

    def overwritten(mgr, step, model, optimizer):  # a real read: test_orbax_s_own_read_error
        if step == 3:
            raise orbax_read_error("model.embed/0.0", "FAILED_PRECONDITION",
                                   "ZSTD_decompressStream() failed: Unknown frame descriptor")
        return load(mgr, step, model, optimizer)

    monkeypatch.setattr(checkpoint, "load", overwritten)
    code, err = run_cli(capsys, "train", "deepseek4-smoke", *SMOKE, "--out", run, "--resume",
                        "-q")
    monkeypatch.undo()
    assert code == 0 and err == (
        f"checkpoint {run / 'checkpoints' / '3'} is damaged: FAILED_PRECONDITION: Error reading "
        '"model.embed/0.0" in OCDBT database at local file "/r/checkpoints/3/state/": '
        "ZSTD_decompressStream() failed: Unknown frame descriptor; moved to 3.damaged; "
        "resuming from step 2\n")
    assert steps_logged(run) == [0, 1, 2] and saved_states_are_finite(run) == [1, 2, 3]


def test_orbax_s_own_read_error_of_overwritten_bytes_is_damage(finished, tmp_path):
    """The same with a real read, in a process of its own: the first value's zstd frame header
    overwritten. Its line only: the read that finds it is Orbax's, whose reads left in flight
    may print around it (docs/reliability.md)."""
    run = copy_of(finished, tmp_path)
    files = [p for p in (run / "checkpoints" / "3").rglob("*") if p.is_file()]
    with open(max(files, key=lambda p: p.stat().st_size), "r+b") as f:
        f.write(bytes(16))
    out, err = conftest.run_cli(["eval", str(run), "--batches", "1", "--json", "-q"],
                                tmp_path / "cache")
    [line] = [line for line in err.splitlines() if line.startswith("checkpoint ")]
    assert line.startswith(f"checkpoint {run / 'checkpoints' / '3'} is damaged: "
                           "FAILED_PRECONDITION: Error reading "), err
    assert "ZSTD_decompressStream() failed" in line and "pybind11" not in line
    assert line.endswith("; left where it is; reading step 2") and out.startswith('{"step": 2,')


def test_the_installed_command_prints_the_one_line_every_time(finished, tmp_path):
    """As the issue's user ran it: the command in a process of its own, three times over, the
    checkpoint's largest file cut in half or missing in turn. Issue 61: a failed read's
    left-overs printed up to 503 lines some of the time; here any line but the one fails."""
    run, printed = tmp_path / "run", set()
    for how in ("cut", "missing", "cut"):
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(finished, run)
        said = damage_said(run, how, damage(run, how))
        out, err = conftest.run_cli(["train", "deepseek4-smoke", *SMOKE, "--out", str(run),
                                     "--resume", "-q"], tmp_path / "cache")
        assert err.startswith(said) and err.count("\n") == 1, err
        assert err.endswith("; moved to 3.damaged; resuming from step 2\n"), err
        printed.add(out)
    assert len(printed) == 1 and printed.pop().endswith(f"run written to {run}\n")


@pytest.mark.parametrize("command, how, times, out, note", [
    (["eval", "{run}", "--batches", "1", "--json", "-q"], "missing", 3,
     '{{"step": 2, "split": "eval"', []),
    (["export", "{run}", "{tmp}/hf{time}"], "cut", 1, "wrote {tmp}/hf0 (step 2, ",
     ["{run}/tokenizer.json does not exist (a synthetic-data run has none): exported the "
      "weights without a tokenizer"]),
])
def test_a_command_that_reads_a_damaged_run_prints_the_one_line(finished, tmp_path, command, how,
                                                               times, out, note):
    """eval and export skip the damaged checkpoint, leave it where it is, and say so in one
    line, every time (repeated: a leak that depends on timing fails it too)."""
    run = copy_of(finished, tmp_path)
    said = damage_said(run, how, damage(run, how))
    for time in range(times):
        got, err = conftest.run_cli([arg.format(run=run, tmp=tmp_path, time=time)
                                     for arg in command], tmp_path / "cache")
        assert got.startswith(out.format(run=run, tmp=tmp_path)) and got.count("\n") == 1, got
        line, *rest = err.splitlines()
        assert line.startswith(said) and line.endswith("; left where it is; reading step 2")
        assert rest == [n.format(run=run) for n in note], err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["1", "2", "3"]


@pytest.mark.parametrize("error", [
    lambda: jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1.0G"),
    lambda: PermissionError(13, "Permission denied", "checkpoints/3/state/_METADATA"),
    lambda: TypeError("StandardRestore.__init__() got an unexpected keyword argument 'item'"),
    lambda: orbax_read_error("model.embed/0.0", "PERMISSION_DENIED", "open failed"),
    lambda: orbax_read_error("params.embed/.zarray", "NOT_FOUND", "does not exist"),
], ids=["out-of-memory", "permission", "api-mismatch", "tensorstore-permission", "other-layout"])
def test_an_error_that_is_not_damage_stops_the_command_and_moves_nothing(finished, tmp_path,
                                                                         monkeypatch, error):
    """A load that fails for another reason than the files (issue 62: a resume that ran out of
    memory set every checkpoint aside, then told the user to --overwrite them): the command
    stops with the cause chained, every checkpoint where it was."""
    run = copy_of(finished, tmp_path)
    cause = error()

    def failing(mgr, step, model, optimizer):
        raise cause

    monkeypatch.setattr(checkpoint, "load", failing)
    with pytest.raises(checkpoint.UnreadableCheckpoint) as stopped:
        cli.main(["train", "deepseek4-smoke", *SMOKE, "--out", str(run), "--resume", "-q"])
    assert stopped.value.__cause__ is cause
    assert str(stopped.value).startswith(f"checkpoint {run / 'checkpoints' / '3'} could not be "
                                         "loaded, though its files are whole, so nothing was "
                                         f"moved or skipped: {type(cause).__name__}: {cause}")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["1", "2", "3"]
    assert steps_logged(run) == [0, 1, 2]


def test_ctrl_c_during_the_load_moves_nothing(finished, tmp_path, capsys, monkeypatch):
    run = copy_of(finished, tmp_path)

    def interrupted(mgr, step, model, optimizer):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "load", interrupted)
    code, err = run_cli(capsys, "train", "deepseek4-smoke", *SMOKE, "--out", run, "--resume")
    assert code == 130 and err == "moebalance: interrupted\n"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["1", "2", "3"]


@pytest.mark.parametrize("process", [0, 1])
def test_process_0_decides_and_renames_and_every_process_loads_its_step(finished, tmp_path,
                                                                         monkeypatch, process):
    """Two processes seen from each: process 0 checks, sets the damaged 3 aside and answers 2;
    process 1 (3 whole in its view here) renames nothing and loads the 2 it is sent."""
    run = copy_of(finished, tmp_path)
    cfg = RunDir(run).config()
    model, optimizer = build(cfg, make_mesh(cfg))
    mgr = checkpoint.manager(RunDir(run).checkpoints)
    if process == 0:
        damage(run, "cut")
    answered, loaded, warned = [], [], []
    load = checkpoint.load

    def broadcast(value):  # process 1 gets the 2 process 0 chose
        answered.append(int(value))
        return value if process == 0 else np.int32(2)

    def load_alone(mgr, step, model, optimizer):  # Orbax's own multi-process reads are not ours
        loaded.append(step)
        with monkeypatch.context() as alone:
            alone.setattr(jax, "process_index", lambda: 0)
            alone.setattr(jax, "process_count", lambda: 1)
            return load(mgr, step, model, optimizer)

    monkeypatch.setattr(checkpoint, "load", load_alone)
    monkeypatch.setattr(checkpoint.log, "warning", lambda *line: warned.append(line))
    monkeypatch.setattr(jax, "process_index", lambda: process)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(checkpoint.multihost_utils, "broadcast_one_to_all", broadcast)
    monkeypatch.setattr(checkpoint.multihost_utils, "process_allgather",
                        lambda x: np.stack([x, x]))
    assert checkpoint.restore(mgr, model, optimizer) == 2
    assert answered == [2 if process == 0 else -1]  # process 1 checked nothing itself
    assert loaded == [2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == (
        ["1", "2", "3.damaged"] if process == 0 else ["1", "2", "3"])
    assert len(warned) == (1 if process == 0 else 0), warned


@pytest.mark.parametrize("process", [0, 1])
def test_when_process_0_cannot_check_every_process_stops_and_nothing_moves(
        finished, tmp_path, monkeypatch, process):
    """Process 0's check of the files raises (here a permission): it tells the others before it
    raises, so process 1 stops too instead of waiting for a step that never comes."""
    run = copy_of(finished, tmp_path)
    cfg = RunDir(run).config()
    model, optimizer = build(cfg, make_mesh(cfg))
    mgr = checkpoint.manager(RunDir(run).checkpoints)
    answered = []

    def refused(directory):
        raise PermissionError(f"[Errno 13] Permission denied: '{directory}/meta/metadata'")

    def broadcast(value):  # process 1 gets what process 0 sent
        answered.append(int(value))
        return value if process == 0 else np.int32(checkpoint.CHECK_FAILED)

    monkeypatch.setattr(checkpoint.damage, "problem", refused)
    monkeypatch.setattr(jax, "process_index", lambda: process)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(checkpoint.multihost_utils, "broadcast_one_to_all", broadcast)
    with pytest.raises(checkpoint.UnreadableCheckpoint) as stopped:
        checkpoint.restore(mgr, model, optimizer)
    if process == 0:
        assert answered == [checkpoint.CHECK_FAILED]  # sent before raising
        assert isinstance(stopped.value.__cause__, PermissionError)
    else:
        assert answered == [-1] and "process 0 could not check" in str(stopped.value)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["1", "2", "3"]
