"""The data tests' shared material: made-up corpora on disk, their config, and the fixture
`corpus` (a test module imports it by name to use it)."""

import os
import random
from pathlib import Path

import numpy as np
import pytest

from moebalance.config import load_config

WORDS = ("expert router balance token gradient bias layer attention window scale vector "
         "matrix query value residual shard device batch loss metric").split()
SEQ = 16


def write_corpus(root: Path, n_docs: int = 8) -> dict[str, str]:
    """`n_docs` made-up documents in nested directories, plus files the corpus must skip: an
    empty one, a non-UTF-8 one and one not matching the glob. Returns {name: text}."""
    rng = random.Random(0)
    docs = {}
    for i in range(n_docs):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
                 for _ in range(rng.randint(4, 30))]
        name = f"pkg{i % 3}/mod_{i}.py"
        docs[name] = f"# document {i}\n" + "\n".join(lines) + "\n"
    docs["pkg0/unicode.py"] = "héllo wörld — 専門家 ✓ and a literal <|endoftext|> inside\n" * 3
    for name, text in docs.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / "pkg1/empty.py").write_text("")
    (root / "pkg1/latin1.py").write_bytes("caf\xe9 = 1\n".encode("latin-1"))
    (root / "notes.txt").write_text("not a python file\n")
    return docs


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    return root, write_corpus(root)


def text_config(tmp_path, root, **overrides):
    values = dict(dataset_type="text", dataset_path=[str(root)], vocab_size=512,
                  tokenizer_vocab_size=300, data_cache_dir=str(tmp_path / "cache"),
                  max_target_length=SEQ, per_device_batch_size=2, gradient_accumulation_steps=2,
                  eval_fraction=0.3)  # the tests' preset: what a test gives is its overrides
    return load_config("deepseek4-smoke", {**values, **overrides}, given=overrides)


def documents_of(stream: np.ndarray, eot_id: int) -> list[np.ndarray]:
    ends = np.flatnonzero(stream == eot_id)
    assert ends.size and ends[-1] == len(stream) - 1
    return np.split(np.asarray(stream), ends + 1)[:-1]


# root reads a file whatever its mode, so chmod cannot make one unreadable for the tests
needs_permissions = pytest.mark.skipif(os.geteuid() == 0, reason="root reads files of mode 000")
