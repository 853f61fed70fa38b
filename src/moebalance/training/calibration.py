"""The biases at the final weights: the refit (the best a bias does on given data) and the
calibration a run applies after its last step.

    refit_biases(cfg, model, mesh, source, first, batches)   -> [L_routed, E] fitted biases
    calibrated_biases(cfg, model, mesh, source, first, batches) -> one Jacobi step towards them
    biases_set_to(model, biases)                              a block that routes with them
    calibrate_biases(cfg, model, mesh, train_data, batches)   the run's own biases := the fit
    first_unused_batch(cfg)                                   where a judging refit starts
    probe_counts(eval_step, model, probes)                    -> [n, L, E] counts of the probe set
    final_probe(cfg, model, mesh, eval_step, probes, train_data) -> the probe set's counts at the end
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from moebalance import balancing
from moebalance.config import Config
from moebalance.model.transformer import DeepSeekV4, get_biases, routed_layers, set_biases
from moebalance.training import sharding
from moebalance.training.step import bind_model, make_fit_step, make_score_step

# One program for the calibration's fit: run eagerly, its bisection loop (a lax.fori_loop) was
# compiled anew on every call, ~1.3 s each time on a loaded 2-core CPU.
_quantile_fit = jax.jit(balancing.quantile_bias, static_argnums=2)


def fit_tokens(mesh, source, first: int, batches: int) -> tuple[list, list]:
    """The micro-batches of `batches` batches of `source` from batch `first` on: their tokens
    [B, S+1] and segment ids [B, S], in order, as two lists."""
    tokens, segment_ids = [], []
    for i in range(first, first + batches):
        batch_tokens, _, batch_segments = sharding.global_batch(mesh, *source.batch(i))
        tokens += list(batch_tokens)
        segment_ids += list(batch_segments)
    return tokens, segment_ids


def refit_biases(cfg: Config, model: DeepSeekV4, mesh, source, first: int,
                 batches: int) -> jax.Array:
    """[L_routed, E] float32: the top-k biases that balance `batches` batches of `source` (from
    batch `first` on) at the model's current weights, i.e. what a perfectly estimated bias would
    be on that data: its fixed point, reached in one forward pass over all their tokens at once
    (make_fit_step), since a block's scores depend only on the earlier blocks' biases. The
    model's own biases are left unchanged."""
    tokens, segment_ids = fit_tokens(mesh, source, first, batches)
    return make_fit_step(cfg, model, mesh)(model, jnp.concatenate(tokens),
                                           jnp.concatenate(segment_ids))


def calibrated_biases(cfg: Config, model: DeepSeekV4, mesh, source, first: int, batches: int,
                      iterations: int = 1) -> jax.Array:
    """[L_routed, E] float32: `iterations` undamped Quantile Balancing fits of every top-k block
    at once on the scores of all the tokens of `batches` batches of `source` (from batch `first`
    on), routed by the previous fit's biases (the first by the model's own): Jacobi steps
    towards `refit_biases`. The model's own biases are put back unchanged."""
    score_step = bind_model(make_score_step(cfg, model, mesh), model)
    tokens, segment_ids = fit_tokens(mesh, source, first, batches)
    fit = get_biases(model)
    for _ in range(iterations):
        with biases_set_to(model, fit):
            scores = jnp.concatenate([score_step(t, s) for t, s in zip(tokens, segment_ids)],
                                     axis=1)
        fit = _quantile_fit(scores, fit, cfg.num_experts_per_tok)
    return fit


@contextlib.contextmanager
def biases_set_to(model: DeepSeekV4, biases: jax.Array):
    """The top-k blocks use `biases` [L_routed, E] inside the block; their own come back after it,
    also when it raises."""
    trained = get_biases(model)
    set_biases(model, biases)
    try:
        yield
    finally:
        set_biases(model, trained)


def calibration_batches(cfg: Config, model: DeepSeekV4) -> int:
    """How many fresh training batches a run calibrates its biases on after the last step
    (`routed_bias_calibration_batches`; 0 for runs without routed_bias or top-k blocks)."""
    if not (cfg.routed_bias and routed_layers(model)):
        return 0
    return cfg.routed_bias_calibration_batches


def refits(cfg: Config, model: DeepSeekV4) -> bool:
    """Whether a run measures its probe set with refitted biases too (`probe_refit_batches`)."""
    return bool(cfg.probe_refit_batches and cfg.routed_bias and routed_layers(model))


def first_unused_batch(cfg: Config) -> int:
    """The first training batch that neither the steps nor the calibration saw: where a refit
    that judges the run's biases starts."""
    return cfg.steps + (cfg.routed_bias_calibration_batches if cfg.routed_bias else 0)


def calibrate_biases(cfg: Config, model: DeepSeekV4, mesh, train_data, batches: int) -> None:
    """After the last step: set every top-k bias to the one that balances the next `batches`
    training batches (fresh: batches steps .. steps + batches - 1, which no step trained on) at
    the final weights, one undamped fit per block on all their tokens (`calibrated_biases`). The
    online rule fits each batch with the weights of its own step, which lag behind the router,
    and can only average few batches; this fit sees many batches as the final weights route
    them, and, like the data the model will meet, none it was trained on (docs/results.md,
    issue 27: on the run's own last batches it was up to 1.3x worse than on fresh ones)."""
    set_biases(model, calibrated_biases(cfg, model, mesh, train_data, cfg.steps, batches))


def probe_counts(eval_step, model: DeepSeekV4, probes: list[tuple]) -> np.ndarray:
    """[n, L, E] int32: each probe micro-batch's expert counts at the model's current biases."""
    step = bind_model(eval_step, model)
    return np.stack([np.asarray(jax.device_get(step(*p)["counts"]), np.int32) for p in probes])


def final_probe(cfg: Config, model: DeepSeekV4, mesh, eval_step, probes, train_data) -> dict:
    """After the last step: calibrate the biases (when the run does) and measure the probe set
    ([n, L, E] counts each): {"counts": with the run's final biases, "online": with the online
    rule's bias before the calibration (or None), "refit": with refitted biases (or None)}, and
    "calibration": the number of batches calibrated on (0: none)."""
    online, calibration = None, calibration_batches(cfg, model)
    if calibration:
        online = probe_counts(eval_step, model, probes)
        calibrate_biases(cfg, model, mesh, train_data, calibration)
    counts, refit = probe_counts(eval_step, model, probes), None
    if refits(cfg, model):
        with biases_set_to(model, refit_biases(cfg, model, mesh, train_data,
                                               first_unused_batch(cfg), cfg.probe_refit_batches)):
            refit = probe_counts(eval_step, model, probes)
    return {"counts": counts, "online": online, "refit": refit,
            "calibration": calibration}
