"""The command line's own behaviour: output channels, levels and error messages (no training)."""

import logging
import re

import pytest

from moebalance import cli


def test_progress_notes_reach_stderr_once(moebalance_logger, capsys):
    """A library that gave the root logger a stream handler (as orbax's import does) must not
    make every note appear twice."""
    root = logging.getLogger()
    extra = logging.StreamHandler()  # stderr, like the handler such libraries add
    root.addHandler(extra)
    try:
        cli.setup_logging(logging.INFO)
        logging.getLogger("moebalance.data").info("encoding the train split: 3 files")
    finally:
        root.removeHandler(extra)
    captured = capsys.readouterr()
    assert captured.err.count("encoding the train split") == 1 and captured.out == ""


def test_a_repeated_warning_is_shown_once_per_command(moebalance_logger, capsys):
    cli.setup_logging(logging.INFO)
    log = logging.getLogger("moebalance.routing")
    for _ in range(2):  # e.g. Run A and Run B building the same uneven hash table
        log.warning("hash table 'balanced': expected MaxVio 0.5385 on the given token counts")
        log.info("encoding the train split: 3 files")
    log.warning("another warning")
    err = capsys.readouterr().err
    assert err.count("expected MaxVio 0.5385") == 1 and err.count("another warning") == 1
    assert err.count("encoding the train split") == 2  # notes are not warnings
    cli.setup_logging(logging.INFO)  # the next command shows it again
    log.warning("hash table 'balanced': expected MaxVio 0.5385 on the given token counts")
    assert capsys.readouterr().err.count("expected MaxVio") == 1


@pytest.mark.parametrize("flag, shown", [("-q", ()), ("", ("info",)), ("-v", ("info", "debug"))])
def test_quiet_and_verbose(moebalance_logger, capsys, flag, shown):
    assert cli.main(["keys", "zzz-no-such-key", *([flag] if flag else [])]) == 0
    log = logging.getLogger("moebalance.test")
    log.info("info note")
    log.debug("debug note")
    err = capsys.readouterr().err
    assert all((f"{level} note" in err) == (level in shown) for level in ("info", "debug"))


def test_keys_lists_the_schema(capsys):
    assert cli.main(["keys", "bias_update_rule"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("routed_bias_update_rule (str, default 'sign'): ")
    assert len(out.splitlines()) == 1


@pytest.mark.parametrize("command", [["eval", "{d}/nowhere"], ["generate", "{d}/nowhere",
                                     "--prompt", "x"], ["report", "{d}/nowhere", "--out",
                                                        "{d}/out"]])
def test_a_missing_run_directory_is_named(tmp_path, capsys, command):
    assert cli.main([c.format(d=tmp_path) for c in command]) == 2
    err = capsys.readouterr().err
    assert f"run directory {tmp_path}/nowhere does not exist" in err
    assert "Errno" not in err and not (tmp_path / "nowhere").exists()


def test_a_directory_without_config_is_not_a_run(tmp_path, capsys):
    assert cli.main(["eval", str(tmp_path)]) == 2
    assert "is not a run directory: it has no config.yaml" in capsys.readouterr().err


def test_convert_names_a_missing_checkpoint_directory(tmp_path, capsys):
    assert cli.main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint directory {tmp_path}/nowhere does not exist" in err
    assert not (tmp_path / "out").exists()
    assert cli.main(["convert", str(tmp_path), str(tmp_path / "out")]) == 2
    assert f"{tmp_path}: no config.json" in capsys.readouterr().err


@pytest.mark.parametrize("steps, columns, window", [
    (2, [0, 1], 0), (5, [0, 2, 4], 0), (11, [0, 5, 10], 0), (39, [0, 10, 19, 38], 0),
    (40, [0, 10, 20, 39], 20), (51, [0, 10, 25, 50], 25), (150, [0, 10, 50, 75, 149], 75),
    (201, [0, 10, 50, 100, 200], 100)])
def test_demo_shows_the_steps_that_exist(capsys, steps, columns, window):
    """The MaxVio table's columns are 0, 10, 50, the middle and the last step, those that exist;
    every row has a value in each; the overshoot column only from 40 steps, over the run's second
    half (at most 100 steps): from two points it would read +1.00 or -1.00 whatever the rule."""
    small = ["--tokens", "64", "--experts", "8", "--k", "2"]
    assert cli.main(["demo", "--steps", str(steps), *small]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "rule" in line)
    assert [int(s) for s in re.findall(r"@(\d+)", header)] == columns
    assert ("osc" in header) == bool(window)
    quantile = next(line for line in lines if "quantile" in line)
    assert len(re.findall(r"\d\.\d{3}", quantile)) == len(columns)
    assert len(re.findall(r"[+-]\d\.\d\d", quantile)) == (1 if window else 0)
    text = " ".join(lines)
    assert (f"over the last {window} steps" in text) if window else (
        "needs at least 40 steps" in text)


def test_a_mistyped_subcommand_or_choice_names_the_one_meant(capsys):
    for argv, meant in ((["trian"], "train"), (["eval", "run", "--split", "evl"], "eval")):
        with pytest.raises(SystemExit) as stop:
            cli.main(argv)
        assert stop.value.code == 2
        assert f"; did you mean {meant}?" in capsys.readouterr().err


def test_the_command_line_and_the_loop_stay_short():
    """Each module of the command line under 450 lines, the training loop's `train` under 60:
    one module per group of subcommands, the loop a loop."""
    import inspect
    from pathlib import Path

    from moebalance.training import loop

    modules = Path(cli.__file__).parent.glob("*.py")
    assert {m.name: n for m in modules if (n := len(m.read_text().splitlines())) >= 450} == {}
    assert len(inspect.getsource(loop.train).splitlines()) < 60


@pytest.mark.parametrize("steps", ["1", "0", "-3"])
def test_demo_refuses_fewer_than_two_steps(capsys, steps):
    with pytest.raises(SystemExit) as stop:
        cli.main(["demo", "--steps", steps])
    assert stop.value.code == 2
    assert f"argument --steps: must be at least 2, got {steps}" in capsys.readouterr().err
