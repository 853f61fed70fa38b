"""Helper for test_sharding: train 3 steps of a small config on however many CPU devices this
process has (set by XLA_FLAGS before JAX starts) and dump counts, biases, losses and the router and
output logits of the trained model on the first batch, and how many programs the steps after
the first compiled."""

import sys

import jax
import numpy as np
from jax import monitoring
from flax import nnx

from moebalance.config import load_config
from moebalance.data import batches
from moebalance.model.transformer import get_biases
from moebalance.training import sharding
from moebalance.training.loop import build
from moebalance.training.step import make_train_step, on_mesh

GLOBAL_BATCH = 8


def main(out: str, *overrides: str):
    devices = jax.device_count()
    cfg = load_config("deepseek4-smoke", [f"per_device_batch_size={GLOBAL_BATCH // devices}",
                                          "max_target_length=32", "gradient_accumulation_steps=2",
                                          "load_balance_loss_weight=1e-3", *overrides])
    mesh = sharding.make_mesh(cfg)
    model, optimizer = build(cfg, mesh)
    step = make_train_step(cfg, model, mesh)
    data = batches(cfg)
    results = {"counts": [], "loss": [], "grad_norm": []}
    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    for i in range(3):
        if i == 1:
            compiles.clear()
        metrics = jax.device_get(step(model, optimizer, *sharding.global_batch(mesh, *data.batch(i))))
        for key in results:
            results[key].append(np.asarray(metrics[key]))
    compiles_after_first = len(compiles)  # the forward below compiles more
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
             **{k: np.stack(v) for k, v in results.items()})


if __name__ == "__main__":
    main(*sys.argv[1:])
