"""Which data should the bias be calibrated on after the last step? Measured on a finished run.

Loads RUN_DIR's latest checkpoint (a run trained with `routed_bias_calibration_batches=0`, so its
biases are the online rule's) and measures its probe set (the first `--probe-batches` held-out
micro-batches) with each candidate bias: the online one; refitted (training.calibration.
calibrated_biases) on the run's last N training batches (already trained on), or on N fresh
training batches (the next ones the run would train on), with 1 or more iterations; and, as the
reference, the refit (refit_biases, its fixed point) on as many fresh batches disjoint from the
candidates'. Per candidate:
the mean and std over the probe set of the variance summed over the top-k layers, / the sampling
floor, / the reference refit of the same size. JSON on stdout.

    python tools/calibration_study.py RUN_DIR [--probe-batches 16] [--sizes 16,32]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from moebalance import data
from moebalance.metrics import load_stats, sampling_floor
from moebalance.model.transformer import routed_layers
from moebalance.rundir import RunDir
from moebalance.training import checkpoint, sharding
from moebalance.training.calibration import (biases_set_to, calibrated_biases, probe_counts,
                                             refit_biases)
from moebalance.training.loop import build, probe_set
from moebalance.training.step import make_eval_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--probe-batches", type=int, default=16)
    parser.add_argument("--sizes", default="16,32", help="batches per fit, comma-separated")
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]

    run = RunDir(args.run)
    cfg = dataclasses.replace(run.config(), probe_batches=args.probe_batches)
    mesh = sharding.make_mesh(cfg)
    train_data = data.batches(cfg, "train")
    model, optimizer = build(cfg, mesh, train_data)
    step = checkpoint.restore_latest(run.checkpoints, model, optimizer)
    eval_step = make_eval_step(cfg, model, mesh)
    probes = probe_set(cfg, mesh)
    topk = routed_layers(model)
    floor = sampling_floor(probes[0][1].size, cfg.num_experts_per_tok,
                           cfg.num_experts) * len(topk)

    def judge(biases=None) -> np.ndarray:  # [n] summed top-k variance per probe micro-batch
        if biases is None:
            counts = probe_counts(eval_step, model, probes)
        else:
            with biases_set_to(model, biases):
                counts = probe_counts(eval_step, model, probes)
        return load_stats(counts)["variance"][:, topk].sum(-1)

    # candidates: name -> (first batch, batches, iterations); fresh ones start at `step`, the
    # references come after every candidate's batches
    candidates = {f"trained {min(n, step)}, 1 it": (step - min(n, step), min(n, step), 1)
                  for n in sizes[:1]}
    for n in sizes:
        candidates[f"fresh {n}, 1 it"] = (step, n, 1)
        candidates[f"fresh {n}, 2 it"] = (step, n, 2)
    after = step + max(sizes)
    references = {}
    for n in sizes:
        references[n] = (after, n)
        after += n

    results = {"run": str(args.run), "step": step, "probe_batches": len(probes),
               "floor": floor, "candidates": {}}
    online = judge()
    results["candidates"]["online"] = {"mean": float(online.mean()), "std": float(online.std())}
    refit_means = {}
    for n, (first, batches) in references.items():
        start = time.perf_counter()
        v = judge(refit_biases(cfg, model, mesh, train_data, first, batches))
        refit_means[n] = float(v.mean())
        results["candidates"][f"reference refit {n} (batches {first}-{first + n - 1})"] = {
            "mean": float(v.mean()), "std": float(v.std()),
            "seconds": round(time.perf_counter() - start, 1)}
    for name, (first, batches, iterations) in candidates.items():
        start = time.perf_counter()
        v = judge(calibrated_biases(cfg, model, mesh, train_data, first, batches, iterations))
        results["candidates"][name] = {"mean": float(v.mean()), "std": float(v.std()),
                                       "vs_reference": float(v.mean()) / refit_means[
                                           min(refit_means, key=lambda n: abs(n - batches))],
                                       "seconds": round(time.perf_counter() - start, 1)}
    for row in results["candidates"].values():
        row["vs_floor"] = row["mean"] / floor
        row["vs_online"] = row["mean"] / results["candidates"]["online"]["mean"]
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
