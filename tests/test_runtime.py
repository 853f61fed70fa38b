import os
import subprocess
import sys

from moebalance import runtime


def test_hugepage_env_adds_the_tunable_once(monkeypatch):
    monkeypatch.setattr(runtime, "_glibc_supports_hugetlb", lambda: True)
    assert runtime.hugepage_malloc_env({"PATH": "/bin"}) == {
        "PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert runtime.hugepage_malloc_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    assert runtime.hugepage_malloc_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None


def test_no_reexec_without_a_glibc_that_has_the_tunable(monkeypatch):
    monkeypatch.setattr(runtime, "_glibc_supports_hugetlb", lambda: False)
    assert runtime.hugepage_malloc_env({}) is None


def test_glibc_version_is_read(monkeypatch):
    monkeypatch.setattr(runtime.os, "confstr", lambda name: "glibc 2.34")
    assert not runtime._glibc_supports_hugetlb()
    monkeypatch.setattr(runtime.os, "confstr", lambda name: "glibc 2.36")
    assert runtime._glibc_supports_hugetlb()


def test_compilation_cache_dir_rules():
    home = os.path.expanduser("~")
    assert runtime.compilation_cache_dir({}) == f"{home}/.cache/moebalance/xla"
    assert runtime.compilation_cache_dir({"MOEBALANCE_CACHE_DIR": "~/c"}) == f"{home}/c"
    assert runtime.compilation_cache_dir({"MOEBALANCE_CACHE_DIR": ""}) is None  # off
    assert runtime.compilation_cache_dir({"JAX_COMPILATION_CACHE_DIR": "/j"}) is None  # JAX's
    assert runtime.compilation_cache_dir({"XDG_CACHE_HOME": "/x"}) == "/x/moebalance/xla"


def test_a_second_process_loads_the_compiled_program_from_the_cache(tmp_path):
    script = (
        "import jax, jax.numpy as jnp\n"
        "from moebalance import runtime\n"
        f"assert runtime.enable_compilation_cache({{'MOEBALANCE_CACHE_DIR': '{tmp_path}'}})\n"
        "jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)\n"
        "print(jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))).sum())\n")
    env = {**os.environ, "JAX_LOG_COMPILES": "1"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, check=True) for _ in range(2)]
    assert runs[0].stdout == runs[1].stdout
    assert any(tmp_path.iterdir())
    assert "cache hit" not in runs[0].stderr and "cache hit" in runs[1].stderr
