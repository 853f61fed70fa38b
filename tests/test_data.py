import gzip
import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from moebalance import data
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
                  eval_fraction=0.3)
    return load_config("deepseek4-smoke", {**values, **overrides})


# --- corpus and split ------------------------------------------------------------------------


def test_corpus_files_sorted_and_skips_empty_and_non_utf8(tmp_path, corpus):
    root, docs = corpus
    files = data.corpus_files(text_config(tmp_path, root))
    assert files == sorted(root / name for name in docs)


def test_default_corpus_is_the_stdlib_without_site_packages():
    cfg = load_config("deepseek4-smoke", {"dataset_type": "text", "vocab_size": 8192})
    files = data.corpus_files(cfg)
    assert len(files) > 500 and files == sorted(files)
    assert not any({"site-packages", "dist-packages"} & set(f.parts) for f in files)
    assert all(f.suffix == ".py" for f in files)


def test_split_is_deterministic_order_independent_and_covers_each_document_once(tmp_path, corpus):
    root, _ = corpus
    docs = data.corpus_documents(text_config(tmp_path, root))
    train, held = data.split_documents(docs, 0.3, seed=0)
    shuffled = docs[::-1]
    random.Random(1).shuffle(shuffled)
    assert data.split_documents(shuffled, 0.3, seed=0) == (train, held)
    assert sorted(train + held, key=lambda d: d.path) == docs and not set(train) & set(held)


def test_split_of_a_document_depends_only_on_its_name_and_the_seed():
    docs = [data.Document(f"pkg/d{i}.py", Path(f"/corpus/pkg/d{i}.py")) for i in range(400)]
    _, held = data.split_documents(docs, 0.25, seed=7)
    assert 0.18 < len(held) / len(docs) < 0.32
    _, sub_held = data.split_documents(docs[100:300], 0.25, seed=7)
    assert set(sub_held) == set(held) & set(docs[100:300])
    moved = [data.Document(d.name, Path("/elsewhere") / d.name) for d in docs]
    assert [d.name for d in data.split_documents(moved, 0.25, seed=7)[1]] == [d.name for d in held]
    assert data.split_documents(docs, 0.25, seed=8)[1] != held


@pytest.mark.parametrize("fraction", [1e-9, 1 - 1e-9])
def test_split_keeps_a_document_on_each_side(tmp_path, corpus, fraction):
    root, _ = corpus
    docs = data.corpus_documents(text_config(tmp_path, root))
    train, held = data.split_documents(docs, fraction, seed=3)
    assert len(train) >= 1 and len(held) >= 1 and len(train) + len(held) == len(docs)


# --- tokenizer and streams -------------------------------------------------------------------


def documents_of(stream: np.ndarray, eot_id: int) -> list[np.ndarray]:
    ends = np.flatnonzero(stream == eot_id)
    assert ends.size and ends[-1] == len(stream) - 1
    return np.split(np.asarray(stream), ends + 1)[:-1]


def test_streams_hold_every_document_once_and_round_trip(tmp_path, corpus):
    root, texts = corpus
    cfg = text_config(tmp_path, root)
    train, held = data.TextBatches(cfg, "train"), data.TextBatches(cfg, "eval")
    tok = train.tokenizer
    assert tok.get_vocab_size() <= 300 and train.eot_id == held.eot_id == tok.token_to_id(data.EOT)
    decoded = {}
    for split in (train, held):
        stream = np.load(next((tmp_path / "cache").glob(f"*/{split.split}-*.npy")))
        assert split.tokens_in_split == len(stream) and stream.dtype == np.int32
        decoded[split.split] = [tok.decode(d[:-1].tolist()) for d in documents_of(stream,
                                                                                  split.eot_id)]
    train_docs, held_docs = data.split_documents(
        data.corpus_documents(cfg), cfg.eval_fraction, cfg.seed)
    assert decoded["train"] == [texts[d.name] for d in train_docs]
    assert decoded["eval"] == [texts[d.name] for d in held_docs]
    for text in texts.values():
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text and train.eot_id not in ids


def test_cache_is_reused(tmp_path, corpus, monkeypatch):
    root, _ = corpus
    cfg = text_config(tmp_path, root)
    first = data.TextBatches(cfg, "train").batch(1)

    def fail(*args, **kwargs):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(data, "train_tokenizer", fail)
    monkeypatch.setattr(data, "encode_documents", fail)
    again = data.TextBatches(cfg, "train").batch(1)
    assert all(np.array_equal(x, y) for x, y in zip(first, again))
    # an edited training file changes the key: the tokenizer is trained again
    train_docs, _ = data.split_documents(data.corpus_documents(cfg), cfg.eval_fraction, cfg.seed)
    train_docs[0].path.write_text("changed text\n")
    with pytest.raises(AssertionError, match="cache"):
        data.TextBatches(cfg, "train")


def test_given_tokenizer_is_used(tmp_path, corpus):
    root, _ = corpus
    tok = data.train_tokenizer(["some words to learn from, some words"], 270)
    tok.save(str(tmp_path / "tok.json"))
    cfg = text_config(tmp_path, root, tokenizer_path=str(tmp_path / "tok.json"))
    batches = data.TextBatches(cfg, "train")
    assert batches.tokenizer.to_str() == Tokenizer.from_file(str(tmp_path / "tok.json")).to_str()


# --- packing ---------------------------------------------------------------------------------


def reference_row(stream: np.ndarray, row: int, seq_len: int, eot_id: int):
    """Slow and obvious: label every stream position with its document (an end-of-text token
    belongs to the document it ends), then read a row's segments and masks off the labels."""
    doc_of, doc = [], 0
    for token in stream:
        doc_of.append(doc)
        if token == eot_id:
            doc += 1
    start = row * seq_len
    tokens = [int(stream[start + t]) for t in range(seq_len + 1)]
    segment_ids = [doc_of[start + t] - doc_of[start] for t in range(seq_len)]
    mask = [doc_of[start + t + 1] == doc_of[start + t] for t in range(seq_len)]
    return np.array(tokens, np.int32), np.array(mask, bool), np.array(segment_ids, np.int32)


@pytest.mark.parametrize("seed", range(6))
def test_pack_row_matches_reference(seed):
    rng = np.random.default_rng(seed)
    seq_len, eot_id = int(rng.integers(1, 9)), 0
    stream = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(seq_len + 1, 80)))
    stream = stream.astype(np.int32)
    assert data.num_rows(len(stream), seq_len) == (len(stream) - 1) // seq_len
    for row in range(data.num_rows(len(stream), seq_len)):
        got = data.pack_row(stream, row, seq_len, eot_id)
        want = reference_row(stream, row, seq_len, eot_id)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and np.array_equal(g, w)


def test_pack_row_hand_computed():
    stream = np.array([5, 0, 0, 7, 8, 0, 9, 4, 0], np.int32)  # eot 0
    tokens, mask, segment_ids = data.pack_row(stream, 0, 4, 0)
    assert tokens.tolist() == [5, 0, 0, 7, 8]
    assert mask.tolist() == [True, False, False, True]  # an empty document between the eots
    assert segment_ids.tolist() == [0, 0, 1, 2]
    tokens, mask, segment_ids = data.pack_row(stream, 1, 4, 0)
    assert tokens.tolist() == [8, 0, 9, 4, 0]  # row 1 starts on row 0's last token
    assert mask.tolist() == [True, False, True, True]
    assert segment_ids.tolist() == [0, 0, 1, 1]


def test_rows_cover_every_target_once(tmp_path, corpus):
    root, _ = corpus
    cfg = text_config(tmp_path, root)
    batches = data.TextBatches(cfg, "train")
    stream = np.load(next((tmp_path / "cache").glob("*/train-*.npy")))
    rows = [data.pack_row(stream, r, SEQ, batches.eot_id)[0] for r in range(batches.num_rows)]
    targets = np.concatenate([row[1:] for row in rows])
    assert np.array_equal(targets, stream[1:1 + batches.num_rows * SEQ])


# --- batches ---------------------------------------------------------------------------------


@pytest.mark.parametrize("split", ["train", "eval"])
def test_batches_are_a_seeded_permutation_per_epoch(tmp_path, corpus, split):
    root, _ = corpus
    cfg = text_config(tmp_path, root, gradient_accumulation_steps=1, per_device_batch_size=1)
    batches = data.TextBatches(cfg, split, 1, 0, global_batch=1)
    stream = np.load(next((tmp_path / "cache").glob(f"*/{split}-*.npy")))
    n = batches.num_rows
    in_order = [data.pack_row(stream, r, SEQ, batches.eot_id)[0].tobytes() for r in range(n)]
    seen = [batches.batch(s)[0][0, 0].tobytes() for s in range(2 * n)]
    assert sorted(seen[:n]) == sorted(seen[n:]) == sorted(in_order)  # each epoch: every row once
    assert seen[:n] != in_order and seen[:n] != seen[n:]  # shuffled, and reshuffled per epoch
    other = data.TextBatches(text_config(tmp_path, root, seed=1, gradient_accumulation_steps=1),
                             split, 1, 0, global_batch=1)
    assert any(not np.array_equal(other.batch(s)[0], batches.batch(s)[0]) for s in range(n))


def test_batch_layout_follows_the_row_sequence_and_wraps_around(tmp_path, corpus):
    """Row j of micro-batch a of step s is element (s*A + a)*global_batch + j of the split's row
    sequence, read here one row per step from a batch-of-one source."""
    root, _ = corpus
    cfg = text_config(tmp_path, root)
    held = data.TextBatches(cfg, "eval", 1, 0, global_batch=8)
    single = data.TextBatches(text_config(tmp_path, root, gradient_accumulation_steps=1),
                              "eval", 1, 0, global_batch=1)
    for step in range(held.num_rows // 16 + 2):  # past the last row: wraps around
        tokens, mask, segment_ids = held.batch(step)
        assert tokens.shape == (2, 8, SEQ + 1) and tokens.dtype == np.int32
        assert mask.shape == segment_ids.shape == (2, 8, SEQ) and mask.dtype == bool
        assert segment_ids.dtype == np.int32
        for a in range(2):
            for j in range(8):
                want = single.batch((step * 2 + a) * 8 + j)
                assert all(np.array_equal(x[a, j], w[0, 0])
                           for x, w in zip((tokens, mask, segment_ids), want))


@pytest.mark.parametrize("split", ["train", "eval"])
def test_process_shards_concatenate_to_the_global_batch(tmp_path, corpus, split):
    root, _ = corpus
    cfg = text_config(tmp_path, root)
    whole = data.TextBatches(cfg, split, 1, 0, global_batch=4)
    parts = [data.TextBatches(cfg, split, 2, i, global_batch=4) for i in range(2)]
    for step in (0, 3, 17):
        joined = [np.concatenate(x, axis=1) for x in zip(*(p.batch(step) for p in parts))]
        assert all(np.array_equal(x, y) for x, y in zip(joined, whole.batch(step)))
        assert parts[0].batch(step)[0].shape == (2, 2, SEQ + 1)


def test_batch_is_a_function_of_the_step(tmp_path, corpus):
    root, _ = corpus
    cfg = text_config(tmp_path, root)
    one, two = data.TextBatches(cfg, "train"), data.TextBatches(cfg, "train")
    later = [one.batch(s) for s in (5, 2, 9)]
    assert all(np.array_equal(x, y) for s, b in zip((5, 2, 9), later)
               for x, y in zip(b, two.batch(s)))
    assert not np.array_equal(one.batch(0)[0], one.batch(1)[0])


# --- errors ----------------------------------------------------------------------------------


def test_empty_corpus_is_an_error(tmp_path):
    root = tmp_path / "nothing"
    root.mkdir()
    (root / "empty.py").write_text("")
    (root / "bytes.py").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(data.DataError, match="dataset_path.*dataset_glob"):
        data.corpus_files(text_config(tmp_path, root))


def test_missing_path_is_an_error(tmp_path, corpus):
    root, _ = corpus
    with pytest.raises(data.DataError, match="nowhere.*does not exist"):
        data.corpus_files(text_config(tmp_path, root, dataset_path=[str(root),
                                                                    str(tmp_path / "nowhere")]))


def test_single_document_is_an_error(tmp_path):
    (tmp_path / "one.py").write_text("only one document here\n")
    with pytest.raises(data.DataError, match="at least 2 files"):
        data.TextBatches(text_config(tmp_path, tmp_path / "one.py"), "train")


def test_tokenizer_larger_than_the_model_vocabulary_is_an_error(tmp_path, corpus):
    root, _ = corpus
    tok = data.train_tokenizer(["a b c"], 300)
    tok.add_tokens([f"extra{i}" for i in range(300)])
    tok.save(str(tmp_path / "big.json"))
    cfg = text_config(tmp_path, root, tokenizer_path=str(tmp_path / "big.json"))
    with pytest.raises(data.DataError, match="tokenizer_vocab_size.*tokenizer_path.*vocab_size"):
        data.TextBatches(cfg, "train")


def test_tokenizer_smaller_than_the_byte_alphabet_is_an_error(tmp_path, corpus):
    root, _ = corpus
    with pytest.raises(data.DataError, match="tokenizer_vocab_size.*at least 257"):
        data.TextBatches(text_config(tmp_path, root, tokenizer_vocab_size=200), "train")


def test_corpus_too_small_for_the_sequence_is_an_error(tmp_path, corpus):
    root, _ = corpus
    with pytest.raises(data.DataError, match="too small.*max_target_length"):
        data.TextBatches(text_config(tmp_path, root, max_target_length=50_000), "train")


def test_batch_not_divisible_by_processes_is_an_error(tmp_path, corpus):
    root, _ = corpus
    with pytest.raises(data.DataError, match="per_device_batch_size"):
        data.TextBatches(text_config(tmp_path, root), "train", 2, 0, global_batch=3)


# --- record files (JSON Lines, Parquet) and token files -----------------------------------------


def _held_out_reference(seed, name, fraction):
    """The split rule, written out: sha256 of 'seed\\0name', first 8 bytes big-endian / 2**64."""
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def write_records(root: Path) -> dict[str, str | None]:
    """A JSON Lines file, a gzipped one, a `.json` one as datasets' to_json writes, a Parquet file
    (with a null and an empty text) and a plain text file. Returns {document name: text}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(1)

    def text():
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))

    root.mkdir(parents=True)
    docs = {}
    for name, opener in (("a.jsonl", open), ("b.jsonl.gz", gzip.open), ("c.json", open)):
        rows = [text() for _ in range(25)]
        with opener(root / name, "wt", encoding="utf-8") as f:
            for i, row in enumerate(rows):
                f.write(json.dumps({"id": i, "text": row, "meta": {"n": i}}) + "\n")
                if i == 3:
                    f.write("\n")  # a blank line is no record
        docs.update({f"{name}#{i}": row for i, row in enumerate(rows)})
    rows = [text() for _ in range(30)] + [None, ""]
    pq.write_table(pa.table({"id": list(range(32)), "text": rows}), root / "d.parquet",
                   row_group_size=7)
    docs.update({f"d.parquet#{i}": row for i, row in enumerate(rows)})
    (root / "e.txt").write_text("a plain text file is one document\n")
    docs["e.txt"] = "a plain text file is one document\n"
    return docs


def test_record_files_split_by_record_and_stream_every_text_once(tmp_path, caplog):
    docs = write_records(tmp_path / "corpus")
    cfg = text_config(tmp_path, tmp_path / "corpus", dataset_glob="*", eval_fraction=0.2)
    decoded = {}
    for split in ("train", "eval"):
        with caplog.at_level("INFO", logger="moebalance.data"):
            source = data.TextBatches(cfg, split)
        stream = np.load(next((tmp_path / "cache").glob(f"*/{split}-*.npy")))
        decoded[split] = [source.tokenizer.decode(d[:-1].tolist())
                          for d in documents_of(stream, source.eot_id)]
    for split in ("train", "eval"):  # every document (record or text file) by its own name
        want = [text for name, text in docs.items()
                if text and _held_out_reference(0, name, 0.2) == (split == "eval")]
        assert sorted(decoded[split]) == sorted(want)
    assert len(decoded["eval"]) >= 10 and len(decoded["train"]) >= 60
    empty = [name for name, text in docs.items() if not text]  # the null and the "" record
    skipped = sum(int(m.split()[1]) for m in caplog.messages if m.startswith("skipped"))
    # counted once, when its split is encoded (not again when the BPE reads the training split)
    assert skipped == len(empty) == 2


@pytest.mark.parametrize("name, content, message", [
    ("x.jsonl", '{"text": "ok"}\n{"body": "no text"}\n', "x.jsonl:2: the record has no 'text'"),
    ("x.jsonl", '{"text": "ok"}\n{"text": 7}\n', "x.jsonl:2: field 'text' holds int"),
    ("x.jsonl", '{"text": "ok"}\n{"text": "cut\n', "x.jsonl:2: not JSON"),
    ("x.jsonl", b'{"text": "caf\xe9"}\n', "x.jsonl:1: not UTF-8"),
    ("x.json", '[{"text": "an array"}]\n', "not one array"),
    ("x.jsonl", '["text"]\n', "must be a JSON object .* got list; a JSON Lines file holds"),
    ("x.json", '[\n  {"text": "pretty"}\n]\n', "x.json:1: not JSON .*not one array"),
])
def test_bad_records_name_the_file_and_line(tmp_path, name, content, message):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    (root / "other.jsonl").write_text('{"text": "fine"}\n')
    with pytest.raises(ValueError, match=message):
        data.TextBatches(text_config(tmp_path, root, dataset_glob="*.json*"), "train")


def test_parquet_without_a_text_column_names_the_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "corpus"
    root.mkdir()
    pq.write_table(pa.table({"content": [f"text {i}" for i in range(20)]}), root / "x.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), root / "y.parquet")
    with pytest.raises(ValueError, match="x.parquet: no column 'text' \\(columns: content\\)"):
        data.TextBatches(text_config(tmp_path, root, dataset_glob="x.parquet"), "train")
    with pytest.raises(ValueError, match="y.parquet: column 'text' is int64, not text"):
        data.TextBatches(text_config(tmp_path, root, dataset_glob="y.parquet"), "train")
    cfg = text_config(tmp_path, root, dataset_glob="x.parquet", dataset_text_field="content",
                      eval_fraction=0.5, max_target_length=1)
    assert data.TextBatches(cfg, "train").tokens_in_split >= 2


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
