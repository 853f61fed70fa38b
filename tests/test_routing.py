import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import reference as ref
from conftest import function_rtol
from moebalance import routing
from moebalance.metrics import load_stats

SCORE_FNS = ["softmax", "sigmoid", "sqrtsoftplus"]


@st.composite
def routing_case(draw):
    num_experts = draw(st.sampled_from([4, 6, 8, 12, 16]))
    groups = draw(st.sampled_from([g for g in (0, 1, 2, 3, 4) if g == 0 or num_experts % g == 0]))
    topk_groups = draw(st.integers(1, groups)) if groups else 0
    max_k = topk_groups * (num_experts // groups) if groups else num_experts
    k = draw(st.integers(1, max_k))
    tokens = 6  # one shape per (E, k): fewer recompilations
    ties = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    if ties:  # a small alphabet of logits and biases makes exact ties common
        logits = rng.integers(-2, 3, (tokens, num_experts)).astype(np.float32)
        bias = rng.choice([0.0, 0.25, -0.25], num_experts).astype(np.float32)
    else:
        logits = rng.normal(size=(tokens, num_experts)).astype(np.float32)
        bias = (0.1 * rng.normal(size=num_experts)).astype(np.float32)
    score_fn = draw(st.sampled_from(SCORE_FNS))
    return dict(logits=logits, bias=bias, k=k, score_fn=score_fn, n_groups=groups,
                topk_groups=topk_groups, route_scale=draw(st.sampled_from([1.0, 1.5, 2.5])),
                normalize=draw(st.sampled_from([None, True, False])))


# one program per routing configuration, as the model runs it, not one per eager operation
jitted_route = jax.jit(routing.route, static_argnames=("k", "score_fn", "route_scale", "n_groups",
                                                       "topk_groups", "normalize"))


@settings(max_examples=150, deadline=None)
@given(routing_case())
def test_route_matches_reference(case):
    idx, w, s = jitted_route(jnp.asarray(case["logits"]), jnp.asarray(case["bias"]),
                             **{k: v for k, v in case.items() if k not in ("logits", "bias")})
    assert idx.dtype == jnp.int32 and w.dtype == jnp.float32 and s.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(s), ref.scores(case["logits"], case["score_fn"]),
                               rtol=function_rtol(1e-6, case["score_fn"]), atol=1e-7)
    # The selection and weights given the scores the backend computed (exact, whatever the
    # accuracy of its score function): exact ties (equal values) go to the lower index in both;
    # only near-ties that float rounding decides (e.g. group sums equal in exact arithmetic) are
    # left out of the comparison.
    normalize = case["score_fn"] != "softmax" if case["normalize"] is None else case["normalize"]
    ridx, rw, ambiguous = ref.route_scores(np.asarray(s), case["bias"], case["k"],
                                           case["route_scale"], case["n_groups"],
                                           case["topk_groups"], normalize)
    ok = ~ambiguous
    np.testing.assert_array_equal(np.asarray(idx)[ok], ridx[ok])
    np.testing.assert_allclose(np.asarray(w)[ok], rw[ok], rtol=1e-5, atol=1e-7)
    # k distinct experts per token
    assert all(len(set(row)) == case["k"] for row in np.asarray(idx).tolist())


def test_route_hand_computed():
    # sigmoid(0) = 0.5, sigmoid(ln 3) = 0.75; the bias flips the choice of the 2nd expert only.
    logits = jnp.array([[np.log(3.0), 0.0, 0.0, -10.0]], jnp.float32)
    bias = jnp.array([0.0, 0.0, 0.1, 0.0], jnp.float32)
    idx, w, s = routing.route(logits, bias, k=2, score_fn="sigmoid", route_scale=2.0)
    assert idx.tolist() == [[0, 2]]
    np.testing.assert_allclose(w, [[2.0 * 0.75 / 1.25, 2.0 * 0.5 / 1.25]],
                               rtol=function_rtol(1e-6, "sigmoid", 2))
    # softmax keeps raw probabilities by default (the logits' logs taken in float64)
    idx, w, _ = routing.route(jnp.asarray(np.log([[0.5, 0.3, 0.2]]), jnp.float32), k=2,
                              score_fn="softmax")
    np.testing.assert_allclose(w, [[0.5, 0.3]], rtol=function_rtol(1e-6, "softmax"))


def test_group_limited_routing_hand_computed():
    # 2 groups of 3, keep 1; a group scores the sum of its top-(k // topk_groups) = top-2:
    # group0 = 0.9 + 0.1 = 1.0 < group1 = 0.6 + 0.5 = 1.1, so group1 wins despite expert 0.
    s = np.array([[0.9, 0.1, 0.01, 0.6, 0.5, 0.01]], np.float64)
    logits = np.log(s / (1 - s)).astype(np.float32)  # sigmoid^-1
    idx, _, _ = routing.route(jnp.asarray(logits), k=2, score_fn="sigmoid", n_groups=2,
                              topk_groups=1)
    assert sorted(idx[0].tolist()) == [3, 4]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(SCORE_FNS))
def test_bias_never_changes_weights_of_a_selection(seed, score_fn):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)
    b1 = jnp.asarray(0.02 * rng.normal(size=8), jnp.float32)
    b2 = jnp.asarray(0.02 * rng.normal(size=8), jnp.float32)
    i1, w1, _ = routing.route(logits, b1, k=3, score_fn=score_fn)
    i2, w2, _ = routing.route(logits, b2, k=3, score_fn=score_fn)
    i0, w0, _ = routing.route(logits, b1 + 7.0, k=3, score_fn=score_fn)  # a uniform shift
    # A uniform shift keeps each token's chosen set and its weights (the order of selection may
    # swap near-ties, since score + bias + 7 rounds to fewer bits; to 1 ulp of the normaliser).
    o0, o1 = np.argsort(i0, -1), np.argsort(i1, -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(i0), o0, -1),
                                  np.take_along_axis(np.asarray(i1), o1, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w0), o0, -1),
                               np.take_along_axis(np.asarray(w1), o1, -1), rtol=3e-7, atol=0)
    # Tokens whose chosen SET is the same under both biases get the same weight per expert.
    o2 = np.argsort(i2, -1)
    i1, w1 = np.take_along_axis(np.asarray(i1), o1, -1), np.take_along_axis(np.asarray(w1), o1, -1)
    i2, w2 = np.take_along_axis(np.asarray(i2), o2, -1), np.take_along_axis(np.asarray(w2), o2, -1)
    same = np.all(i1 == i2, axis=-1)
    assert same.any()
    assume(not same.all())  # the two biases must change some token's set
    # (to 1 ulp: the normaliser sums the same weights in the order of selection)
    np.testing.assert_allclose(w1[same], w2[same], rtol=3e-7, atol=0)


def test_route_bf16_logits_keep_float32_maths():
    logits = jnp.ones((3, 8), jnp.bfloat16)
    idx, w, s = routing.route(logits, jnp.zeros(8, jnp.bfloat16), k=2, score_fn="sigmoid")
    assert w.dtype == jnp.float32 and s.dtype == jnp.float32


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(k=9, score_fn="sigmoid"), "1 <= k <= num_experts"),
        (dict(k=0, score_fn="sigmoid"), "1 <= k <= num_experts"),
        (dict(k=2, score_fn="relu"), "unknown score_fn"),
        (dict(k=2, score_fn="sigmoid", n_groups=3, topk_groups=1), "divisor of num_experts"),
        (dict(k=2, score_fn="sigmoid", n_groups=4, topk_groups=5), "topk_groups=5"),
        (dict(k=2, score_fn="sigmoid", topk_groups=2), "needs n_groups"),
        (dict(k=5, score_fn="sigmoid", n_groups=4, topk_groups=2), "raise topk_groups"),
    ],
)
def test_route_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        routing.route(jnp.zeros((2, 8)), **kwargs)


# ---------------------------------------------------------------------------------------------
# hash routing


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(SCORE_FNS), st.booleans())
def test_hash_route_matches_reference(seed, score_fn, normalize):
    rng = np.random.default_rng(seed)
    table = routing.build_hash_table(50, 8, 3, "random", seed=seed)
    ids = rng.integers(0, 50, (2, 5))
    logits = rng.normal(size=(2, 5, 8)).astype(np.float32)
    s = routing.compute_scores(jnp.asarray(logits), score_fn)
    idx, w = routing.hash_route(jnp.asarray(ids), jnp.asarray(table), s, route_scale=1.5,
                                normalize=normalize)
    np.testing.assert_array_equal(idx, table[ids])
    rs = ref.scores(logits, score_fn)
    rw = np.take_along_axis(rs, table[ids], -1).astype(np.float64)
    if normalize:
        rw = rw / rw.sum(-1, keepdims=True)
    np.testing.assert_allclose(w, 1.5 * rw,
                               rtol=function_rtol(1e-5, score_fn, 2 if normalize else 1))


def test_hash_route_rejects_ids_outside_table():
    table = jnp.asarray(routing.build_hash_table(10, 4, 2, "round_robin"))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 10\)"):
        routing.hash_route(jnp.array([3, 10]), table, jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="token ids"):
        routing.hash_route(jnp.array([-1]), table, jnp.ones((1, 4)))


def test_hash_tables():
    zeros = routing.build_hash_table(100, 16, 4, "zeros")
    assert zeros.shape == (100, 4) and zeros.dtype == np.int32 and not zeros.any()
    rr = routing.build_hash_table(100, 16, 4, "round_robin")
    t, j = np.meshgrid(np.arange(100), np.arange(4), indexing="ij")
    np.testing.assert_array_equal(rr, (t * 4 + j) % 16)
    r1 = routing.build_hash_table(1000, 16, 4, "random", seed=3)
    np.testing.assert_array_equal(r1, routing.build_hash_table(1000, 16, 4, "random", seed=3))
    assert not np.array_equal(r1, routing.build_hash_table(1000, 16, 4, "random", seed=4))
    for table in (rr, r1):
        routing.check_hash_table(table, 16)  # distinct experts in each row
    # k == E: every row is a permutation
    full = routing.build_hash_table(20, 5, 5, "random")
    assert (np.sort(full, 1) == np.arange(5)).all()


def test_balanced_hash_table_beats_the_others_on_zipf_counts():
    vocab, experts, k = 5000, 16, 4
    counts = np.floor(1e6 / np.arange(1, vocab + 1) ** 1.1)
    counts[4000:] = 0  # unseen tokens still get distinct experts
    balanced = routing.build_hash_table(vocab, experts, k, "balanced", token_counts=counts)
    routing.check_hash_table(balanced, experts)
    maxvio = {
        m: load_stats(routing.expected_load(routing.build_hash_table(
            vocab, experts, k, m, token_counts=counts), counts, experts))["maxvio"]
        for m in ("balanced", "random", "round_robin")
    }
    # Greedy largest-first on the real frequencies must beat frequency-blind hashing by far.
    assert maxvio["balanced"] < 0.5 * min(maxvio["random"], maxvio["round_robin"])
    # Hand-checkable: 4 equal tokens, 4 experts, k=2 -> every expert exactly twice.
    t = routing.build_hash_table(4, 4, 2, "balanced", token_counts=np.ones(4))
    np.testing.assert_array_equal(np.bincount(t.ravel(), minlength=4), [2, 2, 2, 2])


def test_only_an_unbalanced_hash_table_is_logged(caplog):
    """Nothing for a table that spreads its counts evenly; one warning for one that cannot:
    token 0 (10 of 13 occurrences) takes experts 0 and 1, tokens 1-3 go to 2 and 3, so the loads
    are [10, 10, 3, 3], mean 6.5, expected MaxVio 3.5 / 6.5 = 0.5385."""
    with caplog.at_level("INFO", logger="moebalance.routing"):
        routing.build_hash_table(4, 4, 2, "balanced", token_counts=np.ones(4))
        assert caplog.records == []
        routing.build_hash_table(4, 4, 2, "balanced", token_counts=np.array([10, 1, 1, 1]))
    [record] = caplog.records
    assert record.levelname == "WARNING"
    assert record.getMessage().startswith("hash table 'balanced': expected MaxVio 0.5385 on")


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((10, 4, 2, "modulo"), {}, "unknown hash table method"),
        ((10, 4, 5, "random"), {}, "1 <= k <= num_experts"),
        ((10, 4, 2, "balanced"), {}, "needs token_counts"),
        ((10, 4, 2, "balanced"), {"token_counts": np.ones(9)}, "shape"),
    ],
)
def test_hash_table_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        routing.build_hash_table(*args, **kwargs)


def test_check_hash_table_rejects_repeats_and_out_of_range():
    with pytest.raises(ValueError, match="row 1 .* repeats an expert"):
        routing.check_hash_table(np.array([[0, 1], [2, 2]]), 4)
    routing.check_hash_table(np.array([[0, 0]]), 4, distinct=False)
    with pytest.raises(ValueError, match="outside"):
        routing.check_hash_table(np.array([[0, 4]]), 4)
