import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import reference as ref
from conftest import tolerance
from moebalance.config import load_config
from moebalance.model.transformer import DeepSeekV4, get_biases, routed_layers
from moebalance.training.step import (chained, decay_mask, make_eval_step, make_optimizer,
                                      make_score_step, make_train_step, new_optimizer)

BASE = dict(max_target_length=16, steps=10, load_balance_loss_weight=1e-2,
            routed_bias_update_rate=1e-2)
# What a step does with a top-k block's bias, whatever the other blocks: one hash and one top-k
# block. A block's forward and backward compile in ~9 s on the chip's host, and these tests run
# there too (--device-tests); the blocks of every kind go through the accumulation and chain
# tests.
ONE_TOPK = dict(base_num_decoder_layers=2, compress_ratios=[0, 0], first_num_hash_layers=1)


def setup(**over):
    cfg = load_config("deepseek4-smoke", {**BASE, **over})
    model = DeepSeekV4(cfg, rngs=nnx.Rngs(0))
    opt = new_optimizer(cfg, model)  # one program, not one per shape of an AdamW moment
    return cfg, model, opt


def batch(micro, size, seed=0, seq=16):
    tokens = jax.random.randint(jax.random.key(seed), (micro, size, seq + 1), 0, 256)
    return tokens, jnp.ones((micro, size, seq), bool), jnp.zeros((micro, size, seq), jnp.int32)


def params_of(model) -> dict:
    return {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def first_moments(opt) -> dict:
    """The optimizer's AdamW first moments by path: after one step, (1 - b1) times the clipped
    gradient."""
    state = nnx.to_flat_state(nnx.state(opt, nnx.OptState))
    return {path: np.asarray(v[...]) for path, v in state if "mu" in path}


def test_accumulated_step_equals_one_big_batch_and_updates_the_bias_from_every_micro_batch():
    """2 micro-batches of 2 sequences against one batch of 4, a step at the full learning rate
    (no warm-up: the update moves every weight): the same loss, gradient norm, counts, AdamW
    first moments ((1 - b1) times the clipped gradient) and weight updates; the counts a
    brute-force recount of every micro-batch, the bias update the rule applied to them (one
    compiled program of each kind, shared by the claims)."""
    tokens, mask, seg = batch(2, 2)
    moving = dict(warmup_steps_fraction=0.0, adam_eps=1e-4)
    cfg_a, model_a, opt_a = setup(gradient_accumulation_steps=2, **moving)
    cfg_b, model_b, opt_b = setup(**moving)
    before = np.asarray(get_biases(model_a))
    start = params_of(model_a)
    # brute-force recount: every micro-batch through the model before the step (the evaluation
    # step's forward: the one program it compiles serves the check at the end too)
    evaluate = make_eval_step(cfg_a, model_a)
    recount = sum(np.asarray(evaluate(model_a, tokens[a], mask[a], seg[a])["counts"])
                  for a in range(2))
    ma = make_train_step(cfg_a, model_a)(model_a, opt_a, tokens, mask, seg)
    mb = make_train_step(cfg_b, model_b)(model_b, opt_b, tokens.reshape(1, 4, -1),
                                         mask.reshape(1, 4, -1), seg.reshape(1, 4, -1))
    np.testing.assert_array_equal(ma["counts"], recount)
    np.testing.assert_array_equal(mb["counts"], recount)
    assert ma["counts"].dtype == jnp.int32
    assert (recount.sum(1) == 2 * 2 * 16 * cfg_a.num_experts_per_tok).all()
    assert ma["lr"] == mb["lr"] == np.float32(cfg_a.learning_rate)
    np.testing.assert_allclose(ma["loss"], mb["loss"], **tolerance(mb["loss"], rtol=1e-5))
    np.testing.assert_allclose(ma["grad_norm"], mb["grad_norm"],
                               **tolerance(mb["grad_norm"], rtol=1e-4))
    mu_a, mu_b = (first_moments(opt) for opt in (opt_a, opt_b))
    assert len(mu_a) == len(mu_b) > 50
    for path, mu in mu_b.items():
        np.testing.assert_allclose(mu_a[path], mu, **tolerance(mu, rtol=1e-4, atol=1e-5 * np.abs(
            mu).max()), err_msg=str(path))
    # the updates: step 1's AdamW update is lr g / (|g| + eps); at the default eps (1e-8) a
    # gradient entry of eps's size, summed over the micro-batches in another order, moves it by
    # a quarter of lr (seen), so eps is 1e-4 here: the update a smooth function of the gradient;
    # each weight after the step is rounded to float32 (half an ulp of the weight, each side)
    moved_a, moved_b = params_of(model_a), params_of(model_b)
    updates = {path: moved_b[path] - weight for path, weight in start.items()}
    assert max(np.abs(update).max() for update in updates.values()) > 0.9 * cfg_a.learning_rate
    for path, update in updates.items():
        rounding = np.finfo(np.float32).eps * np.abs(start[path]).max()
        np.testing.assert_allclose(moved_a[path] - start[path], update, **tolerance(
            update, rtol=1e-4, atol=1e-4 * np.abs(update).max() + rounding), err_msg=str(path))
    routed = routed_layers(model_a)
    assert routed == [2, 3]  # the two hash blocks have no bias to update
    want = np.stack([ref.update_bias(before[i], recount[layer], "sign", 1e-2)
                     for i, layer in enumerate(routed)])
    np.testing.assert_allclose(get_biases(model_a), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ma["bias"], want, rtol=1e-6, atol=1e-7)
    assert get_biases(model_a).dtype == jnp.float32
    # evaluation reports every block's counts and never touches the bias
    out = evaluate(model_a, tokens[0], mask[0], seg[0])
    np.testing.assert_array_equal(get_biases(model_a), want.astype(np.float32))
    assert int(out["counts"].sum()) == 2 * 16 * 2 * 4


def test_the_chain_of_segment_programs_is_the_one_programs_step():
    """step_programs=segments against the one program, one step from the same weights, on
    everything a step's gradient goes through: 2 micro-batches, hash blocks, MTP (the embedding's
    gradient from both ends), the sequence, global and z losses (the records' gradients), the
    quantile bias. Metrics and the bias agree, counts exactly; AdamW's first moments, (1 - b1)
    times the clipped gradient after one step, to float32 reassociation: the chain sums the
    embedding's two gradients and the micro-batches' in another order than the one program."""
    over = dict(gradient_accumulation_steps=2, mtp_num_layers=1, global_balance_loss_weight=1e-2,
                router_z_loss_weight=1e-3, routed_bias_update_rule="quantile",
                routed_bias_update_rate=0.5)
    tokens, mask, seg = batch(2, 2, seed=3)
    runs = []
    for programs in ("one", "segments"):
        cfg, model, opt = setup(step_programs=programs, **over)
        metrics = jax.device_get(make_train_step(cfg, model)(model, opt, tokens, mask, seg))
        runs.append((metrics, first_moments(opt), np.asarray(get_biases(model))))
    (one, mu_one, bias_one), (chain, mu_chain, bias_chain) = runs
    assert len(mu_one) == len(mu_chain) > 100
    assert set(one) == set(chain) >= {"ce", "mtp", "sequence_loss", "global_loss", "z_loss"}
    for name in one:
        if name == "counts":
            np.testing.assert_array_equal(chain[name], one[name])
        else:
            np.testing.assert_allclose(chain[name], one[name], rtol=1e-5, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(bias_chain, bias_one, rtol=1e-5, atol=1e-7)
    scale = max(np.abs(mu).max() for mu in mu_one.values())
    for path, mu in mu_one.items():
        np.testing.assert_allclose(mu_chain[path], mu, rtol=1e-4, atol=1e-6 * scale,
                                   err_msg=str(path))


def test_the_chains_evaluation_and_scores_are_the_one_programs():
    """step_programs=segments: the evaluation step's cross-entropy sum and counts, and the score
    step's top-k scores, from the forward cut into programs per segment, against the one-program
    steps on the same weights (bias included) and batch."""
    tokens, mask, seg = (x[0] for x in batch(1, 2, seed=5))
    out = {}
    for programs in ("one", "segments"):
        cfg, model, _ = setup(step_programs=programs)
        model.segments[1].ffn.bias[...] = jnp.linspace(-0.1, 0.1, cfg.num_experts)
        evaluation = jax.device_get(make_eval_step(cfg, model)(model, tokens, mask, seg))
        scores = np.asarray(make_score_step(cfg, model)(model, tokens, seg))
        out[programs] = evaluation, scores
    (one, scores_one), (chain, scores_chain) = out["one"], out["segments"]
    np.testing.assert_array_equal(chain["counts"], one["counts"])
    assert chain["tokens"] == one["tokens"] == 2 * 16
    np.testing.assert_allclose(chain["ce_sum"], one["ce_sum"], rtol=1e-6)
    assert scores_one.shape == (2, 2 * 16, 8)  # the two top-k blocks
    np.testing.assert_allclose(scores_chain, scores_one, rtol=1e-6, atol=1e-7)


def test_step_programs_auto_chains_the_steps_on_a_tpu_only(monkeypatch):
    """On a mesh its devices decide, without one JAX's default devices (whichever backend runs
    the tests: the CPU, or the chip with --device-tests)."""
    def devices_of(platform):
        return [types.SimpleNamespace(platform=platform)]

    def mesh_of(platform):
        return types.SimpleNamespace(devices=np.array(devices_of(platform)))

    auto, one = (load_config("deepseek4-smoke", dict(step_programs=v)) for v in ("auto", "one"))
    assert chained(auto, mesh_of("tpu")) and not chained(one, mesh_of("tpu"))
    assert not chained(auto, mesh_of("cpu")) and not chained(auto, mesh_of("gpu"))
    assert chained(auto) == (jax.devices()[0].platform == "tpu")
    for platform in ("tpu", "cpu", "gpu"):
        monkeypatch.setattr(jax, "devices", lambda platform=platform: devices_of(platform))
        assert chained(auto) == (platform == "tpu")
        assert not chained(one) and chained(load_config("deepseek4-smoke",
                                                        dict(step_programs="segments")))


def test_bias_freezes_and_the_optimizer_never_moves_it():
    cfg, model, opt = setup(routed_bias_freeze_step=2, **ONE_TOPK)
    tokens, mask, seg = batch(1, 2)
    step = make_train_step(cfg, model)
    biases, routers = [], []
    for _ in range(4):
        step(model, opt, tokens, mask, seg)
        biases.append(np.asarray(get_biases(model)))
        routers.append(np.asarray(model.segments[-1].ffn.router[...]))
    assert not np.array_equal(biases[0], biases[1])  # steps 0 and 1 update
    # from step 2 on the rate is 0: the optimizer keeps training the router, the bias stays
    np.testing.assert_array_equal(biases[1], biases[2])
    np.testing.assert_array_equal(biases[2], biases[3])
    assert not np.array_equal(routers[2], routers[3])


def test_decaying_bias_rate_follows_the_cosine_in_the_step():
    cfg, model, opt = setup(steps=3, routed_bias_update_rule="proportional",
                            routed_bias_update_rate=1e-2,
                            routed_bias_update_rate_final_fraction=0.1, **ONE_TOPK)
    tokens, mask, seg = batch(1, 2)
    step = make_train_step(cfg, model)
    rates = [1e-2, 1e-2 * 0.55, 1e-3]  # steps 0, 1, 2 of a cosine over steps 0 .. 2
    for rate in rates:
        before = np.asarray(get_biases(model))
        metrics = step(model, opt, tokens, mask, seg)
        want = np.stack([ref.update_bias(before[i], np.asarray(metrics["counts"])[layer],
                                         "proportional", rate)
                         for i, layer in enumerate(routed_layers(model))])
        np.testing.assert_allclose(get_biases(model), want, rtol=1e-5, atol=1e-7)


def test_quantile_rule_sets_the_bias_from_the_step_scores_at_each_runs_rate_on_one_program():
    """The fit to the step's own scores, damped by the run's rate (1: the fit itself); runs that
    differ only in their rate run one compiled step, the rate passed at run time."""
    from moebalance.training import step as step_module

    tokens, mask, seg = batch(1, 4)
    programs = set()
    for rate in (1.0, 0.25):
        cfg, model, opt = setup(routed_bias_update_rule="quantile", routed_bias_update_rate=rate,
                                **ONE_TOPK)
        programs.add(step_module._train_step(step_module.program_key(cfg),
                                             tuple(routed_layers(model)), None))
        if rate == 1.0:  # both models start from the same weights and biases
            out = nnx.jit(lambda m, t: m(t))(model, tokens[0, :, :-1])
            before = np.asarray(get_biases(model))
        make_train_step(cfg, model)(model, opt, tokens, mask, seg)
        for i, layer in enumerate(routed_layers(model)):
            s = np.asarray(out.routing.scores[layer]).reshape(-1, cfg.num_experts)
            fit = ref.quantile_bias(s, before[i], cfg.num_experts_per_tok)
            np.testing.assert_allclose(get_biases(model)[i], before[i] + rate * (fit - before[i]),
                                       rtol=1e-4, atol=1e-5)
    (compiled,) = programs
    assert compiled.jitted_fn._cache_size() == 1


def test_weight_decay_skips_norms_and_scales():
    cfg = load_config("deepseek4-smoke", dict(adam_weight_decay=0.5, learning_rate=0.1,
                                              warmup_steps_fraction=0.0))
    params = {"norm": {"weight": jnp.ones(3)}, "hc": {"scale": jnp.ones(3), "fn": jnp.ones((2, 2))},
              "attn": {"attn_sink": jnp.ones(2), "wq_a": jnp.ones((2, 2))}}
    assert decay_mask(params) == {"norm": {"weight": False}, "hc": {"scale": False, "fn": True},
                                  "attn": {"attn_sink": False, "wq_a": True}}
    tx = make_optimizer(cfg)
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zero, tx.init(params), params)  # zero gradients: only decay moves
    np.testing.assert_array_equal(updates["norm"]["weight"], 0.0)
    np.testing.assert_allclose(updates["attn"]["wq_a"], -0.1 * 0.5, rtol=1e-6)


def test_run_a_on_run_b_program_equals_run_a_alone_and_compiles_once():
    from moebalance.experiment import without_balancing
    from moebalance.training import step as step_module

    tokens, mask, seg = batch(1, 2, seed=5)
    cfg_b, _, _ = setup(global_balance_loss_weight=1e-3, **ONE_TOPK)
    cfg_a = without_balancing(cfg_b)
    results = {}
    for name, program in (("alone", None), ("shared", cfg_b)):
        _, model, opt = setup(**ONE_TOPK)
        start = params_of(model)
        step = make_train_step(cfg_a, model, program=program)
        compiled = step_module._train_step(step_module.program_key(program or cfg_a),
                                           tuple(routed_layers(model)), None)
        for _ in range(2):  # step 0 at the warm-up's learning rate 0, step 1 moves the weights
            metrics = step(model, opt, tokens, mask, seg)
        updates = {path: weight - start[path] for path, weight in params_of(model).items()}
        results[name] = (metrics, get_biases(model), updates)
    (alone, bias_alone, update_alone), (shared, bias_shared, update_shared) = results.values()
    np.testing.assert_array_equal(bias_shared, bias_alone)  # the bias never moved
    np.testing.assert_array_equal(shared["counts"], alone["counts"])
    assert alone["lr"] > 0
    np.testing.assert_allclose(shared["loss"], alone["loss"], **tolerance(alone["loss"], rtol=1e-6))
    assert max(np.abs(update).max() for update in update_alone.values()) > 0.5 * alone["lr"]
    for path, update in update_alone.items():  # each weight's update to float32 rounding
        rounding = np.finfo(np.float32).eps * np.abs(start[path]).max()
        np.testing.assert_allclose(update_shared[path], update, **tolerance(
            update, rtol=2e-5, atol=rounding), err_msg=str(path))
    # Run B then runs on the program Run A compiled: one program, no second compilation
    _, model_b, opt_b = setup(global_balance_loss_weight=1e-3, **ONE_TOPK)
    make_train_step(cfg_b, model_b)(model_b, opt_b, tokens, mask, seg)
    assert compiled.jitted_fn._cache_size() == 1
    assert not np.array_equal(get_biases(model_b), bias_shared)


def test_a_shared_program_refuses_configs_it_cannot_run():
    """Another model, bias rule or balance loss than the program's, or a bias update where the
    program has none, is refused, naming the key; another bias rate runs (a run-time value)."""
    cfg_b, model, _ = setup()
    unbiased = load_config("deepseek4-smoke", {**BASE, "routed_bias_update_rate": 0})
    for change, program in (({"num_experts_per_tok": 1}, cfg_b),
                            ({"routed_bias_update_rule": "proportional"}, cfg_b),
                            ({"global_balance_loss_weight": 1e-3}, cfg_b),
                            ({}, unbiased)):
        cfg = load_config("deepseek4-smoke", {**BASE, **change})
        with pytest.raises(ValueError, match=next(iter(change), "routed_bias_update_rate")):
            make_train_step(cfg, model, program=program)
    make_train_step(load_config("deepseek4-smoke", {**BASE, "routed_bias_update_rate": 0.5}),
                    model, program=cfg_b)


def test_the_step_donates_the_state_it_replaces():
    """The model's and optimizer's old buffers are given to the step (its new state takes their
    place: one copy of the state in memory, not two), and the objects hold the new state."""
    cfg, model, opt = setup(routed_bias_freeze_step=2, **ONE_TOPK)  # test_bias_freezes_...'s
    tokens, mask, seg = batch(1, 2)
    old = jax.tree.leaves(nnx.state((model, opt)))
    make_train_step(cfg, model)(model, opt, tokens, mask, seg)
    new = jax.tree.leaves(nnx.state((model, opt)))
    assert len(old) == len(new) and all(leaf.is_deleted() for leaf in old)
    assert not any(leaf.is_deleted() for leaf in new) and int(opt.step[...]) == 1
