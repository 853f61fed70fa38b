import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import reference as ref
from conftest import float32_model, tolerance
from moebalance import routing
from moebalance.model.moe import MoE, MoEConfig, RouterBias


def make(rngs=0, **kw):
    base = dict(emb_dim=16, num_experts=8, num_experts_per_tok=3, moe_mlp_dim=12,
                shared_experts=0, routed_score_func="sigmoid", swiglu_limit=0.7,
                routed_scaling_factor=1.5, block_size=4)
    base.update(kw)
    model = MoE(MoEConfig(**base), rngs=nnx.Rngs(rngs))
    # a non-zero bias so that selection differs from the unbiased top-k
    model.bias[...] = jnp.linspace(-0.05, 0.05, base["num_experts"]).astype(jnp.float32)
    return model


def params(model):
    return [np.asarray(model.w1[...], np.float64), np.asarray(model.w3[...], np.float64),
            np.asarray(model.w2[...], np.float64)]


def inputs(seed=1, shape=(2, 9)):
    x = jax.random.normal(jax.random.key(seed), (*shape, 16)) * 2.0  # large enough to clamp
    mask = jax.random.uniform(jax.random.key(seed + 1), shape) < 0.8
    return x, mask


# the layer as training runs it: one program per layer's layout, not a program per eager operation
forward = nnx.jit(lambda model, x, mask: model(x, mask=mask))

# (dispatch, kernel); Pallas kernels interpreted on the CPU; megablox's blocks: test_kernels.py
LAYOUTS = [("blocked", "xla"), ("blocked", "pallas"), ("ragged", "xla"), ("ragged", "megablox")]


@pytest.mark.parametrize("dispatch,kernel", LAYOUTS)
def test_dropless_layer_equals_per_token_loop(dispatch, kernel):
    model = make(dispatch=dispatch, kernel=kernel)
    x, mask = inputs()
    y, rec = forward(model, x, mask)
    xt, valid = np.asarray(x).reshape(-1, 16), np.asarray(mask).reshape(-1)
    idx = np.asarray(rec.indices).reshape(-1, 3)
    w = np.asarray(rec.weights).reshape(-1, 3)
    want = ref.moe(xt, idx, w, *params(model), 0.7, kept=np.repeat(valid[:, None], 3, 1))
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 16), want,
                               **tolerance(want, rtol=2e-5, atol=2e-5))
    # the routing in the record is the router's, recomputed independently
    logits = xt @ np.asarray(model.router[...])
    ridx, rw, _, amb = ref.route(logits, np.asarray(model.bias[...]), 3, "sigmoid", 1.5)
    assert not amb.any()
    np.testing.assert_array_equal(idx, ridx)
    np.testing.assert_allclose(w, rw, rtol=1e-5)
    np.testing.assert_array_equal(rec.counts, ref.counts(idx, 8, valid))
    assert int(rec.dropped) == 0


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.25])
def test_capacity_layer_equals_per_token_loop(policy, capacity_factor, kernel):
    model = make(capacity_factor=capacity_factor, drop_policy=policy, kernel=kernel)
    x, mask = inputs(seed=3)
    y, rec = forward(model, x, mask)
    xt, valid = np.asarray(x).reshape(-1, 16), np.asarray(mask).reshape(-1)
    idx = np.asarray(rec.indices).reshape(-1, 3)
    w = np.asarray(rec.weights).reshape(-1, 3)
    capacity = model.config.capacity(18)
    assert capacity == int(np.ceil(capacity_factor * 18 * 3 / 8))
    kept = ref.kept_assignments(idx, w, valid, 8, capacity, policy)
    want = ref.moe(xt, idx, w, *params(model), 0.7, kept=kept)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 16), want,
                               **tolerance(want, rtol=2e-5, atol=2e-5))
    assert int(rec.dropped) == int(valid.sum()) * 3 - int(kept.sum())
    if capacity_factor == 0.5:
        assert int(rec.dropped) > 0
    np.testing.assert_array_equal(rec.counts, ref.counts(idx, 8, valid))  # before the drop


@pytest.mark.parametrize("kw", [dict(dispatch="blocked"), dict(dispatch="ragged"),
                                dict(capacity_factor=0.5, drop_policy="position"),
                                dict(capacity_factor=0.5, drop_policy="probs")])
def test_the_tpus_slot_major_numbering_computes_the_same_layer(kw, monkeypatch):
    """A TPU numbers assignments slot-major (model/dispatch.py); forced here on the CPU, the
    layer's output, drops and gradients equal the token-major layer's, which the tests above hold
    against the references (the buffer rows are the same; only sums' order may differ)."""
    import moebalance.model.moe as moe_module

    model = make(**kw)
    x, mask = inputs(seed=3)
    probe = jax.random.normal(jax.random.key(9), x.shape)

    def run():
        jax.clear_caches()
        y, rec = nnx.jit(lambda m, x: m(x, mask=mask))(model, x)
        grads = nnx.jit(nnx.grad(lambda m, x: (m(x, mask=mask)[0] * probe).sum(),
                                 argnums=(0, 1)))(model, x)
        return y, rec.dropped, grads

    token_major = run()
    monkeypatch.setattr(moe_module, "slot_major_here", lambda: True)
    slot_major = run()
    assert int(token_major[1]) == int(slot_major[1])
    if "capacity_factor" in kw:
        assert int(slot_major[1]) > 0
    np.testing.assert_allclose(slot_major[0], token_major[0], rtol=1e-6, atol=1e-6)
    (gm1, gx1), (gm2, gx2) = token_major[2], slot_major[2]
    np.testing.assert_allclose(gx2, gx1, rtol=1e-6, atol=1e-6)
    for name in ("router", "w1", "w3", "w2"):
        np.testing.assert_allclose(gm2[name][...], gm1[name][...], rtol=1e-6, atol=1e-6,
                                   err_msg=name)


def test_shared_experts_are_added_unweighted():
    model = make(shared_experts=2)
    x, _ = inputs()
    y, rec = forward(model, x, None)
    xt = np.asarray(x, np.float64).reshape(-1, 16)
    sh = model.shared
    assert sh.w1.shape == (16, 24)  # two experts fused into one of width 2*F
    shared = np.stack([ref.swiglu_expert(t, np.asarray(sh.w1[...]), np.asarray(sh.w3[...]),
                                         np.asarray(sh.w2[...]), 0.7) for t in xt])
    routed = ref.moe(xt, np.asarray(rec.indices).reshape(-1, 3),
                     np.asarray(rec.weights).reshape(-1, 3), *params(model), 0.7)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 16), routed + shared,
                               **tolerance(routed + shared, rtol=2e-5, atol=2e-5))


def _dense_reference(model, x):
    """Every expert on every token, combined with a dense [T, E] weight matrix: plain autodiff,
    no dispatch, no custom gradient."""
    c = model.config
    xt = x.reshape(-1, c.emb_dim)
    idx, w, _ = routing.route(xt @ model.router[...], model.bias[...], k=c.num_experts_per_tok,
                              score_fn=c.routed_score_func, route_scale=c.routed_scaling_factor)
    combine = jnp.zeros((xt.shape[0], c.num_experts)).at[
        jnp.arange(xt.shape[0])[:, None], idx].add(w)  # [T, E]
    gate = jnp.einsum("td,edf->tef", xt, model.w1[...])
    up = jnp.einsum("td,edf->tef", xt, model.w3[...])
    lim = c.swiglu_limit
    h = jax.nn.silu(jnp.minimum(gate, lim)) * jnp.clip(up, -lim, lim) * combine[..., None]
    return jnp.einsum("tef,efd->td", h, model.w2[...]).reshape(x.shape)


@pytest.mark.parametrize("dispatch,kernel", LAYOUTS)
def test_gradients_equal_dense_autodiff(dispatch, kernel):
    """XLA's blocked path at the float32 model's matmul precision, to the CPU's tolerances on every
    backend (a gradient 1% off fails on a TPU too); the Pallas kernels and ragged_dot at the
    backend's default precision, to tolerance()."""
    float32 = (dispatch, kernel) == ("blocked", "xla")
    model = make(dispatch=dispatch, kernel=kernel)
    x, _ = inputs(seed=5)
    probe = jax.random.normal(jax.random.key(9), x.shape)

    def loss_layer(m, x):
        return (m(x)[0] * probe).sum()

    def loss_dense(m, x):
        return (_dense_reference(m, x) * probe).sum()

    with float32_model() if float32 else contextlib.nullcontext():
        g1, gx1 = nnx.jit(nnx.grad(loss_layer, argnums=(0, 1)))(model, x)
        g2, gx2 = nnx.jit(nnx.grad(loss_dense, argnums=(0, 1)))(model, x)
    for got, want, name in [(gx1, gx2, "x")] + [(g1[name][...], g2[name][...], name)
                                                for name in ("router", "w1", "w3", "w2")]:
        tol = dict(rtol=1e-4, atol=1e-5) if float32 else tolerance(want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got, want, **tol, err_msg=name)


def test_blocked_backward_keeps_no_per_block_weights():
    """Each block's copy of its expert's weights ([nb, D, F], nb / E times the weights) is picked
    again in the backward pass rather than kept: none of what jax.vjp keeps for the backward, bar
    the layer's own weights, has the shape of a weight matrix."""
    model = make(dispatch="blocked", kernel="xla")
    graphdef, state = nnx.split(model)
    x, _ = inputs()
    residuals = jax.make_jaxpr(lambda state, x: jax.vjp(
        lambda state: nnx.merge(graphdef, state)(x)[0].sum(), state)[1])(state, x).jaxpr
    kept = [v.aval.shape for v in residuals.outvars if v not in residuals.invars]
    assert (20, 4, 16) in kept  # the blocks themselves: nb = ceil((18 * 3 + 8 * 3) / 4) = 20
    assert not [shape for shape in kept if shape[1:] in ((16, 12), (12, 16))], kept


@pytest.mark.parametrize("dispatch,kernel", [("blocked", "xla"), ("blocked", "pallas"),
                                             ("ragged", "megablox")])
def test_bfloat16_gradients_equal_ragged_dot_autodiff(dispatch, kernel):
    """The layer's backward (blocked xla: each block's weights picked again; pallas and megablox:
    the grouped-matmul kernels' own backward) in bfloat16 against autodiff of the ragged layout's
    jax.lax.ragged_dot, also in bfloat16."""
    x, mask = inputs(seed=5)  # masked tokens leave rows past the ragged groups' sum
    probe = jax.random.normal(jax.random.key(9), x.shape)
    grads = {}
    for key, (layout, matmul) in {"kernel": (dispatch, kernel), "xla": ("ragged", "xla")}.items():
        model = make(dispatch=layout, dtype="bfloat16", kernel=matmul)
        grads[key] = nnx.jit(nnx.grad(
            lambda m, x: (m(x, mask=mask)[0].astype(jnp.float32) * probe).sum(),
            argnums=(0, 1)))(model, x)
    (g_kernel, gx_kernel), (g_xla, gx_xla) = grads["kernel"], grads["xla"]
    assert gx_kernel.dtype == jnp.float32  # the input's cotangent in the input's dtype
    np.testing.assert_allclose(gx_kernel, gx_xla, rtol=2e-2, atol=2e-2)
    for name in ("router", "w1", "w3", "w2"):
        assert g_kernel[name][...].dtype == jnp.float32
        scale = np.abs(np.asarray(g_xla[name][...])).max()
        np.testing.assert_allclose(g_kernel[name][...], g_xla[name][...], atol=2e-2 * scale,
                                   err_msg=name)


def test_bias_is_never_a_parameter_gradient_or_optimizer_target():
    model = make()
    x, _ = inputs()
    grads = nnx.jit(nnx.grad(lambda m: m(x)[0].sum()))(model)
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(grads))
    assert not any("bias" in jax.tree_util.keystr(p) for p, _ in leaves)
    assert all(isinstance(v, nnx.Param) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
    opt = nnx.Optimizer(model, optax.adam(1.0), wrt=nnx.Param)
    bias_before = np.asarray(model.bias[...]).copy()
    router_before = np.asarray(model.router[...]).copy()
    opt.update(model, grads)
    np.testing.assert_array_equal(model.bias[...], bias_before)
    assert not np.array_equal(model.router[...], router_before)
    assert isinstance(model.bias, RouterBias) and model.bias.dtype == jnp.float32


def test_bf16_model_keeps_float32_router_maths_and_bias():
    model = make(dtype="bfloat16", weight_dtype="bfloat16")
    x, _ = inputs()
    y, rec = forward(model, x.astype(jnp.bfloat16), None)
    assert y.dtype == jnp.bfloat16 and model.w1.dtype == jnp.bfloat16
    assert model.bias.dtype == jnp.float32 and model.router.dtype == jnp.float32
    assert rec.scores.dtype == jnp.float32 and rec.weights.dtype == jnp.float32
    assert rec.logits.dtype == jnp.float32 and rec.counts.dtype == jnp.int32
    y32, _ = forward(make(), x, None)
    np.testing.assert_allclose(np.asarray(y, np.float32), y32, rtol=0.1, atol=0.1)


def test_any_leading_shape_and_jit():
    model = make()
    x = jax.random.normal(jax.random.key(0), (2, 3, 4, 16))
    y, rec = nnx.jit(lambda m, x: m(x))(model, x)
    assert y.shape == x.shape and rec.indices.shape == (2, 3, 4, 3)
    assert rec.scores.shape == (2, 3, 4, 8) and int(rec.counts.sum()) == 24 * 3
    y2, _ = model(x.reshape(-1, 16))
    np.testing.assert_allclose(y.reshape(-1, 16), y2, **tolerance(y2, rtol=1e-5, atol=1e-6))


def test_hash_routed_layer():
    table = routing.build_hash_table(32, 8, 3, "random", seed=1)
    model = MoE(MoEConfig(emb_dim=16, num_experts=8, num_experts_per_tok=3, moe_mlp_dim=12),
                hash_table=table, rngs=nnx.Rngs(0))
    assert model.hash_routed and model.hash_table.dtype == jnp.int32
    ids = jax.random.randint(jax.random.key(0), (2, 5), 0, 32)
    x, _ = inputs(shape=(2, 5))
    y, rec = nnx.jit(lambda m, x, ids: m(x, token_ids=ids))(model, x, ids)
    np.testing.assert_array_equal(rec.indices, table[np.asarray(ids)])
    np.testing.assert_array_equal(rec.counts, ref.counts(table[np.asarray(ids)], 8))
    assert model.bias is None  # no selection bias on a hash layer
    with pytest.raises(ValueError, match="needs token_ids"):
        model(x)
    with pytest.raises(ValueError, match="token ids must lie"):
        model(x, token_ids=ids + 32)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(num_experts_per_tok=9), "1 <= k <= num_experts"),
        (dict(routed_score_func="tanh"), "unknown score_fn"),
        (dict(n_routing_groups=3, topk_routing_group=1), "divisor"),
        (dict(drop_policy="random"), "unknown drop_policy"),
        (dict(dispatch="einsum"), "unknown dispatch"),
        (dict(kernel="triton"), "unknown expert kernel"),
        (dict(dispatch="ragged", kernel="pallas"), "takes blocked rows"),
        (dict(swiglu_limit=-1.0), "swiglu_limit"),
        (dict(moe_mlp_dim=0), "moe_mlp_dim must be >= 1"),
    ],
)
def test_bad_config(kw, match):
    with pytest.raises(ValueError, match=match):
        make(**kw)


def test_hash_table_must_match_k():
    with pytest.raises(ValueError, match="hash table gives 2 experts per token"):
        MoE(MoEConfig(emb_dim=4, num_experts=4, num_experts_per_tok=3, moe_mlp_dim=4),
            hash_table=np.zeros((5, 2), np.int32), rngs=nnx.Rngs(0))
