"""Expert parallelism: routed experts split over the `expert` mesh axis, tokens sent to the devices
that hold their experts by all-to-all, inside one `jax.shard_map` over the whole mesh.

Per device (axis glossary): R expert-axis size, E_l = E / R local experts, T_l local tokens (the
token axis is split over every mesh axis), A_l = T_l * K local assignments, S send slots per
destination rank.

    route     before this module, on global arrays: counts, losses and the bias update stay global
    pack      each local assignment -> a slot of the send buffer [R * S, D] of its expert's rank
    exchange  all_to_all over `expert`: slice r of every source's buffer goes to rank r
    experts   the received rows [R * S, D] through the E_l local experts (the core's layouts)
    return    all_to_all back, unpack to assignments, sum each token's K outputs in float32

Buffers are static under jit. Dropless needs S >= the most one device sends to one rank; the worst
case is S = A_l (every assignment to one rank), which has every device compute R * A_l rows. With
`buffer_factor` f > 0 a fast path with S = ceil(f * A_l / R) runs whenever every (device, rank) pair
fits, decided alike on all devices by a `pmax`, and the worst-case path otherwise: dropless either
way, and balanced routing is what keeps a step on the fast path. With R = 1 (data / fsdp only) the
exchange is the identity and each device dispatches its own tokens to all experts.

A capacity limit (`capacity_factor` > 0) applies on the receiving side, per local expert, to the
tokens of one expert-parallel group: C = ceil(cf * T_l * R * K / E).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moebalance.balancing import expert_counts
from moebalance.model.dispatch import gather_rows, plan_dispatch, slot_major_here

EXPERT_AXIS = "expert"


def active_mesh():
    """The mesh set by `jax.set_mesh` when it spans more than one device, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return None
    return mesh


def _take(x, idx, fill):
    """x[idx] with `fill` where idx == len(x) (non-differentiable metadata)."""
    return jnp.concatenate([x, jnp.full((1, *x.shape[1:]), fill, x.dtype)])[idx]


def expert_parallel_ffn(x, indices, weights, valid, w1, w3, w2, *, mesh, expert_mlp, layout,
                        config):
    """Routed experts under expert parallelism.

    x [B, N, D], indices / weights [B, N, K], valid [B, N] (B split over every mesh axis);
    w1 / w3 [E, D, F], w2 [E, F, D] (E split over `expert`); expert_mlp(rows, row_weights, plan,
    layout, w1, w3, w2) the core's expert computation; layout(num_tokens) the core's layout choice.
    -> (y [B, N, D] float32, dropped [] int32 summed over the mesh).
    """
    axes = tuple(mesh.axis_names)
    ranks = mesh.shape[EXPERT_AXIS]
    if config.num_experts % ranks:
        raise ValueError(f"num_experts={config.num_experts} is not divisible by the {ranks} "
                         f"expert-parallel ranks (`ici_expert_parallelism`)")
    local = functools.partial(_local_ffn, ranks=ranks, axes=axes, expert_mlp=expert_mlp,
                              layout=layout, config=config)
    tokens, experts = P(axes), P(EXPERT_AXIS)
    return jax.shard_map(
        local, mesh=mesh, in_specs=(tokens, tokens, tokens, tokens, experts, experts, experts),
        out_specs=(tokens, P()))(x, indices, weights, valid, w1, w3, w2)


def fast_slots(num_assign: int, ranks: int, buffer_factor: float) -> int | None:
    """Send slots per rank of the fast path, ceil(f * A_l / R), or None when there is none (one
    rank, f <= 0, or no fewer slots than the worst case's A_l)."""
    fast = math.ceil(buffer_factor * num_assign / ranks)
    if ranks == 1 or buffer_factor <= 0 or fast >= num_assign:
        return None
    return fast


def _local_ffn(x, indices, weights, valid, w1, w3, w2, *, ranks, axes, expert_mlp, layout,
               config):
    lead, d = x.shape[:-1], x.shape[-1]
    k = indices.shape[-1]
    xt = x.reshape(-1, d)  # [T_l, D]
    indices, weights = indices.reshape(-1, k), weights.reshape(-1, k)
    valid = valid.reshape(-1)
    num_local = w1.shape[0]  # E_l
    num_assign = indices.size  # A_l
    dest_rank = indices // num_local  # [T_l, K]
    rank_counts = expert_counts(dest_rank, ranks, valid)  # [R] assignments sent to each rank

    def run(slots):
        return _exchange(xt, indices, weights, valid, dest_rank, rank_counts, w1, w3, w2,
                         slots=slots, ranks=ranks, axes=axes, expert_mlp=expert_mlp,
                         layout=layout, config=config)

    fast = fast_slots(num_assign, ranks, config.ep_buffer_factor)
    if fast is None:
        y, dropped = run(num_assign)
    else:
        fits = jax.lax.pmax(rank_counts.max(), axes) <= fast
        y, dropped = jax.lax.cond(fits, lambda: run(fast), lambda: run(num_assign))
    return y.reshape(*lead, d), jax.lax.psum(dropped, axes)


def _exchange(xt, indices, weights, valid, dest_rank, rank_counts, w1, w3, w2, *, slots, ranks,
              axes, expert_mlp, layout, config):
    """One expert-parallel pass with `slots` send slots per rank (>= every rank_counts entry)."""
    k = indices.shape[-1]
    num_local = w1.shape[0]
    send = plan_dispatch(dest_rank, weights, valid, rank_counts, layout="capacity",
                         capacity=slots, drop_policy="position",
                         slot_major=slot_major_here())  # [R * S] slots, rank-major
    rows = gather_rows(send.per_assignment(xt, k), send.row_src, send.dest)  # [R*S, D]
    row_w = gather_rows(send.flat(weights)[:, None], send.row_src, send.dest)  # [R*S, 1]
    local_expert = send.flat(jnp.where(valid[:, None], indices % num_local, num_local))
    row_e = _take(local_expert, send.row_src, num_local)  # [R*S], E_l marks an empty slot

    def exchange(a):
        return jax.lax.all_to_all(a, EXPERT_AXIS, 0, 0, tiled=True) if ranks > 1 else a

    rows, row_w, row_e = exchange(rows), exchange(row_w), exchange(row_e)
    recv_valid = row_e < num_local
    recv_counts = expert_counts(row_e[:, None], num_local, recv_valid)  # [E_l]
    group_tokens = xt.shape[0] * ranks
    mode = layout(group_tokens)
    plan = plan_dispatch(row_e[:, None], row_w, recv_valid, recv_counts, layout=mode,
                         block=config.block_size, capacity=config.capacity(group_tokens),
                         drop_policy=config.drop_policy)
    buf = gather_rows(rows, plan.row_src, plan.dest)
    buf_w = gather_rows(row_w, plan.row_src, plan.dest)
    out = expert_mlp(buf, buf_w, plan, mode, w1, w3, w2)
    back = exchange(gather_rows(out, plan.dest, plan.row_src))  # [R*S, D], in send order again
    return send.token_sum(gather_rows(back, send.dest, send.row_src), k), plan.dropped
