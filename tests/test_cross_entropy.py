import json
import os
import subprocess
import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from pathlib import Path

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


def equations(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from equations(sub)


def test_the_head_is_read_once_per_pass():
    """Walking the vocabulary, the forward's and the backward's loops each take the [D, V] head
    in blocks, and the backward writes each block of its gradient once: no [D, V] value is
    carried through a loop (walking the tokens accumulated one per chunk of tokens)."""
    h = jnp.zeros((64, 8), jnp.float32)
    head = jnp.zeros((8, 1000), jnp.float32)
    targets = jnp.zeros(64, jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(
        lambda h, w: token_cross_entropy(h, w, targets, 128)[0].sum(), argnums=(0, 1)))(h, head)
    scans = [e for e in equations(jaxpr.jaxpr) if e.primitive.name == "scan"]
    assert len(scans) == 2
    for scan in scans:
        body = scan.params["jaxpr"].jaxpr
        dots = [e for e in body.eqns if e.primitive.name == "dot_general"]
        # every dot in the loop works on one [8, 128] block of the head, never all 1,000 columns
        assert dots and all(128 in e.invars[1].aval.shape or 128 in e.invars[0].aval.shape
                            for e in dots)


VOCAB, WIDTH, CHUNK = 1000, 16, 512  # split over fsdp 4: slices of 250, blocks of 4 x 128 columns


def _on_8_devices(out: str) -> None:
    """On 8 CPU devices (data 2 x fsdp 4): the loss and gradients of a [64, WIDTH] x
    [WIDTH, VOCAB] cross-entropy whose head is split as the trainer splits it, against the full
    logits on one device; the compiled program's all-gathers; the default blocks' count for
    4,096 tokens a device of a 129,280-word vocabulary -> `out` (JSON)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from moebalance.config import load_config
    from moebalance.training import collectives, sharding

    cfg = load_config("deepseek4-smoke", {"ici_data_parallelism": 2, "ici_fsdp_parallelism": 4})
    mesh = sharding.make_mesh(cfg, jax.devices())
    spec = sharding.param_spec(("head",), (WIDTH, VOCAB), 4)
    rng = np.random.default_rng(1)
    h = rng.normal(size=(64, WIDTH)).astype(np.float32)
    head = rng.normal(size=(WIDTH, VOCAB)).astype(np.float32)
    targets = rng.integers(0, VOCAB, 64).astype(np.int32)

    def loss(fn):
        def f(h, head):
            ce, lse = fn(h, head)
            return ce.sum() + 0.1 * (lse**2).sum()
        return jax.value_and_grad(f, argnums=(0, 1))

    with jax.set_mesh(mesh):
        program = jax.jit(loss(lambda h, w: token_cross_entropy(h, w, targets, CHUNK,
                                                                 vocab_axis=spec[1])))
        args = (jax.device_put(h, NamedSharding(mesh, P(sharding.AXES))),
                jax.device_put(head, NamedSharding(mesh, spec)))
        found, _ = collectives.count(program.lower(*args).compile().as_text())
        value, (d_h, d_head) = program(*args)
        tokens = jax.ShapeDtypeStruct((8 * 4096, 8), jnp.float32)
        pod = jax.ShapeDtypeStruct((8, 129280), jnp.float32)
        jaxpr = jax.make_jaxpr(lambda h, w: token_cross_entropy(
            h, w, jnp.zeros(8 * 4096, jnp.int32), vocab_axis="fsdp"))(tokens, pod)
    want, (want_h, want_head) = jax.jit(loss(lambda h, w: plain(h, w, targets)))(h, head)
    scans = [e.params["length"] for e in equations(jaxpr.jaxpr) if e.primitive.name == "scan"]
    Path(out).write_text(json.dumps({
        "head_spec": list(spec), "d_head_spec": list(d_head.sharding.spec),
        "errors": [float(abs(value - want) / abs(want)),
                   float(np.abs(d_h - want_h).max() / np.abs(want_h).max()),
                   float(np.abs(d_head - want_head).max() / np.abs(want_head).max())],
        "gathers": [c.bytes for c in found if c.kind == "all-gather"], "scans": scans}))


def test_a_head_split_over_devices_is_gathered_a_block_at_a_time(tmp_path):
    """The trainer splits the head's vocabulary over fsdp: the result and gradients equal the
    full-logits formula on one device; no all-gather exceeds one block of the head (before, the
    whole head was gathered, on a TPU once per block: Flash on a v5p-256 ~8,000 GiB a device and
    step); the head's gradient stays split as the head is; the default blocks are sized from the
    tokens one device holds (4,096 of them: 64 blocks of 2,048 columns), not the global count
    (32,768: 505 blocks of 256)."""
    out = tmp_path / "ce.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
           + " --xla_force_host_platform_device_count=8"}
    subprocess.run([sys.executable, __file__, str(out)], env=env, check=True)
    got = json.loads(out.read_text())
    assert got["head_spec"] == [None, "fsdp"] == got["d_head_spec"]
    assert max(got["errors"]) < 1e-5
    assert got["gathers"] and max(got["gathers"]) <= WIDTH * CHUNK * 4
    assert got["scans"] == [64]


if __name__ == "__main__":
    _on_8_devices(sys.argv[1])
