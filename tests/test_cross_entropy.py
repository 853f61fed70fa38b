import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import function_rtol, tolerance
from moebalance.training.cross_entropy import (CHUNK_BYTES, LANES, default_chunk,
                                               token_cross_entropy)

RNG = np.random.default_rng(0)


def plain(h, head, targets):
    """The obvious formula on the full logits: (ce, lse) per token."""
    logits = h.astype(jnp.float32) @ head
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0], lse


# chunk: vocabulary columns per block of V = 11 (4 and 5 leave a ragged last block, 11 is one)
@pytest.mark.parametrize("tokens,chunk", [(13, 4), (16, 11), (16, 5), (7, None)])
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
    want = jax.jit(plain)(h, head, targets)
    np.testing.assert_allclose(jax.jit(token_cross_entropy, static_argnums=3)(h, head, targets,
                                                                               chunk),
                               want, **tolerance(want, rtol=1e-5, atol=1e-5))
    for got, want in zip(jax.jit(jax.grad(fused, argnums=(0, 1)))(h, head),
                         jax.jit(jax.grad(ref, argnums=(0, 1)))(h, head)):
        np.testing.assert_allclose(got, want, **tolerance(want, rtol=1e-5, atol=1e-5))


def test_hand_computed_case():
    # logits = [0, ln 3] for one token: lse = ln 4; target 1 -> ce = ln 4 - ln 3. At float32
    # precision (what a float32 model asks for), so that the head's dot keeps ln 3 unrounded; the
    # log-sum-exp's own log is a TPU's approximate one (lse 1.386246 on a v5e), ce off by as much.
    h = jnp.asarray([[1.0]])
    head = jnp.asarray([[0.0, np.log(3.0)]], jnp.float32)

    def ce_lse(head):
        return token_cross_entropy(h, head, jnp.asarray([1]), precision="highest")

    ce, lse = ce_lse(head)
    lse_error = np.log(4.0) * function_rtol(0.0, "log")  # 0 on the CPU
    np.testing.assert_allclose(lse, [np.log(4.0)], rtol=1e-6, atol=lse_error)
    np.testing.assert_allclose(ce, [np.log(4.0 / 3.0)], rtol=1e-6, atol=lse_error)
    # d ce / d logits = softmax - onehot = [1/4, -1/4]; d/d head = h^T that. The probabilities
    # exp(logit - lse) carry lse's error (p e^-d ~ p (1 - d)) and exp's own
    np.testing.assert_allclose(jax.grad(lambda w: ce_lse(w)[0].sum())(head), [[0.25, -0.25]],
                               rtol=1e-6, atol=lse_error + function_rtol(0.0, "exp"))


def test_bfloat16_hidden_keeps_its_dtype_and_float32_maths():
    h = jnp.asarray(RNG.normal(size=(9, 4)), jnp.bfloat16)
    head = jnp.asarray(RNG.normal(size=(4, 5)), jnp.float32)
    targets = jnp.asarray(RNG.integers(0, 5, 9))
    np.testing.assert_allclose(token_cross_entropy(h, head, targets, 4)[0],
                               plain(h, head, targets)[0], rtol=1e-5, atol=1e-5)
    grad = jax.grad(lambda h: token_cross_entropy(h, head, targets, 4)[0].sum())(h)
    assert grad.dtype == jnp.bfloat16


def test_chunks_bound_the_logits_memory():
    # 4,096 tokens: 2,048 columns = 32 MiB of float32 logits, 64 blocks over the padded 131,072
    assert default_chunk(4096, 129280) == 2048
    # 16,384 tokens: 512 columns; the 253 blocks' widths round up to whole 128 lanes
    assert default_chunk(16384, 129280) == 512
    # two even blocks of 4,096 rather than 3 of 4,096 + 0: the fewest blocks, as even as lanes allow
    assert default_chunk(2048, 8192) == 4096
    assert default_chunk(2048, 8000) == 4096 and default_chunk(3000, 8000) == 2688
    assert default_chunk(100, 8192) == 8192  # one block
    assert default_chunk(10**6, 129280) == 128  # at least one lane group
    assert default_chunk(16, 11) == 11  # a vocabulary under one lane group is one block


@pytest.mark.parametrize("tokens,vocab", [(4096, 129280), (300, 1000), (5, 130)])
def test_default_blocks_cover_the_vocabulary_within_the_bound(tokens, vocab):
    chunk = default_chunk(tokens, vocab)
    blocks = -(-vocab // chunk)
    assert (blocks - 1) * chunk < vocab <= blocks * chunk  # no block of padding alone
    assert tokens * chunk * 4 <= max(CHUNK_BYTES, tokens * LANES * 4)
    assert chunk % LANES == 0 or chunk == vocab


def test_the_head_is_read_once_per_pass():
    """Walking the vocabulary, the forward's and the backward's loops each take the [D, V] head
    in blocks, and the backward writes each block of its gradient once: no [D, V] value is
    carried through a loop (walking the tokens accumulated one per chunk of tokens)."""
    h = jnp.zeros((64, 8), jnp.float32)
    head = jnp.zeros((8, 1000), jnp.float32)
    targets = jnp.zeros(64, jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(
        lambda h, w: token_cross_entropy(h, w, targets, 128)[0].sum(), argnums=(0, 1)))(h, head)

    def equations(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from equations(sub)

    scans = [e for e in equations(jaxpr.jaxpr) if e.primitive.name == "scan"]
    assert len(scans) == 2
    for scan in scans:
        body = scan.params["jaxpr"].jaxpr
        dots = [e for e in body.eqns if e.primitive.name == "dot_general"]
        # every dot in the loop works on one [8, 128] block of the head, never all 1,000 columns
        assert dots and all(128 in e.invars[1].aval.shape or 128 in e.invars[0].aval.shape
                            for e in dots)
