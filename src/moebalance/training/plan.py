"""Will a config train on a mesh of N devices? Per-device memory and all-to-all traffic of one
training step, by abstract evaluation: nothing is allocated and no real devices are needed.

Per device, for the mesh the `ici_*` keys give on N devices (an `AbstractMesh`):

    parameters   the model's variables (weights, router biases, hash tables), each as its shard
                 under the trainer's own rules (`sharding.variable_sharding`: fsdp on the largest
                 divisible axis, routed experts over `expert`; biases and hash tables replicated)
    optimizer    the real `nnx.Optimizer` state (AdamW: mu and nu in the parameters' dtype, a step
                 count), sharded by the same rules
    gradients    one per weight (`nnx.Param`), sharded like it; twice that with gradient
                 accumulation (the running sum and the micro-batch's own)
    gathered     what a device holds of the largest block's weights beyond its own shard while
                 running it: gathered over fsdp (XLA all-gathers a weight where it is used), the
                 routed experts still split over `expert`
    activations  what the backward pass keeps from the forward pass of one micro-batch, plus the
                 backward's working set:
                     remat none:  saved(loss)         + 2 x block
                     otherwise:   saved(loss, policy) + 3 x block
                 saved(.) = the residuals of `jax.vjp` of the trainer's own loss
                 (`objective.losses`), traced at the global batch under the abstract mesh:
                 every array the backward reads that is not an input. An array computed from
                 the batch is split over all devices (the batch is split over every mesh axis;
                 inside the expert-parallel `shard_map` each device holds its own rows); one
                 computed from parameters alone (a cast to the compute dtype) is split like its
                 parameter, over fsdp. The split
                 is decided per top-level operation, so what a layer scan saves counts as from
                 the batch, weight casts inside it too (undercounted by N / fsdp; they are a small
                 part, and a remat scan saves only the blocks' inputs). With full remat the saved
                 arrays are each block's inputs, with another policy also what it keeps.
                 block = the largest single block's residuals. The backward of a block holds
                 about twice that again (WORKING_SET: the cotangents of its arrays); under a
                 remat policy it first recomputes the block's residuals (one more, at most).
                 The dispatch traced is the GPUs' (`blocked`) unless the config names another.
                 Under expert parallelism this counts what the code does: `lax.cond` keeps the
                 residuals of both buffers (the branch not taken as zeros), so the worst-case
                 buffer's R * A rows per layer are paid in memory on every step, not only when
                 it runs.

Not counted: XLA's own temporaries beyond that working set (fusion can also drop residuals it
recomputes), the [chunk, V] cross-entropy logits (32 MiB), framework and allocator overhead. The
test compares the parameter and optimizer bytes with a real sharded model on 8 devices; the
docs/distributed.md compares the activations with XLA's compiled memory analysis of a small config.

All-to-all traffic (expert parallelism, R = expert-axis size > 1): per MoE layer and micro-batch a
device sends R * S rows (S = ceil(ep_buffer_factor * A / R) slots per rank on the fast path, A on
the worst-case one; A = the device's token-expert assignments), of which (R - 1) / R leave it:
forward dispatch (row, routing weight, expert id) and combine (row), the backward's transposes of
both, and the forward again under a remat policy. `cross_host` is the share of those bytes between
devices of different hosts, the expert axis being the mesh's last (consecutive devices).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend.core import Literal
from jax.sharding import AbstractMesh, AxisType

from moebalance.config import REMAT_ORDER, Config, ConfigError
from moebalance.model.expert_parallel import fast_slots
from moebalance.model.transformer import (Block, DeepSeekV4, layer_kinds, placeholder_hash_tables,
                                          routed_layers)
from moebalance.training import sharding
from moebalance.training.objective import losses
from moebalance.training.step import config_key, new_optimizer

GIB = 2**30
# The backward of one block needs about this many times its residuals on top of them (the
# cotangents of its arrays and their temporaries): XLA's compiled memory analysis of one
# deepseek4-smoke-shaped block's forward + backward peaks at 2.7-3.0x its residuals.
WORKING_SET = 2


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per-device bytes of one training step on a mesh, and whether it fits."""

    mesh: dict  # {data, fsdp, expert}: axis sizes
    parameters: int
    optimizer: int
    gradients: int
    gathered: int
    activations: dict  # {policy: bytes}: none, full and the config's remat_policy (auto: all)
    block: int  # the largest block's residuals (a part of the activations)
    all_to_all: dict  # {"fast"|"worst": {policy: bytes sent per step}}: buffer, remat
    cross_host: float  # share of the all-to-all device pairs on two hosts (of bytes: evenly routed)
    device_memory: int  # bytes, 0 = not given

    def total(self, remat: str) -> int:
        return (self.parameters + self.optimizer + self.gradients + self.gathered
                + self.activations[remat])

    def fits(self, remat: str) -> bool | None:
        return self.total(remat) <= self.device_memory if self.device_memory else None

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self),
                "total": {r: self.total(r) for r in self.activations},
                "fits": {r: self.fits(r) for r in self.activations}}


def mesh_of(shape: tuple) -> AbstractMesh:
    """An abstract (data, fsdp, expert) mesh of `shape` with the trainer's `Auto` axes (those of
    `sharding.make_mesh`'s `Mesh`). Named, not left to the default: JAX 0.11 makes an
    `AbstractMesh`'s axes `Explicit` by default, under which every array traced carries its
    sharding in its type and the expert-parallel `shard_map` refuses the replicated inputs."""
    return AbstractMesh(shape, sharding.AXES, axis_types=(AxisType.Auto,) * len(sharding.AXES))


def abstract_mesh(cfg: Config, devices: int) -> AbstractMesh:
    """The trainer's (data, fsdp, expert) mesh on `devices` devices, without devices."""
    if devices < 1:
        raise ConfigError(f"--devices must be >= 1, got {devices}")
    return mesh_of(sharding.mesh_shape(cfg, devices))


def abstract_model(cfg: Config) -> DeepSeekV4:
    """The model as shapes only (`nnx.eval_shape`)."""
    return nnx.eval_shape(lambda: DeepSeekV4(cfg, hash_tables=placeholder_hash_tables(cfg),
                                             rngs=nnx.Rngs(0)))


def abstract_optimizer(cfg: Config, model: DeepSeekV4) -> nnx.Optimizer:
    """The trainer's optimizer of an abstract model, as shapes only."""
    return nnx.eval_shape(lambda m: new_optimizer(cfg, m), model)


def nbytes(shape, dtype) -> int:
    return math.prod(shape) * jnp.dtype(dtype).itemsize


def shard_bytes(obj, mesh: AbstractMesh) -> int:
    """Bytes one device holds of a model's or optimizer's state under the trainer's sharding."""
    leaves = jax.tree_util.tree_flatten_with_path(
        nnx.state(obj), is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return sum(nbytes(sharding.variable_sharding(path, var, mesh).shard_shape(var.shape),
                      var.dtype) for path, var in leaves)


def param_bytes(obj, mesh: AbstractMesh) -> int:
    """Bytes one device holds of the `nnx.Param`s of a module."""
    return shard_bytes(nnx.state(obj, nnx.Param), mesh)


def residual_bytes(fn, args: tuple, batch_args: set[int], mesh: AbstractMesh) -> int:
    """Per-device bytes of what the backward of `fn(*args)` keeps from its forward, traced under
    `mesh`: the outputs of jax.vjp's residual function that are not inputs of `fn`. `fn`'s first
    argument is differentiated; `batch_args` are the positions of the batch's arrays in `args`."""
    def residuals(*args):
        return jax.vjp(lambda first: fn(first, *args[1:]), args[0])[1]

    with jax.sharding.use_abstract_mesh(mesh):
        jaxpr = jax.make_jaxpr(residuals)(*args).jaxpr
    starts = [0, *itertools.accumulate(len(jax.tree.leaves(a)) for a in args)]
    from_batch = {v for i in batch_args for v in jaxpr.invars[starts[i]:starts[i + 1]]}
    for eqn in jaxpr.eqns:  # in order: whatever is computed from the batch is split like it
        if any(v in from_batch for v in eqn.invars if not isinstance(v, Literal)):
            from_batch.update(eqn.outvars)
    inputs = set(jaxpr.invars) | set(jaxpr.constvars)
    saved = {v for v in jaxpr.outvars if not isinstance(v, Literal) and v not in inputs}
    return sum(nbytes(v.aval.shape, v.aval.dtype)
               // (mesh.size if v in from_batch else mesh.shape["fsdp"]) for v in saved)


def traced_config(cfg: Config, remat: str) -> Config:
    """The config whose training step is traced: `remat_policy` as asked, the GPUs' dispatch
    (`blocked`) where the config leaves it to the backend."""
    dispatch = "blocked" if cfg.moe_dispatch == "auto" else cfg.moe_dispatch
    return dataclasses.replace(cfg, remat_policy=remat, moe_dispatch=dispatch)


def global_rows(cfg: Config, mesh: AbstractMesh) -> int:
    """B of one micro-batch: per_device_batch_size rows on every device."""
    return cfg.per_device_batch_size * mesh.size


def loss_and_inputs(cfg: Config, model: DeepSeekV4, rows: int):
    """-> (loss of one micro-batch as a function of (params, rest, tokens, mask, segment_ids),
    those inputs as shapes for `rows` sequences)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    routed = routed_layers(model)
    s = cfg.max_target_length
    batch = (jax.ShapeDtypeStruct((rows, s + 1), jnp.int32),
             jax.ShapeDtypeStruct((rows, s), bool), jax.ShapeDtypeStruct((rows, s), jnp.int32))

    def loss(params, rest, tokens, mask, segment_ids):
        return losses(cfg, nnx.merge(graphdef, params, rest), tokens, mask, segment_ids,
                      routed)[0]

    return loss, (params, rest, *batch)


# loss_residuals of the configs and meshes planned in this process: tracing the loss is most of a
# plan's time (~2 s a policy for deepseek4-smoke), and a process may plan one config again
_LOSS_RESIDUALS: dict[tuple, int] = {}


def loss_residuals(cfg: Config, model: DeepSeekV4, mesh: AbstractMesh) -> int:
    """Per-device bytes the backward of one micro-batch's loss (`objective.losses`) keeps
    (`model` is `cfg`'s, as abstract_model builds it)."""
    key = (config_key(cfg), tuple(mesh.shape.items()))
    if key not in _LOSS_RESIDUALS:
        loss, inputs = loss_and_inputs(cfg, model, global_rows(cfg, mesh))
        _LOSS_RESIDUALS[key] = residual_bytes(loss, inputs, {2, 3, 4}, mesh)
    return _LOSS_RESIDUALS[key]


def abstract_blocks(cfg: Config) -> list[Block]:
    """One block of each kind (compress ratio, hash or top-k routed) the model has, as shapes."""
    tables = placeholder_hash_tables(cfg)[:1]
    return [nnx.eval_shape(lambda r=ratio, h=hashed: Block(cfg, r, tables[0] if h else None,
                                                           rngs=nnx.Rngs(0)))
            for ratio, hashed in sorted(set(layer_kinds(cfg)))]


def block_residuals(cfg: Config, block: Block, mesh: AbstractMesh) -> int:
    """Per-device bytes the backward of one block's forward (no remat) keeps."""
    graphdef, params, rest = nnx.split(block, nnx.Param, ...)
    b, s = global_rows(cfg, mesh), cfg.max_target_length
    h = jax.ShapeDtypeStruct((cfg.hc_mult, b, s, cfg.base_emb_dim), cfg.dtype)
    ids = jax.ShapeDtypeStruct((b, s), jnp.int32)  # token ids, positions, segment ids

    def forward(params, rest, h, token_ids, positions, segment_ids):
        return nnx.merge(graphdef, params, rest).forward(h, token_ids, positions, segment_ids,
                                                         None)[0]

    return residual_bytes(forward, (params, rest, h, ids, ids, ids), {2, 3, 4, 5}, mesh)


def gathered_bytes(blocks: list[Block], mesh: AbstractMesh) -> int:
    """What a device holds of the largest block's weights while running it beyond its own
    shard: the weights gathered over fsdp, the routed experts still split over `expert`."""
    whole = mesh_of((mesh.shape["data"] * mesh.shape["fsdp"], 1, mesh.shape["expert"]))
    return max(param_bytes(b, whole) - param_bytes(b, mesh) for b in blocks)


def all_to_all_bytes(cfg: Config, ranks: int,
                     policies=("none", "full")) -> dict[str, dict[str, int]]:
    """Bytes one device sends to other devices per step over the expert axis, on the fast and the
    worst-case buffer, by remat policy: {"fast": {"none": .., "full": ..}, "worst": {..}}. Every
    policy but none runs the forward's exchanges again (none keeps their outputs)."""
    if ranks == 1:
        return {path: dict.fromkeys(policies, 0) for path in ("fast", "worst")}
    assign = cfg.per_device_batch_size * cfg.max_target_length * cfg.num_experts_per_tok
    row = cfg.base_emb_dim * jnp.dtype(cfg.dtype).itemsize
    forward = (row + 4 + 4) + row  # dispatch: row, float32 weight, int32 expert; combine: row
    backward = (row + 4) + row  # the transposes of the differentiable exchanges
    exchanges = cfg.gradient_accumulation_steps * (cfg.base_num_decoder_layers
                                                   + cfg.mtp_num_layers)
    slots = {"fast": fast_slots(assign, ranks, cfg.ep_buffer_factor) or assign, "worst": assign}
    return {path: {remat: exchanges * s * (ranks - 1) * (forward * (1 + (remat != "none"))
                                                         + backward)
                   for remat in policies} for path, s in slots.items()}


def cross_host_share(ranks: int, devices: int, devices_per_host: int) -> float:
    """Share of the expert all-to-all's device pairs (source != destination) on two hosts: the
    expert groups are `ranks` consecutive devices, host h holds devices [h*H, (h+1)*H)."""
    if ranks == 1:
        return 0.0
    pairs = crossing = 0
    for first in range(0, devices, ranks):
        hosts = [(first + i) // devices_per_host for i in range(ranks)]
        pairs += ranks * (ranks - 1)
        crossing += sum(a != b for a in hosts for b in hosts)
    return crossing / pairs


def plan(cfg: Config, devices: int, device_memory_gib: float = 0.0,
         devices_per_host: int = 8) -> Plan:
    """The memory and traffic plan of `cfg`'s training step on `devices` devices."""
    if device_memory_gib < 0:
        raise ConfigError(f"--device-memory must be >= 0 GiB (0: no fit check), got "
                          f"{device_memory_gib}")
    if devices_per_host < 1:
        raise ConfigError(f"--devices-per-host must be >= 1, got {devices_per_host}")
    mesh = abstract_mesh(cfg, devices)
    asked = REMAT_ORDER if cfg.remat_policy == "auto" else (cfg.remat_policy,)
    policies = tuple(dict.fromkeys(("none", "full", *asked)))
    traced = {remat: traced_config(cfg, remat) for remat in policies}
    models = {remat: abstract_model(c) for remat, c in traced.items()}  # the same variables
    model, blocks = models["none"], abstract_blocks(traced["none"])
    block = max(block_residuals(traced["none"], b, mesh) for b in blocks)
    activations = {remat: loss_residuals(traced[remat], models[remat], mesh)
                   + (WORKING_SET + (remat != "none")) * block for remat in traced}
    grads = param_bytes(model, mesh)  # one per nnx.Param
    ranks = mesh.shape["expert"]
    return Plan(mesh=dict(mesh.shape), parameters=shard_bytes(model, mesh),
                optimizer=shard_bytes(abstract_optimizer(cfg, model), mesh),
                gradients=grads * (2 if cfg.gradient_accumulation_steps > 1 else 1),
                gathered=gathered_bytes(blocks, mesh), activations=activations, block=block,
                all_to_all=all_to_all_bytes(cfg, ranks, policies),
                cross_host=cross_host_share(ranks, devices, devices_per_host),
                device_memory=int(device_memory_gib * GIB))
