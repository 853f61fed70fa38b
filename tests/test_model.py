import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import reference_v4 as ref
from conftest import float32_model, tolerance
from moebalance.config import ConfigError, load_config
from moebalance.model import attention as attention_module
from moebalance.model import layers
from moebalance.model.attention import Attention, Compressor
from moebalance.model.hyper import HyperConnection, sinkhorn
from moebalance.model.transformer import (DeepSeekV4, attention_dims, get_biases, parameter_counts,
                                          routed_layers, set_biases)
from moebalance.training.step import make_train_step, new_optimizer

RNG = np.random.default_rng(0)


def f64(x):
    return np.asarray(x, np.float64)


def test_rope_matches_reference_and_inverse_undoes_it():
    freqs = layers.rope_frequencies(8, 10000.0)
    x = RNG.normal(size=(5, 12)).astype(np.float32)  # 4 unrotated dims, then 8 rotated
    pos = jnp.arange(5) * 7
    cos, sin = layers.rope_angles(pos, freqs)
    y = layers.apply_rope(jnp.asarray(x), cos, sin)
    want = np.stack([ref.rope(x[t], 7 * t, freqs) for t in range(5)])
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(y[:, :4], x[:, :4])
    np.testing.assert_allclose(layers.apply_rope(y, cos, sin, inverse=True), x, atol=1e-5)
    # q.k depends only on the offset between positions
    q, k = RNG.normal(size=12), RNG.normal(size=12)
    dots = [ref.rope(q, a + 3, freqs) @ ref.rope(k, a, freqs) for a in (0, 11, 40)]
    np.testing.assert_allclose(dots, dots[0], rtol=1e-9)


def test_yarn_frequencies_hand_checked():
    # V4-Flash: rope 64, theta 160000, factor 16, original 65536, beta 32/1 -> dims <= 15 keep
    # their frequency, dims >= 25 are divided by 16, a linear ramp between.
    base = layers.rope_frequencies(64, 160000.0)
    yarn = layers.rope_frequencies(64, 160000.0, yarn_factor=16.0, original_length=65536,
                                   beta_fast=32.0, beta_slow=1.0)
    np.testing.assert_allclose(yarn[:16], base[:16])
    np.testing.assert_allclose(yarn[25:], base[25:] / 16)
    ramp = (20 - 15) / (25 - 15)
    np.testing.assert_allclose(yarn[20], base[20] / 16 * ramp + base[20] * (1 - ramp))


def test_sinkhorn_is_doubly_stochastic():
    # Logits of the spread the mixing sees in practice (std 0.5). DeepSeek's 20 iterations leave
    # very peaked matrices (std >= 1) short of convergence: rows then sum to 1 only to ~1e-4.
    logits = jnp.asarray(RNG.normal(size=(500, 4, 4)) * 0.5, jnp.float32)
    comb = sinkhorn(logits, 20, 1e-6)
    np.testing.assert_allclose(comb.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(comb.sum(-2), 1.0, atol=1e-5)
    np.testing.assert_allclose(comb[0], ref.sinkhorn(f64(logits[0]), 20, 1e-6), rtol=1e-5)


def test_sinkhorn_gradient_matches_autodiff_of_the_plain_iteration():
    def plain(logits, iters, eps):  # the obvious loop, differentiated by JAX
        c = jax.nn.softmax(logits, axis=-1) + eps
        c = c / (c.sum(-2, keepdims=True) + eps)
        for _ in range(iters - 1):
            c = c / (c.sum(-1, keepdims=True) + eps)
            c = c / (c.sum(-2, keepdims=True) + eps)
        return c

    logits = jnp.asarray(RNG.normal(size=(2, 5, 4, 4)) * 2, jnp.float32)
    weights = jnp.asarray(RNG.normal(size=logits.shape), jnp.float32)
    for iters in (1, 2, 20):
        got = jax.jit(jax.grad(lambda x: (sinkhorn(x, iters, 1e-6) * weights).sum()))(logits)
        want = jax.jit(jax.grad(lambda x: (plain(x, iters, 1e-6) * weights).sum()))(logits)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_hyper_connection_matches_reference():
    m, d = 4, 8
    hc = HyperConnection(d, m, iters=20, eps=1e-6, norm_eps=1e-6, rngs=nnx.Rngs(0))
    hc.fn[...] = jnp.asarray(RNG.normal(size=hc.fn.shape) * 0.3, jnp.float32)
    hc.base[...] = jnp.asarray(RNG.normal(size=hc.base.shape), jnp.float32)
    hc.scale[...] = jnp.asarray([0.5, 1.5, 2.0], jnp.float32)
    h = jnp.asarray(RNG.normal(size=(m, 2, 3, d)), jnp.float32)  # streams first
    y, post, comb = hc.pre(h)
    fy = jnp.asarray(RNG.normal(size=(2, 3, d)), jnp.float32)
    out = HyperConnection.post(fy, h, post, comb)
    for b in range(2):
        for s in range(3):
            ry, rpost, rcomb = ref.hc_pre(f64(h[:, b, s]), f64(hc.fn[...]), f64(hc.base[...]),
                                          f64(hc.scale[...]), 20, 1e-6, 1e-6)
            np.testing.assert_allclose(y[b, s], ry, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(post[b, s], rpost, rtol=1e-5)
            np.testing.assert_allclose(comb[b, s], rcomb, rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(out[:, b, s], ref.hc_post(
                f64(fy[b, s]), f64(h[:, b, s]), rpost, rcomb), rtol=1e-4, atol=1e-5)


def _plain_pre(h, fn, base, scale, iters, eps, norm_eps):
    """The pre side as the formulas read, on h [m, T, D], for autodiff: (y, post, comb)."""
    m, t, d = h.shape
    x = jnp.moveaxis(h, 0, 1).reshape(t, m * d)
    x = x / jnp.sqrt((x * x).mean(-1, keepdims=True) + norm_eps)
    mixes = jnp.matmul(x, fn, precision="highest")
    pre = jax.nn.sigmoid(mixes[:, :m] * scale[0] + base[:m]) + eps
    post = 2 * jax.nn.sigmoid(mixes[:, m:2 * m] * scale[1] + base[m:2 * m])
    comb = sinkhorn((mixes[:, 2 * m:] * scale[2] + base[2 * m:]).reshape(t, m, m), iters, eps)
    return (pre.T[:, :, None] * h).sum(0), post, comb


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hyper_connection_pre_gradient_matches_autodiff_of_the_plain_formula(dtype):
    """The hand-written backward of the pre side (collapse, mixes, RMS) against autodiff of the
    formulas, for h, fn, base and scale; in bfloat16 the cotangents of y and of the streams are
    bfloat16 too, so every gradient holds to bfloat16's precision there."""
    m, d, iters = 4, 8, 3
    hc = HyperConnection(d, m, iters=iters, eps=1e-6, norm_eps=1e-6, rngs=nnx.Rngs(0))
    fn = jnp.asarray(RNG.normal(size=hc.fn.shape) * 0.3, jnp.float32)
    base = jnp.asarray(RNG.normal(size=hc.base.shape), jnp.float32)
    scale = jnp.asarray([0.5, 1.5, 2.0], jnp.float32)
    h = jnp.asarray(RNG.normal(size=(m, 2, 3, d)), dtype)
    weights = [jnp.asarray(RNG.normal(size=s), jnp.float32) for s in ((2, 3, d), (2, 3, m),
                                                                        (2, 3, m, m))]

    def loss(pre_fn, h, fn, base, scale):
        return sum((out.astype(jnp.float32) * w).sum()
                   for out, w in zip(pre_fn(h, fn, base, scale), weights))

    graphdef, state = nnx.split(hc)

    def module(h, fn, base, scale):
        state["fn"], state["base"], state["scale"] = fn, base, scale
        return nnx.merge(graphdef, state).pre(h)

    def plain(h, fn, base, scale):
        y, post, comb = _plain_pre(h.astype(jnp.float32).reshape(m, 6, d), fn, base, scale,
                                   iters, 1e-6, 1e-6)
        return y.reshape(2, 3, d), post.reshape(2, 3, m), comb.reshape(2, 3, m, m)

    want = jax.grad(lambda *a: loss(plain, *a), argnums=(0, 1, 2, 3))(h.astype(jnp.float32), fn,
                                                                      base, scale)
    got = jax.grad(lambda *a: loss(module, *a), argnums=(0, 1, 2, 3))(h, fn, base, scale)
    assert got[0].dtype == h.dtype
    for g, w in zip(got, want):
        tol = (dict(rtol=2e-2, atol=2e-2 * np.abs(w).max()) if dtype == "bfloat16"
               else tolerance(w, rtol=1e-4, atol=1e-5))
        np.testing.assert_allclose(g.astype(jnp.float32), w, **tol)


def test_hyper_connection_post_gradient_matches_autodiff_of_the_plain_formula():
    m, d = 4, 8
    args = [jnp.asarray(RNG.normal(size=shape), jnp.float32)
            for shape in ((2, 3, d), (m, 2, 3, d), (2, 3, m), (2, 3, m, m))]
    weights = jnp.asarray(RNG.normal(size=(m, 2, 3, d)), jnp.float32)

    def plain(fy, h, post, comb):  # h'[i] = post[i] * f(y) + sum_j comb[j, i] * h[j]
        mixed = (jnp.moveaxis(comb, (-2, -1), (0, 1))[..., None] * h[:, None]).sum(0)
        return jnp.moveaxis(post, -1, 0)[..., None] * fy + mixed

    got = jax.jit(jax.grad(lambda *a: (HyperConnection.post(*a) * weights).sum(),
                           argnums=(0, 1, 2, 3)))
    want = jax.jit(jax.grad(lambda *a: (plain(*a) * weights).sum(), argnums=(0, 1, 2, 3)))
    for g, w in zip(got(*args), want(*args)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def _randomize(module, scale=0.5):
    """Give zero/one-initialised parameters (sinks, ape, norms) random values too."""
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        if path[-1] in ("attn_sink", "ape", "weight"):
            var[...] = jnp.asarray(RNG.normal(size=var.shape) * scale + (path[-1] == "weight"),
                                   var.dtype)


@pytest.mark.parametrize("ratio", [4, 8])
def test_compressor_matches_reference(ratio):
    comp = Compressor(16, 6, ratio, 4, 1e-6, nnx.Rngs(1))
    _randomize(comp)
    freqs = layers.rope_frequencies(4, 160000.0)
    x = jnp.asarray(RNG.normal(size=(2, 21, 16)), jnp.float32)  # 21: a trailing partial block
    with float32_model():  # as the model runs it: the CPU's tolerances hold on a TPU
        got = nnx.jit(lambda comp, x: comp(x, freqs))(comp, x)
    assert got.shape == (2, 21 // ratio, 6)
    for b in range(2):
        want = ref.compressor(f64(x[b]), f64(comp.wkv[...]), f64(comp.wgate[...]),
                              f64(comp.ape[...]), f64(comp.norm.weight[...]), ratio, freqs, 1e-6)
        np.testing.assert_allclose(got[b], want, rtol=1e-4, atol=1e-5)


def _params_of_attention(attn):
    def get(mod):
        return {path[-1] if path[-1] != "weight" else path[-2]: f64(v[...])
                for path, v in nnx.to_flat_state(nnx.state(mod, nnx.Param))
                if len(path) == 1 or (len(path) == 2 and path[-1] == "weight")}
    p = get(attn)
    if attn.compressor is not None:
        p["compressor"] = get(attn.compressor)
    if attn.indexer is not None:
        p["indexer"] = {**get(attn.indexer), **get(attn.indexer.compressor)}
    return p


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("ratio,dense_topk", [(0, 4), (4, 4), (4, 0), (8, 4)])
def test_attention_matches_reference(ratio, dense_topk, packed, monkeypatch):
    """dense_topk: CSA (ratio 4) attends its 3 chosen of 6 entries densely with the others
    masked (4) or gathered per query (0)."""
    monkeypatch.setattr(attention_module, "DENSE_TOPK", dense_topk)
    cfg = load_config("deepseek4-smoke", dict(index_topk=3, sliding_window_size=6))
    dims = attention_dims(cfg, ratio)
    attn = Attention(dims, nnx.Rngs(2))
    _randomize(attn)
    freqs = layers.rope_frequencies(dims.rope_dim, 10000.0)
    s = 26
    x = jnp.asarray(RNG.normal(size=(1, s, dims.emb_dim)), jnp.float32)
    # packed: three documents; boundaries inside and on compressed blocks
    seg = np.repeat([0, 1, 2], [9, 8, 9]) if packed else np.zeros(s, int)
    with float32_model():  # as the model runs it: the CPU's tolerances hold on a TPU
        got = nnx.jit(lambda attn, x, positions, seg: attn(x, positions, seg, freqs))(
            attn, x, jnp.arange(s)[None], jnp.asarray(seg)[None])
    p = _params_of_attention(attn)
    c = dict(heads=dims.heads, head_dim=dims.head_dim, eps=dims.eps, ratio=ratio,
             window=dims.window, o_groups=dims.o_groups, index_heads=dims.index_heads,
             index_head_dim=dims.index_head_dim, index_topk=dims.index_topk,
             q_norm=p["q_norm"], kv_norm=p["kv_norm"])
    want = ref.attention(f64(x[0]), p, c, freqs, seg)
    np.testing.assert_allclose(got[0], want, rtol=2e-4, atol=2e-5)


def test_the_indexer_choice_does_not_depend_on_the_sign_of_a_zero_score():
    """Zero scores tie whatever their sign (top_k alone puts +0 above -0): the best positive
    entry, then the zeros by index, never an invisible entry; the same choice with the signs of
    the zeros flipped."""
    zero = np.array([-0.0, 0.0, -0.0, 0.5, 0.0, -1.0, 2.0], np.float32)
    visible = jnp.asarray([True, True, True, True, True, True, False])
    for score in (zero, np.where(zero == 0, -zero, zero)):
        got = attention_module.top_entries(jnp.asarray(score)[None, None], visible[None, None], 3)
        assert got[0, 0].tolist() == [3, 0, 1]


def test_csa_dense_and_gathered_give_the_same_gradients(monkeypatch):
    """The two ways of attending CSA's chosen entries (Attention.compressed_part) differ only in
    how they are computed: the same output and gradients (inputs and every weight)."""
    cfg = load_config("deepseek4-smoke", dict(index_topk=3, sliding_window_size=6))
    attn = Attention(attention_dims(cfg, 4), nnx.Rngs(2))
    _randomize(attn)
    graphdef, params = nnx.split(attn)
    freqs = layers.rope_frequencies(cfg.qk_rope_head_dim, 10000.0)
    x = jnp.asarray(RNG.normal(size=(2, 26, cfg.base_emb_dim)), jnp.float32)
    seg = jnp.asarray(np.repeat([0, 1], [11, 15]))[None].repeat(2, 0)
    w = jnp.asarray(RNG.normal(size=(2, 26, cfg.base_emb_dim)), jnp.float32)

    def value_and_grads(dense_topk):  # one program each, not ~200 eager operations
        monkeypatch.setattr(attention_module, "DENSE_TOPK", dense_topk)
        return jax.jit(jax.value_and_grad(lambda p, x: (nnx.merge(graphdef, p)(
            x, jnp.arange(26)[None].repeat(2, 0), seg, freqs) * w).sum(), argnums=(0, 1)))(
            params, x)

    dense, gathered = value_and_grads(4), value_and_grads(0)
    for got, want in zip(jax.tree.leaves(dense), jax.tree.leaves(gathered), strict=True):
        # float32 sums in another order: gradients of size ~5 agree to ~1e-6
        np.testing.assert_allclose(got, want, **tolerance(want, rtol=1e-5, atol=1e-5))


CAUSAL = dict(compress_ratios=[0, 4, 8, 4], first_num_hash_layers=1, max_target_length=32,
              index_topk=2, sliding_window_size=5, mtp_num_layers=1)


def test_causality_every_layer_kind_and_mtp():
    cfg = load_config("deepseek4-smoke", CAUSAL)
    model = DeepSeekV4(cfg, rngs=nnx.Rngs(0))
    run = nnx.jit(lambda m, t, n: m(t, mtp_tokens=n))
    tokens = jax.random.randint(jax.random.key(1), (1, 32), 0, cfg.vocab_size)
    nxt = jnp.roll(tokens, -1, axis=1)
    base = run(model, tokens, nxt)
    for t in (0, 7, 8, 19, 31):
        changed = tokens.at[0, t].set((tokens[0, t] + 1) % cfg.vocab_size)
        out = run(model, changed, jnp.roll(changed, -1, axis=1))
        np.testing.assert_array_equal(out.logits[0, :t], base.logits[0, :t])
        assert not np.allclose(out.logits[0, t], base.logits[0, t])
        # MTP at position p reads token p+1: positions < t-1 are untouched
        np.testing.assert_array_equal(out.mtp_logits[0, :max(t - 1, 0)],
                                      base.mtp_logits[0, :max(t - 1, 0)])


# Two hash blocks, then three units of two scanned blocks and a last single block (routed rows
# 0, 2, 4 | 1, 3, 5 | 6), scanned and unrolled from the same seed; their forward compiled once
# (nnx.jit's cache is per model structure) for the tests below
NINE_BLOCKS = dict(compress_ratios=[0, 0, 4, 8, 4, 8, 4, 8, 4], base_num_decoder_layers=9,
                   first_num_hash_layers=2, max_target_length=16)
_forward = nnx.jit(lambda m, t: m(t))


def scanned_and_unrolled() -> tuple[DeepSeekV4, DeepSeekV4]:
    return (DeepSeekV4(load_config("deepseek4-smoke", NINE_BLOCKS), rngs=nnx.Rngs(3)),
            DeepSeekV4(load_config("deepseek4-smoke", {**NINE_BLOCKS, "scan_layers": False}),
                       rngs=nnx.Rngs(3)))


def test_scan_equals_unrolled_and_records_are_per_layer():
    scanned, unrolled = scanned_and_unrolled()
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 256)
    a, b = _forward(scanned, tokens), _forward(unrolled, tokens)
    np.testing.assert_allclose(a.logits, b.logits, **tolerance(b.logits, rtol=1e-5, atol=1e-5))
    np.testing.assert_array_equal(a.routing.counts, b.routing.counts)
    assert a.routing.counts.shape == (9, 8) and a.routing.counts.dtype == jnp.int32
    assert (np.asarray(a.routing.counts).sum(1) == 2 * 16 * 2).all()
    # hash layers route by token id: their record is the table lookup
    tables = [blk.ffn.hash_table[...] for blk in unrolled.segments[:2]]
    for layer in range(2):
        np.testing.assert_array_equal(b.routing.indices[layer], np.asarray(tables[layer])[tokens])


def test_biases_are_written_to_their_own_layers_scanned_or_not_eagerly_or_under_jit():
    scanned, unrolled = scanned_and_unrolled()
    assert routed_layers(scanned) == routed_layers(unrolled) == list(range(2, 9))
    # biases large enough to decide the top-k: any row written to another layer changes counts
    biases = 4.0 * jax.random.normal(jax.random.key(5), (7, 8), jnp.float32)
    set_biases(scanned, biases)
    nnx.jit(set_biases)(unrolled, biases)
    for row, layer in enumerate(routed_layers(unrolled)):
        np.testing.assert_array_equal(unrolled.segments[layer].ffn.bias[...], biases[row])
    np.testing.assert_array_equal(get_biases(scanned), biases)
    np.testing.assert_array_equal(nnx.jit(get_biases)(scanned), biases)
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 256)
    np.testing.assert_array_equal(_forward(scanned, tokens).routing.counts,
                                  _forward(unrolled, tokens).routing.counts)


@functools.cache
def _scan_loss_and_grads(remat: str, dispatch: str):
    """A 3-block model's loss and gradients (as NumPy) under the layer scan with `remat`; each
    (remat, dispatch) computed once, so the policies of one dispatch share its reference."""
    cfg = load_config("deepseek4-smoke", dict(
        compress_ratios=[0, 0, 4], base_num_decoder_layers=3, first_num_hash_layers=2,
        max_target_length=16, moe_dispatch=dispatch, remat_policy=remat))  # hash blocks: one scan
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 256)
    graphdef, params, rest = nnx.split(DeepSeekV4(cfg, rngs=nnx.Rngs(3)), nnx.Param, ...)

    def loss(params):
        out = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(out.logits, tokens[:, 1:]).mean()

    return jax.tree.map(np.asarray, jax.jit(jax.value_and_grad(loss))(params))


@pytest.mark.parametrize("policy, dispatch", [("full", "blocked"), ("minimal", "blocked"),
                                              ("save_experts", "ragged")])
def test_remat_policies_give_the_same_loss_and_gradients_under_the_layer_scan(policy, dispatch):
    loss_none, grads_none = _scan_loss_and_grads("none", dispatch)
    loss_policy, grads_policy = _scan_loss_and_grads(policy, dispatch)
    np.testing.assert_allclose(loss_policy, loss_none, **tolerance(loss_none, rtol=1e-6))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, **tolerance(b, rtol=1e-4, atol=1e-6)), grads_policy, grads_none)


def test_tiny_config_trains_on_a_fixed_batch():
    cfg = load_config("deepseek4-tiny", dict(max_target_length=32, steps=8, learning_rate=3e-3,
                                             warmup_steps_fraction=0.0, hash_table="random"))
    model = DeepSeekV4(cfg, rngs=nnx.Rngs(0))
    opt = new_optimizer(cfg, model)
    step = make_train_step(cfg, model)
    tokens = jax.random.randint(jax.random.key(0), (1, 2, 33), 0, 1000)
    mask, seg = jnp.ones((1, 2, 32), bool), jnp.zeros((1, 2, 32), jnp.int32)
    losses = [float(step(model, opt, tokens, mask, seg)["ce"]) for _ in range(8)]
    assert losses[0] == pytest.approx(np.log(cfg.vocab_size), rel=0.1)
    assert losses[-1] < 0.7 * losses[0], losses


def test_bf16_model_keeps_float32_islands():
    cfg = load_config("deepseek4-smoke", dict(dtype="bfloat16", weight_dtype="bfloat16"))
    model = DeepSeekV4(cfg, rngs=nnx.Rngs(0))
    out = nnx.jit(lambda m, t: m(t))(model, jnp.zeros((1, 8), jnp.int32))
    assert out.logits.dtype == jnp.float32 and out.routing.scores.dtype == jnp.float32
    blk = model.segments[-1]
    assert blk.attn_hc.fn.dtype == jnp.float32 and blk.ffn.bias.dtype == jnp.float32
    assert blk.ffn.router.dtype == jnp.float32 and blk.attn.wq_a.dtype == jnp.bfloat16
    assert model.head.dtype == jnp.float32


@pytest.mark.parametrize("name, total, active", [("deepseek4-flash", 284e9, 13e9),
                                                 ("deepseek4-pro", 1.6e12, 49e9)])
def test_real_shapes_parameter_counts(name, total, active):
    counts = parameter_counts(load_config(name))
    assert counts["total"] == pytest.approx(total, rel=0.03)
    assert counts["active"] == pytest.approx(active, rel=0.03)


@pytest.mark.parametrize(
    "over, key",
    [
        (dict(compress_ratios=[0, 4]), "compress_ratios"),
        (dict(first_num_hash_layers=5), "first_num_hash_layers"),
        (dict(o_groups=3), "o_groups"),
        (dict(sliding_window_size=0), "sliding_window_size"),
        (dict(base_num_kv_heads=2), "base_num_kv_heads"),
        (dict(qk_rope_head_dim=20), "qk_rope_head_dim"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(hash_table="modulo"), "hash_table"),
        (dict(moe_kernel="triton"), "moe_kernel.*choose one of"),
        (dict(moe_kernel="pallas", moe_dispatch="ragged"), "moe_kernel.*takes blocked rows"),
        (dict(head_dim="big"), "head_dim"),
        (dict(num_expert=8), "unknown config key `num_expert`; did you mean num_experts"),
    ],
)
def test_bad_config_names_the_key(over, key):
    with pytest.raises(ConfigError, match=key):
        load_config("deepseek4-smoke", over)


def test_traced_initialiser_draws_the_keys_of_flax_own_stream():
    """Under tracing init_normal advances the Rngs itself (fast path): the keys and values must be
    those flax's own `rngs.params()` gives, one after another."""
    def draw():
        rngs = nnx.Rngs(3)
        a = layers.init_normal(rngs, (5,), jnp.float32, 2.0)
        b = layers.init_normal(rngs, (2, 3), jnp.bfloat16, 1.0)
        return a, b, jax.random.key_data(rngs.params())

    a, b, after = jax.jit(draw)()
    rngs = nnx.Rngs(3)
    keys = [rngs.params() for _ in range(3)]
    np.testing.assert_array_equal(a, 2.0 * jax.random.normal(keys[0], (5,), jnp.float32))
    np.testing.assert_array_equal(b, jax.random.normal(keys[1], (2, 3)).astype(jnp.bfloat16))
    np.testing.assert_array_equal(after, jax.random.key_data(keys[2]))


def test_eager_initialiser_is_numpy_normal_from_the_rngs_seed():
    """Eagerly, a parameter is std * NumPy's float32 normal from the seed the Rngs stream gives."""
    rngs = nnx.Rngs(3)
    got = layers.init_normal(rngs, (40, 7), jnp.bfloat16, 0.5)
    seed = np.asarray(jax.random.key_data(nnx.Rngs(3).params())).ravel()
    want = np.random.default_rng(seed).standard_normal((40, 7), dtype=np.float32) * 0.5
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got), want.astype(jnp.bfloat16))


def test_large_draws_are_chunks_of_independent_seeds_whatever_the_threads(monkeypatch):
    """A parameter larger than DRAW_CHUNK is drawn chunk by chunk on threads: chunk i is NumPy's
    normal from the i-th child of the seed (SeedSequence.spawn), the same with one thread or many,
    and no chunk repeats another."""
    monkeypatch.setattr(layers, "DRAW_CHUNK", 1000)
    seed = np.array([7, 11], np.uint32)
    monkeypatch.setattr(layers.os, "cpu_count", lambda: 1)
    one = layers.host_normal(seed, (45, 101), np.dtype(np.float32), 2.0)  # 4,545 values: 5 chunks
    monkeypatch.setattr(layers.os, "cpu_count", lambda: 8)
    many = layers.host_normal(seed, (45, 101), np.dtype(np.float32), 2.0)
    np.testing.assert_array_equal(one, many)
    flat = one.ravel()
    children = np.random.SeedSequence(seed).spawn(5)
    for i, child in enumerate(children):
        n = min(1000, flat.size - 1000 * i)
        want = np.random.default_rng(child).standard_normal(n, dtype=np.float32) * 2.0
        np.testing.assert_array_equal(flat[1000 * i:1000 * i + n], want)
    starts = {tuple(flat[i:i + 4]) for i in range(0, flat.size, 1000)}
    assert len(starts) == 5
    assert abs(flat.mean()) < 0.1 and abs(flat.std() - 2.0) < 0.1
