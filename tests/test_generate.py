import numpy as np
import pytest
from flax import nnx

from moebalance import generate
from moebalance.config import load_config
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


@pytest.mark.parametrize("context", [64, 10])
def test_greedy_decoding_is_the_argmax_of_the_full_forward_pass(model, context):
    """One padded fixed-length context per call (and, with context 10, a sliding window over a
    longer text) gives exactly the tokens the plain forward pass ranks first."""
    cfg, net = model
    prompt = [5, 17, 200, 3, 99, 42, 7]
    new = generate.sample_tokens(net, prompt, max_new_tokens=9, context=context)
    assert len(new) == 9
    assert new == _greedy_reference(net, prompt + new, len(prompt), context)


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
