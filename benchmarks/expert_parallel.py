"""Expert parallelism on 8 simulated CPU devices: step time per mesh layout, and what balance does
to the busiest expert-parallel rank.

Prints one JSON line per measurement:
  layout   the trainer's step (deepseek4-tiny, one global batch) on `data=8` (experts replicated,
           every device runs every expert on its own tokens), `expert=8` (each device holds E/8
           experts, tokens travel by all-to-all) and `expert=8` forced onto the worst-case buffer
           (ep_buffer_factor=0: the path a step takes when one device sends more than its
           fast-path share to one rank): compile time, mean step time, tokens/s, ratio to data=8.
  balance  `expert=8`, trained `--train-steps` steps without balancing (Run A) and with the
           config's recipe (Run B) from the same weights and batches: per step the mean and max
           over top-k layers of the busiest rank's assignments over the mean rank (1.0 = even),
           and the step time.

Simulated devices share the host's cores, so times compare layouts, not hardware.

    python benchmarks/expert_parallel.py [--config deepseek4-tiny] [--batch 8] [--seq 256]
                                         [--steps 3] [--train-steps 10] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from moebalance.config import load_config
from moebalance.data import batches
from moebalance.experiment import without_balancing
from moebalance.metrics import rank_loads
from moebalance.model.transformer import routed_layers
from moebalance.training import sharding
from moebalance.training.loop import build
from moebalance.training.step import make_train_step
from model_step import time_step  # this directory's step timer

LAYOUTS = {
    "data=8": ["ici_data_parallelism=8", "ici_fsdp_parallelism=1"],
    "expert=8": ["ici_fsdp_parallelism=1", "ici_expert_parallelism=8"],
    "expert=8 worst-case buffer": ["ici_fsdp_parallelism=1", "ici_expert_parallelism=8",
                                   "ep_buffer_factor=0"],
}


def setup(config, overrides, batch, seq):
    cfg = load_config(config, [*overrides, f"max_target_length={seq}",
                               f"per_device_batch_size={batch // jax.device_count()}"])
    mesh = sharding.make_mesh(cfg)
    data = batches(cfg)
    model, optimizer = build(cfg, mesh, data)
    return cfg, mesh, data, model, optimizer


def layout(name, config, overrides, batch, seq, steps):
    cfg, mesh, data, model, optimizer = setup(config, [*overrides, *LAYOUTS[name]], batch, seq)
    step = make_train_step(cfg, model, mesh)
    compile_s, step_s, _, _ = time_step(step, model, optimizer,
                                        sharding.global_batch(mesh, *data.batch(0)), steps)
    return {"bench": "layout", "layout": name, "mesh": dict(mesh.shape), "batch": batch,
            "seq": seq, "compile_s": round(compile_s, 2), "step_s": round(step_s, 3),
            "tokens_per_s": round(batch * seq / step_s, 1)}


def balance(run, config, overrides, batch, seq, train_steps):
    cfg, mesh, data, model, optimizer = setup(config, [*overrides, *LAYOUTS["expert=8"]],
                                              batch, seq)
    if run == "A":
        cfg = without_balancing(cfg)
    step = make_train_step(cfg, model, mesh)
    topk = routed_layers(model)
    ranks = mesh.shape["expert"]
    per_step = []
    for i in range(train_steps):
        start = time.perf_counter()
        inputs = sharding.global_batch(mesh, *data.batch(i))
        metrics = jax.device_get(step(model, optimizer, *inputs))
        imbalance = rank_loads(np.asarray(metrics["counts"])[topk], ranks)[1]
        per_step.append({"step": i, "step_s": round(time.perf_counter() - start, 3),
                         "mean": round(float(imbalance.mean()), 3),
                         "max": round(float(imbalance.max()), 3)})
    last = per_step[-1]
    return {"bench": "balance", "run": run, "ranks": ranks, "tokens_per_step": batch * seq,
            "final_mean_imbalance": last["mean"], "final_max_imbalance": last["max"],
            "steps": per_step}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deepseek4-tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout")
    parser.add_argument("--train-steps", type=int, default=10, help="steps of each balance run")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", 8)  # before the first use of a device
    results = {}
    for name in LAYOUTS:
        results[name] = layout(name, args.config, args.overrides, args.batch, args.seq, args.steps)
        results[name]["vs_data8"] = round(results["data=8"]["step_s"] / results[name]["step_s"], 3)
        print(json.dumps(results[name]), flush=True)
    runs = {run: balance(run, args.config, args.overrides, args.batch, args.seq, args.train_steps)
            for run in ("A", "B")}
    for run in runs.values():
        print(json.dumps(run), flush=True)
    print(json.dumps({"bench": "summary",
                      "expert8_vs_data8_speed": results["expert=8"]["vs_data8"],
                      "fast_path_speedup": round(
                          results["expert=8 worst-case buffer"]["step_s"]
                          / results["expert=8"]["step_s"], 3),
                      "busiest_rank_over_mean_A": runs["A"]["final_mean_imbalance"],
                      "busiest_rank_over_mean_B": runs["B"]["final_mean_imbalance"]}), flush=True)


if __name__ == "__main__":
    main()
