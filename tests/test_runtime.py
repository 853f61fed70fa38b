import importlib.metadata
import json
import os
import subprocess
import sys

from conftest import run_cli
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
    entries = list(tmp_path.glob("*-cache"))
    assert entries
    # zstd frames (the `zstandard` dependency): with zlib, writing a training step took 6x longer
    assert all(entry.read_bytes()[:4] == b"\x28\xb5\x2f\xfd" for entry in entries)
    assert "cache hit" not in runs[0].stderr and "cache hit" in runs[1].stderr


def test_the_command_keeps_compiled_programs_unless_told_not_to(tmp_path):
    demo = ["demo", "--steps", "2", "--experts", "4", "--k", "2", "--tokens", "64"]
    run_cli(demo, tmp_path / "on", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    assert any((tmp_path / "on").iterdir())
    run_cli([*demo, "--no-compile-cache"], tmp_path / "off",
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    assert not (tmp_path / "off").exists()


def test_min_compile_time_is_ours_unless_jax_is_told(tmp_path):
    script = ("import jax; from moebalance import runtime\n"
              "runtime.enable_compilation_cache()\n"
              "print(jax.config.jax_compilation_cache_dir, "
              "jax.config.jax_persistent_cache_min_compile_time_secs)\n")
    ours, jaxs = (run_cli([], tmp_path, main=("-c", script),
                          JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=value)[0].split()
                  for value in (None, "7"))
    assert ours == [str(tmp_path), str(runtime.MIN_COMPILE_S)]
    assert jaxs == [str(tmp_path), "7.0"]


# the trainer's model and optimizer built in a new process, counting XLA compilations by function
COUNT_BUILD_COMPILES = """
import collections, json
import jax
from jax import monitoring
from moebalance.config import load_config
from moebalance.training.loop import build
from moebalance.training.sharding import make_mesh

compiles = collections.Counter()
monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: event == "/jax/core/compile/backend_compile_duration"
    and compiles.update([kw["fun_name"]]))
cfg = load_config("deepseek4-smoke", dict(hash_table="random"))
model, optimizer = build(cfg, make_mesh(cfg, jax.devices()), train_data=iter(()))
print(json.dumps(compiles))
"""


def test_building_the_model_and_optimizer_compiles_no_program_per_parameter_shape(tmp_path):
    # made eagerly, each new shape of a parameter moved to the device (jnp.asarray) or of an
    # AdamW moment (zeros) compiled a program of its own: 82 programs in all for deepseek4-smoke
    # before, 104 for deepseek4-tiny (2026-12-06)
    out, _ = run_cli([], tmp_path / "xla", main=("-c", COUNT_BUILD_COMPILES))
    compiles = json.loads(out.splitlines()[-1])
    assert compiles.get("jit(optimizer_init)") == 1
    assert sum(compiles.values()) <= 6, compiles


def test_the_command_ends_at_once_with_its_output_and_exit_code(tmp_path, capsys):
    """cli.entry ends the process by runtime.exit_at_once (no Python clean-up at exit): what it
    printed to a pipe (block-buffered) arrives whole, as main prints it in this process, and an
    error's exit code and one-line message come through."""
    from moebalance import cli

    for command in (["keys"], ["params", "deepseek4-tiny"]):
        printed, _ = run_cli(command, tmp_path, PYTHONUNBUFFERED=None)  # stdout buffered
        assert cli.main(command) == 0
        assert printed == capsys.readouterr().out and printed.count("\n") >= 3
    bad = subprocess.run([sys.executable, "-m", "moebalance.cli", "train", "no-such-config",
                          "--out", str(tmp_path / "run")], capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.startswith("moebalance: ") and bad.stderr.count("\n") == 1


def _git(repo, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_code_commit_names_the_checkout_its_changes_or_the_version(tmp_path):
    package = tmp_path / "repo" / "src" / "moebalance"
    package.mkdir(parents=True)
    (package / "runtime.py").write_text("a = 1\n")
    _git(tmp_path / "repo", "init", "-q")
    _git(tmp_path / "repo", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
         "--allow-empty", "-m", "first")
    _git(tmp_path / "repo", "add", "src")
    _git(tmp_path / "repo", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    head = _git(tmp_path / "repo", "rev-parse", "--short", "HEAD")
    assert runtime.code_commit({}, package) == head
    (package / "untracked.py").write_text("")  # untracked files are not the code's change
    assert runtime.code_commit({}, package) == head
    (package / "runtime.py").write_text("a = 2\n")
    assert runtime.code_commit({}, package) == head + "+"
    # a launcher's name wins (a copy without .git); an installed package gives its version
    assert runtime.code_commit({"MOEBALANCE_COMMIT": "c0ffee1"}, package) == "c0ffee1"
    installed = tmp_path / "lib" / "site-packages" / "moebalance"
    installed.mkdir(parents=True)
    assert runtime.code_commit({}, installed) == (
        f"moebalance {importlib.metadata.version('moebalance')}")
