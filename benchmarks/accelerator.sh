#!/usr/bin/env bash
# The accelerator check of issue 28 (docs/performance.md: On one GPU) as one script, for a
# machine with one GPU and the GPU image's Python (3.12, JAX 0.11.2, its Flax), no registry:
#   0. the MoE layer alone (moe_layer.py) at d1024's expert shape (64 experts top-6, 1024 x 512)
#      and the Flash slice's (16 top-6, 4096 x 2048), 16,384 bf16 tokens, with each kernel below,
#   1. the training step of benchmarks/configs/deepseek4-d1024.yml (1.1B parameters, 0.25B
#      active, V = 129280, bf16, 8 x 2048 tokens, blocked experts) with each expert-matmul
#      kernel in turn: `xla` (each block's weights picked, then batched matmuls; `auto` on GPUs) and
#      `pallas` (the grouped-matmul kernels of kernels/triton.py, Triton),
#   2. the step of benchmarks/configs/deepseek4-flash-slice.yml (V4-Flash's layer width, nine
#      layers, the 16 experts one device holds under expert parallelism, 1 x 4096 tokens, full
#      remat; 128.2 GiB planned) with the kernel that was faster in 1,
#   each appended to the record $OUT/h200.json (model_step.py --record; commit it as
#   benchmarks/results/h200.json) with its JSON lines in $OUT/d1024.json, $OUT/flash-slice.json,
#   3. profile_step.py on the d1024 step with that kernel: device time by part of the step
#      ($OUT/profile-d1024.json, its tables in $OUT/log.txt).
# Each part has its own time limit (a d1024 part spent ~45 s initialising and ~80 s compiling on
# an H200 on 2026-12-04) so that one slow part cannot take the others with it: 510 s in
# all. Logs go to $OUT/log.txt (default OUT=/tmp/accelerator).
# What the image lacks (grain and what it imports, tensorboardX) comes as wheels in .whl/, made
# here by benchmarks/gpu_wheels.sh and carried by the device tool (`carry: [".whl"]`); they are
# installed into /tmp/site. The log also says whether `pip install -e .` would resolve there.
#
#     bash benchmarks/accelerator.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/accelerator}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-.95}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
D1024=benchmarks/configs/deepseek4-d1024.yml
SLICE=benchmarks/configs/deepseek4-flash-slice.yml
NOTES="benchmarks/accelerator.sh; XLA_PYTHON_CLIENT_MEM_FRACTION=$XLA_PYTHON_CLIENT_MEM_FRACTION"
# what pyproject.toml names and the image may hold in other versions
PACKAGES="jax|jaxlib|flax|optax|orbax-checkpoint|numpy|ml.dtypes|pyyaml|rich|grain|tokenizers"
PACKAGES="$PACKAGES|tensorboardx|matplotlib|pyarrow|protobuf|setuptools"

. benchmarks/parts.sh  # log, part

if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | log
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | log
python3 --version | log
python3 -m pip list 2>/dev/null | grep -iE "^($PACKAGES)\s" | log
timeout 30 python3 -m pip install --dry-run --no-index --no-build-isolation --find-links .whl \
    -e . 2>&1 | tail -n 2 | log
part 60 moe-layer python3 benchmarks/moe_layer.py --tokens 16384 --repeats 10 --dtype bfloat16 \
    --dispatch blocked --kernels xla,pallas --shapes 64:6:1024:512,16:6:4096:2048 --only-shapes
part 220 d1024 python3 benchmarks/model_step.py --config "$D1024" --batch 8 --seq 2048 \
    --steps 5 --dtypes bfloat16 --kernels xla,pallas --record "$OUT/h200.json" --notes "$NOTES"
KERNEL=$(python3 -c 'import json, sys
runs = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
print(min(runs, key=lambda r: r["step_s"])["overrides"][-1].split("=")[1] if runs else "xla")' \
    "$OUT/d1024.json" 2>> "$OUT/log.txt" || echo xla)
echo "== the faster expert kernel: $KERNEL" | log
part 140 flash-slice python3 benchmarks/model_step.py --config "$SLICE" --batch 1 --seq 4096 \
    --steps 3 --dtypes bfloat16 --record "$OUT/h200.json" --notes "$NOTES" "moe_kernel=$KERNEL"
part 90 profile-d1024 python3 benchmarks/profile_step.py --config "$D1024" --batch 8 \
    --seq 2048 --steps 1 --top 25 "moe_kernel=$KERNEL"
cat "$OUT/moe-layer.json" "$OUT/d1024.json" "$OUT/flash-slice.json" "$OUT/profile-d1024.json"
