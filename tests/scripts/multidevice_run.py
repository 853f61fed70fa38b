"""Helper for test_sharding: train 3 steps of a small config on each of the given device counts
and meshes, one after another in this process (its CPU devices set by XLA_FLAGS before JAX
starts; a run on n devices uses the first n), and dump for each its counts, biases, losses and
the router and output logits of the trained model on the first batch, how many programs the
steps after the first compiled, and how many of the step's own programs the first step compiled (a
chain of programs is compiled ahead first, ahead.compile_ahead, as the trainer does).

Usage: multidevice_run.py OUT_DIR RUN ...; RUN is DEVICES[:KEY=VALUE,...] (config overrides, e.g.
the mesh's `ici_*` keys); run i is written to OUT_DIR/i.npz."""

import gc
import logging
import re
import sys
from pathlib import Path

import jax
import numpy as np
from jax import monitoring
from flax import nnx

from moebalance.config import load_config
from moebalance.data import batches
from moebalance.model.transformer import get_biases
from moebalance.training import sharding
from moebalance.training.ahead import compile_ahead
from moebalance.training.loop import build
from moebalance.training.step import chained, make_train_step, on_mesh

GLOBAL_BATCH = 8
COMPILES = []  # every program compiled in this process, in order
monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: COMPILES.append(event)
    if event == "/jax/core/compile/backend_compile_duration" else None)
# the training step's programs: the one program, or a chain's (training/step.py)
STEP_PROGRAMS = {"step", "forward", "head", "backward", "accumulate", "apply"}
COMPILED_NAMES = []  # the names of the programs XLA compiled, from JAX's own timing lines


class _CompiledNames(logging.Handler):
    def emit(self, record):
        found = re.match(r"Finished XLA compilation of jit\((\w+)\)", record.getMessage())
        if found:
            COMPILED_NAMES.append(found[1])


_dispatch_log = logging.getLogger("jax._src.dispatch")
_dispatch_log.setLevel(logging.DEBUG)
_dispatch_log.addHandler(_CompiledNames())
_dispatch_log.propagate = False


def run(out: Path, devices: int, *overrides: str):
    cfg = load_config("deepseek4-smoke", [f"per_device_batch_size={GLOBAL_BATCH // devices}",
                                          "max_target_length=32", "gradient_accumulation_steps=2",
                                          "load_balance_loss_weight=1e-3", *overrides])
    mesh = sharding.make_mesh(cfg, jax.devices()[:devices])
    data = batches(cfg, global_batch=GLOBAL_BATCH)
    model, optimizer = build(cfg, mesh, train_data=data)
    step = make_train_step(cfg, model, mesh)
    if chained(cfg, mesh):  # a chain's programs compiled ahead, as the trainer does
        with compile_ahead() as ahead:
            ahead(step, model, optimizer, *sharding.global_batch(mesh, *data.batch(0)))
    names_before = len(COMPILED_NAMES)
    results = {"counts": [], "loss": [], "grad_norm": []}
    for i in range(3):
        if i == 1:
            compiled_before = len(COMPILES)
            step_compiled_first = len(STEP_PROGRAMS.intersection(COMPILED_NAMES[names_before:]))
        metrics = jax.device_get(step(model, optimizer, *sharding.global_batch(mesh, *data.batch(i))))
        for key in results:
            results[key].append(np.asarray(metrics[key]))
    compiles_after_first = len(COMPILES) - compiled_before  # the forward below compiles more
    tokens, _, segment_ids = sharding.global_batch(mesh, *data.batch(0))

    @nnx.jit
    def forward(model, tokens, segment_ids):
        out = model(tokens[:, :-1], segment_ids=segment_ids)
        return out.logits, out.routing.logits

    logits, router_logits = jax.device_get(on_mesh(forward, mesh)(model, tokens[0], segment_ids[0]))
    embed = model.embed[...]
    expert_weights = model.segments[-1].ffn.w1[...]  # a top-k block's routed experts [E, D, F]
    np.savez(out, devices=devices, mesh=np.asarray(list(mesh.shape.values())),
             bias=np.asarray(get_biases(model)), embed_spec=str(embed.sharding.spec),
             expert_spec=str(expert_weights.sharding.spec), logits=logits,
             router_logits=router_logits, embed=np.asarray(embed),
             compiles_after_the_first_step=compiles_after_first,
             step_compiled_in_the_first_step=step_compiled_first,
             **{k: np.stack(v) for k, v in results.items()})


def main(out_dir: str, *runs: str):
    for i, spec in enumerate(runs):
        devices, _, overrides = spec.partition(":")
        run(Path(out_dir) / f"{i}.npz", int(devices), *filter(None, overrides.split(",")))
        jax.clear_caches()  # the run's programs released: the next ones compile faster without
        gc.collect()


if __name__ == "__main__":
    main(*sys.argv[1:])
