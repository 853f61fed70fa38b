"""Test-session set-up: the pytest-xdist workers (new processes, started after this file is read)
inherit glibc's huge-page malloc tunable, as the `moebalance` command sets it (moebalance.runtime)."""

import os

from moebalance.runtime import hugepage_malloc_env

os.environ.update(hugepage_malloc_env() or {})
