"""How a process learns that it is one of several (sharding.distributed_settings), and how two
processes joined by `jax.distributed` end: the installed command's fast exit (runtime.exit_at_once)
waits for the other process. The run itself across processes, checked against one process, is
tests/scripts/multiprocess_run.py (a minute or more: outside CI)."""

import os
import socket
import subprocess
import sys

import pytest

from moebalance.config import ConfigError, load_config
from moebalance.training.sharding import distributed_settings

SMOKE = load_config("deepseek4-smoke")
LAUNCH = {"MOEBALANCE_COORDINATOR": "host0:1234", "MOEBALANCE_NUM_PROCESSES": "4",
          "MOEBALANCE_PROCESS_ID": "3"}


def test_single_process_without_keys_or_variables():
    assert distributed_settings(SMOKE, {"SLURM_JOB_ID": "7"}) is None


def test_launch_variables_start_a_multi_process_run():
    assert distributed_settings(SMOKE, LAUNCH) == {
        "coordinator_address": "host0:1234", "num_processes": 4, "process_id": 3}


def test_config_keys_win_over_the_variables():
    cfg = load_config("deepseek4-smoke", {"distributed_coordinator": "a:1",
                                          "distributed_num_processes": 2,
                                          "distributed_process_id": 1})
    assert distributed_settings(cfg, LAUNCH) == {
        "coordinator_address": "a:1", "num_processes": 2, "process_id": 1}


def test_the_switch_alone_leaves_discovery_to_jax():
    cfg = load_config("deepseek4-smoke", {"jax_distributed_initialization": True})
    assert distributed_settings(cfg, {}) == {
        "coordinator_address": None, "num_processes": None, "process_id": None}


@pytest.mark.parametrize("environ,message", [
    ({"MOEBALANCE_COORDINATOR": "h:1"}, "missing: `distributed_num_processes` \\(or "
                                        "MOEBALANCE_NUM_PROCESSES\\), `distributed_process_id`"),
    ({**LAUNCH, "MOEBALANCE_PROCESS_ID": "4"}, "4 is not in \\[0, 4\\) for 4 processes"),
    ({**LAUNCH, "MOEBALANCE_NUM_PROCESSES": "four"},
     "MOEBALANCE_NUM_PROCESSES='four' must be an integer"),
])
def test_incomplete_or_bad_launch_fails_naming_the_variable(environ, message):
    with pytest.raises(ConfigError, match=message):
        distributed_settings(SMOKE, environ)


def test_devices_open_on_their_own_thread_after_the_distributed_start(monkeypatch):
    import threading

    import jax

    from moebalance.training import sharding

    events, opened, go = [], threading.Event(), threading.Event()

    def devices():
        # the opening waits until the caller has gone on: it must not be waiting for it
        events.append(("devices", threading.current_thread().name, go.wait(timeout=60)))
        opened.set()

    monkeypatch.setattr(sharding, "initialize_distributed",
                        lambda cfg: events.append(("distributed", cfg.model_name)))
    monkeypatch.setattr(jax, "devices", devices)
    thread = sharding.open_devices_early(load_config("deepseek4-smoke"))
    events.append(("caller went on", threading.current_thread().name))
    go.set()
    thread.join(timeout=60)
    assert opened.is_set() and not thread.daemon
    assert events == [("distributed", "deepseek4-smoke"), ("caller went on", "MainThread"),
                      ("devices", "open-devices", True)]


def test_a_failed_opening_is_left_to_the_callers_own_call(monkeypatch):
    import threading

    import jax

    from moebalance.training import sharding

    calls, unhandled = [], []

    def devices():
        calls.append(threading.current_thread().name)
        raise RuntimeError("Unable to initialize backend 'tpu'")

    monkeypatch.setattr(sharding, "initialize_distributed", lambda cfg: None)
    monkeypatch.setattr(jax, "devices", devices)
    monkeypatch.setattr(threading, "excepthook", unhandled.append)
    sharding.open_devices_early(load_config("deepseek4-smoke")).join(timeout=60)
    assert calls == ["open-devices"] and unhandled == []  # no thread traceback: the caller's
    with pytest.raises(RuntimeError, match="backend 'tpu'"):  # own call raises it
        jax.devices()


def _two_processes(command: list[str], variables: bool = True, **env) -> list[tuple[int, str]]:
    """`python command` in two local CPU processes joined through the launch variables (or,
    variables False, given the coordinator's address and its own index as their last two
    arguments) -> each one's (exit code, output)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    procs = []
    for i in range(2):
        launch = {"MOEBALANCE_COORDINATOR": address, "MOEBALANCE_NUM_PROCESSES": "2",
                  "MOEBALANCE_PROCESS_ID": str(i)} if variables else {}
        procs.append(subprocess.Popen(
            [sys.executable, *command, *([] if variables else [address, str(i)])],
            env={**os.environ, "JAX_PLATFORMS": "cpu", **launch, **env},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return [(p.returncode, out) for p in procs for out in [p.communicate(timeout=600)[0]]]


# one process of two that leaves at once, the other a few seconds later (still writing, or
# slower at its last step), both ending by the installed command's exit
STAGGERED = """
import sys, time
import jax
from moebalance.runtime import exit_at_once
address, index = sys.argv[1], int(sys.argv[2])
jax.distributed.initialize(address, 2, index)
count = jax.process_count()  # the backends started: each process has joined the other
time.sleep(3 * index)
print(f"process {index} of {count} done")
exit_at_once(0)
"""


def test_the_fast_exit_waits_for_every_process():
    # before: the coordinator (process 0) left at once, its service with it, and process 1,
    # still running, was aborted ("the JAX distributed service detected fatal errors", -6)
    # before its output
    ended = _two_processes(["-c", STAGGERED], variables=False)
    for index, (code, output) in enumerate(ended):
        assert code == 0, output
        assert output.splitlines()[-1] == f"process {index} of 2 done", output


def test_two_processes_of_the_installed_command_end_whole(tmp_path):
    """`python -m moebalance.cli train` (cli.entry, the installed command's path) in two processes:
    both exit 0 and print their last line, the run's files are whole."""
    tiny = ["steps=1", "max_target_length=8", "per_device_batch_size=1", "probe_batches=1",
            "probe_refit_batches=0", "base_num_decoder_layers=1", "compress_ratios=[0]",
            "first_num_hash_layers=0", "checkpoint_period=1"]
    ended = _two_processes(["-m", "moebalance.cli", "train", "deepseek4-smoke", *tiny, "--out",
                            str(tmp_path / "run"), "--no-compile-cache"])
    for code, output in ended:
        assert code == 0, output
        assert output.rstrip().endswith(f"run written to {tmp_path / 'run'}"), output
    assert "after step 0: loss" in ended[0][1]  # process 0 shows the run, process 1 is quiet
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["1"]
