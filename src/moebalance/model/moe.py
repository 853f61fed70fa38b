"""The DeepSeek-V4 MoE feed-forward layer in Flax NNX.

    y = sum_k w_k * Expert_{e_k}(x) + SharedExperts(x)

route -> dispatch -> experts -> combine, each under a `jax.named_scope` of that name. Routed experts
are SwiGLU with DeepSeek-V4's clamp, the routing weight applied before the down projection; the
shared experts (0..n) are the same kind of SwiGLU, unweighted. The router's logits, scores and bias
are float32 whatever the model dtype (the router's matmul at full float32 precision on any
backend, layers.FP32); the bias is a `RouterBias` variable (never an `nnx.Param`, so
optimizers built with `wrt=nnx.Param` and `nnx.grad` never touch it), updated by the trainer from the
layer's `RoutingRecord`. A hash-routed layer holds its token -> experts table as `HashTable` state.

Under a multi-device mesh (`jax.set_mesh`) routing stays on global arrays and the routed experts run
per device inside `jax.shard_map` (expert_parallel.py): each device dispatches its own tokens, and
with an `expert` axis > 1 the experts are split over it and tokens travel by all-to-all.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moebalance import routing
from moebalance.balancing import expert_counts, quantile_fixed_point
from moebalance.config import DISPATCH_MODES, DROP_POLICIES, EXPERT_KERNELS, Config
from moebalance.kernels import grouped_matmul, platform
from moebalance.model.dispatch import gather_rows, plan_dispatch, slot_major_here
from moebalance.model.expert_parallel import active_mesh, expert_parallel_ffn
from moebalance.model.layers import FP32, constant, dense_init
from moebalance.routing import RoutingRecord



class RouterBias(nnx.Variable):
    """The aux-loss-free selection bias [E], float32, non-trainable."""


class RouterBiasAverage(nnx.Variable):
    """The running mean of a RouterBias over the last steps (`routed_bias_average_fraction`)
    [E], float32, non-trainable: the bias validations route with and the run keeps."""


class HashTable(nnx.Variable):
    """A hash-routed layer's token -> experts table [V, K], int32, frozen."""


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """MoE layer settings (MaxText key names where MaxText has the concept)."""

    emb_dim: int  # D
    num_experts: int  # E, routed experts
    num_experts_per_tok: int  # K
    moe_mlp_dim: int  # F, hidden width of one expert
    shared_experts: int = 1  # always-on experts, unweighted
    routed_score_func: str = "sqrtsoftplus"  # softmax | sigmoid | sqrtsoftplus
    routed_scaling_factor: float = 1.0  # route scale on the combine weights
    norm_topk_prob: bool | None = None  # renormalise chosen weights; None: all but softmax
    n_routing_groups: int = 0  # DeepSeek-V3 group-limited routing (0 = off)
    topk_routing_group: int = 0
    swiglu_limit: float = 0.0  # V4 clamp of the SwiGLU inputs (0 = off)
    capacity_factor: float = -1.0  # <= 0: dropless; else C = ceil(cf * T*K/E) per expert
    drop_policy: str = "probs"  # over capacity: drop lowest weight ('probs') or latest ('position')
    dispatch: str = "auto"  # blocked | ragged (jax.lax.ragged_dot) | auto: ragged on TPU only
    block_size: int = 256  # rows per block of the blocked dispatch; ragged: megablox's row tile
    kernel: str = "auto"  # the experts' grouped matmuls: auto | xla | megablox | pallas (kernels/)
    ep_buffer_factor: float = 2.0  # expert parallelism: fast-path send slots (expert_parallel.py)
    dtype: str = "float32"  # activation / matmul dtype
    weight_dtype: str = "float32"  # parameter storage dtype
    average_bias: bool = False  # a top-k layer keeps a RouterBiasAverage beside its bias

    def __post_init__(self):
        for name in ("emb_dim", "num_experts", "moe_mlp_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shared_experts < 0:
            raise ValueError(f"shared_experts must be >= 0, got {self.shared_experts}")
        routing.check_topk(self.num_experts_per_tok, self.num_experts)
        routing.check_score_fn(self.routed_score_func)
        routing.check_groups(
            self.num_experts, self.num_experts_per_tok, self.n_routing_groups,
            self.topk_routing_group,
        )
        if self.swiglu_limit < 0:
            raise ValueError(f"swiglu_limit must be >= 0 (0 = off), got {self.swiglu_limit}")
        if self.drop_policy not in DROP_POLICIES:
            raise ValueError(f"unknown drop_policy {self.drop_policy!r}; choose {DROP_POLICIES}")
        if self.dispatch not in DISPATCH_MODES:
            raise ValueError(f"unknown dispatch {self.dispatch!r}; choose {DISPATCH_MODES}")
        if self.kernel not in EXPERT_KERNELS:
            raise ValueError(f"unknown expert kernel {self.kernel!r}; choose {EXPERT_KERNELS}")
        if self.kernel == "pallas" and self.dispatch == "ragged":
            raise ValueError("kernel 'pallas' (Triton) takes blocked rows; use dispatch 'blocked'")
        for name in ("dtype", "weight_dtype"):
            jnp.dtype(getattr(self, name))  # raises TypeError naming an unknown dtype

    @classmethod
    def from_config(cls, cfg: Config) -> MoEConfig:
        """The MoE layer of a model config (device-limited routing: the groups are the ranks)."""
        return cls(
            emb_dim=cfg.base_emb_dim, num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok, moe_mlp_dim=cfg.base_moe_mlp_dim,
            shared_experts=cfg.shared_experts, routed_score_func=cfg.routed_score_func,
            routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob,
            n_routing_groups=(cfg.ici_expert_parallelism if cfg.routed_device_limit
                              else cfg.n_routing_groups),
            topk_routing_group=cfg.routed_device_limit or cfg.topk_routing_group,
            swiglu_limit=cfg.swiglu_limit, capacity_factor=cfg.capacity_factor,
            drop_policy=cfg.drop_policy, dispatch=cfg.moe_dispatch,
            block_size=cfg.moe_block_size, kernel=cfg.moe_kernel, ep_buffer_factor=cfg.ep_buffer_factor,
            dtype=cfg.dtype, weight_dtype=cfg.weight_dtype,
            average_bias=cfg.routed_bias_average_fraction > 0,
        )

    def capacity(self, num_tokens: int) -> int:
        """Per-expert capacity C for T tokens, or 0 when dropless."""
        if self.capacity_factor <= 0:
            return 0
        return max(1, math.ceil(self.capacity_factor * num_tokens * self.num_experts_per_tok
                                / self.num_experts))


def resolve_dispatch(dispatch: str) -> str:
    """The dropless layout a `moe_dispatch` value runs on this backend: `auto` is ragged on a TPU,
    else blocked (ragged_dot is 25x slower than blocks on an H200: docs/performance.md)."""
    if dispatch == "auto":
        return "ragged" if platform() == "tpu" else "blocked"
    return dispatch


def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """DeepSeek-V4 SwiGLU in float32: gate clipped above at `limit`, up to [-limit, limit]."""
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    if limit > 0:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


def _keep_block_matmuls(prim, *_, **params) -> bool:
    """Remat policy: of the intermediates, keep for the backward pass only the expert matmuls'
    outputs (matmuls with a batch (block) dimension, or the Pallas kernels); the per-block weights
    (the XLA path's one-hot picks: matmuls without one) and the SwiGLU's steps are recomputed."""
    if prim is jax.lax.dot_general_p:
        return bool(params["dimension_numbers"][1][0])
    return prim.name == "pallas_call"


@functools.partial(jax.checkpoint, static_argnums=(6, 7), policy=_keep_block_matmuls)
def _blocked_mlp(blocks, row_weights, block_expert, w1, w3, w2, limit, kernel):
    """The blocked layout's experts: [nb, b, D] blocks of one expert each, [nb, b, 1] routing
    weights, [nb] expert per block -> [nb, b, D], with w1 / w3 [E', D, F], w2 [E', F, D]; each
    matmul by `kernel` (kernels.grouped_matmul). The XLA path's per-block weights are picked
    again in the backward pass rather than kept (Flash's largest block on 256 devices: 80 GiB of
    residuals with them, 15 without)."""
    gate = grouped_matmul(blocks, w1, block_expert, kernel=kernel)
    up = grouped_matmul(blocks, w3, block_expert, kernel=kernel)
    h = (swiglu(gate, up, limit) * row_weights).astype(blocks.dtype)  # [nb, b, F]
    return grouped_matmul(h, w2, block_expert, kernel=kernel)


class SwiGLU(nnx.Module):
    """A dense clamped SwiGLU [..., D] -> [..., D] (the shared experts, fused into width n*F)."""

    def __init__(self, emb_dim: int, hidden: int, *, limit: float, dtype, weight_dtype, rngs):
        self.limit, self.dtype = limit, dtype
        self.w1 = nnx.Param(dense_init(rngs, (emb_dim, hidden), weight_dtype))  # gate
        self.w3 = nnx.Param(dense_init(rngs, (emb_dim, hidden), weight_dtype))  # up
        self.w2 = nnx.Param(dense_init(rngs, (hidden, emb_dim), weight_dtype))  # down

    def __call__(self, x):
        x = x.astype(self.dtype)
        h = swiglu(x @ self.w1[...].astype(self.dtype), x @ self.w3[...].astype(self.dtype),
                   self.limit)
        return h.astype(self.dtype) @ self.w2[...].astype(self.dtype)


class MoE(nnx.Module):
    """Routed + shared experts. `hash_table` [V, K] makes the layer hash-routed (tid2eid).

    Call: (x [..., D], *, token_ids [...] for hash layers, mask [...] valid tokens)
          -> (y [..., D] in `dtype`, RoutingRecord).
    """

    def __init__(self, config: MoEConfig, *, hash_table=None, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.dtype = jnp.dtype(c.dtype)
        wdtype = jnp.dtype(c.weight_dtype)
        e, d, f = c.num_experts, c.emb_dim, c.moe_mlp_dim
        self.router = nnx.Param(dense_init(rngs, (d, e), jnp.float32))  # fp32 whatever the model
        # the selection bias exists on top-k layers only: hash layers choose by token id
        self.bias = None if hash_table is not None else RouterBias(constant(0.0, (e,)))
        self.bias_average = (RouterBiasAverage(constant(0.0, (e,)))
                             if c.average_bias and self.bias is not None else None)
        # True: before routing, the bias is fitted to the tokens routed (transformer.fitting_biases)
        self.fit_bias = False
        self.w1 = nnx.Param(dense_init(rngs, (e, d, f), wdtype, fan_in=d))  # gate
        self.w3 = nnx.Param(dense_init(rngs, (e, d, f), wdtype, fan_in=d))  # up
        self.w2 = nnx.Param(dense_init(rngs, (e, f, d), wdtype, fan_in=f))  # down
        self.shared = (
            SwiGLU(d, c.shared_experts * f, limit=c.swiglu_limit, dtype=self.dtype,
                   weight_dtype=wdtype, rngs=rngs)
            if c.shared_experts else None
        )
        if hash_table is not None:
            if hash_table.shape[1] != c.num_experts_per_tok:
                raise ValueError(
                    f"hash table gives {hash_table.shape[1]} experts per token, the layer routes "
                    f"num_experts_per_tok={c.num_experts_per_tok}"
                )
            routing.check_hash_table(hash_table, e, distinct=False)
            self.hash_table = HashTable(jax.device_put(np.asarray(hash_table, np.int32)))
        else:
            self.hash_table = None

    @property
    def hash_routed(self) -> bool:
        return self.hash_table is not None

    def route(self, x, token_ids, mask):
        """[T, D] -> RoutingRecord of [T, ...] arrays."""
        c = self.config
        logits = jnp.matmul(x.astype(jnp.float32), self.router[...], precision=FP32)  # [T, E]
        normalize = c.norm_topk_prob
        if self.hash_routed:
            if token_ids is None:
                raise ValueError("a hash-routed MoE layer needs token_ids")
            scores = routing.compute_scores(logits, c.routed_score_func)
            indices, weights = routing.hash_route(
                token_ids.reshape(-1), self.hash_table[...], scores,
                route_scale=c.routed_scaling_factor,
                normalize=True if normalize is None else normalize,
            )
            bias = jnp.zeros(c.num_experts, jnp.float32)
        else:
            bias = self.bias[...]
            if self.fit_bias:  # the bias that balances these tokens, from the layer's own
                bias = quantile_fixed_point(routing.compute_scores(logits, c.routed_score_func),
                                            bias, c.num_experts_per_tok, mask=mask)
            indices, weights, scores = routing.route(
                logits, bias, k=c.num_experts_per_tok, score_fn=c.routed_score_func,
                route_scale=c.routed_scaling_factor, n_groups=c.n_routing_groups,
                topk_groups=c.topk_routing_group, normalize=normalize,
            )
        counts = expert_counts(indices, c.num_experts, mask)
        return RoutingRecord(indices, weights, scores, logits, counts, jnp.zeros((), jnp.int32),
                             bias)

    def _layout(self, num_tokens):
        c = self.config
        return "capacity" if c.capacity(num_tokens) else resolve_dispatch(c.dispatch)

    def expert_mlp(self, rows, row_weights, plan, layout, w1, w3, w2):
        """Every buffer row through its expert: [P, D], [P, 1] -> [P, D] with w1 / w3 [E', D, F],
        w2 [E', F, D] (all E experts, or a device's share under expert parallelism).

        out = w2 (weight * swiglu(w1 x, w3 x)): the routing weight is applied before w2 (V4).
        """
        c = self.config
        w1, w3, w2 = (w.astype(self.dtype) for w in (w1, w3, w2))
        if layout == "ragged":
            matmul = functools.partial(grouped_matmul, groups=plan.counts, kernel=c.kernel,
                                       row_tile=c.block_size)
            h = swiglu(matmul(rows, w1), matmul(rows, w3), c.swiglu_limit)  # [P, F]
            return matmul((h * row_weights).astype(self.dtype), w2)
        blocks = rows.reshape(-1, plan.block, rows.shape[-1])  # [nb, b, D]
        out = _blocked_mlp(blocks, row_weights.reshape(*blocks.shape[:2], 1), plan.block_expert,
                           w1, w3, w2, c.swiglu_limit, c.kernel)
        return out.reshape(rows.shape)  # [P, D]

    def routed(self, xt, rec, valid):
        """The routed experts on one device: [T, D] -> ([T, D] float32, dropped [])."""
        c = self.config
        num_tokens, k = xt.shape[0], c.num_experts_per_tok
        layout = self._layout(num_tokens)
        with jax.named_scope("dispatch"):
            plan = plan_dispatch(
                rec.indices, rec.weights, valid, rec.counts, layout=layout,
                block=c.block_size, capacity=c.capacity(num_tokens), drop_policy=c.drop_policy,
                slot_major=slot_major_here(),
            )
            rows = gather_rows(plan.per_assignment(xt, k), plan.row_src, plan.dest)  # [P, D]
            row_w = gather_rows(plan.flat(rec.weights)[:, None], plan.row_src, plan.dest)  # [P, 1]
        with jax.named_scope("experts"):
            out = self.expert_mlp(rows, row_w, plan, layout, self.w1[...], self.w3[...],
                                  self.w2[...])
        with jax.named_scope("combine"):
            y = gather_rows(out, plan.dest, plan.row_src)  # [A, D]
            return plan.token_sum(y, k), plan.dropped

    def __call__(self, x, *, token_ids=None, mask=None):
        c = self.config
        lead = x.shape[:-1]
        xt = x.reshape(-1, c.emb_dim).astype(self.dtype)  # [T, D]
        num_tokens, k = xt.shape[0], c.num_experts_per_tok
        valid = jnp.ones(num_tokens, bool) if mask is None else mask.reshape(-1).astype(bool)
        with jax.named_scope("route"):
            rec = self.route(xt, token_ids, valid)
        mesh = active_mesh()
        if mesh is None:
            y, dropped = self.routed(xt, rec, valid)
        else:  # tokens split over the mesh: per-device dispatch, experts over the `expert` axis
            batch = lead[0] if lead else 1
            y, dropped = expert_parallel_ffn(
                xt.reshape(batch, -1, c.emb_dim), rec.indices.reshape(batch, -1, k),
                rec.weights.reshape(batch, -1, k), valid.reshape(batch, -1),
                self.w1[...], self.w3[...], self.w2[...], mesh=mesh,
                expert_mlp=self.expert_mlp, layout=self._layout, config=c)
            y = y.reshape(num_tokens, c.emb_dim)
        if self.shared is not None:
            with jax.named_scope("shared"):
                y = y + self.shared(xt).astype(jnp.float32)
        rec = rec._replace(
            indices=rec.indices.reshape(*lead, k),
            weights=rec.weights.reshape(*lead, k),
            scores=rec.scores.reshape(*lead, c.num_experts),
            logits=rec.logits.reshape(*lead, c.num_experts),
            dropped=dropped,
        )
        return y.astype(self.dtype).reshape(*lead, c.emb_dim), rec
