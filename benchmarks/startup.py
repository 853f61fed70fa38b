"""Where a command's first seconds go on a machine: whether Python finds the installed packages'
bytecode (or compiles their sources in every process), the imports of `moebalance ab`, and
opening the devices. Prints one JSON object.

    python benchmarks/startup.py [--pycache-prefix DIR] [--premapped BYTES,...]

Each timing is a fresh interpreter, run twice (the second finds what the first left behind).
--pycache-prefix: the same again with $PYTHONPYCACHEPREFIX=DIR (and $PYTHONDONTWRITEBYTECODE unset),
where Python then keeps the bytecode of every module it imports, also of packages whose folders it
cannot write (a read-only install shipped without its __pycache__). --premapped: opening the
devices again with each of these sizes of libtpu's premapped (pinned) host buffer, and the exit.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

PACKAGES = ("jax", "jaxlib", "flax", "numpy", "orbax.checkpoint", "matplotlib", "moebalance")
# what `moebalance ab` imports before its first step (cli/experiment.py and what it reaches)
IMPORTS = ("import moebalance.experiment, moebalance.training.evaluate, "
           "moebalance.training.calibration")
OPEN = ("import time; t = time.perf_counter(); import jax; i = time.perf_counter(); "
        "jax.devices(); print(i - t, time.perf_counter() - i, time.time(), flush=True)")


def bytecode(name: str) -> dict:
    """A package's folder, whether this user may write it, and how many of its top-level modules
    have bytecode for this interpreter beside them."""
    folder = os.path.dirname(importlib.util.find_spec(name).origin)
    sources = [f for f in os.listdir(folder) if f.endswith(".py")]
    cached = [f for f in sources if os.path.exists(importlib.util.cache_from_source(
        os.path.join(folder, f)))]
    return {"folder": folder, "writable": os.access(folder, os.W_OK),
            "sources": len(sources), "with_bytecode": len(cached)}


def timed(code: str, env: dict) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    return round(time.perf_counter() - start, 2)


def opened(env: dict) -> dict:
    """A fresh process importing JAX and opening the devices, and how long it took to exit."""
    out = subprocess.run([sys.executable, "-c", OPEN], env=env, check=True, capture_output=True,
                         text=True).stdout.split()
    ended = time.time()
    return {"import_jax_s": round(float(out[0]), 2), "devices_s": round(float(out[1]), 2),
            "exit_s": round(ended - float(out[2]), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pycache-prefix")
    parser.add_argument("--premapped", default="",
                        help="comma-separated TPU_PREMAPPED_BUFFER_SIZE values (bytes) to open "
                             "the devices with too")
    args = parser.parse_args()
    env = dict(os.environ)
    result = {"dont_write_bytecode": sys.flags.dont_write_bytecode,
              "pycache_prefix": sys.pycache_prefix,
              "packages": {name: bytecode(name) for name in PACKAGES},
              "imports_s": [timed(IMPORTS, env) for _ in range(2)],
              "open": opened(env)}
    if args.pycache_prefix:
        env["PYTHONPYCACHEPREFIX"] = args.pycache_prefix
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        result["with_prefix"] = {"prefix": args.pycache_prefix,
                                 "imports_s": [timed(IMPORTS, env) for _ in range(2)]}
    for size in filter(None, args.premapped.split(",")):  # libtpu's pinned staging buffer
        result.setdefault("open_premapped", {})[size] = opened(
            {**env, "TPU_PREMAPPED_BUFFER_SIZE": size})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
