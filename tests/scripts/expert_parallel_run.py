"""Helper for test_expert_parallel: one MoE layer on 8 CPU devices (XLA_FLAGS set by the caller),
its output and gradients under expert parallelism next to the same layer on one device.

Usage: expert_parallel_run.py OUT_DIR CASE ..., each CASE one of CASES, run one after another in
this process and written to OUT_DIR/CASE.npz. The 1-device reference runs the
layer once per expert-parallel group (the tokens one group dispatches together), which is what a
capacity limit is defined on; dropless the split makes no difference.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import moebalance.kernels.triton as gm
from moebalance.model.moe import MoE, MoEConfig
from moebalance.training.sharding import AXES

# case -> (mesh shape (data, fsdp, expert), MoEConfig overrides, bias pushing to experts 0..3)
CASES = {
    "balanced": ((1, 1, 8), {}, False),
    "skewed": ((1, 1, 8), {}, True),  # every token on ranks 0-1: the worst-case buffer path
    "no_fast_path": ((2, 2, 2), {"ep_buffer_factor": 0.0}, False),
    "capacity": ((2, 1, 4), {"capacity_factor": 1.0, "drop_policy": "probs"}, False),
    "capacity_position": ((1, 2, 4), {"capacity_factor": 0.8, "drop_policy": "position"}, False),
    "device_limited": ((1, 1, 8), {"n_routing_groups": 8, "topk_routing_group": 2}, False),
    # the grouped matmul's custom VJP under shard_map, its kernels' maths in plain jnp (Pallas'
    # interpret mode cannot run under shard_map; tests/test_kernels_triton.py tests the kernels)
    "pallas": ((2, 1, 4), {"kernel": "pallas"}, False),
}
BATCH, SEQ = 8, 24


def layer(overrides):
    cfg = MoEConfig(emb_dim=16, num_experts=16, num_experts_per_tok=4, moe_mlp_dim=8,
                    shared_experts=1, block_size=8, **overrides)
    return MoE(cfg, rngs=nnx.Rngs(0))


@nnx.jit
def loss_and_grads(model, x, probe):
    """loss = sum(y * probe) -> (y, indices, dropped, d loss / d x, {weight: d loss / d weight})."""
    graphdef, state = nnx.split(model)

    def loss(state, x):
        y, rec = nnx.merge(graphdef, state)(x)
        return jnp.sum(y * probe), (y, rec.indices, rec.dropped)

    (_, (y, indices, dropped)), (state_grads, x_grad) = jax.value_and_grad(
        loss, argnums=(0, 1), has_aux=True)(state, x)
    weights = {k: getattr(state_grads, k)[...] for k in ("w1", "w3", "w2", "router")}
    return y, indices, dropped, x_grad, weights


def plain_block_matmul(x, w, block_expert, *, transpose_w=False):
    w = w.swapaxes(1, 2) if transpose_w else w
    return jnp.einsum("nbk,nkf->nbf", x, w[block_expert]).astype(x.dtype)


def plain_weight_grad(x, dy, block_expert, num_experts):
    one_hot = jax.nn.one_hot(block_expert, num_experts, dtype=x.dtype)
    return jnp.einsum("ne,nbk,nbf->ekf", one_hot, x, dy).astype(x.dtype)


def run(out, case):
    shape, overrides, skewed = CASES[case]
    model = layer(overrides)
    if skewed:
        model.bias[...] = jnp.where(jnp.arange(16) < 4, 100.0, 0.0)
    x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, 16))
    probe = jax.random.normal(jax.random.key(2), (BATCH, SEQ, 16))
    mesh = Mesh(np.asarray(jax.devices()).reshape(shape), AXES)
    with jax.set_mesh(mesh):
        y, indices, dropped, x_grad, w_grads = jax.device_get(loss_and_grads(model, x, probe))
        hlo = jax.jit(lambda x: model(x)[0]).lower(x).as_text()
    # the reference: one call per expert-parallel group (batch rows are split data-major)
    groups = shape[0] * shape[1]
    rows = BATCH // groups
    ref = [jax.device_get(loss_and_grads(model, x[g * rows:(g + 1) * rows],
                                         probe[g * rows:(g + 1) * rows])) for g in range(groups)]
    np.savez(out, all_to_all="all_to_all" in hlo, y=y, indices=indices, dropped=dropped,
             x_grad=x_grad,
             ref_y=np.concatenate([r[0] for r in ref]),
             ref_indices=np.concatenate([r[1] for r in ref]),
             ref_dropped=sum(r[2] for r in ref),
             ref_x_grad=np.concatenate([r[3] for r in ref]),
             **{f"grad_{k}": v for k, v in w_grads.items()},
             **{f"ref_grad_{k}": sum(r[4][k] for r in ref) for k in w_grads})


def main(out_dir, *cases):
    kernels = gm.block_matmul, gm.expert_weight_grad
    for case in cases:
        if CASES[case][1].get("kernel") == "pallas":
            gm.block_matmul, gm.expert_weight_grad = plain_block_matmul, plain_weight_grad
        run(Path(out_dir) / f"{case}.npz", case)
        gm.block_matmul, gm.expert_weight_grad = kernels


if __name__ == "__main__":
    main(*sys.argv[1:])
