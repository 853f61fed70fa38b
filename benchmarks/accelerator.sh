#!/usr/bin/env bash
# Issue 14's accelerator check as one script, for a machine with one GPU and JAX for it installed:
# the step of benchmarks/configs/deepseek4-d1024.yml (1.1B parameters, 0.25B active, V = 129280,
# bf16, 8 x 2048 tokens) with the automatic expert layout (ragged_dot off the CPU) and with the
# CPU's blocked layout, the MoE layer alone in both layouts at that model's shape, and the CPU
# recipe's model (deepseek4-tiny, fp32, 8 x 256) for scale. Each part has its own time limit so
# that one slow part cannot take the others with it. Logs go to $OUT (default /tmp/accelerator).
#
#     PYTHONPATH=src bash benchmarks/accelerator.sh
set -u
OUT=${OUT:-/tmp/accelerator}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
D1024=benchmarks/configs/deepseek4-d1024.yml

part() {  # part SECONDS COMMAND...: run it under a time limit, appending to $OUT/log.txt
    local limit=$1
    shift
    echo "== $* (limit ${limit} s)" | tee -a "$OUT/log.txt"
    timeout "$limit" "$@" 2>&1 | tee -a "$OUT/log.txt"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee -a "$OUT/log.txt"
python3 -c "import sys, jax, flax, optax; print(sys.version.split()[0], 'jax', jax.__version__,
'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" 2>&1 | tee -a "$OUT/log.txt"
part 200 python3 benchmarks/model_step.py --config "$D1024" --batch 8 --seq 2048 --steps 10 \
    --dtypes bfloat16
part 70 python3 benchmarks/moe_layer.py --tokens 16384 --repeats 10 --dtype bfloat16 \
    --dispatch ragged,blocked --shapes 64:6:1024:512 --only-shapes
part 100 python3 benchmarks/model_step.py --config "$D1024" --batch 8 --seq 2048 --steps 5 \
    --dtypes bfloat16 moe_dispatch=blocked
part 60 python3 benchmarks/model_step.py --batch 8 --seq 256 --steps 10 --dtypes float32 \
    dataset_type=synthetic
