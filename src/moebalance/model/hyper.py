"""Manifold-constrained hyper-connections (mHC), DeepSeek-V4's residual stream. All float32, its
dots at full float32 precision on any backend (layers.FP32).

The residual is m parallel streams h [m, B, S, D]. Around each sub-layer f (attention, MoE):

    x      = flatten(h) / RMS(flatten(h))                           [B, S, m*D], j-major
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

from moebalance.model.layers import FP32, constant, init_normal


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


# The residual streams h [m, T, D] lie stream-major: each stream is a [T, D] slab, so every
# operation below is a broadcast product or a reduction over D on whole slabs (a TPU tiles a
# slab's last two axes; with m on the second-minor axis, XLA moved the streams between layouts
# around every operation). Both maps have hand-written backward passes that take h in its own
# dtype and widen it where they read it: on a TPU v5e the autodiff of the float32 forward kept
# float32 copies of the streams and ran 7x as long as the forward.


def _stream_sum(w, h):
    """w [T, m], h [m, T, D] -> sum_j w[:, j] * h[j]  [T, D] float32."""
    return sum(w[:, j, None] * h[j].astype(jnp.float32) for j in range(h.shape[0]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _collapse(maps, norm_eps, h, fn, params):
    """The pre side of a hyper-connection: mixes = RMS-normalised flatten(h) @ fn, the maps'
    weights maps(mixes, params) -> (pre [T, m], extra), and y = sum_j pre[j] * h[j].
    h [m, T, D], fn [m*D, K] -> (y [T, D] in h's dtype, extra)."""
    return _collapse_fwd(maps, norm_eps, h, fn, params)[0]


def _collapse_fwd(maps, norm_eps, h, fn, params):
    m, _, dim = h.shape
    h32 = h.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(h32 * h32, axis=(0, 2)) + norm_eps)  # [T]: 1 / RMS(flatten(h))
    # normalised before the matmul, as the formula reads: streams far from unit RMS (a diverging
    # run's) would overflow h @ fn before the division
    mixes = jnp.einsum("jtd,jdk->tk", h32 * inv[:, None], fn.reshape(m, dim, -1),
                       precision=FP32)  # [T, K]
    (pre, extra), maps_vjp = jax.vjp(maps, mixes, params)
    y = _stream_sum(pre, h).astype(h.dtype)
    return (y, extra), (h, fn, mixes, inv, pre, maps_vjp)


def _collapse_bwd(maps, norm_eps, residuals, grads):
    h, fn, mixes, inv, pre, maps_vjp = residuals
    g_y, g_extra = grads
    m, _, dim = h.shape
    g_y = g_y.astype(jnp.float32)
    g_pre = jnp.stack([(g_y * h[j].astype(jnp.float32)).sum(-1) for j in range(m)], -1)
    g_mixes, g_params = maps_vjp((g_pre, g_extra))
    g_x = g_mixes * inv[:, None]  # [T, K]: the mixes' gradient, divided by RMS(flatten(h))
    # through inv = (mean(h^2) + eps)^(-1/2): d inv / d h = -inv^3 * h / (m*D), and
    # sum_jd (g_mixes @ fn^T)[j] * h[j] = sum_k g_mixes * mixes / inv
    g_norm = -(g_mixes * mixes).sum(-1) * inv ** 2 / (m * dim)  # [T]
    fn = fn.reshape(m, dim, -1)
    g_h = jnp.stack([pre[:, j, None] * g_y + g_norm[:, None] * h[j].astype(jnp.float32)
                     + jnp.matmul(g_x, fn[j].T, precision=FP32) for j in range(m)])
    g_fn = jnp.einsum("jtd,tk->jdk", h.astype(jnp.float32) * inv[:, None], g_mixes,
                      precision=FP32)
    return g_h.astype(h.dtype), g_fn.reshape(m * dim, -1), g_params


_collapse.defvjp(_collapse_fwd, _collapse_bwd)


@jax.custom_vjp
def _mix_streams(fy, h, post, comb):
    """fy [T, D], h [m, T, D], post [T, m], comb [T, m, m] -> [m, T, D] in h's dtype:
    out[i] = post[i] * fy + sum_j comb[j, i] * h[j]."""
    fy = fy.astype(jnp.float32)
    return jnp.stack([post[:, i, None] * fy + _stream_sum(comb[:, :, i], h)
                      for i in range(h.shape[0])]).astype(h.dtype)


def _mix_streams_fwd(fy, h, post, comb):
    return _mix_streams(fy, h, post, comb), (fy, h, post, comb)


def _mix_streams_bwd(residuals, g):
    fy, h, post, comb = residuals
    m = h.shape[0]
    g32, fy32 = g.astype(jnp.float32), fy.astype(jnp.float32)
    g_fy = _stream_sum(post, g)
    g_h = jnp.stack([_stream_sum(comb[:, j, :], g) for j in range(m)])
    g_post = jnp.stack([(g32[i] * fy32).sum(-1) for i in range(m)], -1)  # [T, m]
    g_comb = jnp.stack([jnp.stack([(h[j].astype(jnp.float32) * g32[i]).sum(-1)
                                   for i in range(m)], -1) for j in range(m)], -2)  # [T, m, m]
    return g_fy.astype(fy.dtype), g_h.astype(h.dtype), g_post, g_comb


_mix_streams.defvjp(_mix_streams_fwd, _mix_streams_bwd)


def _init_params(rngs, outputs: int, hc: int, dim: int, base):
    # Small random fn breaks the symmetry of the m identical initial streams.
    fn = nnx.Param(init_normal(rngs, (hc * dim, outputs), jnp.float32, 0.1 / math.sqrt(hc * dim)))
    return fn, nnx.Param(jax.device_put(np.asarray(base, np.float32)))


def _connection_maps(iters: int, eps: float, mixes, params):
    """mixes [T, (2+m)m] -> (pre [T, m], (post [T, m], comb [T, m, m]))."""
    base, scale = params
    m = math.isqrt(mixes.shape[-1] + 1) - 1
    pre = jax.nn.sigmoid(mixes[:, :m] * scale[0] + base[:m]) + eps
    post = 2.0 * jax.nn.sigmoid(mixes[:, m:2 * m] * scale[1] + base[m:2 * m])
    comb = (mixes[:, 2 * m:] * scale[2] + base[2 * m:]).reshape(-1, m, m)
    return pre, (post, sinkhorn(comb, iters, eps))


def _head_maps(eps: float, mixes, params):
    """mixes [T, m] -> (pre [T, m], ())."""
    base, scale = params
    return jax.nn.sigmoid(mixes * scale[0] + base) + eps, ()


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

    @jax.named_scope("mhc")
    def pre(self, h: jax.Array):
        """h [m, B, S, D] -> (y [B, S, D] in h's dtype, post [B, S, m], comb [B, S, m, m]),
        on T = B*S flattened tokens."""
        m, *batch, dim = h.shape
        maps = functools.partial(_connection_maps, self.iters, self.eps)
        y, (post, comb) = _collapse(maps, self.norm_eps, h.reshape(m, -1, dim), self.fn[...],
                                    (self.base[...], self.scale[...]))
        return y.reshape(*batch, dim), post.reshape(*batch, m), comb.reshape(*batch, m, m)

    @staticmethod
    @jax.named_scope("mhc")
    def post(fy: jax.Array, h: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
        """h'[i] = post[i] * f(y) + sum_j comb[j, i] * h[j]  -> [m, B, S, D] in h's dtype."""
        m, *_, dim = h.shape
        out = _mix_streams(fy.reshape(-1, dim), h.reshape(m, -1, dim), post.reshape(-1, m),
                           comb.reshape(-1, m, m))
        return out.reshape(h.shape)


class HyperHead(nnx.Module):
    """Collapse the m streams before the final norm: y = sum_j pre[j] * h[j]."""

    def __init__(self, dim: int, hc: int, *, eps: float, norm_eps: float, rngs: nnx.Rngs):
        self.eps, self.norm_eps = eps, norm_eps
        base = np.full(hc, -math.log(hc - 1) if hc > 1 else 10.0, np.float32)
        self.fn, self.base = _init_params(rngs, hc, hc, dim, base)
        self.scale = nnx.Param(constant(1.0, (1,)))

    @jax.named_scope("mhc")
    def __call__(self, h: jax.Array) -> jax.Array:
        """h [m, ..., D] -> y [..., D] in h's dtype."""
        m, *batch, dim = h.shape
        maps = functools.partial(_head_maps, self.eps)
        y, _ = _collapse(maps, self.norm_eps, h.reshape(m, -1, dim), self.fn[...],
                         (self.base[...], self.scale[...]))
        return y.reshape(*batch, dim)
