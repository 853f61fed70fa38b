"""Manifold-constrained hyper-connections (mHC), DeepSeek-V4's residual stream. All float32, its
dots at full float32 precision on any backend (layers.FP32).

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

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moebalance.model.layers import FP32, constant, init_normal, rms


@jax.named_scope("sinkhorn")
def sinkhorn(logits: jax.Array, iters: int, eps: float) -> jax.Array:
    """[..., m, m] -> doubly stochastic [..., m, m] (rows j, columns i)."""
    *batch, m, _ = logits.shape
    # [m, m, T]: tokens flat on the fast axis (XLA's CPU runs this layout ~10x faster, and more
    # than 10x slower again with any size-1 axis left among the token axes)
    c = logits.reshape(-1, m, m).transpose(1, 2, 0)
    return _sinkhorn(c, iters, eps).transpose(2, 0, 1).reshape(*batch, m, m)


def _normalize_columns(c, eps):
    return c / (c.sum(0, keepdims=True) + eps)


def _rows_then_columns(c, eps):
    """One Sinkhorn iteration on c [m, m, ...] -> (out, what its backward needs)."""
    r = c.sum(1, keepdims=True) + eps
    rows = c / r
    s = rows.sum(0, keepdims=True) + eps
    out = rows / s
    return out, (rows, r, out, s)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _sinkhorn(x, iters, eps):
    return _sinkhorn_fwd(x, iters, eps)[0]


def _sinkhorn_fwd(x, iters, eps):
    c, first_vjp = jax.vjp(lambda x: _normalize_columns(jax.nn.softmax(x, axis=1) + eps, eps), x)

    def step(c, _):
        return _rows_then_columns(c, eps)[0], c

    out, inputs = jax.lax.scan(step, c, None, length=iters - 1)
    return out, (inputs, first_vjp)


def _sinkhorn_bwd(iters, eps, residuals, g):
    # Hand-written so that XLA sees one small loop body: differentiating the unrolled or scanned
    # iterations lets XLA's CPU fusion recompute earlier iterations inside later ones (~40x slower).
    inputs, first_vjp = residuals

    def step(g, c):
        rows, r, out, s = _rows_then_columns(c, eps)[1]
        g = (g - (g * out).sum(0, keepdims=True)) / s  # through the column normalisation
        return (g - (g * rows).sum(1, keepdims=True)) / r, None  # through the row normalisation

    g, _ = jax.lax.scan(step, g, inputs, reverse=True)
    return first_vjp(g)


_sinkhorn.defvjp(_sinkhorn_fwd, _sinkhorn_bwd)


@jax.custom_vjp
def _mix_streams(fy, h, post, comb):
    """fy [T, D], h [T, m, D], post [T, m], comb [T, m, m] -> [T, m, D]:
    out[i] = post[i] * fy + sum_j comb[j, i] * h[j]."""
    # m broadcast products, one fused loop: XLA's CPU runs this contraction over the
    # non-minor axis j as a batched matmul ~10x slower
    mixed = sum(comb[:, j, :, None] * h[:, j, None, :] for j in range(h.shape[1]))
    return post[..., None] * fy[:, None] + mixed


def _mix_streams_fwd(fy, h, post, comb):
    return _mix_streams(fy, h, post, comb), (fy, h, post, comb)


def _mix_streams_bwd(residuals, g):
    # Four small batched matmuls; XLA's CPU runs the autodiff of the forward ~2x slower.
    fy, h, post, comb = residuals
    return (jnp.einsum("ti,tid->td", post, g, precision=FP32),
            jnp.einsum("tji,tid->tjd", comb, g, precision=FP32),
            jnp.einsum("tid,td->ti", g, fy, precision=FP32),
            jnp.einsum("tjd,tid->tji", h, g, precision=FP32))


_mix_streams.defvjp(_mix_streams_fwd, _mix_streams_bwd)


def _init_params(rngs, outputs: int, hc: int, dim: int, base):
    # Small random fn breaks the symmetry of the m identical initial streams.
    fn = nnx.Param(init_normal(rngs, (hc * dim, outputs), jnp.float32, 0.1 / math.sqrt(hc * dim)))
    return fn, nnx.Param(jax.device_put(np.asarray(base, np.float32)))


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
        """h [B, S, m, D] -> (y [B, S, D] in h's dtype, post [B, S, m], comb [B, S, m, m]).
        Computed on T = B*S flattened tokens, which XLA's CPU runs ~2x faster than [B, S] with
        B = 1."""
        with jax.named_scope("mhc"):
            return self._pre(h)

    def _pre(self, h):
        m = self.hc
        *batch, _, dim = h.shape
        h32 = h.astype(jnp.float32).reshape(-1, m, dim)  # [T, m, D]
        mixes = jnp.matmul(rms(h32.reshape(-1, m * dim), self.norm_eps), self.fn[...],
                           precision=FP32)  # [T, (2+m)m]
        base, scale = self.base[...], self.scale[...]
        pre = jax.nn.sigmoid(mixes[..., :m] * scale[0] + base[:m]) + self.eps
        post = 2.0 * jax.nn.sigmoid(mixes[..., m:2 * m] * scale[1] + base[m:2 * m])
        comb = (mixes[..., 2 * m:] * scale[2] + base[2 * m:]).reshape(*mixes.shape[:-1], m, m)
        comb = sinkhorn(comb, self.iters, self.eps)
        y = jnp.einsum("tj,tjd->td", pre, h32, precision=FP32)  # [T, D]
        return y.reshape(*batch, dim).astype(h.dtype), post.reshape(*batch, m), comb.reshape(
            *batch, m, m)

    @staticmethod
    @jax.named_scope("mhc")
    def post(fy: jax.Array, h: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
        """h'[i] = post[i] * f(y) + sum_j comb[j, i] * h[j]  -> [B, S, m, D] in h's dtype."""
        m, dim = h.shape[-2:]
        out = _mix_streams(fy.astype(jnp.float32).reshape(-1, dim),
                           h.astype(jnp.float32).reshape(-1, m, dim), post.reshape(-1, m),
                           comb.reshape(-1, m, m))  # [T, m, D]
        return out.reshape(h.shape).astype(h.dtype)


class HyperHead(nnx.Module):
    """Collapse the m streams before the final norm: y = sum_j pre[j] * h[j]."""

    def __init__(self, dim: int, hc: int, *, eps: float, norm_eps: float, rngs: nnx.Rngs):
        self.eps, self.norm_eps = eps, norm_eps
        base = np.full(hc, -math.log(hc - 1) if hc > 1 else 10.0, np.float32)
        self.fn, self.base = _init_params(rngs, hc, hc, dim, base)
        self.scale = nnx.Param(constant(1.0, (1,)))

    @jax.named_scope("mhc")
    def __call__(self, h: jax.Array) -> jax.Array:
        h32 = h.astype(jnp.float32)
        mixes = jnp.matmul(rms(h32.reshape(*h.shape[:-2], -1), self.norm_eps), self.fn[...],
                           precision=FP32)  # [B, S, m]
        pre = jax.nn.sigmoid(mixes * self.scale[0] + self.base[...]) + self.eps
        return jnp.einsum("...j,...jd->...d", pre, h32, precision=FP32).astype(h.dtype)
