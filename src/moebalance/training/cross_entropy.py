"""Cross-entropy over a large vocabulary without materialising the [T, V] logits.

    logits[t] = h[t] @ head                       [V] float32, one chunk of tokens at a time
    lse[t]    = log sum_v exp(logits[t, v])
    ce[t]     = lse[t] - logits[t, target[t]]

Forward and backward walk the tokens in chunks of `chunk` rows, so at most [chunk, V] logits exist
at once (32 MiB by default, against 1 GiB of float32 logits for 2048 tokens x V = 129280, which the
plain formula writes and reads several times). The backward recomputes each chunk's logits
(one more [chunk, D] x [D, V] matmul) instead of storing them:

    d logits[t] = (g_ce[t] + g_lse[t]) * softmax(logits[t]) - g_ce[t] * onehot(target[t])

Both per-token outputs are differentiable, so a logit z-loss (mean lse^2) costs nothing extra.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

CHUNK_BYTES = 32 * 2**20  # float32 logits of one chunk


def default_chunk(num_tokens: int, vocab_size: int) -> int:
    """Tokens per chunk: [chunk, V] float32 logits fit in CHUNK_BYTES (at least 8 tokens)."""
    return max(8, min(num_tokens, CHUNK_BYTES // (4 * vocab_size)))


def token_cross_entropy(h: jax.Array, head: jax.Array, targets: jax.Array,
                        chunk: int | None = None) -> tuple[jax.Array, jax.Array]:
    """h [T, D] (any float dtype), head [D, V] float32, targets [T] int ->
    (ce [T], lse [T]) float32: each token's cross-entropy and log-partition."""
    num_tokens = h.shape[0]
    chunk = chunk or default_chunk(num_tokens, head.shape[1])
    return _token_cross_entropy(h, head, targets.astype(jnp.int32), chunk)


def _in_chunks(x: jax.Array, chunk: int) -> jax.Array:
    """[T, ...] -> [T'/chunk, chunk, ...], zero-padded up to a multiple of chunk."""
    pad = -x.shape[0] % chunk
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape(-1, chunk, *x.shape[1:])


def _from_chunks(x: jax.Array, num_tokens: int) -> jax.Array:
    return x.reshape(-1, *x.shape[2:])[:num_tokens]


def _chunk_logits(h_chunk, head):
    return h_chunk.astype(jnp.float32) @ head  # [chunk, V]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _token_cross_entropy(h, head, targets, chunk):
    return _forward(h, head, targets, chunk)[0]


def _forward(h, head, targets, chunk):
    def one(args):
        h_chunk, t_chunk = args
        logits = _chunk_logits(h_chunk, head)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, t_chunk[:, None], axis=-1)[:, 0]
        return lse - picked, lse

    ce, lse = jax.lax.map(one, (_in_chunks(h, chunk), _in_chunks(targets, chunk)))
    num_tokens = h.shape[0]
    ce, lse = _from_chunks(ce, num_tokens), _from_chunks(lse, num_tokens)
    return (ce, lse), (h, head, targets, lse)


def _backward(chunk, residuals, cotangents):
    h, head, targets, lse = residuals
    g_ce, g_lse = cotangents

    def one(d_head, args):
        h_chunk, t_chunk, lse_chunk, gc, gl = args
        logits = _chunk_logits(h_chunk, head)
        probs = jnp.exp(logits - lse_chunk[:, None])
        target = jnp.arange(head.shape[1]) == t_chunk[:, None]
        d_logits = (gc + gl)[:, None] * probs - jnp.where(target, gc[:, None], 0.0)
        d_head = d_head + h_chunk.astype(jnp.float32).T @ d_logits
        return d_head, (d_logits @ head.T).astype(h.dtype)

    chunks = tuple(_in_chunks(x, chunk) for x in (h, targets, lse, g_ce, g_lse))
    d_head, d_h = jax.lax.scan(one, jnp.zeros_like(head), chunks)
    return _from_chunks(d_h, h.shape[0]), d_head, None


_token_cross_entropy.defvjp(_forward, _backward)
