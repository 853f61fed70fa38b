import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import reference as ref
from moebalance import balancing, routing


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([1, 4, 7, 16]), st.booleans())
def test_expert_counts_matches_recount(seed, num_experts, masked):
    rng = np.random.default_rng(seed)
    k = rng.integers(1, num_experts + 1)
    idx = jnp.asarray(np.argsort(rng.random((3, 7, num_experts)), -1)[..., :k], jnp.int32)
    mask = rng.random((3, 7)) < 0.7 if masked else None
    c = jax.jit(balancing.expert_counts, static_argnums=1)(
        idx, num_experts, None if mask is None else jnp.asarray(mask))
    assert c.dtype == jnp.int32
    np.testing.assert_array_equal(c, ref.counts(np.asarray(idx), num_experts, mask))
    n_valid = 21 if mask is None else mask.sum()
    assert int(c.sum()) == n_valid * k


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from([2, 5, 16]).flatmap(
        lambda n: st.lists(st.integers(0, 3000), min_size=n, max_size=n)),
    st.sampled_from(sorted(balancing.BIAS_RULES)),
    st.sampled_from([0.0, 1e-4, 1e-3, 0.5]),
    st.booleans(),
)
@example([31, 31, 32, 34, 34], "proportional", 0.5, False)  # found by hypothesis in CI
def test_update_bias_matches_reference(counts, rule, rate, center):
    if rule == "fraction" and sum(counts) == 0:
        counts[0] = 1
    c = np.array(counts, np.int32)
    bias = np.linspace(-0.1, 0.1, len(c)).astype(np.float32)
    new = balancing.update_bias(jnp.asarray(bias), jnp.asarray(c), rule=rule, rate=rate,
                                center=center)
    assert new.dtype == jnp.float32
    want = ref.update_bias(bias, c, rule, rate, center)
    # float32 resolution of the operands: the proportional rule's mean(c) - c is formed at the
    # counts' magnitude (mean 32.4 is 32.400002 in float32, x 0.5 -> 7.6e-7 off a delta of 0.2),
    # and an update of 158 cancelling to -0.38 keeps ~1e-5 abs.
    operands = rate * c.max() if rule == "proportional" else rate
    atol = 4 * np.finfo(np.float32).eps * max(1.0, np.abs(want - bias).max() + 0.1, operands)
    np.testing.assert_allclose(new, want, rtol=1e-6, atol=atol)


def test_update_bias_hand_computed():
    c = jnp.array([6, 2, 4, 4], jnp.int32)  # mean 4
    b = jnp.zeros(4, jnp.float32)
    np.testing.assert_allclose(balancing.update_bias(b, c, rule="sign", rate=0.001),
                               [-0.001, 0.001, 0.0, 0.0])
    np.testing.assert_allclose(balancing.update_bias(b, c, rule="proportional", rate=0.1),
                               [-0.2, 0.2, 0.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(balancing.update_bias(b, c, rule="fraction", rate=1.0),
                               [0.25 - 6 / 16, 0.25 - 2 / 16, 0.0, 0.0], rtol=1e-6)
    c = jnp.array([3, 0, 0, 0], jnp.int32)  # mean 0.75: centering removes the 0.5e-3 drift
    np.testing.assert_allclose(balancing.update_bias(b, c, rule="sign", rate=0.001, center=True),
                               [-0.0015, 0.0005, 0.0005, 0.0005], rtol=1e-6)


def test_sign_rule_is_exact_for_huge_counts():
    # Counts near 2^31 / E: float32 cannot tell c from the mean, the integer rule can.
    big = 2**27
    c = jnp.array([big + 1, big, big, big - 1], jnp.int32)
    new = balancing.update_bias(jnp.zeros(4), c, rule="sign", rate=1.0)
    np.testing.assert_array_equal(new, [-1.0, 0.0, 0.0, 1.0])
    # mean 2^27 + 0.25: the three experts at 2^27 are below it
    c = jnp.array([big + 1, big, big, big], jnp.int32)
    np.testing.assert_array_equal(balancing.update_bias(jnp.zeros(4), c, rule="sign", rate=1.0),
                                  [-1.0, 1.0, 1.0, 1.0])


def test_update_bias_layers_are_independent():
    c = jnp.array([[4, 0], [0, 4]], jnp.int32)
    new = balancing.update_bias(jnp.zeros((2, 2)), c, rule="sign", rate=1.0)
    np.testing.assert_array_equal(new, [[-1, 1], [1, -1]])


def test_update_bias_bad_input():
    with pytest.raises(ValueError, match="unknown bias update rule 'signum'"):
        balancing.update_bias(jnp.zeros(2), jnp.ones(2, jnp.int32), rule="signum", rate=1e-3)
    with pytest.raises(ValueError, match="rate must be >= 0"):
        balancing.update_bias(jnp.zeros(2), jnp.ones(2, jnp.int32), rule="sign", rate=-1e-3)
    with pytest.raises(ValueError, match="rate must be >= 0"):
        balancing.rate_schedule(-1.0)


def test_rate_schedule():
    sched = balancing.rate_schedule(1e-3, freeze_after=10)
    assert float(sched(0)) == pytest.approx(1e-3) and float(sched(9)) == pytest.approx(1e-3)
    assert float(sched(10)) == 0.0 and float(sched(1000)) == 0.0
    assert float(jax.jit(sched)(jnp.int32(12))) == 0.0
    assert float(balancing.rate_schedule(2e-3)(10**9)) == pytest.approx(2e-3)


def test_cosine_rate_schedule():
    sched = balancing.rate_schedule(1.0, decay_steps=100, final_fraction=0.05)
    for step in (0, 25, 50, 99, 100, 500):  # rate * (f + (1 - f) * (1 + cos(pi * t / T)) / 2)
        t = min(step, 100) / 100
        expected = 0.05 + 0.95 * (1 + np.cos(np.pi * t)) / 2
        assert float(sched(step)) == pytest.approx(expected, rel=1e-6)
        assert float(jax.jit(sched)(jnp.int32(step))) == pytest.approx(expected, rel=1e-6)
    assert float(sched(50)) == pytest.approx(0.525)
    frozen = balancing.rate_schedule(1.0, freeze_after=60, decay_steps=100, final_fraction=0.0)
    assert float(frozen(59)) > 0.0 and float(frozen(60)) == 0.0
    with pytest.raises(ValueError, match="final_fraction must be in"):
        balancing.rate_schedule(1.0, decay_steps=10, final_fraction=1.5)
    with pytest.raises(ValueError, match="needs decay_steps"):
        balancing.rate_schedule(1.0, final_fraction=0.5)


def quantile_rounding(x: np.ndarray, q: float, valid: np.ndarray | None) -> np.ndarray:
    """[E]: how far column_quantile's float32 result may lie from NumPy's float64 one, per column.
    The interpolation index q * (n - 1) is formed in float32 (q rounded, then the product: off by
    up to eps * q * (n - 1)), and the result is linear in the index with the slope of the gap
    between the neighbouring order statistics it falls between (the index's error is below 1, so
    the gaps next to those bound it); then the interpolation's own three roundings (the gap, its
    product with the fraction, the sum: each u = eps / 2 of its value) and NumPy's float64 result
    rounded to float32 (u of it): at most 6 u = 3 eps of the values near the index."""
    eps = float(np.finfo(np.float32).eps)
    rows = x if valid is None else x[valid]
    if len(rows) == 0:
        return np.zeros(x.shape[1])
    ordered = np.sort(rows.astype(np.float64), axis=0)
    position = q * (len(rows) - 1)
    gaps = np.diff(ordered, axis=0, prepend=ordered[:1], append=ordered[-1:])  # gaps[i]: i-1 .. i
    near = slice(max(int(position) - 1, 0), int(position) + 3)
    slope = np.abs(gaps[near]).max(0)
    size = np.abs(ordered[near]).max(0)
    return slope * eps * (position + 1) + 3 * eps * size


@pytest.mark.filterwarnings("error::RuntimeWarning")
@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 50), st.floats(0.0, 1.0), st.booleans(),
       st.booleans())
@example(23, 46, 0.9515442549137989, False, True)  # CI: 3.0e-6 off at the former guess, 2e-6
def test_column_quantile_equals_numpy_nanquantile(seed, rows, q, masked, ties):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 5)).astype(np.float32) * 10.0 ** rng.integers(-30, 30)
    if ties:  # repeated values, signed zeros and both signs of the same magnitude
        x = np.round(x / np.abs(x).max() * 2).astype(np.float32)
        x[0, 0], x[-1, 0] = -0.0, 0.0
    valid = rng.random(rows) < 0.6 if masked else None
    if masked and not valid.any():  # every row masked: NaN (numpy warns "All-NaN slice")
        expected = np.full(x.shape[1], np.nan)
    else:
        expected = np.nanquantile(np.where(valid[:, None], x, np.nan) if masked else x, q, axis=0)
    got = jax.jit(balancing.column_quantile)(jnp.asarray(x), q,
                                            None if valid is None else jnp.asarray(valid))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    off = np.nan_to_num(np.abs(np.asarray(got, np.float64) - expected))
    bound = quantile_rounding(x, q, valid)
    assert (off <= bound).all(), f"{off} off NumPy's, over float32's {bound}"


def test_column_quantile_hand_computed_and_empty():
    x = jnp.asarray([[4.0, -1.0], [1.0, -3.0], [3.0, -2.0], [2.0, 7.0]])
    # column 0 sorted 1 2 3 4: position 0.75 * 3 = 2.25 -> 3 + 0.25 * (4 - 3)
    np.testing.assert_allclose(balancing.column_quantile(x, 0.75), [3.25, 0.25 * 7 + 0.75 * -1])
    assert np.isnan(balancing.column_quantile(x, 0.5, jnp.zeros(4, bool))).all()
    np.testing.assert_allclose(balancing.column_quantile(x, 0.5, jnp.asarray([0, 1, 0, 0], bool)),
                               [1.0, -3.0])


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([(8, 2), (6, 3), (16, 4), (5, 1)]), st.booleans())
def test_quantile_bias_matches_reference(seed, ek, masked):
    num_experts, k = ek
    rng = np.random.default_rng(seed)
    s = rng.random((40, num_experts)).astype(np.float32)
    bias = (0.05 * rng.normal(size=num_experts)).astype(np.float32)
    mask = rng.random(40) < 0.8 if masked else None
    new = jax.jit(balancing.quantile_bias, static_argnums=2)(
        jnp.asarray(s), jnp.asarray(bias), k, mask=None if mask is None else jnp.asarray(mask))
    # float32's error: each margin s_i - (s_j + b_j) two roundings of values below 1.2 (3e-7),
    # then the quantile's index over <= 40 margins (40 eps = 4.8e-6 of a gap between neighbouring
    # margins, ~0.05: 2.4e-7); 1e-6 bounds both
    np.testing.assert_allclose(new, ref.quantile_bias(s, bias, k, mask), rtol=1e-5, atol=1e-6)


def test_quantile_bias_per_layer_bias_equals_layer_by_layer():
    rng = np.random.default_rng(3)
    s = jnp.asarray(rng.random((3, 2, 20, 8)), jnp.float32)  # [L, B, S, E]
    bias = jnp.asarray(0.1 * rng.normal(size=(3, 8)), jnp.float32)
    mask = jnp.asarray(rng.random((2, 20)) < 0.7)
    together = balancing.quantile_bias(s, bias, 2, mask=mask, center=True, rate=0.5)
    # Each layer's own formula, not a mix of layers (a mixed-up layer is off by ~1e-2): equal on
    # the CPU. A TPU compiles the [3, 8] and the [1, 8] programs' reductions and fused
    # multiply-adds in other orders: the centring mean of E = 8 values summed in another order
    # moves by up to (E - 1) / 2 roundings of partial sums <= E max|b|, i.e. (E - 1) / 2 eps
    # max|b| in the mean, and the interpolation and the subtraction a few half-ulps more: within
    # E eps max|b| (measured on a v5e: 8 ulps apart)
    for layer in range(3):
        alone = balancing.quantile_bias(s[layer], bias[layer], 2, mask=mask, center=True,
                                        rate=0.5)
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(together[layer], alone)
        else:
            np.testing.assert_allclose(together[layer], alone, rtol=0, atol=8 * np.finfo(
                np.float32).eps * np.abs(alone).max())


def test_quantile_bias_balances_each_expert_against_fixed_others():
    # With the others' biases held fixed, expert i alone at its new bias gets exactly N*K/E tokens
    # (continuous scores, N*K/E an integer): the defining property of the quantile.
    rng = np.random.default_rng(0)
    num_experts, k, n = 8, 2, 400
    s = (rng.random((n, num_experts)) + np.linspace(0, 0.5, num_experts)).astype(np.float32)
    bias = np.zeros(num_experts, np.float32)
    new = np.asarray(balancing.quantile_bias(jnp.asarray(s), jnp.asarray(bias), k))
    for i in range(num_experts):
        trial = bias.copy()
        trial[i] = new[i]
        chosen = (np.argsort(-(s + trial), axis=1, kind="stable")[:, :k] == i).any(1)
        assert chosen.sum() == n * k // num_experts


def test_quantile_bias_repeated_converges_on_a_fixed_batch():
    rng = np.random.default_rng(1)
    num_experts, k, n = 16, 4, 2048
    s = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(n, num_experts)) + np.linspace(-1, 1, 16),
                                   jnp.float32))
    bias = jnp.zeros(num_experts)
    start = balancing.expert_counts(routing.select_experts(s + bias, k), num_experts)
    for _ in range(20):
        bias = balancing.quantile_bias(s, bias, k)
    end = balancing.expert_counts(routing.select_experts(s + bias, k), num_experts)
    target = n * k / num_experts
    assert np.abs(np.asarray(start) - target).max() > 300
    assert np.abs(np.asarray(end) - target).max() <= 0.05 * target


def test_quantile_bias_k_equal_e_keeps_bias():
    b = jnp.array([0.1, -0.1])
    np.testing.assert_array_equal(balancing.quantile_bias(jnp.ones((5, 2)), b, 2), b)


# ---------------------------------------------------------------------------------------------
# losses


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.booleans(), st.booleans(),
       st.sampled_from(["softmax", "sigmoid", "sqrtsoftplus"]))
def test_sequence_loss_matches_reference(seed, packed, masked, score_fn):
    rng = np.random.default_rng(seed)
    batch, seq, num_experts, k = 3, 12, 8, 2
    s = np.asarray(routing.compute_scores(jnp.asarray(rng.normal(size=(batch, seq, num_experts)),
                                                      jnp.float32), score_fn))
    seg = np.sort(rng.choice([3, 7, 40], (batch, seq)), axis=1) if packed else None
    mask = rng.random((batch, seq)) < 0.75 if masked else None
    got = balancing.sequence_balance_loss(
        jnp.asarray(s), num_experts, k,
        segment_ids=None if seg is None else jnp.asarray(seg),
        mask=None if mask is None else jnp.asarray(mask),
    )
    # float32's error of sums over <= 36 tokens and 8 experts, a few roundings each: under
    # (36 + 8 + 4) u = 2.9e-6 of the loss (positive terms, no cancellation)
    np.testing.assert_allclose(got, ref.sequence_loss(s, num_experts, k, seg, mask), rtol=1e-5)


def test_sequence_loss_hand_computed():
    # One sequence, 2 tokens, E=2, K=1, scores already normalised.
    s = jnp.array([[[0.75, 0.25], [0.75, 0.25]]])
    # f = [E/(K*T) * 2, 0] = [2, 0]; P = [0.75, 0.25] -> 1.5
    np.testing.assert_allclose(balancing.sequence_balance_loss(s, 2, 1), 1.5)
    # perfectly balanced: f = [1, 1], P = [0.5, 0.5] -> 1.0
    s = jnp.array([[[0.6, 0.4], [0.4, 0.6]]])
    np.testing.assert_allclose(balancing.sequence_balance_loss(s, 2, 1), 1.0, rtol=1e-6)
    # padding excluded: the second token does not exist
    s = jnp.array([[[0.75, 0.25], [0.0, 1.0]]])
    np.testing.assert_allclose(
        balancing.sequence_balance_loss(s, 2, 1, mask=jnp.array([[True, False]])), 1.5)


def test_sequence_loss_segments_are_not_the_sequence():
    # Two packed documents, each internally balanced -> 1.0 per document; as one sequence it
    # would also be 1.0, but a document that is internally skewed must not be averaged away.
    s = jnp.array([[[0.9, 0.1], [0.9, 0.1], [0.1, 0.9], [0.1, 0.9]]])
    whole = balancing.sequence_balance_loss(s, 2, 1)
    split = balancing.sequence_balance_loss(s, 2, 1, segment_ids=jnp.array([[1, 1, 2, 2]]))
    np.testing.assert_allclose(whole, 1.0, rtol=1e-6)
    np.testing.assert_allclose(split, 2 * 0.9, rtol=1e-6)


def test_sequence_loss_gradient_flows_through_p_only():
    rng = np.random.default_rng(0)
    s = jnp.asarray(rng.random((2, 6, 4)) + 0.1, jnp.float32)
    g = jax.jit(jax.grad(lambda x: balancing.sequence_balance_loss(x, 4, 2)))(s)
    # d/ds[t,i] of sum_i f_i P_i with f fixed, P_i = mean_t s[t,i]/sum_j s[t,j]
    hits = np.zeros((2, 4))
    for b in range(2):
        for t in range(6):
            for e in ref.top_indices(list(np.asarray(s[b, t])), 2):
                hits[b, e] += 1
    f = 4 / (2 * 6) * hits  # [B, E]
    sn = np.asarray(s, np.float64)
    tot = sn.sum(-1, keepdims=True)
    expect = (f[:, None, :] - (f[:, None, :] * sn).sum(-1, keepdims=True) / tot) / tot / 6 / 2
    np.testing.assert_allclose(g, expect, rtol=1e-4, atol=1e-7)


def test_maxtext_mode_matches_reference_and_is_k_times_the_paper():
    rng = np.random.default_rng(0)
    batch, seq, num_experts, k = 2, 10, 8, 3
    logits = jnp.asarray(rng.normal(size=(batch, seq, num_experts)), jnp.float32)
    s = jax.nn.softmax(logits)
    bias = jnp.asarray(0.1 * rng.normal(size=num_experts), jnp.float32)
    idx = routing.select_experts(s + bias, k)
    got = balancing.sequence_balance_loss(s, num_experts, k, mode="maxtext", bias=bias,
                                          indices=idx)
    np.testing.assert_allclose(
        got, ref.maxtext_sequence_loss(np.asarray(s), np.asarray(bias), np.asarray(idx),
                                       num_experts), rtol=1e-5)
    # No bias: MaxText's value is K times the paper's. MaxText softmaxes what it is given, so give
    # it log(s), whose softmax is s itself (s sums to 1 per token).
    idx0 = routing.select_experts(s, k)
    paper = balancing.sequence_balance_loss(s, num_experts, k)
    maxtext = balancing.sequence_balance_loss(jnp.log(s), num_experts, k, mode="maxtext",
                                              indices=idx0)
    np.testing.assert_allclose(maxtext, k * paper, rtol=1e-5)


def test_sequence_loss_bad_input():
    s = jnp.ones((1, 4, 8)) / 8
    with pytest.raises(ValueError, match="ignores padding and packing"):
        balancing.sequence_balance_loss(s, 8, 2, mode="maxtext", mask=jnp.ones((1, 4), bool),
                                        indices=jnp.zeros((1, 4, 2), jnp.int32))
    with pytest.raises(ValueError, match="needs `indices`"):
        balancing.sequence_balance_loss(s, 8, 2, mode="maxtext")
    with pytest.raises(ValueError, match="unknown sequence loss mode"):
        balancing.sequence_balance_loss(s, 8, 2, mode="megatron")
    with pytest.raises(ValueError, match=r"\[B, S, E=8\]"):
        balancing.sequence_balance_loss(jnp.ones((4, 8)), 8, 2)
    with pytest.raises(ValueError, match="1 <= k <= num_experts"):
        balancing.sequence_balance_loss(s, 8, 9)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.booleans())
def test_global_and_z_loss_match_reference(seed, masked):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(4, 9, 6)).astype(np.float32) * 3
    s = np.asarray(jax.nn.sigmoid(jnp.asarray(logits)))
    mask = rng.random((4, 9)) < 0.7 if masked else None
    m = None if mask is None else jnp.asarray(mask)
    # float32's error of positive sums over 36 tokens and 6 experts (and a logsumexp of 6, squared):
    # under (36 + 6 + 6) u = 2.9e-6 of each loss
    np.testing.assert_allclose(balancing.global_balance_loss(jnp.asarray(s), 6, 2, mask=m),
                               ref.global_loss(s, 6, 2, mask), rtol=1e-5)
    np.testing.assert_allclose(balancing.z_loss(jnp.asarray(logits), m),
                               ref.z_loss(logits, mask), rtol=1e-5)


def test_global_loss_hand_computed_and_counts():
    s = jnp.array([[0.6, 0.4], [0.4, 0.6]])
    np.testing.assert_allclose(balancing.global_balance_loss(s, 2, 1), 1.0, rtol=1e-6)
    # all assignments on expert 0 (given counts), mean P = [0.5, 0.5]: E * (1 * 0.5) = 1.0;
    # with P = [0.9, 0.1]: 2 * 0.9 = 1.8
    s = jnp.array([[0.9, 0.1], [0.9, 0.1]])
    np.testing.assert_allclose(
        balancing.global_balance_loss(s, 2, 1, counts=jnp.array([2, 0])), 1.8, rtol=1e-6)
    # z-loss: logsumexp of [0, 0] = ln 2
    np.testing.assert_allclose(balancing.z_loss(jnp.zeros((3, 2))), np.log(2) ** 2, rtol=1e-6)
