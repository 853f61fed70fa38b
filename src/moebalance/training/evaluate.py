"""`moebalance eval`: a run's latest checkpoint measured on one split, the run left untouched."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from moebalance import data
from moebalance.metrics import maxvio_global, summed_variance_spread
from moebalance.model.transformer import routed_layers
from moebalance.rundir import RunDir
from moebalance.training import checkpoint, sharding
from moebalance.training.calibration import biases_set_to, first_unused_batch, refit_biases
from moebalance.training.loop import build
from moebalance.training.step import make_eval_step
from moebalance.training.validation import measure as measure_split
from moebalance.training.validation import split_batches


def evaluate(run_dir: Path, batches: int | None = None, split: str = "eval",
             refit_batches: int = 0,
             on_batch: Callable[[str, int, int], None] | None = None) -> dict:
    """Loss, perplexity and per-layer MaxVio_global of the run's latest checkpoint on a split.

    `batches` batches of `split` (default: the whole split once for text, 4 for synthetic data;
    'train' measures balance on the distribution the bias was fitted to, 'eval' on held-out
    text). Counts are accumulated over all of them before MaxVio is taken. With `refit_batches`,
    each layer also gets `maxvio_global_refit`: the same measurement with the top-k biases
    refitted to balance that many fresh training batches (`refit_biases`), i.e. what a perfectly
    estimated bias would reach on this data. With top-k blocks, `variance` (and `variance_refit`)
    is the judge of the probe set over the measured micro-batches: the variance summed over the
    top-k layers per micro-batch, its mean, std, min and max. Nothing is written to the run; its
    bias is only read. `on_batch(phase, done, total)`, if given, is called after each global batch
    of each pass ('measuring', then 'with refitted biases'): the progress of a long evaluation.
    """
    if (batches is not None and batches < 1) or refit_batches < 0:
        raise ValueError(f"evaluate needs batches >= 1 and refit_batches >= 0, got {batches} and "
                         f"{refit_batches}")
    run = RunDir(run_dir)
    cfg = run.config()
    mesh = sharding.make_mesh(cfg)
    source = data.batches(cfg, split)
    batches = batches or split_batches(cfg, source)
    model, optimizer = build(cfg, mesh, restoring=True)  # the hash tables come from it too
    step = checkpoint.restore_latest(run.checkpoints, model, optimizer)
    eval_step = make_eval_step(cfg, model, mesh)

    def measure(phase):  # -> (CE summed over the valid targets, their number, [n, L, E] counts)
        report = None if on_batch is None else (lambda done: on_batch(phase, done, batches))
        return measure_split(eval_step, model, mesh, source, batches, report)

    ce_sum, n_tokens, counts = measure("measuring")
    loss = ce_sum / n_tokens
    if not math.isfinite(loss):
        raise FloatingPointError(f"{run.checkpoints / str(step)} gives the loss {loss}: its "
                                 "weights are not finite (a run that diverged before the trainer "
                                 "checked its gradients); resume from an earlier checkpoint")
    routed = routed_layers(model)
    layers = [{"layer": i, "routing": "topk" if i in routed else "hash",
               "maxvio_global": float(m)} for i, m in enumerate(maxvio_global(counts))]
    result = {"step": step, "split": split, "loss": loss, "perplexity": math.exp(loss),
              "tokens": int(n_tokens), "batches": batches, "layers": layers}
    if routed:
        result["variance"] = summed_variance_spread(counts, routed)
    if refit_batches and routed:
        with biases_set_to(model, refit_biases(cfg, model, mesh, data.batches(cfg, "train"),
                                               first_unused_batch(cfg), refit_batches)):
            refit_counts = measure("with refitted biases")[2]
        for row, m in zip(layers, maxvio_global(refit_counts)):
            row["maxvio_global_refit"] = float(m)
        result["variance_refit"] = summed_variance_spread(refit_counts, routed)
    return result
