"""Manifold-constrained hyper-connections (mHC), DeepSeek-V4's residual stream. All float32.

The residual is m parallel streams h [B, S, m, D]. Around each sub-layer f (attention, MoE):

    x      = flatten(h) / RMS(flatten(h))                           [B, S, m*D]
    mixes  = x @ fn                                                 [B, S, (2+m)*m]
    pre    = sigmoid(mixes[:m] * scale[0] + base[:m]) + eps         [B, S, m]
    post   = 2 * sigmoid(mixes[m:2m] * scale[1] + base[m:2m])       [B, S, m]
    comb   = Sinkhorn(softmax_rows(mixes[2m:] * scale[2] + base[2m:]) + eps)   [B, S, m, m]
    y      = sum_j pre[j] * h[j]                                    the sub-layer's input
    h'[i]  = post[i] * f(y) + sum_j comb[j, i] * h[j]

Sinkhorn: normalise columns, then (iters - 1) times rows then columns, so comb is doubly
stochastic (to the iteration's precision) and the stream mixing preserves the residual's mass.
The head collapses the streams with its own pre weights only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moebalance.model.layers import constant, init_normal, rms


def sinkhorn(logits: jax.Array, iters: int, eps: float) -> jax.Array:
    """[..., m, m] -> doubly stochastic [..., m, m] (rows j, columns i)."""
    c = jax.nn.softmax(logits, axis=-1) + eps
    c = c / (c.sum(-2, keepdims=True) + eps)

    def rows_then_columns(_, c):
        c = c / (c.sum(-1, keepdims=True) + eps)
        return c / (c.sum(-2, keepdims=True) + eps)

    # a loop, not 19 unrolled copies: one body to compile (and to differentiate)
    return jax.lax.fori_loop(0, iters - 1, rows_then_columns, c)


def _init_params(rngs, outputs: int, hc: int, dim: int, base):
    # Small random fn breaks the symmetry of the m identical initial streams.
    fn = nnx.Param(init_normal(rngs, (hc * dim, outputs), jnp.float32, 0.1 / math.sqrt(hc * dim)))
    return fn, nnx.Param(jnp.asarray(base, jnp.float32))


class HyperConnection(nnx.Module):
    """The pre/post/comb maps around one sub-layer."""

    def __init__(self, dim: int, hc: int, *, iters: int, eps: float, norm_eps: float,
                 rngs: nnx.Rngs):
        self.hc, self.iters, self.eps, self.norm_eps = hc, iters, eps, norm_eps
        # Initially pre = 1/m (y = the stream mean), post = 1, comb uniform.
        base = np.concatenate([np.full(hc, -math.log(hc - 1) if hc > 1 else 10.0),
                               np.zeros(hc), np.zeros(hc * hc)]).astype(np.float32)
        self.fn, self.base = _init_params(rngs, (2 + hc) * hc, hc, dim, base)
        self.scale = nnx.Param(constant(1.0, (3,)))

    def pre(self, h: jax.Array):
        """h [B, S, m, D] -> (y [B, S, D] in h's dtype, post [B, S, m], comb [B, S, m, m])."""
        m = self.hc
        h32 = h.astype(jnp.float32)
        mixes = rms(h32.reshape(*h.shape[:-2], -1), self.norm_eps) @ self.fn[...]  # [B,S,(2+m)m]
        base, scale = self.base[...], self.scale[...]
        pre = jax.nn.sigmoid(mixes[..., :m] * scale[0] + base[:m]) + self.eps
        post = 2.0 * jax.nn.sigmoid(mixes[..., m:2 * m] * scale[1] + base[m:2 * m])
        comb = (mixes[..., 2 * m:] * scale[2] + base[2 * m:]).reshape(*mixes.shape[:-1], m, m)
        comb = sinkhorn(comb, self.iters, self.eps)
        y = (pre[..., None] * h32).sum(-2)  # [B, S, D]; broadcasts, not m x m batched matmuls,
        return y.astype(h.dtype), post, comb  # which XLA's CPU runs ~3x slower

    @staticmethod
    def post(fy: jax.Array, h: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
        """h'[i] = post[i] * f(y) + sum_j comb[j, i] * h[j]  -> [B, S, m, D] in h's dtype."""
        mixed = (comb[..., None] * h.astype(jnp.float32)[..., :, None, :]).sum(-3)  # [B,S,m,D]
        out = post[..., None] * fy.astype(jnp.float32)[..., None, :] + mixed
        return out.astype(h.dtype)


class HyperHead(nnx.Module):
    """Collapse the m streams before the final norm: y = sum_j pre[j] * h[j]."""

    def __init__(self, dim: int, hc: int, *, eps: float, norm_eps: float, rngs: nnx.Rngs):
        self.eps, self.norm_eps = eps, norm_eps
        base = np.full(hc, -math.log(hc - 1) if hc > 1 else 10.0, np.float32)
        self.fn, self.base = _init_params(rngs, hc, hc, dim, base)
        self.scale = nnx.Param(constant(1.0, (1,)))

    def __call__(self, h: jax.Array) -> jax.Array:
        h32 = h.astype(jnp.float32)
        mixes = rms(h32.reshape(*h.shape[:-2], -1), self.norm_eps) @ self.fn[...]  # [B, S, m]
        pre = jax.nn.sigmoid(mixes * self.scale[0] + self.base[...]) + self.eps
        return (pre[..., None] * h32).sum(-2).astype(h.dtype)
