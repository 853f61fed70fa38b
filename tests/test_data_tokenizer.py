"""The byte-level BPE, its cache and the token streams: moebalance.data.tokenizer."""

import numpy as np
import pytest
from tokenizers import Tokenizer

import moebalance.data.tokenizer as tokenizer_module
from data_fixtures import corpus, documents_of, text_config  # noqa: F401 (corpus: a fixture)
from moebalance import data


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

    monkeypatch.setattr(tokenizer_module, "train_tokenizer", fail)  # where load_tokenizer and
    monkeypatch.setattr(tokenizer_module, "encode_documents", fail)  # load_stream look them up
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


# --- errors ----------------------------------------------------------------------------------


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
