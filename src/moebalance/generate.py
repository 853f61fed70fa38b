"""Sampling text from a trained run: greedy, temperature and nucleus (top-p) decoding.

    load(run_dir)                           -> Generator (the latest checkpoint + the tokenizer)
    generator.complete(prompt, ...)         -> the continuation as text
    sample_tokens(model, ids, ...)          -> new token ids (any model, no tokenizer)
    decoder(model, length)                  -> logits_after(ids), the logits one token at a time

Decoding is cached (model/decode.py): a prefill runs the model once over the prompt and fills a KV
cache (per layer the sliding window's keys/values, the compressors' unfinished blocks and their
compressed entries so far, the indexer's compressed keys), then each new token is one step of one
position against it: on deepseek4-tiny at a 256-token context, 8.5 ms a token instead of 150 ms
on a 2-core CPU (benchmarks/decode.py). The context is at most `max_target_length` tokens, the length
the model was trained on; a longer text keeps its last tokens at positions from 0, the rule of the
uncached decoder, so past that length each token refills the cache from the last tokens (as costly
as uncached) rather than sliding on. `cached=False` runs the model over the whole context for every
token: the reference the cached decoder is tested against (the same tokens, logits equal to float32
rounding). Each position's logits depend only on the tokens up to it (every attention path is
causal, routing is per token and dropless), so contexts are padded to one fixed length, compiled
once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer

from moebalance import routing
from moebalance.config import Config
from moebalance.data import EOT, read_tokenizer
from moebalance.model import decode
from moebalance.model.transformer import DeepSeekV4
from moebalance.rundir import RunDir
from moebalance.training import checkpoint


def next_token_probs(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """[V] float64 sampling distribution from [V] logits: softmax(logits / temperature), cut to
    the smallest set of most likely tokens whose probability reaches `top_p` (ties at the cut are
    kept in id order) and renormalised. temperature 0: all mass on the argmax (greedy)."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        greedy = np.zeros_like(logits)
        greedy[np.argmax(logits)] = 1.0
        return greedy
    z = logits / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]  # mass of the more likely tokens
    kept = order[before < top_p]
    out = np.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


@nnx.jit
def _logits_at(model, tokens, index):
    """tokens [1, C] -> [V] float32 logits at position `index`."""
    return model.logits(model(tokens).hidden[0, index])


@functools.lru_cache(maxsize=4)
def _cached_decoding(graphdef):
    """The jitted prefill and step of the models of one graph structure, called with the model's
    state: compiled once per shape, and the graph hashed once per text, not on every call as a
    static argument would be (0.4 ms a token for deepseek4-tiny, 4 ms with scan_layers off)."""
    return (jax.jit(lambda state, tokens, length: decode.prefill(nnx.merge(graphdef, state),
                                                                 tokens, length)),
            jax.jit(lambda state, cache, token: decode.step(nnx.merge(graphdef, state), cache,
                                                            token)))


def _padded(ids: list[int], length: int):
    """The last `length` ids as [1, length] int32 tokens (zeros after them) and their count."""
    window = ids[-length:]
    tokens = np.zeros((1, length), np.int32)  # positions after the window do not matter
    tokens[0, :len(window)] = window
    return jnp.asarray(tokens), len(window)


def decoder(model: DeepSeekV4, length: int, *, cached: bool = True):
    """-> logits_after(ids): the [V] float32 logits (NumPy) of the token after `ids` (the text so
    far: one id more than at the call before), from the model run on their last `length`.

    cached: a KV cache of `length` positions (model/decode.py), filled by a prefill of the first
    ids and then advanced by one position per call; once the text is longer than `length`, every
    call fills it again from the last `length` ids (the positions shift: nothing can be kept), as
    costly as uncached. Uncached: one forward pass over the last `length` ids, padded to `length`.
    """
    if not cached:
        def forward(ids):
            tokens, n = _padded(ids, length)
            return np.asarray(_logits_at(model, tokens, n - 1))

        return forward
    graphdef, state = nnx.split(model)
    prefill, step = _cached_decoding(graphdef)
    cache = None

    def logits_after(ids):
        nonlocal cache
        if cache is None or len(ids) > length:
            logits, cache = prefill(state, *_padded(ids, length))
        else:
            logits, cache = step(state, cache, jnp.asarray(ids[-1:], jnp.int32))
        return np.asarray(logits)[0]

    return logits_after


def sample_tokens(model: DeepSeekV4, prompt: list[int], *, max_new_tokens: int, context: int,
                  temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                  stop_id: int | None = None, cached: bool = True) -> list[int]:
    """Up to `max_new_tokens` ids following `prompt` (ids), each drawn from `next_token_probs` of
    the model's logits over the last `context` ids; stops after `stop_id` (which is returned).
    cached=False decodes without the KV cache (the reference the cached decoder is tested with)."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    if temperature < 0 or not 0 < top_p <= 1 or max_new_tokens < 1:
        raise ValueError(f"sampling needs temperature >= 0 (0: greedy), top_p in (0, 1] and "
                         f"max_new_tokens >= 1, got {temperature}, {top_p}, {max_new_tokens}")
    routing.check_token_ids(np.asarray(prompt), model.vocab_size)
    rng = np.random.default_rng(seed)
    logits_after = decoder(model, min(context, len(prompt) + max_new_tokens - 1), cached=cached)
    ids = list(prompt)
    for _ in range(max_new_tokens):
        logits = logits_after(ids)
        token = int(rng.choice(len(logits), p=next_token_probs(logits, temperature, top_p)))
        ids.append(token)
        if token == stop_id:
            break
    return ids[len(prompt):]


@dataclasses.dataclass
class Generator:
    """A trained run ready to sample from."""

    config: Config
    model: DeepSeekV4
    tokenizer: Tokenizer
    step: int  # optimizer steps of the checkpoint

    def complete(self, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0) -> str:
        """The text the model writes after `prompt` (up to max_new_tokens tokens or the end of
        the document)."""
        ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        eot = self.tokenizer.token_to_id(EOT)
        new = sample_tokens(self.model, ids or [eot], max_new_tokens=max_new_tokens,
                            context=self.config.max_target_length, temperature=temperature,
                            top_p=top_p, seed=seed, stop_id=eot)
        return self.tokenizer.decode([t for t in new if t != eot])


def load(run_dir) -> Generator:
    """The run's latest checkpoint (on the default device) and the tokenizer it trained with."""
    run = RunDir(run_dir)
    cfg = run.config()
    tokenizer_file = run.tokenizer
    if not tokenizer_file.is_file():
        raise FileNotFoundError(
            f"{tokenizer_file} is missing: only runs on text data (dataset_type: text, or "
            "tokens with a tokenizer_path) have a tokenizer to turn the sampled ids into text"
            if cfg.dataset_type != "text" else
            f"{tokenizer_file} is missing: runs trained before the trainer kept the tokenizer "
            "have none; train again, or copy the tokenizer.json the run used (in the data cache) "
            "there")
    model, step = checkpoint.restore_model(cfg, run.checkpoints)
    tokenizer = read_tokenizer(tokenizer_file, f"{tokenizer_file} is not a tokenizer the run can "
                               "use ({reason}); copy the tokenizer.json the run trained with (in "
                               "the data cache) there")
    tokenizer.encode_special_tokens = True  # as in training: literal <|endoftext|> is text
    return Generator(cfg, model, tokenizer, step)
