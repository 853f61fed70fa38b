"""How a process learns that it is one of several (sharding.distributed_settings). The run itself
across processes is tests/scripts/multiprocess_run.py (a minute or more: outside CI)."""

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
