"""Pre-tokenized token files (dataset_type 'tokens'): moebalance.data.tokens."""

import json
from pathlib import Path

import numpy as np
import pytest

from data_fixtures import SEQ
from moebalance import data
from moebalance.config import load_config


def _token_dataset(root: Path, docs: list[list[int]], eot: int, dtype: str, suffix: str) -> Path:
    stream = np.concatenate([np.array(d + [eot], dtype) for d in docs])
    path = root / f"train{suffix}"
    if suffix == ".npy":
        np.save(path, stream)
    else:
        stream.tofile(path)
    (root / "meta.json").write_text(json.dumps({"dtype": dtype, "eot_id": eot}))
    return path


@pytest.mark.parametrize("dtype, suffix", [("uint16", ".bin"), ("uint32", ".npy")])
def test_token_files_tail_split_at_a_document_boundary(tmp_path, dtype, suffix):
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 200, rng.integers(3, 30)).tolist() for _ in range(40)]
    _token_dataset(tmp_path, docs, 0, dtype, suffix)
    cfg = load_config("deepseek4-smoke", dict(dataset_type="tokens", dataset_path=[str(tmp_path)],
                                              max_target_length=SEQ, eval_fraction=0.25))
    train, held = data.TextBatches(cfg, "train"), data.TextBatches(cfg, "eval")
    everything = np.concatenate([np.array(d + [0]) for d in docs])
    cut = train.tokens_in_split
    assert cut + held.tokens_in_split == len(everything) and everything[cut - 1] == 0
    assert cut >= 0.75 * len(everything) and (everything[int(0.75 * len(everything)):cut - 1]
                                              != 0).all()  # the first boundary after 75%
    tokens, mask, seg = train.batch(0)
    assert tokens.dtype == np.int32 and train.eot_id == 0 and train.tokenizer is None
    row = [data.pack_row(everything[:cut], r, SEQ, 0) for r in range(train.num_rows)]
    assert any(np.array_equal(tokens[0, 0], r[0]) for r in row)


def test_token_files_with_a_held_out_file_and_their_errors(tmp_path):
    _token_dataset(tmp_path, [[5, 6, 7] * 20], 1, "uint16", ".bin")
    np.array([9, 9, 1] * 20, np.uint16).tofile(tmp_path / "val.bin")
    cfg = load_config("deepseek4-smoke", dict(dataset_type="tokens", dataset_path=[str(tmp_path)],
                                              max_target_length=8))
    held = data.TextBatches(cfg, "eval")
    val = [9, 9, 1] * 20
    assert held.batch(0)[0][0, 0].tolist() in [val[r * 8: r * 8 + 9] for r in range(held.num_rows)]
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16", "eot_id": 1}))
    np.array([300, 1], np.uint16).tofile(tmp_path / "val.bin")
    with pytest.raises(ValueError, match="token ids >= vocab_size=256"):
        data.TextBatches(cfg, "eval")
    with pytest.raises(ValueError, match="`tokenizer_path`: .* is not a file"):
        data.TextBatches(load_config("deepseek4-smoke", dict(
            dataset_type="tokens", dataset_path=[str(tmp_path)], tokenizer_path="/nope.json")))
    tokenizer = data.train_tokenizer(["some text"] * 3, 300)  # its <|endoftext|> is id 0, not 1
    tokenizer.save(str(tmp_path / "tok.json"))
    with pytest.raises(ValueError, match="<\\|endoftext\\|> is id 0, .* eot_id 1"):
        data.TextBatches(load_config("deepseek4-smoke", dict(
            dataset_type="tokens", dataset_path=[str(tmp_path)], vocab_size=512,
            tokenizer_path=str(tmp_path / "tok.json"))))
    (tmp_path / "meta.json").unlink()
    with pytest.raises(ValueError, match="train.bin has no sidecar"):
        data.TextBatches(cfg, "train")
    with pytest.raises(ValueError, match="dataset_path"):
        load_config("deepseek4-smoke", dict(dataset_type="tokens"))
