"""tests/conftest.py's `--device-tests` (the numerics tests alone, for a run on an accelerator)
and `tolerance()` (float tolerances by backend)."""

import subprocess
import sys
from pathlib import Path

import jax

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


def test_tolerance_is_the_cpus_unchanged_and_at_least_the_tpus_on_a_tpu(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert conftest.tolerance(rtol=2e-5, atol=1e-6) == {"rtol": 2e-5, "atol": 1e-6}
    assert conftest.tolerance(atol=2e-5) == {"rtol": 0.0, "atol": 2e-5}
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert conftest.tolerance(rtol=2e-5, atol=1e-6) == conftest.TPU_TOLERANCE
    assert conftest.tolerance(rtol=0.5) == {"rtol": 0.5, "atol": conftest.TPU_TOLERANCE["atol"]}
