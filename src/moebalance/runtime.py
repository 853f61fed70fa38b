"""Process set-up for the `moebalance` command: glibc's huge-page malloc, the compilation cache,
and which code runs (code_commit, for records that compare runs).

XLA's CPU runtime allocates every step's temporary buffers afresh (gigabytes for a training step),
and glibc serves blocks that large with new mmaps, so each step page-faults its whole working set
in 4 KiB pages: measured on deepseek4-tiny (8 x 256 tokens), 810k faults and 1.9 s of system time
per 4.2 s step. `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (glibc >= 2.35) backs those mappings with
transparent huge pages: 13k faults, 0.3 s, the step 3.3 s. glibc reads tunables only when a
process starts, so the command line re-executes itself once with the tunable set.

Compiled programs are kept on disk (JAX's persistent compilation cache) so that a later run of the
same program skips XLA's compilation: measured on deepseek4-tiny's training step, 21 s of XLA
compilation become 1.8 s of loading (tracing, ~5 s, still runs). Where: $MOEBALANCE_CACHE_DIR
(default user_cache_root()/xla, i.e. ~/.cache/moebalance/xla; set it empty, or give the command
--no-compile-cache, to turn the cache off), unless JAX's own $JAX_COMPILATION_CACHE_DIR is set.
JAX keys each entry by the program, the XLA flags, the JAX version and the device, so a changed
program or flag compiles afresh. Kept: every program that took MIN_COMPILE_S or more to compile.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb=1"
COMMIT_ENV = "MOEBALANCE_COMMIT"
CACHE_ENV = "MOEBALANCE_CACHE_DIR"
# JAX keeps only programs that took 1 s to compile by default. A run also compiles dozens of small
# ones (initialisation, eager array ops: 0.1-0.5 s each on a loaded 2-core CPU): 60 of them took
# 22-27 s to compile and 8 s to load from the cache. Below 0.1 s loading saves little.
MIN_COMPILE_S = 0.1


def _glibc_supports_hugetlb() -> bool:
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # e.g. "glibc 2.36"
    except (AttributeError, ValueError, OSError):
        return False  # not glibc (musl, macOS, Windows)
    major, minor = (int(part) for part in version.split(".")[:2])
    return name == "glibc" and (major, minor) >= (2, 35)


def hugepage_malloc_env(environ=os.environ) -> dict | None:
    """The environment to re-execute with, or None when the tunable is set or not supported."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables or not _glibc_supports_hugetlb():
        return None
    return {**environ, "GLIBC_TUNABLES": ":".join(filter(None, [tunables, TUNABLE]))}


def reexec_with_hugepage_malloc() -> None:
    """Replace this process by the same command with the tunable set (returns when not needed).

    Only for entry points (the CLI, benchmarks): it restarts the interpreter."""
    env = hugepage_malloc_env()
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def user_cache_root(environ=os.environ) -> Path:
    """moebalance's default cache directory: $XDG_CACHE_HOME/moebalance, else
    ~/.cache/moebalance (tokenizers and token streams, compiled programs)."""
    xdg = environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "moebalance"


def compilation_cache_dir(environ=os.environ) -> str | None:
    """The directory the command keeps compiled programs in, or None (off, or JAX's own setting
    applies)."""
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    path = environ.get(CACHE_ENV, str(user_cache_root(environ) / "xla"))
    return os.path.expanduser(path) if path else None


def enable_compilation_cache(environ=os.environ) -> str | None:
    """Turn on JAX's persistent compilation cache at compilation_cache_dir() for programs that
    took MIN_COMPILE_S to compile (JAX's $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS, when set,
    instead); returns the path."""
    path = compilation_cache_dir(environ)
    if path is not None:
        import jax

        jax.config.update("jax_compilation_cache_dir", path)
        if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in environ:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    return path


def exit_at_once(code: int) -> None:
    """End the command's process with `code` once what it started has finished (its non-daemon
    threads, JAX's pending effects) and what it wrote is flushed, without Python's clean-up at
    exit: there JAX's atexit hook destroys the accelerator's client, which on a TPU v5e took
    4.6 s after `moebalance ab` (2026-12-07), and the operating system releases the same at
    exit. Only for entry points, after main returned: every file it wrote is closed by then.

    One process of several (`jax.distributed`) first shuts the distributed runtime down, as
    JAX's hook would: that waits until every process has come to its own shutdown, and the
    coordinator's service, which the others poll, stops only then. Without it the coordinator
    left at once and each process still running (writing its output, or slower to finish its
    last step) ended with "Terminating process because the JAX distributed service detected
    fatal errors" (SIGABRT), its output cut."""
    import logging
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    if "jax" in sys.modules:
        jax = sys.modules["jax"]
        jax.effects_barrier()
        if jax.distributed.is_initialized():
            jax.distributed.shutdown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def code_commit(environ=os.environ, package_dir: Path = Path(__file__).resolve().parent) -> str:
    """Which code this process runs: $MOEBALANCE_COMMIT where a launcher names it (a copy of a
    checkout without its .git, as a device machine gets), else the git commit of the source
    checkout the package is imported from (`<root>/src/moebalance`), with '+' when tracked files
    differ from it, else the installed package's version ('moebalance 0.1.0')."""
    if environ.get(COMMIT_ENV):
        return environ[COMMIT_ENV]
    root = package_dir.parents[1]
    if package_dir == root / "src" / "moebalance" and (root / ".git").exists():
        try:
            head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                                  capture_output=True, text=True, timeout=30)
            changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                      "--untracked-files=no"],
                                     capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            head = None
        if head is not None and head.returncode == 0 and changed.returncode == 0:
            return head.stdout.strip() + ("+" if changed.stdout.strip() else "")
    return f"moebalance {importlib.metadata.version('moebalance')}"
