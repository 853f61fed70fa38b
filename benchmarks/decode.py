"""Per-token decoding time with and without the KV cache, at a full context (default deepseek4-tiny,
random weights, synthetic ids, 256 positions).

Both decoders (`moebalance.generate.sample_tokens`, greedy, cached=True / False) run in the same
process on the same model, at the same context L = --context positions: prompts of L - N and
L - N/2 ids each followed by N and N/2 new tokens. Compilation is excluded (one warm-up call
each). Prints one JSON object:

    per_token_s        the marginal cost of a token, (time(N tokens) - time(N/2)) / (N/2): a
                       cached step, or an uncached forward pass over L positions
    end_to_end_s       time(N tokens) / N: per token, the cached decoder's prefill included
    speedup            uncached / cached per_token_s (and end_to_end_speedup)

    python benchmarks/decode.py [--config deepseek4-tiny] [--context 256] [--new 64]
                                [--repeats 3] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np
from flax import nnx

from moebalance.config import load_config, override_keys
from moebalance.generate import sample_tokens
from moebalance.model.transformer import DeepSeekV4
from moebalance.runtime import reexec_with_hugepage_malloc


def best_time(fn, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls (after a warm-up call that compiles)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench(config: str, overrides: list[str], context: int, new: int, repeats: int) -> dict:
    # random hash tables: the balanced ones need training data, and decoding speed does not
    cfg = load_config(config, [*overrides, "hash_table=random", f"max_target_length={context}"],
                      given=override_keys(overrides))
    model = DeepSeekV4(cfg, rngs=nnx.Rngs(0))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, context).tolist()
    out = {"config": config, "layers": cfg.base_num_decoder_layers, "context": context,
           "new_tokens": new, "backend": jax.default_backend()}
    for name, cached in (("cached", True), ("uncached", False)):
        def run(n, cached=cached):
            tokens = sample_tokens(model, ids[:context - n], max_new_tokens=n, context=context,
                                   cached=cached)
            assert len(tokens) == n

        full, half = best_time(lambda: run(new), repeats), best_time(lambda: run(new // 2), repeats)
        out[f"{name}_per_token_s"] = round((full - half) / (new - new // 2), 5)
        out[f"{name}_end_to_end_s"] = round(full / new, 5)
    out["speedup"] = round(out["uncached_per_token_s"] / out["cached_per_token_s"], 1)
    out["end_to_end_speedup"] = round(out["uncached_end_to_end_s"] / out["cached_end_to_end_s"], 1)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deepseek4-tiny")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    reexec_with_hugepage_malloc()
    print(json.dumps(bench(args.config, args.overrides, args.context, args.new, args.repeats)))


if __name__ == "__main__":
    main()
