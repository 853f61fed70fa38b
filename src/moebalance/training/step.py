"""The jitted steps: training (every micro-batch's loss and gradient, then the update), evaluation
and scoring, each one program (`step_programs: one`) or a chain of programs per model segment
(`segments`, and `auto` on a TPU: training/chain.py); what they compute is training/objective.py.
Runs that differ only in their balancing switches (SWITCHES) or their seed share one compiled
program.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from moebalance.config import Config
from moebalance.model.transformer import DeepSeekV4, fitting_biases, routed_layers
from moebalance.training import chain
from moebalance.training.objective import (SWITCHES, apply_gradients, bias_rate,
                                           evaluation_sums, losses, lr_schedule, switches)

NO_DECAY = ("weight", "scale", "base", "attn_sink", "ape")  # norms, hc scales/biases, sinks


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


def config_key(cfg: Config) -> str:
    """The config as one canonical JSON string: the key of what is kept per config (traced plans
    in training.plan; compiled steps by program_key)."""
    return json.dumps(dataclasses.asdict(cfg), sort_keys=True)


def program_key(program: Config) -> str:
    """config_key of what a program compiles: its bias rate and balance-loss weights only as on
    or off (1 or 0), since their values are passed at run time, and none of OUTSIDE_KEYS, so
    that programs that differ in them share one compiled step."""
    on = {key: float(getattr(program, key) > 0) for key in _LOSSES}
    outside = {key: getattr(Config, key) for key in OUTSIDE_KEYS}
    return config_key(dataclasses.replace(program, routed_bias_update_rate=float(
        _uses_bias(program)), **on, **outside))


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
        steps = chain.segment_steps(program_key(program), routed, mesh)

        def step(model, optimizer, tokens, mask, segment_ids):
            return steps(model, optimizer, tokens, mask, segment_ids, values)

        step.lower_programs = lambda emit, *args: steps.lower_programs(emit, *args, values)
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


# Keys that never reach a step's program: the seed draws the initial weights and orders the data,
# both outside it (a study's seeds share their arms' programs).
OUTSIDE_KEYS = ("seed",)
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
    free = SWITCHES + OUTSIDE_KEYS + (() if _uses_bias(cfg) else BIAS_KEYS)
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


def make_eval_step(cfg: Config, model: DeepSeekV4, mesh=None):
    """-> step(model, tokens [B, S+1], mask [B, S], segment_ids [B, S]) -> {ce_sum, tokens,
    counts}; never touches the bias. One per mesh, so models of one layout share its compilation;
    with `step_programs: segments` a chain of programs (chain.inference_chain)."""
    if chained(cfg, mesh):
        return chain.inference_chain(mesh).eval_step
    return _eval_step(mesh)


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
    `step_programs: segments` a chain of programs (chain.inference_chain)."""
    routed = tuple(routed_layers(model))
    if chained(cfg, mesh):
        return chain.inference_chain(mesh).score_step(routed, cfg.num_experts)
    return _score_step(routed, cfg.num_experts, mesh)


@functools.cache
def _score_step(routed: tuple[int, ...], num_experts: int, mesh):
    routed = jnp.asarray(routed, jnp.int32)

    @nnx.jit
    def score_step(model, tokens, segment_ids):
        scores = model(tokens[:, :-1], segment_ids=segment_ids).routing.scores[routed]
        return scores.reshape(len(routed), -1, num_experts).astype(jnp.float32)

    return on_mesh(score_step, mesh)


def make_fit_step(cfg: Config, model: DeepSeekV4, mesh=None):
    """-> step(model, tokens [B, S+1], segment_ids [B, S]) -> [L_routed, E] float32: the top-k
    blocks' biases that balance these B*S tokens, each block's fitted to its fixed point on their
    scores given the earlier blocks' fitted biases (transformer.fitting_biases), in one forward
    pass; the model's own biases are left as they are. With `step_programs: segments` a chain of
    programs (chain.inference_chain). Lowered (ahead.compile_ahead) in the fit mode too."""
    routed = tuple(routed_layers(model))
    fit = (chain.inference_chain(mesh).fit_step(routed) if chained(cfg, mesh)
           else _fit_step(routed, mesh))

    def step(model, tokens, segment_ids):
        with fitting_biases(model):
            return fit(model, tokens, segment_ids)

    if hasattr(fit, "lower_programs"):
        def lower_programs(emit, model, *args):
            with fitting_biases(model):
                return fit.lower_programs(emit, model, *args)
        step.lower_programs = lower_programs
    else:
        def lower(model, *args):
            with fitting_biases(model):
                return fit.lower(model, *args)
        step.lower = lower
    return step


@functools.cache
def _fit_step(routed: tuple[int, ...], mesh):
    routed = jnp.asarray(routed, jnp.int32)

    @nnx.jit
    def fit_step(model, tokens, segment_ids):
        return model(tokens[:, :-1], segment_ids=segment_ids).routing.bias[routed]

    return on_mesh(fit_step, mesh)
