#!/usr/bin/env bash
# The accelerator check (docs/performance.md: On one GPU) as one script, for a machine with one GPU
# and JAX for it installed: the step of benchmarks/configs/deepseek4-d1024.yml (1.1B parameters,
# 0.25B active, V = 129280, bf16, 8 x 2048 tokens) with the automatic expert layout (blocked on a
# GPU), the MoE layer alone in both layouts at that model's shape, and the step with the ragged
# layout (jax.lax.ragged_dot).
# Each part has its own time limit (a part spends ~45 s initialising and ~80 s compiling on an
# H200) so that one slow part cannot take the others with it; about 9 minutes in all. Logs go to
# $OUT (default /tmp/accelerator). Needs the package's dependencies beside the GPU's JAX.
#
#     PYTHONPATH=src bash benchmarks/accelerator.sh
set -u
OUT=${OUT:-/tmp/accelerator}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-.95}
D1024=benchmarks/configs/deepseek4-d1024.yml

part() {  # part SECONDS COMMAND...: run it under a time limit, appending to $OUT/log.txt
    local limit=$1
    shift
    echo "== $* (limit ${limit} s)" | tee -a "$OUT/log.txt"
    timeout "$limit" "$@" 2>&1 | tee -a "$OUT/log.txt"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
    | tee -a "$OUT/log.txt"
python3 -c "import sys, jax, flax, optax; print(sys.version.split()[0], 'jax', jax.__version__,
'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" 2>&1 | tee -a "$OUT/log.txt"
part 240 python3 benchmarks/model_step.py --config "$D1024" --batch 8 --seq 2048 --steps 10 \
    --dtypes bfloat16
part 90 python3 benchmarks/moe_layer.py --tokens 16384 --repeats 10 --dtype bfloat16 \
    --dispatch ragged,blocked --block-sizes 256,512 --shapes 64:6:1024:512 --only-shapes
part 200 python3 benchmarks/model_step.py --config "$D1024" --batch 8 --seq 2048 --steps 5 \
    --dtypes bfloat16 moe_dispatch=ragged
