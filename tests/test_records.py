"""Record files (JSON Lines, Parquet) as documents: moebalance.data.records, and their records
split one by one through the pipeline."""

import gzip
import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest

from data_fixtures import WORDS, documents_of, needs_permissions, text_config
from moebalance import data


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
    ("x.jsonl", '{"text": "ok"}\n{"text": "cut off mid-rec', "x.jsonl:2: not JSON"),
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
    with pytest.raises(data.DataError, match=message):
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


def test_truncated_or_corrupt_record_files_are_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "corpus"
    root.mkdir()
    lines = "".join(json.dumps({"text": f"record {i} " * 20}) + "\n" for i in range(3000))
    whole = gzip.compress(lines.encode())
    (root / "x.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(data.DataError, match=r"x.jsonl.gz: unreadable after line \d+ .*truncated"):
        data.TextBatches(text_config(tmp_path, root, dataset_glob="x.jsonl.gz"), "train")
    (root / "y.jsonl.gz").write_bytes(b"not gzip\n")
    with pytest.raises(data.DataError, match="y.jsonl.gz: unreadable after line 0 .*corrupt"):
        data.TextBatches(text_config(tmp_path, root, dataset_glob="y.jsonl.gz"), "train")
    pq.write_table(pa.table({"text": [f"row {i} " * 20 for i in range(3000)]}), root / "z.parquet",
                   row_group_size=1000)
    broken = bytearray((root / "z.parquet").read_bytes())
    broken[len(broken) // 2: len(broken) // 2 + 500] = bytes(500)
    (root / "z.parquet").write_bytes(bytes(broken))
    with pytest.raises(data.DataError, match=r"z.parquet: unreadable at row \d+ .*write it again"):
        data.TextBatches(text_config(tmp_path, root, dataset_glob="z.parquet"), "train")


@needs_permissions
def test_unreadable_record_file_is_an_error(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.jsonl").write_text('{"text": "fine"}\n')
    (root / "b.jsonl").write_text('{"text": "fine too"}\n')
    (root / "b.jsonl").chmod(0)
    with pytest.raises(data.DataError, match="dataset_path.*cannot read .*b.jsonl"):
        data.TextBatches(text_config(tmp_path, root, dataset_glob="*.jsonl"), "train")
