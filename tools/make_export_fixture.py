"""Build the fixture of tests/test_export.py under tests/fixtures/export/.

Needs torch and transformers (>= 5.18, with DeepseekV4ForCausalLM), which are no dependencies of
moebalance or of its CI, and this project's venv for the moebalance side:

    PYTHON_WITH_TORCH tools/make_export_fixture.py [--moebalance-python .venv/bin/python]

1. moebalance (a subprocess in its own venv) writes a corpus of a few KB of text, trains a tiny
   text run on it (`moebalance train deepseek4-smoke` with OVERRIDES: a 300-token byte-level
   BPE, calibrated biases) and exports it with `moebalance export`; the run's config.yaml,
   tokenizer.json and latest checkpoint are copied to run/ (the export itself is not kept: the
   test makes it again).
2. transformers loads the export with AutoModelForCausalLM and AutoTokenizer and, for each of
   TEXTS, records its tokenizer's ids and its float32 logits of [<|endoftext|>] + those ids (a
   document starts after an end of text, as in training) in expected.npz, with the texts, the
   versions and transformers' own float32-vs-float64 difference in expected.json.

Every text is at most max_target_length - 1 tokens and index_topk is max_target_length / 4: every
visible compressed entry is chosen, so ties among the indexer's scores cannot make torch and JAX
pick differently (docs/hf.md, "Ties in the indexer").
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

# tools/ is this script's directory: its sibling imports as a module
from make_hf_fixture import ROOT, command_line, difference, run_moebalance_side

OUT = ROOT / "tests" / "fixtures" / "export"
LENGTH = 32
OVERRIDES = [  # deepseek4-smoke shrunk so that the checkpoint (with AdamW's state) stays small
    "dataset_type=text", "dataset_glob=*.txt", "tokenizer_vocab_size=300", "vocab_size=300",
    f"max_target_length={LENGTH}", f"index_topk={LENGTH // 4}", "base_emb_dim=16",
    "base_moe_mlp_dim=8", "num_experts=4", "q_lora_rank=8", "o_lora_rank=8", "steps=4",
    "per_device_batch_size=2", "learning_rate=3e-3", "eval_fraction=0.2",
    "probe_refit_batches=0", "routed_bias_calibration_batches=2",
    "max_num_checkpoints_to_keep=1",
]
TEXTS = [
    "The lazy fox jumps.",
    "experts route tokens",
    " héllo 🙂\n\tend ",
    "a <|endoftext|> b",  # literal special-token text: text, as in training
]
WORDS = ("the quick brown fox jumps over a lazy dog while experts route tokens to balanced loads "
         "and every layer learns what the router chose").split()


# --- the moebalance side (run in the project's venv) ------------------------------------------


def write_corpus(directory: Path) -> None:
    """Eight seeded documents of twenty short sentences each (about 10 KB)."""
    rng = random.Random(0)
    directory.mkdir(parents=True)
    for i in range(8):
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))).capitalize()
                     + "." for _ in range(20)]
        (directory / f"doc{i}.txt").write_text("\n".join(sentences) + "\n")


def moebalance_side(work: Path) -> None:
    """Train the run, export it to work/export, copy the run's files to OUT/run."""
    from moebalance import cli
    from moebalance.rundir import RunDir

    write_corpus(work / "corpus")
    run = RunDir(work / "run")
    train = ["train", "deepseek4-smoke", *OVERRIDES, f"dataset_path={work / 'corpus'}",
             f"data_cache_dir={work / 'cache'}", "--out", str(run.path), "-q"]
    assert cli.main(train) == 0, "training failed"
    assert cli.main(["export", str(run.path), str(work / "export")]) == 0, "export failed"
    shutil.rmtree(OUT / "run", ignore_errors=True)
    (OUT / "run").mkdir(parents=True)
    for name in ("config.yaml", "tokenizer.json"):
        shutil.copyfile(run.path / name, OUT / "run" / name)
    step = max(int(p.name) for p in run.checkpoints.iterdir() if p.name.isdigit())
    shutil.copytree(run.checkpoints / str(step), OUT / "run" / "checkpoints" / str(step))


# --- the transformers side (run with torch) ---------------------------------------------------


def transformers_side(export: Path) -> dict:
    """The export in transformers: per text its ids and float32 logits into OUT/expected.npz."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    problems = {k: sorted(v) for k, v in info.items() if v}
    assert not problems, f"from_pretrained({export}): {problems}"
    exact = AutoModelForCausalLM.from_pretrained(export, experts_implementation="eager").double()
    tokenizer = AutoTokenizer.from_pretrained(export)
    eos = tokenizer.eos_token_id
    assert model.generation_config.eos_token_id == eos == 0, "<|endoftext|> is not the eos"
    arrays, rounding = {}, []
    for i, text in enumerate(TEXTS):
        ids = tokenizer(text)["input_ids"]
        assert len(ids) < LENGTH and tokenizer.decode(ids) == text, (text, ids)
        inputs = torch.tensor([[eos, *ids]])
        with torch.no_grad():
            logits = model(inputs).logits.float().numpy()[0]
            rounding.append(difference(logits, exact(inputs).logits.numpy()[0]))
        arrays[f"ids_{i}"], arrays[f"logits_{i}"] = np.asarray(ids, np.int32), logits
    np.savez_compressed(OUT / "expected.npz", **arrays)
    special = AutoTokenizer.from_pretrained(export, split_special_tokens=False)(TEXTS[-1])
    return {
        "texts": TEXTS, "inputs": "[eos_token_id] + ids", "eos_token_id": eos,
        "transformers_float32_vs_float64": max(rounding, key=lambda d: d["max_rel"]),
        "split_special_tokens_false_ids": {TEXTS[-1]: special["input_ids"]},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def main() -> int:
    python = command_line(__doc__, moebalance_side)
    if python is None:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        run_moebalance_side(python, __file__, Path(tmp))
        record = transformers_side(Path(tmp) / "export")
    (OUT / "expected.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps(record, indent=2, ensure_ascii=False))
    size = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"fixture: {size / 1e6:.2f} MB under {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
