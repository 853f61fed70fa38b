"""A pytest plugin: where each test's time goes in JAX, from JAX's own monitoring events, for
planning the chip's test runs (benchmarks/tpu.sh tests), whose time is mostly compilation.

    PYTHONPATH=benchmarks python3 -m pytest -p pytest_compiles --compiles-json FILE ...

FILE gets, per test id, its call's wall seconds and the number and seconds of XLA compilations
(`backend_compile`), JAX's tracing (`trace`) and lowering to StableHLO (`lower`) within it, and
the totals; the summary prints the tests with the most compile seconds.
"""

import json
import time

import pytest
from jax import monitoring

EVENTS = {"/jax/core/compile/backend_compile_duration": "backend_compile",
          "/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower"}
_running: list[str] = []
_tests: dict[str, dict] = {}


def _record(event: str, seconds: float, **_) -> None:
    kind = EVENTS.get(event)
    if kind and _running:
        test = _tests[_running[-1]]
        test[f"{kind}_n"] = test.get(f"{kind}_n", 0) + 1
        test[f"{kind}_s"] = round(test.get(f"{kind}_s", 0.0) + seconds, 3)


def pytest_addoption(parser):
    parser.addoption("--compiles-json", default=None,
                     help="write each test's JAX compilations and their seconds to this file")


def pytest_configure(config):
    if config.getoption("--compiles-json"):
        monitoring.register_event_duration_secs_listener(_record)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if not item.config.getoption("--compiles-json"):
        yield
        return
    _tests[item.nodeid] = {}
    _running.append(item.nodeid)
    start = time.perf_counter()
    try:
        yield
    finally:
        _running.pop()
        _tests[item.nodeid]["wall_s"] = round(time.perf_counter() - start, 3)


def pytest_terminal_summary(terminalreporter, config):
    path = config.getoption("--compiles-json")
    if not path:
        return
    total = {key: round(sum(t.get(key, 0) for t in _tests.values()), 3)
             for key in ("wall_s", "backend_compile_n", "backend_compile_s", "trace_s", "lower_s")}
    with open(path, "w") as f:
        json.dump({"total": total, "tests": _tests}, f, indent=1)
    terminalreporter.write_line(f"JAX per test -> {path}; all tests: {total}")
    slowest = sorted(_tests.items(), key=lambda kv: -kv[1].get("backend_compile_s", 0))[:15]
    for test, seen in slowest:
        terminalreporter.write_line(
            f"{seen.get('backend_compile_s', 0):7.1f} s in {seen.get('backend_compile_n', 0):3d} "
            f"compilations, {seen['wall_s']:7.1f} s in all  {test}")
