import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tolerance
from moebalance.training.cross_entropy import default_chunk, token_cross_entropy

RNG = np.random.default_rng(0)


def plain(h, head, targets):
    """The obvious formula on the full logits: (ce, lse) per token."""
    logits = h.astype(jnp.float32) @ head
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0], lse


@pytest.mark.parametrize("tokens,chunk", [(13, 4), (16, 16), (16, 5), (7, None)])
def test_values_and_gradients_equal_the_full_logits_formula(tokens, chunk):
    h = jnp.asarray(RNG.normal(size=(tokens, 6)), jnp.float32)
    head = jnp.asarray(RNG.normal(size=(6, 11)), jnp.float32)
    targets = jnp.asarray(RNG.integers(0, 11, tokens), jnp.int32)
    w_ce, w_lse = (jnp.asarray(RNG.normal(size=tokens), jnp.float32) for _ in range(2))

    def objective(fn):  # both outputs, as a CE term plus a z-loss term would use them
        def f(h, head):
            ce, lse = fn(h, head)
            return (ce * w_ce).sum() + (lse**2 * w_lse).sum()
        return f

    fused = objective(lambda h, head: token_cross_entropy(h, head, targets, chunk))
    ref = objective(lambda h, head: plain(h, head, targets))
    np.testing.assert_allclose(token_cross_entropy(h, head, targets, chunk),
                               plain(h, head, targets), **tolerance(rtol=1e-5, atol=1e-5))
    for got, want in zip(jax.grad(fused, argnums=(0, 1))(h, head),
                         jax.grad(ref, argnums=(0, 1))(h, head)):
        np.testing.assert_allclose(got, want, **tolerance(rtol=1e-5, atol=1e-5))


def test_hand_computed_case():
    # logits = [0, ln 3] for one token: lse = ln 4; target 1 -> ce = ln 4 - ln 3
    h = jnp.asarray([[1.0]])
    head = jnp.asarray([[0.0, np.log(3.0)]], jnp.float32)
    ce, lse = token_cross_entropy(h, head, jnp.asarray([1]))
    np.testing.assert_allclose(lse, [np.log(4.0)], rtol=1e-6)
    np.testing.assert_allclose(ce, [np.log(4.0 / 3.0)], rtol=1e-6)
    # d ce / d logits = softmax - onehot = [1/4, -1/4]; d/d head = h^T that
    np.testing.assert_allclose(jax.grad(lambda w: token_cross_entropy(h, w, jnp.asarray([1]))[0]
                                        .sum())(head), [[0.25, -0.25]], rtol=1e-6)


def test_bfloat16_hidden_keeps_its_dtype_and_float32_maths():
    h = jnp.asarray(RNG.normal(size=(9, 4)), jnp.bfloat16)
    head = jnp.asarray(RNG.normal(size=(4, 5)), jnp.float32)
    targets = jnp.asarray(RNG.integers(0, 5, 9))
    np.testing.assert_allclose(token_cross_entropy(h, head, targets, 4)[0],
                               plain(h, head, targets)[0], rtol=1e-5, atol=1e-5)
    grad = jax.grad(lambda h: token_cross_entropy(h, head, targets, 4)[0].sum())(h)
    assert grad.dtype == jnp.bfloat16


def test_chunks_bound_the_logits_memory():
    assert default_chunk(2048, 129280) == 64  # 64 x 129280 float32 = 32 MiB
    assert default_chunk(2048, 8192) == 1024
    assert default_chunk(100, 8192) == 100
