"""Helper for test_sharding: train 3 steps of a small config on however many CPU devices this
process has (set by XLA_FLAGS before JAX starts) and dump counts, biases and losses."""

import sys

import jax
import numpy as np
from flax import nnx

from moebalance.config import load_config
from moebalance.data import batches
from moebalance.model.transformer import get_biases
from moebalance.training import sharding
from moebalance.training.loop import build
from moebalance.training.step import make_train_step

GLOBAL_BATCH = 8


def main(out: str, *overrides: str):
    devices = jax.device_count()
    cfg = load_config("deepseek4-smoke", [f"per_device_batch_size={GLOBAL_BATCH // devices}",
                                          "max_target_length=32", "gradient_accumulation_steps=2",
                                          "load_balance_loss_weight=1e-3", *overrides])
    mesh = sharding.make_mesh(cfg)
    model, optimizer = build(cfg, mesh)
    step = make_train_step(cfg, model)
    data = batches(cfg)
    results = {"counts": [], "loss": [], "grad_norm": []}
    for i in range(3):
        metrics = jax.device_get(step(model, optimizer, *sharding.global_batch(mesh, *data.batch(i))))
        for key in results:
            results[key].append(np.asarray(metrics[key]))
    embed = model.embed[...]
    np.savez(out, devices=devices, mesh=np.asarray(list(mesh.shape.values())),
             bias=np.asarray(get_biases(model)), embed_spec=str(embed.sharding.spec),
             embed=np.asarray(embed), **{k: np.stack(v) for k, v in results.items()})


if __name__ == "__main__":
    main(*sys.argv[1:])
