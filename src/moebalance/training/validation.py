"""Measuring a split: the cross-entropy and the expert counts of its first batches, summed.

`measure` is what `moebalance eval` runs on a checkpoint and what the trainer runs every
`eval_period` steps (`Validation`): the loss of the held-out split and its MaxVio_global, the
MaxVio of the counts accumulated over all the measured tokens (arXiv 2408.15664 Eq. 4).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import jax
import numpy as np

from moebalance import data
from moebalance.config import Config
from moebalance.metrics import maxvio_global
from moebalance.model.transformer import averages_biases, get_biases
from moebalance.training import sharding
from moebalance.training.calibration import biases_set_to
from moebalance.training.step import bind_model


def split_batches(cfg: Config, source, wanted: int | None = None) -> int:
    """How many global batches of `source` to measure: `wanted`, at most the whole split once
    (text); default the whole split, 4 batches of synthetic data (which has no end)."""
    if not source.num_rows:
        return wanted or 4
    whole = max(1, source.num_rows // (cfg.gradient_accumulation_steps * source.global_batch))
    return min(wanted or whole, whole)


def measure(eval_step, model, mesh, source, batches: int,
            on_batch: Callable[[int], None] | None = None) -> tuple[float, float, np.ndarray]:
    """(cross-entropy summed over the valid targets, their number, [n, L, E] int32 counts of
    each of the n micro-batches) over the first `batches` global batches of `source`, in order.
    Run by every process (collectives); the model is only read. `on_batch(done)` after each."""
    ce_sum = n_tokens = 0.0
    counts = []
    step = bind_model(eval_step, model)
    for i in range(batches):
        tokens, mask, seg = sharding.global_batch(mesh, *source.batch(i))
        for a in range(tokens.shape[0]):
            out = jax.device_get(step(tokens[a], mask[a], seg[a]))
            ce_sum += float(out["ce_sum"])
            n_tokens += float(out["tokens"])
            counts.append(np.asarray(out["counts"], np.int32))
        if on_batch is not None:
            on_batch(i + 1)
    return ce_sum, n_tokens, np.stack(counts)


class Validation:
    """The trainer's periodic validation: after every `cfg.eval_period`-th step and the last, the
    same first `cfg.eval_batches` batches of the held-out split at the current weights."""

    def __init__(self, cfg: Config, mesh, eval_step):
        self.cfg, self.mesh, self.eval_step = cfg, mesh, eval_step
        self.source = data.batches(cfg, "eval") if cfg.eval_period else None
        self.batches = split_batches(cfg, self.source, cfg.eval_batches) if self.source else 0

    def due(self, step: int) -> bool:
        """Whether the weights after step `step` are validated."""
        period = self.cfg.eval_period
        return bool(period) and ((step + 1) % period == 0 or step + 1 == self.cfg.steps)

    def attach(self, record: dict, model) -> None:
        """Add `validation` to the record of a step that is `due`."""
        if self.due(record["step"]):
            record["validation"] = self(model)

    def __call__(self, model) -> dict:
        """{loss, perplexity, tokens, maxvio_global: [per layer]} of the held-out batches, routed
        with the biases the run keeps: their running mean where the run averages them."""
        kept = get_biases(model, "bias_average") if averages_biases(model) else None
        with biases_set_to(model, kept) if kept is not None else contextlib.nullcontext():
            ce_sum, n_tokens, counts = measure(self.eval_step, model, self.mesh, self.source,
                                               self.batches)
        loss = ce_sum / n_tokens
        return {"loss": loss, "perplexity": math.exp(loss) if math.isfinite(loss) else loss,
                "tokens": int(n_tokens), "maxvio_global": maxvio_global(counts).tolist()}
