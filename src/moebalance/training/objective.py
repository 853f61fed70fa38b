"""What a training step computes, whichever programs run it (the one program of training/step.py,
or the chains of training/chain.py): the loss and its logged terms, the evaluation's sums, and the
update after the micro-batches.

    for each micro-batch a:       loss_a, grads_a, counts_a = value_and_grad(loss)(params, batch_a)
    grads = mean_a grads_a;        counts = sum_a counts_a        (exact int32, whole global batch)
    params <- AdamW(clip(grads))  (warm-up + cosine; no decay on norms, scales, biases)
    bias   <- rule(bias, counts)  for every top-k routed block, AFTER the optimizer step; hash
                                  blocks have no bias; the optimizer never sees it (wrt=nnx.Param)
    mean   <- Polyak(mean, bias)  where routed_bias_average_fraction > 0; after the last step
                                  bias <- mean (balancing.average_bias)

Loss = CE (+ mtp_loss_scaling_factor * MTP CE) + the configured balance losses, each computed once
from the model's routing records and logged apart. Balance losses are summed over the top-k routed
blocks (DeepSeek applies alpha per layer); mode 'maxtext' averages them over blocks, as MaxText does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from moebalance import balancing
from moebalance.config import Config
from moebalance.model.expert_parallel import active_mesh
from moebalance.model.transformer import (DeepSeekV4, ModelOutput, averages_biases, get_biases,
                                          set_biases)
from moebalance.training import sharding
from moebalance.training.cross_entropy import token_cross_entropy


def lr_schedule(cfg: Config) -> optax.Schedule:
    warmup = int(cfg.warmup_steps_fraction * cfg.steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else cfg.learning_rate, peak_value=cfg.learning_rate,
        warmup_steps=warmup, decay_steps=max(cfg.steps, warmup + 1),
        end_value=cfg.learning_rate * cfg.cosine_learning_rate_final_fraction,
    )


def head_vocab_axis(model: DeepSeekV4) -> str | None:
    """The mesh axis that splits the output head's vocabulary (training/sharding.py), if any."""
    mesh = active_mesh()
    if mesh is None:
        return None
    spec = sharding.param_spec(("head",), model.head.shape, mesh.shape["fsdp"],
                               mesh.shape["expert"])
    return spec[1] if len(spec) > 1 else None


@jax.named_scope("loss")
def token_ce(model: DeepSeekV4, hidden, targets):
    """hidden [..., D] (the head's input), targets [...] -> [...] float32 cross-entropy, without
    the full logits (cross_entropy)."""
    ce, _ = token_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), model.head[...],
                                targets.reshape(-1), precision=model.matmul_precision,
                                vocab_axis=head_vocab_axis(model))
    return ce.reshape(targets.shape)


def _masked_ce(model, hidden, targets, mask):
    return (token_ce(model, hidden, targets) * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def losses(cfg: Config, model: DeepSeekV4, tokens, mask, segment_ids, routed, weights=None):
    """tokens [B, S+1]; mask [B, S]: which targets count in the loss (not those that cross a
    document boundary); segment_ids [B, S]: packed documents; weights: the balance-loss weights
    (`switches`; default the config's). -> (total, aux dict). A balance loss is computed when the
    config's weight is positive and weighted by `weights`.

    Every input token is routed, counted and balanced (the data has no padding)."""
    mtp = tokens[:, 1:] if cfg.mtp_num_layers > 0 else None
    out = model(tokens[:, :-1], segment_ids=segment_ids, mtp_tokens=mtp)
    return loss_terms(cfg, model, out, tokens, mask, segment_ids, routed, weights)


def loss_terms(cfg: Config, model: DeepSeekV4, out: ModelOutput, tokens, mask, segment_ids,
               routed, weights=None):
    """`losses` from the model's output `out` on tokens[:, :-1] (with the MTP part where the
    config has one)."""
    weights = switches(cfg) if weights is None else weights
    targets = tokens[:, 1:]
    mtp = cfg.mtp_num_layers > 0
    m = mask.astype(jnp.float32)
    aux = {"ce": _masked_ce(model, out.hidden, targets, m)}
    total = aux["ce"]
    if mtp:  # position t predicts token t+2
        aux["mtp"] = _masked_ce(model, out.mtp_hidden[:, :-1], tokens[:, 2:],
                                m[:, :-1] * m[:, 1:])
        total = total + cfg.mtp_loss_scaling_factor * aux["mtp"]
    rec = out.routing
    idx = jnp.asarray(routed, jnp.int32)
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    if cfg.load_balance_loss_weight > 0:
        if cfg.sequence_loss_mode == "maxtext":
            per_layer = jax.vmap(lambda s, b, i: balancing.sequence_balance_loss(
                s, e, k, mode="maxtext", bias=b, indices=i))(
                rec.scores[idx], get_biases(model), rec.indices[idx])
            aux["sequence_loss"] = per_layer.mean()
        else:
            aux["sequence_loss"] = jax.vmap(lambda s: balancing.sequence_balance_loss(
                s, e, k, segment_ids=segment_ids))(rec.scores[idx]).sum()
        total = total + weights["load_balance_loss_weight"] * aux["sequence_loss"]
    if cfg.global_balance_loss_weight > 0:
        aux["global_loss"] = jax.vmap(lambda s, c: balancing.global_balance_loss(
            s, e, k, counts=c))(rec.scores[idx], rec.counts[idx]).sum()
        total = total + weights["global_balance_loss_weight"] * aux["global_loss"]
    if cfg.router_z_loss_weight > 0:
        aux["z_loss"] = jax.vmap(balancing.z_loss)(rec.logits).sum()
        total = total + cfg.router_z_loss_weight * aux["z_loss"]
    aux["counts"] = rec.counts  # [L, E] int32, every block
    if cfg.routed_bias_update_rule == "quantile":
        aux["scores"] = rec.scores[idx]  # [L_routed, B, S, E]
    return total, aux


def base_bias_rate(cfg: Config) -> float:
    """The bias rate a run starts from: `routed_bias_update_rate`, the rule's default where it is
    negative, 0 without a routed bias."""
    if not cfg.routed_bias:
        return 0.0
    rate = cfg.routed_bias_update_rate
    return balancing.DEFAULT_RATES[cfg.routed_bias_update_rule] if rate < 0 else rate


def bias_rate_fraction(cfg: Config, step):
    """The bias rate at `step` as a fraction of its base rate: its cosine decay and its freeze."""
    freeze = cfg.routed_bias_freeze_step if cfg.routed_bias_freeze_step >= 0 else None
    return balancing.rate_schedule(1.0, freeze, decay_steps=max(cfg.steps - 1, 1),
                                   final_fraction=cfg.routed_bias_update_rate_final_fraction)(step)


def bias_rate(cfg: Config, step):
    return base_bias_rate(cfg) * bias_rate_fraction(cfg, step)


# The config keys in which Run A of the A/B experiment differs from Run B. A step takes their
# values as traced arguments, so that runs differing only in them share one compiled program.
SWITCHES = ("routed_bias", "routed_bias_update_rate", "load_balance_loss_weight",
            "global_balance_loss_weight")


def switches(cfg: Config) -> dict[str, jax.Array]:
    """The traced values of a run's SWITCHES: `bias`, its base bias rate (0: off), which the
    program's schedule scales step by step."""
    return {"bias": jnp.float32(base_bias_rate(cfg)),
            "load_balance_loss_weight": jnp.float32(cfg.load_balance_loss_weight),
            "global_balance_loss_weight": jnp.float32(cfg.global_balance_loss_weight)}


def apply_gradients(cfg: Config, routed, model, optimizer, grads, loss, aux, values) -> dict:
    """The step after its micro-batches: grads and loss summed over them, aux their `losses`
    terms stacked on a leading micro-batch axis A -> the step's metrics; AdamW on the mean
    gradient, then the bias update, in place."""
    micro_batches = aux["counts"].shape[0]
    grads = jax.tree.map(lambda g: g / micro_batches, grads)
    counts = aux.pop("counts").sum(0)  # [L, E] exact int32 over the whole step
    scores = aux.pop("scores", None)
    metrics = {name: value.mean() for name, value in aux.items()}
    metrics.update(loss=loss / micro_batches, grad_norm=optax.tree.norm(grads),
                   lr=lr_schedule(cfg)(optimizer.step[...]), counts=counts)
    step = optimizer.step[...]
    rate = values["bias"] * bias_rate_fraction(cfg, step)
    with jax.named_scope("optimizer"):
        optimizer.update(model, grads)
    with jax.named_scope("bias_update"):
        update_biases(cfg, model, routed, counts, scores, rate, metrics, step)
    return metrics


def update_biases(cfg: Config, model: DeepSeekV4, routed, counts, scores, rate, metrics, step):
    """The bias update of the top-k blocks after the optimizer step `step` (records `bias` in
    metrics); where the run averages its biases, their running mean too, which after the last
    step becomes the bias the run keeps."""
    if not routed:
        return
    biases = get_biases(model)
    if cfg.routed_bias_update_rule == "quantile":
        new = balancing.quantile_bias(scores.swapaxes(0, 1), biases,  # [L_routed, A, ..., E]
                                      cfg.num_experts_per_tok, rate=rate)
    else:
        new = balancing.update_bias(biases, counts[jnp.asarray(routed)],
                                    rule=cfg.routed_bias_update_rule, rate=rate)
    if averages_biases(model):
        average = balancing.average_bias(
            get_biases(model, "bias_average"), new, step,
            balancing.average_start(cfg.steps, cfg.routed_bias_average_fraction))
        set_biases(model, average, "bias_average")
        new = jnp.where(step + 1 == cfg.steps, average, new)
    set_biases(model, new)
    metrics["bias"] = new


def evaluation_sums(model: DeepSeekV4, out: ModelOutput, tokens, mask) -> dict:
    """make_eval_step's result from the model's output on tokens[:, :-1]: the masked
    cross-entropy sum, the tokens it counts and every block's expert counts."""
    ce = token_ce(model, out.hidden, tokens[:, 1:])
    m = mask.astype(jnp.float32)
    return {"ce_sum": (ce * m).sum(), "tokens": m.sum(), "counts": out.routing.counts}
