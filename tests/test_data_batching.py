"""Packed rows and the batch sources: moebalance.data.batching."""

import numpy as np
import pytest

from data_fixtures import SEQ, corpus, text_config  # noqa: F401 (corpus: a fixture)
from moebalance import data


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


def test_corpus_too_small_for_the_sequence_is_an_error(tmp_path, corpus):
    root, _ = corpus
    with pytest.raises(data.DataError, match="too small.*max_target_length"):
        data.TextBatches(text_config(tmp_path, root, max_target_length=50_000), "train")


def test_batch_not_divisible_by_processes_is_an_error(tmp_path, corpus):
    root, _ = corpus
    with pytest.raises(data.DataError, match="per_device_batch_size"):
        data.TextBatches(text_config(tmp_path, root), "train", 2, 0, global_batch=3)
