import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tolerance
from moebalance import generate
from moebalance.config import load_config
from moebalance.model import decode
from moebalance.model.transformer import DeepSeekV4


def test_next_token_probs_hand_cases():
    logits = np.log([0.5, 0.2, 0.2, 0.1])
    assert generate.next_token_probs(logits, 0.0, 1.0).tolist() == [1, 0, 0, 0]
    np.testing.assert_allclose(generate.next_token_probs(logits, 1.0, 1.0), [0.5, 0.2, 0.2, 0.1])
    # temperature 0.5 squares the probabilities before renormalising: 25, 4, 4, 1 over 34
    np.testing.assert_allclose(generate.next_token_probs(logits, 0.5, 1.0),
                               np.array([25, 4, 4, 1]) / 34)
    # top-p 0.6: 0.5 alone is short of 0.6, so the next (0.2, id 1 before its tie id 2) joins
    np.testing.assert_allclose(generate.next_token_probs(logits, 1.0, 0.6), [5 / 7, 2 / 7, 0, 0])
    # a first token holding more than top_p keeps it alone
    np.testing.assert_allclose(generate.next_token_probs(logits, 1.0, 0.45), [1, 0, 0, 0])


@pytest.fixture(scope="module")
def model():
    cfg = load_config("deepseek4-smoke", {"mtp_num_layers": 1, "compress_ratios": [0, 0, 4, 0, 4]})
    return cfg, DeepSeekV4(cfg, rngs=nnx.Rngs(3))


def _greedy_reference(model, ids, prompt_len, context):
    """What greedy decoding must produce: each new token is the argmax of the plain forward pass
    over (the last `context` of) the tokens before it. Positions within the first `context`
    tokens read one unpadded pass over the whole text (causal: later tokens do not matter)."""
    forward = nnx.jit(lambda m, t: m(t).logits[0])
    full = np.asarray(forward(model, np.asarray(ids)[None]))
    return [int(np.argmax(full[t - 1] if t <= context else np.asarray(
        forward(model, np.asarray(ids[t - context:t])[None]))[-1]))
        for t in range(prompt_len, len(ids))]


@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.parametrize("context", [64, 10])
def test_greedy_decoding_is_the_argmax_of_the_full_forward_pass(model, context, cached):
    """Cached or one padded fixed-length context per call (and, with context 10, a sliding window
    over a longer text) gives exactly the tokens the plain forward pass ranks first."""
    cfg, net = model
    prompt = [5, 17, 200, 3, 99, 42, 7]
    new = generate.sample_tokens(net, prompt, max_new_tokens=9, context=context, cached=cached)
    assert len(new) == 9
    assert new == _greedy_reference(net, prompt + new, len(prompt), context)


@pytest.fixture(scope="module")
def decode_model():
    """Every cache boundary within 40 positions: a window of 4, CSA (r = 4, the indexer keeping 4
    of up to 10 entries) and HCA at r = 8; the last four blocks scanned as two [8, 4] units."""
    cfg = load_config("deepseek4-smoke", {"base_num_decoder_layers": 6, "sliding_window_size": 4,
                                          "compress_ratios": [0, 4, 8, 4, 8, 4],
                                          "max_target_length": 40})
    return DeepSeekV4(cfg, rngs=nnx.Rngs(5))


IDS = np.random.default_rng(0).integers(0, 256, 40).tolist()


def test_cached_logits_are_the_forward_pass_logits_at_every_step(decode_model):
    """A prefill of the first n ids (n inside, at and past block boundaries of both ratios and
    the window), then one step per id up to 40 positions: each step's logits are the full forward
    pass's at that position, to float32 rounding."""
    full = np.asarray(nnx.jit(lambda m, t: m(t).logits[0])(decode_model, np.asarray(IDS)[None]))
    for n in (1, 3, 4, 5, 8, 9, 16, 17, 33, 40):
        logits_after = generate.decoder(decode_model, 40)
        got = np.stack([logits_after(IDS[:t]) for t in range(n, 41)])
        np.testing.assert_allclose(got, full[n - 1:], **tolerance(full[n - 1:], atol=2e-5),
                                   err_msg=f"prompt {n}")


@pytest.mark.parametrize("prompt_len,new_tokens,context", [
    (1, 40, 64), (7, 34, 64), (16, 25, 64), (33, 8, 64), (3, 20, 12), (2, 2, 64)])
def test_cached_greedy_decoding_equals_uncached(decode_model, prompt_len, new_tokens, context):
    """The same tokens with and without the cache, across the boundaries, past the context (12:
    the cached decoder refills from the last 12 ids) and in a context shorter than any block (3)."""
    kwargs = dict(max_new_tokens=new_tokens, context=context)
    cached = generate.sample_tokens(decode_model, IDS[:prompt_len], **kwargs)
    assert len(cached) == new_tokens
    assert cached == generate.sample_tokens(decode_model, IDS[:prompt_len], cached=False, **kwargs)


def test_sampling_is_seeded_and_stops_at_the_stop_token(model):
    cfg, net = model
    kwargs = dict(max_new_tokens=6, context=64, temperature=1.5, top_p=0.9)
    first = generate.sample_tokens(net, [1, 2, 3], seed=7, **kwargs)
    assert first == generate.sample_tokens(net, [1, 2, 3], seed=7, **kwargs)
    assert first != generate.sample_tokens(net, [1, 2, 3], seed=8, **kwargs)
    cut = generate.sample_tokens(net, [1, 2, 3], seed=7, stop_id=first[2], **kwargs)
    assert cut == first[:first.index(first[2]) + 1]
    with pytest.raises(ValueError, match="top_p in"):
        generate.sample_tokens(net, [1], max_new_tokens=1, context=8, top_p=0.0)


def test_load_names_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        generate.load(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="has no config.yaml"):
        generate.load(tmp_path)
    (tmp_path / "config.yaml").write_text("dataset_type: synthetic\n")
    with pytest.raises(FileNotFoundError, match="only runs on text data"):
        generate.load(tmp_path)


def test_overlap_slots_equal_the_two_slices_side_by_side():
    """The slots an overlapping (r = 4) entry pools in a decode step, as the step computes them
    (a position written into the unfinished block, then the previous block's first d channels and
    this block's last d): on a TPU v5e, XLA compiled the former concatenation of the two slices
    wrong, the cause of cached decoding parting from the full pass there (docs/distributed.md)."""
    r, d = 4, 16
    rng = np.random.default_rng(0)
    state = rng.normal(size=(1, 2 * r, 2 * d)).astype(np.float32)
    new = rng.normal(size=(1, 1, 2 * d)).astype(np.float32)
    got = jax.jit(lambda s, n, t: decode._overlap_slots(jax.lax.dynamic_update_slice_in_dim(
        s, n, r + t % r, axis=1), r, d))(state, new, jnp.int32(3))
    want = state.copy()
    want[:, r + 3] = new[:, 0]
    np.testing.assert_array_equal(got, np.concatenate([want[:, :r, :d], want[:, r:, d:]], 1))
