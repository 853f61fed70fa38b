"""The jitted training step: losses, gradients over micro-batches, AdamW, then the bias update.

    for each micro-batch a:       loss_a, grads_a, counts_a = value_and_grad(loss)(params, batch_a)
    grads = mean_a grads_a;        counts = sum_a counts_a        (exact int32, whole global batch)
    params <- AdamW(clip(grads))  (warm-up + cosine; no decay on norms, scales, biases)
    bias   <- rule(bias, counts)  for every top-k routed block, AFTER the optimizer step; hash
                                  blocks have no bias; the optimizer never sees it (wrt=nnx.Param)

Loss = CE (+ mtp_loss_scaling_factor * MTP CE) + the configured balance losses, each computed once
from the model's routing records and logged apart. Balance losses are summed over the top-k routed
blocks (DeepSeek applies alpha per layer); mode 'maxtext' averages them over blocks, as MaxText does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import types
import typing

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from moebalance import balancing
from moebalance.config import Config
from moebalance.model.layers import precision_scope
from moebalance.model.transformer import (DeepSeekV4, ModelOutput, get_biases, routed_layers,
                                          run_segment, set_biases)
from moebalance.training.cross_entropy import token_cross_entropy

NO_DECAY = ("weight", "scale", "base", "attn_sink", "ape")  # norms, hc scales/biases, sinks


def lr_schedule(cfg: Config) -> optax.Schedule:
    warmup = int(cfg.warmup_steps_fraction * cfg.steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else cfg.learning_rate, peak_value=cfg.learning_rate,
        warmup_steps=warmup, decay_steps=max(cfg.steps, warmup + 1),
        end_value=cfg.learning_rate * cfg.cosine_learning_rate_final_fraction,
    )


def decay_mask(params):
    """True for parameters that get weight decay: not norms, hc scales/biases, sinks, ape."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) not in NO_DECAY, params)


OPTIMIZER_KEYS = ("learning_rate", "warmup_steps_fraction", "steps",
                  "cosine_learning_rate_final_fraction", "adam_b1", "adam_b2", "adam_eps",
                  "adam_weight_decay", "gradient_clipping_threshold")


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """AdamW (+ clipping); one object per hyperparameter set, so that the optimizers of runs with
    the same hyperparameters are equal and share compiled steps (it is static in their graph)."""
    return _optimizer(tuple(getattr(cfg, key) for key in OPTIMIZER_KEYS))


def new_optimizer(cfg: Config, model: DeepSeekV4) -> nnx.Optimizer:
    """make_optimizer's optimizer of `model`, its state made by one compiled program (made
    eagerly, AdamW's zero moments compile a program for each new shape: 48 for deepseek4-tiny)."""
    return _initialiser(make_optimizer(cfg))(model)


@functools.cache
def _initialiser(tx: optax.GradientTransformation):
    def optimizer_init(model):
        return nnx.Optimizer(model, tx, wrt=nnx.Param)
    return nnx.jit(optimizer_init)


@functools.cache
def _optimizer(values: tuple) -> optax.GradientTransformation:
    hp = types.SimpleNamespace(**dict(zip(OPTIMIZER_KEYS, values)))
    adamw = optax.adamw(lr_schedule(hp), b1=hp.adam_b1, b2=hp.adam_b2, eps=hp.adam_eps,
                        weight_decay=hp.adam_weight_decay, mask=decay_mask)
    if hp.gradient_clipping_threshold > 0:
        return optax.chain(optax.clip_by_global_norm(hp.gradient_clipping_threshold), adamw)
    return adamw


@jax.named_scope("loss")
def token_ce(model: DeepSeekV4, hidden, targets):
    """hidden [..., D] (the head's input), targets [...] -> [...] float32 cross-entropy, without
    the full logits (cross_entropy)."""
    ce, _ = token_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), model.head[...],
                                targets.reshape(-1), precision=model.matmul_precision)
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


def schedule_changes(before: Config, after: Config, steps: int) -> list[str]:
    """The rates that follow a schedule of the step ("learning rate", "bias rate") whose values
    on steps 0 .. `steps` - 1 differ between `before` and `after`, e.g. a config and the same
    with another total `steps`. None: a run of `before` resumed after `steps` steps as `after`
    trains as a run of `after` from the start would (warm-up then a constant rate, when the
    warm-up is as many steps; a cosine, whose every value depends on the total, never)."""
    done = jnp.arange(steps)
    rates = {"learning rate": lambda cfg: lr_schedule(cfg)(done),
             "bias rate": lambda cfg: bias_rate(cfg, done)}
    return [name for name, rate in rates.items()
            if not jnp.array_equal(rate(before), rate(after))]


def on_mesh(fn, mesh):
    """`fn` run (and so traced) with `mesh` set, where the MoE layers find it; as is without.
    Like the jitted `fn`, the result has `.lower(*args)` (ahead.compile_ahead)."""
    if mesh is None:
        return fn

    @functools.wraps(fn)
    def run(*args):
        with jax.set_mesh(mesh):
            return fn(*args)

    def lower(*args):
        with jax.set_mesh(mesh):
            return fn.lower(*args)

    run.mesh, run.lower = mesh, lower
    return run


def bind_model(step, model):
    """`step` (make_eval_step's or make_score_step's) with `model` bound as its first argument by
    nnx.cached_partial, for loops that call it many times: each call then skips walking the
    model's graph (a call of deepseek4-tiny's evaluation step returned after 7.4 ms instead of 33
    on a 2-core CPU). The model's values may change between calls (the biases do), not its
    structure. A chain of programs (step_programs: segments) is bound with the model split once
    (its `.bind`; nnx.split took 5.9 ms a call there)."""
    if hasattr(step, "bind"):
        return step.bind(model)
    if not hasattr(step, "mesh"):  # no mesh: the jitted function itself
        return nnx.cached_partial(step, model)
    return on_mesh(nnx.cached_partial(step.__wrapped__, model), step.mesh)


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


def config_key(cfg: Config) -> str:
    """The config as one canonical JSON string: the key of what is kept per config (traced plans
    in training.plan; compiled steps by program_key)."""
    return json.dumps(dataclasses.asdict(cfg), sort_keys=True)


def program_key(program: Config) -> str:
    """config_key of what a program compiles: its bias rate and balance-loss weights only as on
    or off (1 or 0), since their values are passed at run time, so that programs that differ in
    them share one compiled step."""
    on = {key: float(getattr(program, key) > 0) for key in _LOSSES}
    return config_key(dataclasses.replace(program, routed_bias_update_rate=float(
        _uses_bias(program)), **on))


def chained(cfg: Config, mesh=None) -> bool:
    """Whether the config's steps run as chains of programs per model segment (`step_programs`:
    segments, or auto on a TPU, where XLA compiled deepseek4-tiny's one training program in 70-72 s
    on one of the host's cores; on a 2-core CPU its A/B took 269 s with one program against 285)."""
    if cfg.step_programs == "auto":
        devices = mesh.devices.flat if mesh is not None else jax.devices()
        return devices[0].platform == "tpu"
    return cfg.step_programs == "segments"


def make_train_step(cfg: Config, model: DeepSeekV4, mesh=None, program: Config | None = None):
    """-> step(model, optimizer, tokens [A, B, S+1], mask [A, B, S], segment_ids [A, B, S])
    returning a dict of metrics (scalars, `counts` [L, E] int32, `bias` [L_routed, E]).
    With a multi-device `mesh` the routed experts run per device (expert parallelism). A step
    updates model and optimizer in place and donates their previous arrays (deleted after it:
    copy any you want to keep, e.g. with np.asarray, before the step).

    program: the config the step is compiled for (default `cfg`); `cfg` may differ from it in
    SWITCHES only, whose values it passes at run time: with program = Run B's config, Run A runs
    Run B's compiled step with its balancing switched off (bias rate and loss weights 0).
    `step.lower(model, optimizer, tokens, mask, segment_ids)` lowers it without running it."""
    program = program or cfg
    _check_switchable(cfg, program)
    routed = tuple(routed_layers(model))
    values = switches(cfg)
    if chained(program, mesh):
        chain = _segment_steps(program_key(program), routed, mesh)

        def step(model, optimizer, tokens, mask, segment_ids):
            return chain(model, optimizer, tokens, mask, segment_ids, values)

        step.lower_programs = lambda emit, *args: chain.lower_programs(emit, *args, values)
        return step
    compiled = _train_step(program_key(program), routed, mesh)

    def step(model, optimizer, tokens, mask, segment_ids):
        return compiled(model, optimizer, tokens, mask, segment_ids, values)

    step.lower = lambda model, optimizer, *batch: compiled.lower(model, optimizer, *batch, values)
    return step


def lower_train_step(cfg: Config, model: DeepSeekV4, optimizer, tokens, mask, segment_ids,
                     mesh) -> jax.stages.Lowered:
    """make_train_step's jitted step lowered for these arguments, which may be abstract
    (`jax.ShapeDtypeStruct`s with shardings on a mesh of another platform's devices, e.g. a TPU
    topology's), without running it: `.compile().memory_analysis()` is XLA's memory plan of the
    trainer's own step (benchmarks/aot_memory.py)."""
    run = _train_step(program_key(cfg), tuple(routed_layers(model)), mesh)
    values = jax.eval_shape(lambda: switches(cfg))  # abstract: no array on the mesh's devices
    return run.lower(model, optimizer, tokens, mask, segment_ids, values)


# Keys that only shape the bias update: a config whose bias is off may differ from its program's.
BIAS_KEYS = ("routed_bias_update_rule", "routed_bias_freeze_step",
             "routed_bias_update_rate_final_fraction")
_LOSSES = ("load_balance_loss_weight", "global_balance_loss_weight")


def _uses_bias(cfg: Config) -> bool:
    return bool(cfg.routed_bias and cfg.routed_bias_update_rate != 0)


def _conflicts(cfg: Config, program: Config) -> list[str]:
    """The keys that keep `cfg` from running on `program`'s step: any but SWITCHES that differ
    (BIAS_KEYS too, where cfg's bias is on), a bias update other than the program's, a balance
    loss that the program does not compute."""
    free = SWITCHES + (() if _uses_bias(cfg) else BIAS_KEYS)
    differs = [f.name for f in dataclasses.fields(Config)
               if f.name not in free and getattr(cfg, f.name) != getattr(program, f.name)]
    if _uses_bias(cfg) and not _uses_bias(program):
        differs.append("routed_bias_update_rate")
    return differs + [key for key in _LOSSES if getattr(cfg, key) and not getattr(program, key)]


def _check_switchable(cfg: Config, program: Config) -> None:
    differs = _conflicts(cfg, program)
    if differs:
        raise ValueError(f"this config cannot run on a step compiled for another: {differs} "
                         "differ (a shared step switches the bias off and reweights its losses)")


def shared_programs(cfgs: list[Config]) -> list[Config]:
    """The program (make_train_step's `program`) of each config: configs that differ only in
    their balancing (SWITCHES, and BIAS_KEYS where the bias is off) share one, compiled once,
    with the bias update of its members' that use one and every balance loss any of them
    weights. E.g. no balancing, an auxiliary loss and a bias rule: one program."""
    groups: list[list[int]] = []
    for i in range(len(cfgs)):
        for members in groups:
            program = _program([cfgs[j] for j in [*members, i]])
            if not any(_conflicts(cfgs[j], program) for j in [*members, i]):
                members.append(i)
                break
        else:
            groups.append([i])
    programs = {j: _program([cfgs[m] for m in members]) for members in groups for j in members}
    return [programs[i] for i in range(len(cfgs))]


def _program(group: list[Config]) -> Config:
    """A group's program: the first biased config's (else the first's), computing every balance
    loss that any member weights (the weights themselves are run-time values)."""
    base = next((cfg for cfg in group if _uses_bias(cfg)), group[0])
    return dataclasses.replace(base, **{key: max(getattr(cfg, key) for cfg in group)
                                        for key in _LOSSES})


@functools.cache
def _train_step(key: str, routed: tuple[int, ...], mesh):
    """The jitted step of a program (`program_key`; one per program, mesh and model layout:
    jax.jit's cache)."""
    cfg = Config(**json.loads(key))
    routed = list(routed)

    # The model's and optimizer's buffers are donated: the step's new state takes their place
    # instead of a second copy of it (d1024 at 2 x 2048 on a TPU v5e, bf16 weights: 7.0 of the
    # 14.8 GiB XLA planned without it; docs/performance.md)
    @nnx.jit(donate_argnums=(0, 1))
    def step(model, optimizer, tokens, mask, segment_ids, values):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_of(params, tok, msk, seg):
            return losses(cfg, nnx.merge(graphdef, params, rest), tok, msk, seg, routed, values)

        grad_fn = jax.value_and_grad(loss_of, has_aux=True)

        def micro(acc, batch):
            (loss, aux), grads = grad_fn(params, *batch)
            grads_sum, loss_sum = acc
            return (jax.tree.map(jnp.add, grads_sum, grads), loss_sum + loss), aux

        zeros = jax.tree.map(jnp.zeros_like, params)
        (grads, loss), aux = jax.lax.scan(micro, (zeros, jnp.float32(0.0)),
                                          (tokens, mask, segment_ids))
        return apply_gradients(cfg, routed, model, optimizer, grads, loss, aux, values)

    return on_mesh(step, mesh)


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
    rate = values["bias"] * bias_rate_fraction(cfg, optimizer.step[...])
    with jax.named_scope("optimizer"):
        optimizer.update(model, grads)
    with jax.named_scope("bias_update"):
        update_biases(cfg, model, routed, counts, scores, rate, metrics)
    return metrics


def _split_ints(tree):
    """tree -> (its float arrays, its integer arrays), each with None in place of the others':
    a program's integer outputs (the records' counts and choices) have no gradient, and passing
    float0 cotangents between programs would make each call compile its program again."""
    def is_int(x):
        return not jnp.issubdtype(x.dtype, jnp.inexact)
    return (jax.tree.map(lambda x: None if is_int(x) else x, tree),
            jax.tree.map(lambda x: x if is_int(x) else None, tree))


def _join(floats, ints):
    """The inverse of _split_ints."""
    return jax.tree.map(lambda f, i: i if f is None else f, floats, ints,
                        is_leaf=lambda x: x is None)


def _mesh_set(mesh):
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def _call(program, *args):
    return program(*args)


def _lowering(mesh, emit):
    """A chain's `call` that lowers each program for the shapes of its inputs, the earlier
    programs' outputs, and returns its outputs' shapes. On one device they are that device's
    whole arrays: emit(lowered) compiles each in the background. On several, XLA chooses the
    outputs' layouts as it compiles: each program is compiled before the next is traced."""
    def trace(program, *args):
        with _mesh_set(mesh):
            traced = program.trace(*args)
            lowered = traced.lower()
        if mesh is not None and mesh.size > 1:
            compiled = lowered.compile()
            return jax.tree.map(lambda out, sharding: jax.ShapeDtypeStruct(
                out.shape, out.dtype, sharding=sharding), traced.out_info,
                compiled.output_shardings)
        emit(lowered)
        if mesh is None:
            return traced.out_info
        whole = jax.sharding.NamedSharding(  # as a program's outputs are placed
            mesh, jax.sharding.PartitionSpec(),
            memory_kind=mesh.devices.flat[0].default_memory().kind)
        return jax.tree.map(lambda out: out if out.dtype == jax.dtypes.float0 else (
            jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=whole)), traced.out_info)
    return trace


class _Hashed:
    """A static argument of the chains' programs, hashed once: jax.jit hashes its static
    arguments at every call, and deepseek4-tiny's GraphDef took 0.3 ms a hash on a 2-core CPU
    (most programs of a chain take one)."""

    __slots__ = ("value", "_hash")

    def __init__(self, value):
        self.value, self._hash = value, hash(value)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return isinstance(other, _Hashed) and (self.value is other.value or
                                               self.value == other.value)


def _split(model, *filters):
    """nnx.split(model, *filters) with the GraphDef _Hashed."""
    graphdef, *states = nnx.split(model, *filters)
    return _Hashed(graphdef), *states


def _chain_step(chain, mesh, split=_split):
    """chain(call, model, split(model), *args), which runs its programs in order through
    call(program, *its args) and returns the last one's outputs, as a step: step(model, *args)
    runs them; step.bind(model) is the step with the model split once (bind_model: split's
    states hold the model's own Variables, so what is written to them later, the biases, reaches
    it); step.lower_programs(emit, model, *args) lowers each for ahead.compile_ahead."""
    def step(model, *args):
        return bind(model)(*args)

    def bind(model):
        parts = split(model)

        def bound(*args):
            with _mesh_set(mesh):
                return chain(_call, model, parts, *args)
        return bound

    step.bind = bind
    step.lower_programs = lambda emit, model, *args: chain(_lowering(mesh, emit), model,
                                                           split(model), *args)
    return step


@functools.cache
def _segment_steps(key: str, routed: tuple[int, ...], mesh):
    """_train_step's step as a chain of programs (`step_programs: segments`). Per micro-batch,
    the embedding and each entry of model.segments run forward as programs of their own, each
    returning its output and its backward (jax.vjp's, with the residuals); one program computes
    the outputs, the losses and their gradient from the last streams and every segment's record;
    the backward programs run in reverse from there; one last program applies AdamW and the bias
    update (apply_gradients). The same gradients as the one program, which the chain only cuts
    where each segment ends: XLA compiles ~2 programs per segment, side by side
    (ahead.compile_ahead), instead of one program holding every block kind, forward and
    backward, in turn."""
    cfg = Config(**json.loads(key))
    routed = list(routed)

    def parts_of(model):
        """Each program's part (kind, segment, the indices of the parameter states it
        differentiates) and nnx.split's filters of those states (one per part, in order)."""
        last = len(model.segments) + 1
        parts = [("embed", None, (0,))]
        filters = [nnx.All(nnx.Param, lambda path, _: path == ("embed",))]
        for i in range(len(model.segments)):
            parts.append(("segment", i, (i + 1,)))
            filters.append(nnx.All(nnx.Param, lambda path, _, i=i: path[:2] == ("segments", i)))
        # the head's: every parameter outside the segments, and the embedding where MTP reads it
        parts.append(("head", None, (0, last) if cfg.mtp_num_layers > 0 else (last,)))
        filters.append(nnx.All(nnx.Param, lambda path, _: path[0] != "segments"))
        return parts, filters

    def run_part(part, model, carry, batch):
        tokens, mask, segment_ids, values, a = batch
        tokens, mask, segment_ids = tokens[a], mask[a], segment_ids[a]
        inputs = tokens[:, :-1]
        positions, _ = model.defaults(inputs, None, segment_ids)
        kind, i, _ = part
        if kind == "embed":
            return model.streams(inputs)
        if kind == "segment":
            return run_segment(model.segments[i], carry, inputs, positions, segment_ids, None)
        h, records = carry
        out = model.outputs(h, records, positions, segment_ids, None,
                            tokens[:, 1:] if cfg.mtp_num_layers > 0 else None)
        return loss_terms(cfg, model, out, tokens, mask, segment_ids, routed, values)

    def differentiable(part, graphdef, states, batch):
        """The part as a function of its parameters (the states it differentiates) and input."""
        def fn(chosen, carry):
            merged = list(states)
            for index, state in zip(part[2], chosen):
                merged[index] = state
            model = nnx.merge(graphdef.value, *merged)
            with precision_scope(model.matmul_precision):
                return run_part(part, model, carry, batch)
        return fn, tuple(states[index] for index in part[2])

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def forward(part, graphdef, states, carry, batch):
        """-> (the part's output, its backward: the cotangent of the output's float arrays (None
        for the integer ones) -> (parameter grads, input grad))."""
        fn, chosen = differentiable(part, graphdef, states, batch)
        floats, backward, ints = jax.vjp(lambda *a: _split_ints(fn(*a)), chosen, carry,
                                         has_aux=True)
        return _join(floats, ints), backward

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def head(part, graphdef, states, carry, batch):
        """-> (loss, aux, its parameters' grads, (grad of the last streams, of each record's
        float arrays))."""
        fn, chosen = differentiable(part, graphdef, states, batch)
        floats, ints = _split_ints(carry)
        loss, backward, aux = jax.vjp(lambda chosen, floats: fn(chosen, _join(floats, ints)),
                                      chosen, floats, has_aux=True)
        return loss, aux, *backward(jnp.ones_like(loss))

    @jax.jit
    def backward(vjp, cotangent):
        return vjp(cotangent)

    @functools.partial(jax.jit, donate_argnums=0)
    def accumulate(total, grads):
        return jax.tree.map(jnp.add, total, grads)

    @nnx.jit(donate_argnums=(0, 1))
    def apply(model, optimizer, grads, loss, aux, values):
        by_path = {}  # every part's gradients, summed where parts share a parameter (embedding)
        for part_grads in grads:
            for state in part_grads:
                for path, value in nnx.to_flat_state(state):
                    by_path[path] = jax.tree.map(jnp.add, by_path[path], value) if (
                        path in by_path) else value
        grads = nnx.from_flat_state(by_path)
        aux = jax.tree.map(lambda *x: jnp.stack(x), *aux)
        return apply_gradients(cfg, routed, model, optimizer, grads, sum(loss), aux, values)

    def split(model):
        return _split(model, *parts_of(model)[1], ...)

    def chain(call, model, split_model, optimizer, tokens, mask, segment_ids, values):
        """The step's programs in order, each through call(program, *args) -> its outputs
        (running it, or tracing it for their shapes)."""
        parts = parts_of(model)[0]
        graphdef, *states = split_model
        states, last = tuple(states), len(parts) - 1
        grads, losses_, auxes = [None] * len(parts), [], []
        for a in range(tokens.shape[0]):
            batch = (tokens, mask, segment_ids, values, np.int32(a))
            carry, backwards, records = None, [], []
            for part in parts[:-1]:
                out, vjp = call(forward, part, graphdef, states, carry, batch)
                backwards.append(vjp)
                carry = out if part[0] == "embed" else out[0]
                if part[0] == "segment":
                    records.append(out[1])
            loss, aux, g_part, (g_h, g_records) = call(
                head, parts[last], graphdef, states, (carry, records), batch)
            losses_.append(loss)
            auxes.append(aux)
            grads[last] = g_part if a == 0 else call(accumulate, grads[last], g_part)
            for j in reversed(range(last)):
                cotangent = g_h if j == 0 else (g_h, g_records[j - 1])
                g_part, g_h = call(backward, backwards[j], cotangent)
                grads[j] = g_part if a == 0 else call(accumulate, grads[j], g_part)
        return call(apply, model, optimizer, grads, losses_, auxes, values)

    return _chain_step(chain, mesh, split)


def update_biases(cfg: Config, model: DeepSeekV4, routed, counts, scores, rate, metrics):
    """The bias update of the top-k blocks after the optimizer step (records `bias` in metrics)."""
    if not routed:
        return
    biases = get_biases(model)
    if cfg.routed_bias_update_rule == "quantile":
        new = balancing.quantile_bias(scores.swapaxes(0, 1), biases,  # [L_routed, A, ..., E]
                                      cfg.num_experts_per_tok, rate=rate)
    else:
        new = balancing.update_bias(biases, counts[jnp.asarray(routed)],
                                    rule=cfg.routed_bias_update_rule, rate=rate)
    set_biases(model, new)
    metrics["bias"] = new


def make_eval_step(cfg: Config, model: DeepSeekV4, mesh=None):
    """-> step(model, tokens [B, S+1], mask [B, S], segment_ids [B, S]) -> {ce_sum, tokens,
    counts}; never touches the bias. One per mesh, so models of one layout share its compilation;
    with `step_programs: segments` a chain of programs (_inference_chain)."""
    if chained(cfg, mesh):
        return _inference_chain(mesh).eval_step
    return _eval_step(mesh)


def evaluation_sums(model: DeepSeekV4, out: ModelOutput, tokens, mask) -> dict:
    """make_eval_step's result from the model's output on tokens[:, :-1]: the masked
    cross-entropy sum, the tokens it counts and every block's expert counts."""
    ce = token_ce(model, out.hidden, tokens[:, 1:])
    m = mask.astype(jnp.float32)
    return {"ce_sum": (ce * m).sum(), "tokens": m.sum(), "counts": out.routing.counts}


@functools.cache
def _eval_step(mesh):
    @nnx.jit
    def eval_step(model, tokens, mask, segment_ids):  # apart from the training `step` in logs
        return evaluation_sums(model, model(tokens[:, :-1], segment_ids=segment_ids), tokens,
                               mask)

    return on_mesh(eval_step, mesh)


def make_score_step(cfg: Config, model: DeepSeekV4, mesh=None):
    """-> step(model, tokens [B, S+1], segment_ids [B, S]) -> [L_routed, B*S, E] float32 unbiased
    router scores of the top-k blocks (their selection used the current biases); with
    `step_programs: segments` a chain of programs (_inference_chain)."""
    routed = tuple(routed_layers(model))
    if chained(cfg, mesh):
        return _inference_chain(mesh).score_step(routed, cfg.num_experts)
    return _score_step(routed, cfg.num_experts, mesh)


@functools.cache
def _score_step(routed: tuple[int, ...], num_experts: int, mesh):
    routed = jnp.asarray(routed, jnp.int32)

    @nnx.jit
    def score_step(model, tokens, segment_ids):
        scores = model(tokens[:, :-1], segment_ids=segment_ids).routing.scores[routed]
        return scores.reshape(len(routed), -1, num_experts).astype(jnp.float32)

    return on_mesh(score_step, mesh)


class _InferenceChain(typing.NamedTuple):
    eval_step: typing.Callable  # make_eval_step's step
    score_step: typing.Callable  # (routed, num_experts) -> make_score_step's step


@functools.cache
def _inference_chain(mesh) -> _InferenceChain:
    """make_eval_step's and make_score_step's steps as chains of programs (`step_programs:
    segments`, _chain_step): the model's forward cut as _segment_steps cuts it, the embedding's
    program then one per segment, shared by both steps, then a small program of each's own (the
    cross-entropy and counts; the top-k blocks' scores). No program holds the whole model."""

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def infer(segment, graphdef, state, carry, tokens, segment_ids):
        """The embedding (segment None) or one segment -> its output."""
        model = nnx.merge(graphdef.value, state)
        inputs = tokens[:, :-1]
        with precision_scope(model.matmul_precision):
            if segment is None:
                return model.streams(inputs)
            positions, _ = model.defaults(inputs, None, segment_ids)
            return run_segment(model.segments[segment], carry, inputs, positions, segment_ids,
                               None)

    @functools.partial(jax.jit, static_argnums=0)
    def evaluate(graphdef, state, h, records, tokens, mask, segment_ids):
        model = nnx.merge(graphdef.value, state)
        positions, _ = model.defaults(tokens[:, :-1], None, segment_ids)
        with precision_scope(model.matmul_precision):
            out = model.outputs(h, records, positions, segment_ids, None, None)
        return evaluation_sums(model, out, tokens, mask)

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def score(routed, num_experts, records):
        scores = jnp.concatenate([record.scores for record in records])[np.asarray(routed)]
        return scores.reshape(len(routed), -1, num_experts).astype(jnp.float32)

    def trunk(call, model, split_model, tokens, segment_ids):
        """-> (graphdef, state, the last streams, each segment's record)."""
        graphdef, state = split_model
        h = call(infer, None, graphdef, state, None, tokens, segment_ids)
        records = []
        for segment in range(len(model.segments)):
            h, record = call(infer, segment, graphdef, state, h, tokens, segment_ids)
            records.append(record)
        return graphdef, state, h, records

    def evaluation(call, model, split_model, tokens, mask, segment_ids):
        graphdef, state, h, records = trunk(call, model, split_model, tokens, segment_ids)
        return call(evaluate, graphdef, state, h, records, tokens, mask, segment_ids)

    def scoring(routed, num_experts):
        def chain(call, model, split_model, tokens, segment_ids):
            return call(score, routed, num_experts,
                        trunk(call, model, split_model, tokens, segment_ids)[3])
        return _chain_step(chain, mesh)

    return _InferenceChain(_chain_step(evaluation, mesh), scoring)
