"""Small shared pieces of the DeepSeek-V4 model: RMSNorm, RoPE tables and rotation, initialisers."""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# The precision of the float32 dots that decide routing (the router's logits, the hyper-connection
# maps): full float32 on every backend. TPUs otherwise run a float32 dot as one bfloat16 pass (8
# mantissa bits), enough to swap near-tied experts; XLA's CPU computes float32 dots in float32
# either way. Model-dtype matmuls (experts, attention) keep the backend's default.
FP32 = jax.lax.Precision.HIGHEST


def matmul_precision(matmul_precision: str, dtype: str) -> str | None:
    """The precision of every other matmul of the model (config key `matmul_precision`), or None
    for the backend's default. `auto` is `highest` for a float32 dtype: a TPU's default runs a
    float32 matmul as one bfloat16 pass, and rounding activations to 8 bits is not the float32
    model the user asked for; two computations of the same value (a decode step and the full
    pass) then part wherever a tiny difference crosses a bfloat16 rounding boundary, and a flipped
    top-k choice downstream turns that into a different output. A bfloat16 dtype's matmuls take
    bfloat16 operands whatever the precision."""
    if matmul_precision == "auto":
        return "highest" if jnp.dtype(dtype) == jnp.float32 else None
    return None if matmul_precision == "default" else matmul_precision


def precision_scope(precision: str | None):
    """The context in which the model's matmuls run at `precision` (None: as the caller set)."""
    return contextlib.nullcontext() if precision is None else jax.default_matmul_precision(
        precision)


# Values of one draw: larger parameters are drawn in chunks of this many values, each from its own
# child of the parameter's seed, on threads (NumPy's generators release the GIL). d1024's 1.1B
# parameters are ~95 % such chunks; every tiny, smoke and study parameter is one draw.
DRAW_CHUNK = 1 << 24


def host_normal(seed, shape, dtype, std: float) -> np.ndarray:
    """std * N(0, 1) of `shape` as `dtype`, drawn on the host from `seed` (deterministic whatever
    the number of threads)."""
    values = np.empty(shape, np.float32)
    out = np.empty(shape, dtype)
    flat, flat_out = values.reshape(-1), out.reshape(-1)
    chunks = max(1, -(-flat.size // DRAW_CHUNK))
    seeds = [seed] if chunks == 1 else np.random.SeedSequence(seed).spawn(chunks)

    def draw(i):
        part = flat[i * DRAW_CHUNK:(i + 1) * DRAW_CHUNK]
        np.random.default_rng(seeds[i]).standard_normal(dtype=np.float32, out=part)
        part *= np.float32(std)
        flat_out[i * DRAW_CHUNK:(i + 1) * DRAW_CHUNK] = part

    if chunks == 1:
        draw(0)
    else:
        with concurrent.futures.ThreadPoolExecutor(min(chunks, os.cpu_count() or 1)) as pool:
            list(pool.map(draw, range(chunks)))
    return out


def init_normal(rngs: nnx.Rngs, shape, dtype, std: float) -> jax.Array:
    """std * N(0, 1) of `shape`, drawn by NumPy from a seed taken from `rngs`.

    Why not jax.random: every new parameter shape is a new XLA program, and compiling one costs
    0.2-0.5 s on a 2-core CPU (minutes for a 43-layer model); NumPy draws with no compilation,
    and jax.device_put moves the values (jnp.asarray would compile a copy program per shape).
    Deterministic in the Rngs seed like jax.random, but a different stream. Under tracing
    (nnx.eval_shape, jit) the key is abstract and jax.random draws instead.
    """
    stream = rngs.params
    if isinstance(stream.key[...], jax.core.Tracer):
        # the key flax's stream() would give, but its count is advanced without `count[...] =`,
        # whose sharding check on a tracer formats an error message from the whole trace so far:
        # quadratic in the model's size (33 s instead of 1 s to trace V4-Flash's shapes)
        key = jax.random.fold_in(stream.key[...], stream.count[...])
        stream.count.set_value(stream.count[...] + 1)
        return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    seed = np.asarray(jax.random.key_data(stream())).ravel()
    return jax.device_put(host_normal(seed, shape, jnp.dtype(dtype), std))


def stack(arrays) -> jax.Array:
    """Stack arrays along a new leading axis, on the host when they are concrete."""
    if any(isinstance(a, jax.core.Tracer) for a in arrays):
        return jnp.stack(arrays)
    return jax.device_put(np.stack([np.asarray(a) for a in arrays]))


def constant(value, shape, dtype=jnp.float32) -> jax.Array:
    """A filled array made on the host (no XLA compilation, see init_normal)."""
    return jax.device_put(np.full(shape, value, dtype=jnp.dtype(dtype)))


def dense_init(rngs: nnx.Rngs, shape, dtype, fan_in: int | None = None) -> jax.Array:
    """A weight with std 1/sqrt(fan_in); fan_in defaults to shape[0] ([fan_in, ..., fan_out])."""
    return init_normal(rngs, shape, dtype, 1.0 / math.sqrt(fan_in or shape[0]))


def rms(x: jax.Array, eps: float) -> jax.Array:
    """x / RMS(x) over the last axis, computed in float32, returned in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """weight * x / RMS(x); the weight is float32 and the product is cast back to x's dtype."""

    def __init__(self, dim: int, eps: float):
        self.eps = eps
        self.weight = nnx.Param(constant(1.0, (dim,)))

    def __call__(self, x):
        return (self.weight[...] * rms(x, self.eps)).astype(x.dtype)


def rope_frequencies(
    rope_dim: int,
    theta: float,
    *,
    yarn_factor: float = 1.0,
    original_length: int = 65536,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> np.ndarray:
    """[rope_dim/2] float64 angular frequencies theta^(-2i/rope_dim), with DeepSeek's YaRN when
    yarn_factor > 1: dimensions rotating faster than beta_fast turns over the original context
    keep their frequency, slower than beta_slow are divided by the factor, a linear ramp between
    (no attention-scale correction, as in DeepSeek-V4)."""
    freqs = theta ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    if yarn_factor <= 1.0:
        return freqs

    def corr_dim(rotations):
        return rope_dim * math.log(original_length / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rope_dim // 2) - low) / (high - low), 0.0, 1.0)
    smooth = 1.0 - ramp
    return freqs / yarn_factor * (1.0 - smooth) + freqs * smooth


def rope_angles(positions: jax.Array, freqs: np.ndarray):
    """positions [...] -> (cos, sin) [..., rope_dim/2] float32."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs, jnp.float32)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, inverse: bool = False):
    """Rotate the LAST 2*cos.shape[-1] dims of x as interleaved pairs (x[2i], x[2i+1]).

    cos/sin broadcast against x[..., rope_dim/2]; inverse rotates by the negative angle. The
    rotation runs in float32 and the result has x's dtype.
    """
    half = cos.shape[-1]
    rot = x[..., x.shape[-1] - 2 * half:].astype(jnp.float32)
    pairs = rot.reshape(*rot.shape[:-1], half, 2)  # [..., rd/2, 2]
    a, b = pairs[..., 0], pairs[..., 1]
    if inverse:
        sin = -sin
    rotated = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(rot.shape)
    return jnp.concatenate([x[..., : x.shape[-1] - 2 * half], rotated.astype(x.dtype)], axis=-1)
