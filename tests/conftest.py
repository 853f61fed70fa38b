"""Test-session set-up, inherited by the pytest-xdist workers (new processes, started after this
file is read) and by the tests' own subprocesses:

- glibc's huge-page malloc tunable, as the `moebalance` command sets it (moebalance.runtime);
- XLA's CPU backend at its lowest LLVM optimisation and with its older, elemental emitter for
  fusions: the tests run tiny models, whose time is compilation (halved by the first two flags;
  the MLIR fusion emitters compile each of a step's ~750 fusions through a pass pipeline of its
  own, and without them deepseek4-smoke's training step compiles in ~6 s instead of ~10), not
  execution; what they check does not depend on it (not with --device-tests: an accelerator's
  compiler runs as it does in training); and the simulated devices' collectives patient with a
  loaded machine;
- `--device-tests`: only the numerics tests (marker `numerics`: the files in NUMERICS), for a run
  on an accelerator in one process (`-n 0`); `tolerance()` and `function_rtol()` widen their
  float tolerances on a TPU, relative to each quantity's scale (also on the CPU with
  MOEBALANCE_TEST_TOLERANCE=tpu); `float32_model()`, a layer tested alone at the float32
  model's matmul precision, whose CPU tolerances hold on a TPU too;
- hypothesis's profile: derandomized, no example database (one verdict on every run);
- `optimised_programs`, for the few tests whose time is running a program many times, not
  compiling it: their programs compiled at XLA's usual optimisation level;
- `moebalance_logger`, for the tests that run cli.main; `run_cli`, for those that run the
  command in a new process;
- after each module, the compiled programs released (`release_compiled_programs`).
"""

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from moebalance.runtime import hugepage_malloc_env

FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_use_fusion_emitters=false")
# The simulated devices' collectives wait 10 minutes for each other, not XLA's 40 s: on a loaded
# 2-core machine (two workers, eight device threads each) one thread can be starved that long, and
# XLA then aborts the process (seen once in test_sharding's 2 x 2 x 2 mesh, 2026-12-06)
PATIENT_COLLECTIVES = "--xla_cpu_collective_call_terminate_timeout_seconds=600"
# what the model computes: routing, balancing, the layers and model, the training step, decoding
# and the exported model's logits
NUMERICS = {"test_routing.py", "test_balancing.py", "test_metrics.py", "test_moe.py",
            "test_model.py", "test_cross_entropy.py", "test_train_step.py", "test_generate.py",
            "test_export.py", "test_precision.py"}
# A TPU computes a float32 dot at the default precision in one bfloat16 pass: each operand
# rounded to 8 significant bits (relative error up to 2^-9 = 2e-3), products summed in float32, so
# a layer's output is off by ~1e-2 of its scale; the routing maths alone runs at float32
# (model/layers.FP32). On the v5e (2026-12-06) the MoE layer's float32 outputs (scale ~0.5) were
# 4.0e-3 from float64 and its gradients 2.3e-3 from dense autodiff's (tests/test_moe.py). Relative
# to each value and to the compared quantity's own scale (its largest magnitude), never an
# absolute floor: a weight update of 3e-4 is not to be compared at 2e-2.
TPU_MATMUL_RTOL = 2e-2
# A TPU v5e computes float32 transcendentals approximately. Their largest relative errors against
# float64 over 450,000 points in [-20, 20] (benchmarks/tpu_functions.py on the chip, 2026-12-06;
# docs/distributed.md): exp 5.5e-6, sigmoid 5.6e-6, softmax rows 4.5e-6, tanh 8.1e-5, log, log1p
# and softplus 3.7e-4 (log: ~12 bits), sqrt(softplus) 1.3e-4 (a square root halves a relative
# error); sqrt, rsqrt and division within 2.5 ulps. Those, rounded up:
TPU_FUNCTION_RTOL = {"exp": 1e-5, "sigmoid": 1e-5, "softmax": 1e-5, "tanh": 1e-4, "log": 5e-4,
                     "softplus": 5e-4, "sqrtsoftplus": 2e-4}

os.environ.update(hugepage_malloc_env() or {})

# Property tests give one verdict on every run: each test's examples derived from the test itself
# (derandomize), no database of earlier failures replayed, nothing timed (no deadline, no
# too-slow health check: a loaded machine's verdict would differ); a failure found is kept in the
# test as an explicit @example. HYPOTHESIS_PROFILE=explore draws new examples at random.
settings.register_profile("fixed", derandomize=True, database=None, print_blob=True,
                          deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", database=None, print_blob=True, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))


def pytest_addoption(parser):
    parser.addoption("--device-tests", action="store_true",
                     help="only the numerics tests (marker `numerics`), on JAX's default backend "
                          "(e.g. a TPU) with its tolerances; run with -n 0")


def pytest_configure(config):
    config.addinivalue_line("markers", "numerics: what the model computes (--device-tests)")
    if not config.getoption("--device-tests") and FAST_COMPILE not in os.environ.get(
            "XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE} "
                                   f"{PATIENT_COLLECTIVES}").strip()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in NUMERICS:
            item.add_marker(pytest.mark.numerics)
    if config.getoption("--device-tests"):
        others = [item for item in items if not item.get_closest_marker("numerics")]
        config.hook.pytest_deselected(items=others)
        items[:] = [item for item in items if item.get_closest_marker("numerics")]


# MOEBALANCE_TEST_TOLERANCE=tpu: the helpers below return on any backend what they return on a
# TPU, so that a test can be shown to fail on a wrong computation at the chip's tolerances here
TOLERANCE_ENV = "MOEBALANCE_TEST_TOLERANCE"


def chip_tolerances() -> bool:
    """Whether tolerance() and function_rtol() give a TPU's tolerances: on a TPU, or wherever
    MOEBALANCE_TEST_TOLERANCE=tpu."""
    import jax  # not at the top: XLA_FLAGS is set above before any backend starts

    chosen = os.environ.get(TOLERANCE_ENV, "")
    if chosen not in ("", "tpu"):
        raise ValueError(f"{TOLERANCE_ENV}={chosen!r}: set it to 'tpu' (the chip's tolerances on "
                         "any backend) or leave it unset (this backend's)")
    return chosen == "tpu" or jax.default_backend() == "tpu"


def tolerance(want, rtol: float = 0.0, atol: float = 0.0) -> dict:
    """assert_allclose's {rtol, atol} for comparing a float result with `want` that holds to
    (rtol, atol) on the CPU: those, unchanged, on the CPU; on a TPU (whose float32 matmuls are
    bfloat16 passes) at least TPU_MATMUL_RTOL of each value and of `want`'s largest magnitude,
    the quantity's own scale."""
    if chip_tolerances():
        scale = float(np.abs(np.asarray(want, np.float64)).max(initial=0.0))
        return {"rtol": max(rtol, TPU_MATMUL_RTOL), "atol": max(atol, TPU_MATMUL_RTOL * scale)}
    return {"rtol": rtol, "atol": atol}


def function_rtol(rtol: float, function: str, times: int = 1) -> float:
    """The relative tolerance of a value computed through the float32 `function`
    (TPU_FUNCTION_RTOL's names) that holds to rtol on the CPU: rtol there; on a TPU at least
    `times` the chip's error of the function (2 for a ratio of two of its values)."""
    if chip_tolerances():
        return max(rtol, times * TPU_FUNCTION_RTOL[function])
    return rtol


def float32_model():
    """The context in which a float32 model runs its matmuls (matmul_precision auto: highest): a
    layer tested alone in it computes in float32 on a TPU too, not in one bfloat16 pass, so the
    CPU's tolerances hold there (the chip's exp, sigmoid and rsqrt are within 1e-5) and a formula
    a per cent off fails on every backend."""
    from moebalance.model import layers

    return layers.precision_scope(layers.matmul_precision("auto", "float32"))


def run_cli(args, cache, main=("-m", "moebalance.cli"), **env):
    """The installed command's code path (`python -m moebalance.cli`: cli.entry) in a new process
    keeping compiled programs in `cache`, or `main`, another script, with `env` added (a None
    value removes the variable); -> (stdout, stderr)."""
    env = {**os.environ, "MOEBALANCE_CACHE_DIR": str(cache), "JAX_COMPILATION_CACHE_DIR": None,
           **env}
    env = {name: value for name, value in env.items() if value is not None}
    done = subprocess.run([sys.executable, *main, *args], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr


@pytest.fixture
def optimised_programs(monkeypatch):
    """Every program the test jits compiled at XLA's usual backend optimisation level instead of
    the session's lowest (FAST_COMPILE): for a test whose time is running a program many times,
    not compiling it (the balancer simulation's 800 steps of Quantile Balancing: 23 s at level
    0, 4 s at level 2, the same numbers). On the CPU only; elsewhere the backend runs as it does
    in training anyway."""
    import functools

    import jax

    if jax.default_backend() == "cpu":
        monkeypatch.setattr(jax, "jit", functools.partial(
            jax.jit, compiler_options={"xla_backend_optimization_level": 2}))


@pytest.fixture(scope="module")
def moebalance_logger():
    """The `moebalance` logger, whose handlers cli.main replaces (pointing them at the running
    test's stderr, and passing nothing on to the root logger), put back as it was after the
    module's tests."""
    log = logging.getLogger("moebalance")
    saved = log.handlers[:], log.propagate, log.level
    yield log
    log.handlers[:], log.propagate, log.level = saved


def _memory_mappings() -> int | None:
    """This process's memory mappings (Linux), or None where /proc does not say."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


MAPPINGS_PER_MODULE = 40_000  # of the kernel's default 65,530 per process (vm.max_map_count)


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """After each test module, JAX's compiled programs are dropped and collected. Each program
    compiled for the CPU keeps its machine code in memory mappings of its own (three per
    object) until it is freed; a pytest worker that kept every program of its ~300 tests passed
    the kernel's limit of 65,530 mappings a process, and the next compilation aborted without a
    message (CI, 2026-12-06; test_train_step.py alone leaves ~24,000). A module that alone comes
    near the limit fails here, named, instead."""
    import gc

    import jax

    yield
    used = _memory_mappings()
    jax.clear_caches()
    gc.collect()
    if used is not None and used > MAPPINGS_PER_MODULE:
        pytest.fail(f"this module left {used:,} memory mappings (over {MAPPINGS_PER_MODULE:,} of "
                    "the kernel's 65,530): release compiled programs within it "
                    "(jax.clear_caches) or split it")
