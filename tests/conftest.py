"""Test-session set-up, inherited by the pytest-xdist workers (new processes, started after this
file is read) and by the tests' own subprocesses:

- glibc's huge-page malloc tunable, as the `moebalance` command sets it (moebalance.runtime);
- XLA's CPU backend at its lowest LLVM optimisation: the tests run tiny models, whose time is
  compilation (halved by these flags), not execution; what they check does not depend on it;
- `moebalance_logger`, for the tests that run cli.main.
"""

import logging
import os

import pytest

from moebalance.runtime import hugepage_malloc_env

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

os.environ.update(hugepage_malloc_env() or {})
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()


@pytest.fixture(scope="module")
def moebalance_logger():
    """The `moebalance` logger, whose handlers cli.main replaces (pointing them at the running
    test's stderr, and passing nothing on to the root logger), put back as it was after the
    module's tests."""
    log = logging.getLogger("moebalance")
    saved = log.handlers[:], log.propagate, log.level
    yield log
    log.handlers[:], log.propagate, log.level = saved
