"""Pre-tokenized token files (dataset_type 'tokens'): moebalance.data.tokens."""

import json
from pathlib import Path

import numpy as np
import pytest

from data_fixtures import SEQ, needs_permissions
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


def _tokens_config(root: Path, **overrides):
    values = dict(dataset_type="tokens", dataset_path=[str(root)], max_target_length=8)
    return load_config("deepseek4-smoke", {**values, **overrides})


@pytest.mark.parametrize("dtype, suffix", [("uint16", ".bin"), ("uint32", ".npy")])
def test_token_files_tail_split_at_a_document_boundary(tmp_path, dtype, suffix):
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 200, rng.integers(3, 30)).tolist() for _ in range(40)]
    _token_dataset(tmp_path, docs, 0, dtype, suffix)
    cfg = _tokens_config(tmp_path, max_target_length=SEQ, eval_fraction=0.25)
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
    cfg = _tokens_config(tmp_path)
    held = data.TextBatches(cfg, "eval")
    val = [9, 9, 1] * 20
    assert held.batch(0)[0][0, 0].tolist() in [val[r * 8: r * 8 + 9] for r in range(held.num_rows)]
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16", "eot_id": 1}))
    np.array([300, 1], np.uint16).tofile(tmp_path / "val.bin")
    with pytest.raises(ValueError, match="token ids >= vocab_size=256"):
        data.TextBatches(cfg, "eval")
    with pytest.raises(ValueError, match="`tokenizer_path`: '/nope.json' does not exist; give a "
                                         "tokenizer.json"):
        data.TextBatches(_tokens_config(tmp_path, tokenizer_path="/nope.json"))
    tokenizer = data.train_tokenizer(["some text"] * 3, 300)  # its <|endoftext|> is id 0, not 1
    tokenizer.save(str(tmp_path / "tok.json"))
    with pytest.raises(ValueError, match="<\\|endoftext\\|> is id 0, .* eot_id 1"):
        data.TextBatches(_tokens_config(tmp_path, vocab_size=512,
                                        tokenizer_path=str(tmp_path / "tok.json")))
    (tmp_path / "meta.json").unlink()
    with pytest.raises(ValueError, match="train.bin has no sidecar"):
        data.TextBatches(cfg, "train")
    with pytest.raises(ValueError, match="dataset_path"):
        load_config("deepseek4-smoke", dict(dataset_type="tokens"))


@pytest.mark.parametrize("sidecar, message", [
    ("dtype: uint16", "meta.json: not JSON"),
    ('["uint16", 1]', "meta.json: holds a JSON list, not an object"),
    ('{"dtype": "uint16"}', 'meta.json: needs "dtype" .* integer "eot_id", got .* eot_id None'),
    ('{"dtype": "int64", "eot_id": 1}', "meta.json: needs \"dtype\" .* got dtype 'int64'"),
    ('{"dtype": "uint16", "eot_id": true}', "meta.json: needs .* got .* eot_id True"),
    ('{"dtype": "uint16", "eot_id": 300}', "eot_id 300 is outside the vocabulary \\[0, 256\\); "
                                           "fix \"eot_id\" in the sidecar, or .*vocab_size"),
    ('{"dtype": "uint16", "eot_id": -1}', "eot_id -1 is outside the vocabulary \\[0, 256\\)"),
])
def test_bad_sidecar_is_an_error_naming_it(tmp_path, sidecar, message):
    _token_dataset(tmp_path, [[5, 6, 7] * 20], 1, "uint16", ".bin")
    (tmp_path / "meta.json").write_text(sidecar)
    with pytest.raises(data.DataError, match=message):
        data.TextBatches(_tokens_config(tmp_path), "train")


def test_eot_id_beyond_the_dtype_is_an_error(tmp_path):
    _token_dataset(tmp_path, [[5, 6, 7] * 20], 1, "uint16", ".bin")
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16", "eot_id": 70000}))
    with pytest.raises(data.DataError, match="eot_id 70000 does not fit its dtype uint16"):
        data.TextBatches(_tokens_config(tmp_path, vocab_size=70016), "train")


@pytest.mark.parametrize("name, content, message", [
    ("train.bin", b"\x01" * 7, "train.bin: 7 bytes is not a whole number of uint16 tokens \\(2 "
                               "bytes each\\); the file is truncated, or fix \"dtype\""),
    ("train.bin", b"", "train.bin is empty"),
    ("train.npy", b"\x01" * 7, "train.npy: not a whole .npy array"),
    ("train.npy", b"", "train.npy is empty; write its tokens again"),
])
def test_token_file_that_is_not_whole_tokens_is_an_error(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16", "eot_id": 1}))
    with pytest.raises(data.DataError, match=message):
        data.TextBatches(_tokens_config(tmp_path), "train")


def test_truncated_npy_file_is_an_error(tmp_path):
    path = _token_dataset(tmp_path, [[5, 6, 7] * 20], 1, "uint16", ".npy")
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(data.DataError, match="train.npy: not a whole .npy array"):
        data.TextBatches(_tokens_config(tmp_path), "train")


@needs_permissions
@pytest.mark.parametrize("unreadable", ["train.bin", "meta.json"])
def test_unreadable_token_file_is_an_error(tmp_path, unreadable):
    _token_dataset(tmp_path, [[5, 6, 7] * 20], 1, "uint16", ".bin")
    (tmp_path / unreadable).chmod(0)
    with pytest.raises(data.DataError, match=f"dataset_path.*{unreadable} cannot be read "
                                             "\\(permission denied; chmod a\\+rX"):
        data.TextBatches(_tokens_config(tmp_path), "train")


@pytest.mark.parametrize("name, make, problem", [
    ("train.bin", lambda p: None, "does not exist"),
    ("train.bin", lambda p: p.symlink_to(p.parent / "gone.bin"),
     "is a link to .*gone.bin, which does not exist"),
    ("file/train.bin", lambda p: p.parent.write_text("x"),
     "does not exist \\(a part of the path above it is a file\\)"),
])
def test_a_token_path_that_does_not_exist_is_called_missing(tmp_path, name, make, problem):
    """Issue 61: a dataset_path naming no file was called "not a token file"."""
    make(tmp_path / name)
    with pytest.raises(data.DataError, match=f"^config key `dataset_path`: '.*train.bin' "
                                             f"{problem}; give token files \\(.bin/.npy\\)"):
        data.TextBatches(_tokens_config(tmp_path / name), "train")


def test_a_token_path_of_another_kind_says_which(tmp_path):
    (tmp_path / "train.txt").write_text("5 6 7")
    with pytest.raises(data.DataError, match="'.*train.txt' is not a token file \\(its name ends "
                                             "neither in .bin nor .npy\\); give token files"):
        data.TextBatches(_tokens_config(tmp_path / "train.txt"), "train")
    _token_dataset(tmp_path, [[5, 6, 7] * 20], 1, "uint16", ".bin")
    (tmp_path / "meta.json").unlink()
    (tmp_path / "meta.json").mkdir()
    with pytest.raises(data.DataError, match="the sidecar .*meta.json is a directory, not a file"):
        data.TextBatches(_tokens_config(tmp_path / "train.bin"), "train")
    (tmp_path / "meta.json").rmdir()
    (tmp_path / "meta.json").write_text("")
    with pytest.raises(data.DataError, match="the sidecar .*meta.json is empty; write a JSON"):
        data.TextBatches(_tokens_config(tmp_path / "train.bin"), "train")


@needs_permissions
def test_an_unreadable_token_directory_is_an_error(tmp_path):
    _token_dataset(tmp_path, [[5, 6, 7] * 20], 1, "uint16", ".bin")
    tmp_path.chmod(0o300)  # searchable, not listable
    try:
        with pytest.raises(data.DataError, match="dataset_path.* cannot be read \\(permission"):
            data.TextBatches(_tokens_config(tmp_path), "train")
    finally:
        tmp_path.chmod(0o700)
