"""XLA's own memory plan of a config's training step, compiled ahead of time for a device topology
(`moebalance plan --compile`): the programs the chip would run, without the chip.

The step is the trainer's own, as the trainer would run it on those devices (`step.chained`):
one program (`step.lower_train_step`: forward, losses, backward over the micro-batches, AdamW,
bias update), or the chain of programs per model segment (`step_programs: segments`, and `auto`
on a TPU: chain.segment_steps), each distinct program compiled once (`chain_memory`). Traced on
an abstract model and optimizer (`nnx.eval_shape`) whose variables carry the trainer's shardings
on a mesh of the topology's devices, for [gradient_accumulation_steps, per_device_batch_size x
devices, max_target_length] tokens, and compiled by that platform's compiler. A TPU topology
(`v5p-128`, `v5e:2x2`, ...: training/topology.py; every host's and slice's devices) comes from
`jax.experimental.topologies` and needs libtpu importable (`pip install "moebalance[tpu]"`, or
libtpu alone beside the environment), not a chip: MaxText's `train_compile` does the same. `cpu`
compiles for this machine's CPU. The mesh
carries the topology's platform, so every choice the code makes by platform (kernels.platform:
the MoE layout of `auto`, Pallas' interpret mode, `step_programs: auto`) is the chip's.

memory_bytes(stats): XLA's `memory_analysis()` per device: argument (model, optimizer, batch),
output, alias (outputs written into a donated argument's buffer), temp (every other buffer: the
activations, gradients and the backward's working set), generated_code, `needed` = argument +
output - alias + temp (what the device must hold at once by that account) and `peak` (the heap
simulator's peak of live bytes). On a TPU v5e the 2 x 2048 d1024 step's `needed`, 14.81 GiB, was
within 2% of the device peak measured on the chip (15.1 GB; docs/performance.md). A step whose
temporaries exceed the device is refused by the compiler: `refusal` reads what it said it needs.

A chain runs its programs one after another, and what one returns for a later one (a segment's
output, the residuals its backward reads, the gradients summed so far) stays on the device
between them, as do the model, the optimizer and the batch. chain_memory's `needed` is the
step's peak by that account: the most, over the chain's calls, of every array live at the call
(held throughout, made earlier and read then or later, its arguments) plus what the program adds
(outputs - aliased + temporaries) (_ChainAccount.memory). XLA's heap peak is per program: a
chain has none of its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
import time

import jax
import jax.numpy as jnp
from flax import nnx

from moebalance.config import REMAT_ORDER, Config, ConfigError
from moebalance.model.moe import resolve_dispatch
from moebalance.model.transformer import routed_layers
from moebalance.training import chain, sharding
from moebalance.training.objective import SWITCHES, switches
from moebalance.training.plan import GIB, abstract_model, abstract_optimizer
from moebalance.training.step import chained, lower_train_step, program_key

REFUSED = re.compile(r"memory required for HLO temporaries \(([\d.]+)G\)")


def place_abstract(obj, mesh) -> None:
    """Give every variable of an abstract (`nnx.eval_shape`) model or optimizer the trainer's
    sharding on `mesh` (`sharding.variable_sharding`), in place: what `sharding.shard` does to
    real arrays."""
    def place(path, variable):
        return variable.replace(jax.ShapeDtypeStruct(
            variable.shape, variable.dtype,
            sharding=sharding.variable_sharding(path, variable, mesh)))

    nnx.update(obj, jax.tree_util.tree_map_with_path(
        place, nnx.state(obj), is_leaf=lambda x: isinstance(x, nnx.Variable)))


def traced_layout(cfg: Config, devices: list) -> Config:
    """`cfg` with its `moe_dispatch` as compiled for `devices` (`auto` resolved for their
    platform), for the planner to trace the layout the compiled step runs."""
    with jax.set_mesh(sharding.make_mesh(cfg, devices)):
        return dataclasses.replace(cfg, moe_dispatch=resolve_dispatch(cfg.moe_dispatch))


def step_inputs(cfg: Config, devices: list) -> tuple:
    """-> (the trainer's mesh on `devices`, the abstract model, optimizer, and tokens, mask and
    segment ids [A, per_device_batch_size x devices, max_target_length] (A =
    gradient_accumulation_steps)), placed as the trainer places them."""
    mesh = sharding.make_mesh(cfg, devices)
    model = abstract_model(cfg)
    optimizer = abstract_optimizer(cfg, model)
    place_abstract(model, mesh)
    place_abstract(optimizer, mesh)
    rows = sharding.batch_sharding(mesh, 3)
    shape = (cfg.gradient_accumulation_steps, cfg.per_device_batch_size * len(devices),
             cfg.max_target_length)
    return mesh, model, optimizer, *(
        jax.ShapeDtypeStruct((*shape[:2], shape[2] + extra), dtype, sharding=rows)
        for extra, dtype in ((1, jnp.int32), (0, jnp.bool_), (0, jnp.int32)))


def _device_bytes(leaf) -> int:
    """Bytes one device holds of an array's shape (its shard, where it carries a sharding)."""
    if not hasattr(leaf, "shape") or leaf.dtype == jax.dtypes.float0:
        return 0
    sharding = getattr(leaf, "sharding", None)
    shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
    return math.prod(shape) * leaf.dtype.itemsize


class _ChainAccount:
    """A chain's `call` (chain.py) that lowers each program for its arguments' shapes, compiles
    each distinct one once (a program called again, another micro-batch's, is the same HLO),
    returns its outputs' shapes placed as XLA chose, and keeps every call's arguments and
    outputs for the step's peak."""

    def __init__(self, mesh, options):
        self.mesh, self.options = mesh, options
        self.programs: dict[str, dict] = {}  # by the HLO's digest, in order of first call
        self.calls: list[tuple[str, list, list]] = []  # (digest, argument leaves, outputs)

    def __call__(self, program, *args):
        with jax.set_mesh(self.mesh):
            traced = program.trace(*args)
            lowered = traced.lower()
        digest = hashlib.sha256(lowered.as_text().encode()).hexdigest()
        if digest not in self.programs:
            name = getattr(program, "__name__", "program")
            same = sum(p["name"].split(" ")[0] == name for p in self.programs.values())
            start = time.perf_counter()
            compiled = lowered.compile(self.options)
            self.programs[digest] = {
                "name": f"{name} {same + 1}", "calls": 0,
                "compile_s": round(time.perf_counter() - start, 2),
                "memory": memory_bytes(compiled.memory_analysis()),
                "shardings": compiled.output_shardings}
        entry = self.programs[digest]
        entry["calls"] += 1
        outputs = jax.tree.map(lambda out, placed: jax.ShapeDtypeStruct(
            out.shape, out.dtype, sharding=placed), traced.out_info, entry["shardings"])
        self.calls.append((digest, jax.tree.leaves(args), jax.tree.leaves(outputs)))
        return outputs

    def memory(self, held: list) -> dict:
        """{"programs": [{name, calls, compile_s, memory}], "held": bytes of `held` (the arrays
        live throughout: model, optimizer, batch), "needed": the most, over the calls, of what
        is live at the call, "at": the program where it is reached}. Live at a call: every array
        held, made by an earlier call and read by this one or later, or an argument, and what
        the program adds (outputs - aliased + temporaries). Two accounts of it, the larger
        taken: the arrays' own bytes plus the program's additions, or the program's `needed`
        plus the other arrays' bytes (XLA counts the arguments it reads, padded to the device's
        tiles: on a TPU a small array takes more; jit leaves an unused one out)."""
        last_use = {}
        for i, (_, args, _) in enumerate(self.calls):
            for leaf in args:
                last_use[id(leaf)] = i
        made = {id(leaf): (i, leaf) for i, (_, _, outs) in enumerate(self.calls) for leaf in outs}
        throughout = {id(leaf): leaf for leaf in held}
        needed, at = 0, ""
        for i, (digest, args, _) in enumerate(self.calls):
            mine = {id(leaf): leaf for leaf in args}
            others = {key: leaf for key, leaf in throughout.items() if key not in mine}
            others.update({key: leaf for key, (born, leaf) in made.items()
                           if born < i <= last_use.get(key, len(self.calls)) and key not in mine})
            own = self.programs[digest]["memory"]
            beside = sum(map(_device_bytes, others.values()))
            total = beside + max(own["needed"], sum(map(_device_bytes, mine.values()))
                                 + own["needed"] - own["argument"])
            if total > needed:
                needed, at = total, self.programs[digest]["name"]
        return {"needed": needed, "at": at,
                "held": sum(_device_bytes(leaf) for leaf in throughout.values()),
                "programs": [{k: v for k, v in p.items() if k != "shardings"}
                             for p in self.programs.values()]}


def chain_memory(cfg: Config, mesh, model, optimizer, tokens, mask, segment_ids,
                 options: dict | None = None) -> dict:
    """XLA's memory of the trainer's step as a chain of programs (chain.segment_steps) for
    step_inputs' arguments: each distinct program compiled once; _ChainAccount.memory's dict."""
    steps = chain.segment_steps(program_key(cfg), tuple(routed_layers(model)), mesh)
    values = jax.eval_shape(lambda: switches(cfg))  # abstract: no array on the mesh's devices
    account = _ChainAccount(mesh, options)
    steps.programs(account, model, optimizer, tokens, mask, segment_ids, values)
    return account.memory(jax.tree.leaves((model, optimizer, tokens, mask, segment_ids,
                                           values)))


def memory_bytes(stats) -> dict:
    """XLA's CompiledMemoryStats per device in bytes: argument, output, alias, temp,
    generated_code, `needed` = argument + output - alias + temp and `peak`, the heap simulator's
    peak."""
    fields = ("argument", "output", "alias", "temp", "generated_code")
    out = {f: int(getattr(stats, f"{f}_size_in_bytes")) for f in fields}
    out["needed"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    out["peak"] = int(stats.peak_memory_in_bytes)
    return out


def refusal(message: str) -> dict | None:
    """What a compiler that refused the step for want of memory said ("RESOURCE_EXHAUSTED: ...
    the total memory required for HLO temporaries (49.45G) exceeds available HBM (15.75G)"):
    {"temp": bytes (XLA's G are GiB), "refused": its first line}; None for any other error."""
    match = REFUSED.search(message) if "RESOURCE_EXHAUSTED" in message else None
    return ({"temp": round(float(match[1]) * GIB), "refused": message.strip().splitlines()[0]}
            if match else None)


def compiled_memory(cfg: Config, devices: list, options: dict | None = None):
    """Compile the step of `cfg` for `devices` (topology_devices) as the trainer runs it there ->
    (XLA's memory in bytes: memory_bytes of the one program, chain_memory's of a chain, or
    refusal's dict when the compiler refused a program; seconds to lower and compile; the
    compiled one-program step, else None). options: XLA compiler options (e.g. a dump
    directory)."""
    start = time.perf_counter()
    mesh, *args = step_inputs(cfg, devices)
    try:
        if chained(cfg, mesh):
            return chain_memory(cfg, mesh, *args, options), time.perf_counter() - start, None
        compiled = lower_train_step(cfg, *args, mesh).compile(options)
    except jax.errors.JaxRuntimeError as error:
        refused = refusal(str(error))
        if refused is None:
            raise
        return refused, time.perf_counter() - start, None
    return memory_bytes(compiled.memory_analysis()), time.perf_counter() - start, compiled


def least_recompute_that_fits(cfg: Config, devices: list, memory: int | None):
    """`remat_policy: auto` for `devices` with `memory` bytes each: the first policy of
    REMAT_ORDER whose step, compiled for them, XLA accepts and needs at most `memory` of
    (`needed`); with `memory` None (devices whose memory JAX does not report: CPUs, whose memory
    is the host's) `none`, compiling nothing. -> (policy, [{"remat", "compile_s", "memory":
    compiled_memory's} of each policy compiled, the chosen one last])."""
    if memory is None:
        return "none", []
    tried, log = [], logging.getLogger("moebalance")
    for policy in REMAT_ORDER:
        # each candidate is a whole compile (minutes for a large model): say which one runs
        log.info("remat_policy auto: compiling the step under remat %s", policy)
        stats, seconds, _ = compiled_memory(dataclasses.replace(cfg, remat_policy=policy), devices)
        tried.append({"remat": policy, "compile_s": round(seconds, 1), "memory": stats})
        log.info("remat_policy auto: %s", tried_summary(tried[-1:]))
        if "refused" not in stats and stats["needed"] <= memory:
            return policy, tried
    raise ConfigError(f"remat_policy auto: no policy's step fits {memory / GIB:.2f} GiB per "
                      f"device ({tried_summary(tried)}): spread it over "
                      "more devices, or lower per_device_batch_size or max_target_length (with "
                      "more gradient_accumulation_steps for the same tokens per step)")


# remat_policy auto's choices in this process: runs that differ only in their balancing switches
# or their steps (the A/B's, a study's arms) have one step program and one choice
_CHOSEN: dict[tuple, str] = {}


def resolve_remat(cfg: Config | None, mesh) -> Config | None:
    """`cfg` with `remat_policy: auto` chosen for the devices of `mesh` and the memory JAX reports
    for them (least_recompute_that_fits); any other policy (or None) as it is."""
    if cfg is None or cfg.remat_policy != "auto":
        return cfg
    devices = list(mesh.devices.flat)
    program = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in (*SWITCHES, "steps")}
    key = (json.dumps(program, sort_keys=True), tuple(d.id for d in devices))
    if key not in _CHOSEN:
        memory = (devices[0].memory_stats() or {}).get("bytes_limit")
        _CHOSEN[key], tried = least_recompute_that_fits(cfg, devices, memory)
        if tried:
            logging.getLogger("moebalance").info("remat_policy auto: %s (%s)", _CHOSEN[key],
                                                 tried_summary(tried))
    return dataclasses.replace(cfg, remat_policy=_CHOSEN[key])


def tried_summary(tried: list[dict]) -> str:
    """'none refused (temporaries 21.20 GiB), save_experts 12.31 GiB, ...'"""
    return ", ".join(f"{t['remat']} refused (temporaries {t['memory']['temp'] / GIB:.2f} GiB)"
                     if "refused" in t["memory"] else
                     f"{t['remat']} {t['memory']['needed'] / GIB:.2f} GiB" for t in tried)
