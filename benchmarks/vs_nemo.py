"""Training-step throughput side by side with NVIDIA NeMo Automodel's PyTorch DeepSeek-V4.

For each shape (vocabulary, batch, sequence), in one sitting: NeMo's step (a peer script,
nemo_dsv4_step.py, that trains the deepseek4-tiny model in NeMo's config, fp32, AdamW, gate-bias
update and aux loss on, and writes its median step time as JSON) and this project's step
(benchmarks/model_step.py: deepseek4-tiny on synthetic tokens, fp32, the default recipe's
Quantile Balancing and sequence loss), each in a fresh process. Prints one JSON line describing
the machine (CPU model, cores this process may use, the thread settings both sides inherit), then
one per shape with both tokens/s and their ratio: the ratio depends on the CPU (1.8x to 3.9x on
the machines of docs/performance.md), so quote it with the machine line.

The NeMo side is not part of this repository: it needs a NeMo Automodel environment of your own,
a Python with PyTorch and NeMo Automodel installed (--peer-python) and the peer script
(--nemo-script, or the environment variable MOEBALANCE_NEMO_SCRIPT; one of the two is required).
The script is called as `PEER_PYTHON SCRIPT --config maxtext-tiny --vocab V --batch B --seq S
--steps N --warmup 1 --bias-rate 0.001 --aux-coeff 0.0001 --json OUT` and must write
{"step_time_median_s": ...} to OUT.

    python benchmarks/vs_nemo.py --nemo-script PATH/nemo_dsv4_step.py [--steps 4]
    MOEBALANCE_NEMO_SCRIPT=PATH/nemo_dsv4_step.py python benchmarks/vs_nemo.py --peer-python PY
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPES = [(8192, 8, 256), (129280, 4, 256)]  # (vocabulary, batch, sequence)
# Environment variables that set either side's thread pools (XLA's, PyTorch's OpenMP and MKL).
THREAD_VARIABLES = ("XLA_FLAGS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TF_NUM_INTEROP_THREADS")


def cpu_model(cpuinfo: str) -> str:
    """The processor's name from /proc/cpuinfo's text ('model name', or 'Model' on Arm)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model") and value.strip():
            return value.strip()
    return platform.processor() or platform.machine()


def cpu_flags(cpuinfo: str) -> list[str]:
    """The vector extensions that decide matmul speed on x86 (AVX2, AVX-512, AMX), as listed."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return sorted(f for f in value.split() if f in ("avx2", "avx512f", "amx_tile"))
    return []


def machine() -> dict:
    """What the ratio depends on: the CPU, the cores this process may use, thread settings."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    return {"cpu": cpu_model(cpuinfo), "vector_flags": cpu_flags(cpuinfo),
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(),
            "threads": {name: os.environ.get(name) for name in THREAD_VARIABLES}}


def nemo(peer_python: str, script: Path, vocab: int, batch: int, seq: int, steps: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([peer_python, str(script), "--config", "maxtext-tiny", "--vocab",
                        str(vocab), "--batch", str(batch), "--seq", str(seq), "--steps",
                        str(steps + 1), "--warmup", "1", "--bias-rate", "0.001",
                        "--aux-coeff", "0.0001", "--json", out.name],
                       check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def ours(vocab: int, batch: int, seq: int, steps: int) -> dict:
    run = subprocess.run([sys.executable, str(HERE / "model_step.py"), "--batch", str(batch),
                          "--seq", str(seq), "--steps", str(steps), "--dtypes", "float32",
                          "dataset_type=synthetic", f"vocab_size={vocab}"],
                         check=True, capture_output=True, text=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer-python", default=str(Path.home() / ".peers/torch/bin/python"),
                        help="the Python of your NeMo Automodel environment (default: %(default)s)")
    parser.add_argument("--nemo-script", default=os.environ.get("MOEBALANCE_NEMO_SCRIPT"),
                        help="NeMo's one-step script, nemo_dsv4_step.py, from your NeMo "
                             "environment (default: $MOEBALANCE_NEMO_SCRIPT)")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if not args.nemo_script:
        parser.error("give --nemo-script PATH (or set MOEBALANCE_NEMO_SCRIPT): the NeMo peer "
                     "script is not part of this repository")
    print(json.dumps({"machine": machine()}), flush=True)
    for vocab, batch, seq in SHAPES:
        peer = nemo(args.peer_python, Path(args.nemo_script), vocab, batch, seq, args.steps)
        mine = ours(vocab, batch, seq, args.steps)
        nemo_tps = batch * seq / peer["step_time_median_s"]
        print(json.dumps({
            "vocab": vocab, "batch": batch, "seq": seq,
            "nemo_step_s": round(peer["step_time_median_s"], 3),
            "nemo_tokens_per_s": round(nemo_tps, 1), "moebalance_step_s": mine["step_s"],
            "moebalance_tokens_per_s": mine["tokens_per_s"],
            "moebalance_compile_s": mine["compile_s"],
            "ratio": round(mine["tokens_per_s"] / nemo_tps, 2)}), flush=True)


if __name__ == "__main__":
    main()
