"""The planner's activation estimate (training/plan.py) against XLA's compiled memory analysis.

For each config (deepseek4-smoke with the given overrides) and remat policy, on one CPU device:
the temporary bytes XLA allocates for the gradient of one micro-batch's loss (`temp_size_in_bytes`
of `jax.jit(jax.grad(loss)).lower(...).compile().memory_analysis()`: every buffer that is not an
input or output, i.e. the activations and the backward's working set) next to the planner's
activations. Compiles only, runs nothing. Prints one JSON line per case.

    python benchmarks/plan_vs_xla.py ["key=value key=value" ...]   (one quoted string per config)
"""

from __future__ import annotations

import json
import sys
import time

import jax

from moebalance.config import load_config
from moebalance.training import plan

CONFIGS = ["", "max_target_length=256 per_device_batch_size=4",
           "max_target_length=256 per_device_batch_size=2 base_emb_dim=128 num_experts=16 "
           "dtype=bfloat16"]


def xla_temp_bytes(cfg) -> int:
    """XLA's temporary bytes for d loss / d params of one micro-batch on one device."""
    loss, inputs = plan.loss_and_inputs(cfg, plan.abstract_model(cfg), cfg.per_device_batch_size)
    return jax.jit(jax.grad(loss)).lower(*inputs).compile().memory_analysis().temp_size_in_bytes


def main(configs: list[str]) -> None:
    for overrides in configs:
        # the planner traces the GPUs' blocked dispatch: compile the same here
        cfg = load_config("deepseek4-smoke", ["moe_dispatch=blocked", *overrides.split()])
        planned = plan.plan(cfg, 1)
        for remat in ("none", "full"):
            start = time.perf_counter()
            xla = xla_temp_bytes(plan.traced_config(cfg, remat))
            print(json.dumps({"overrides": overrides, "remat": remat, "xla_temp": xla,
                              "planned": planned.activations[remat],
                              "planned / xla": round(planned.activations[remat] / xla, 3),
                              "compile_s": round(time.perf_counter() - start, 1)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or CONFIGS)
