"""tests/conftest.py's `--device-tests` (the numerics tests alone, for a run on an accelerator)
and `tolerance()` / `function_rtol()` (float tolerances by backend)."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import conftest

TESTS = Path(__file__).resolve().parent


def collected(*options) -> set[str]:
    """The files of test_cli.py and test_moe.py whose tests pytest collects with `options`."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "0", "--collect-only", *options,
         str(TESTS / "test_cli.py"), str(TESTS / "test_moe.py")],
        capture_output=True, text=True, cwd=TESTS.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    return {line.split("::")[0].rsplit("/", 1)[-1] for line in done.stdout.splitlines()
            if "::" in line}


def test_device_tests_keep_the_numerics_files_only():
    assert "test_moe.py" in conftest.NUMERICS and "test_cli.py" not in conftest.NUMERICS
    assert collected() == {"test_cli.py", "test_moe.py"}
    assert collected("--device-tests") == {"test_moe.py"}


def test_every_numerics_file_exists():
    assert {path.name for path in TESTS.glob("test_*.py")} >= conftest.NUMERICS


def test_tolerance_is_the_cpus_unchanged_and_relative_to_the_quantitys_scale_on_a_tpu(
        monkeypatch):
    monkeypatch.delenv(conftest.TOLERANCE_ENV, raising=False)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    update = np.array([3e-4, -1e-4])
    assert conftest.tolerance(update, rtol=2e-5, atol=1e-6) == {"rtol": 2e-5, "atol": 1e-6}
    assert conftest.tolerance(update, atol=2e-5) == {"rtol": 0.0, "atol": 2e-5}
    assert conftest.function_rtol(1e-6, "log") == 1e-6
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    chip = conftest.TPU_MATMUL_RTOL
    assert conftest.tolerance(update, rtol=2e-5, atol=1e-9) == {"rtol": chip, "atol": chip * 3e-4}
    assert conftest.tolerance(update, rtol=0.5) == {"rtol": 0.5, "atol": chip * 3e-4}
    assert conftest.function_rtol(1e-6, "log", 2) == 2 * conftest.TPU_FUNCTION_RTOL["log"]


def test_the_chips_tolerances_on_any_backend_by_the_environment(monkeypatch):
    """MOEBALANCE_TEST_TOLERANCE=tpu: the CPU suite at the chip's tolerances (to see a test fail
    on a wrong computation there); any other value is refused, naming the two it takes."""
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    monkeypatch.setenv(conftest.TOLERANCE_ENV, "tpu")
    assert conftest.tolerance([2.0, -4.0], rtol=1e-6) == {"rtol": conftest.TPU_MATMUL_RTOL,
                                                          "atol": 4 * conftest.TPU_MATMUL_RTOL}
    assert conftest.function_rtol(0.0, "exp") == conftest.TPU_FUNCTION_RTOL["exp"]
    monkeypatch.setenv(conftest.TOLERANCE_ENV, "chip")
    with pytest.raises(ValueError, match="set it to 'tpu'"):
        conftest.tolerance(1.0)


def test_property_tests_draw_the_same_examples_on_every_run():
    """conftest's hypothesis profile, the default unless HYPOTHESIS_PROFILE names another: two
    runs of a property test see the same examples (one verdict on every run), no database of
    earlier runs' failures, nothing timed."""
    fixed = settings.get_profile("fixed")
    if "HYPOTHESIS_PROFILE" not in os.environ:
        assert settings.default == fixed
    drawn = []

    @settings(fixed)
    @given(st.integers(0, 10**9), st.floats(0.0, 1.0))
    def draw(n, q):
        drawn.append((n, q))

    draw()
    first, drawn[:] = drawn[:], []
    draw()
    assert drawn == first and len(set(first)) > 50
    assert fixed.database is None and fixed.deadline is None
