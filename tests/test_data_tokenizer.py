"""The byte-level BPE, its cache and the token streams: moebalance.data.tokenizer."""

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import moebalance.data.tokenizer as tokenizer_module
from data_fixtures import WORDS, corpus, documents_of, text_config  # noqa: F401 (corpus)
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


def test_long_documents_are_trained_on_and_encoded_in_pieces(tmp_path, corpus, monkeypatch):
    root, texts = corpus
    monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", 64)
    texts["long/words.py"] = " ".join(WORDS * 10)  # cut at word ends: encodes as one piece would
    texts["long/run.py"] = "x" * 150 + " then words"  # no word end in reach: cut at the limit
    (root / "long").mkdir()
    for name in ("long/words.py", "long/run.py"):
        (root / name).write_text(texts[name])
        parts = tokenizer_module.pieces(texts[name])
        assert len(parts) > 2 and "".join(parts) == texts[name]
        assert all(0 < len(part) <= 64 for part in parts)
    cfg = text_config(tmp_path, root)
    encoded = {}
    for split in ("train", "eval"):
        source = data.TextBatches(cfg, split)
        stream = np.load(next((tmp_path / "cache").glob(f"*/{split}-*.npy")))
        for ids in documents_of(stream, source.eot_id):
            encoded[source.tokenizer.decode(ids[:-1].tolist())] = ids[:-1].tolist()
    assert sorted(encoded) == sorted(texts.values())  # every document, decoded back whole
    tok = source.tokenizer
    for name, text in texts.items():  # as in one piece (as before), unless cut inside a word
        assert name == "long/run.py" or encoded[text] == tok.encode(text).ids


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


@pytest.mark.parametrize("content", [b"just some text\n", b'{"model": "not a tokenizer"}',
                                     b"[1, 2, 3]", b"\xff\xfe binary"])
def test_tokenizer_path_that_is_not_a_tokenizer_is_an_error(tmp_path, corpus, content):
    root, _ = corpus
    (tmp_path / "tok.json").write_bytes(content)
    cfg = text_config(tmp_path, root, tokenizer_path=str(tmp_path / "tok.json"))
    with pytest.raises(data.DataError, match="tokenizer_path.*cannot load .*tok.json as a "
                                             "tokenizer .*Tokenizer.save") as err:
        data.TextBatches(cfg, "train")
    assert "\n" not in str(err.value)


def test_tokenizer_without_endoftext_is_an_error(tmp_path, corpus):
    root, _ = corpus
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["a b c"], trainers.BpeTrainer(
        vocab_size=270, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tok.json"))
    cfg = text_config(tmp_path, root, tokenizer_path=str(tmp_path / "tok.json"))
    with pytest.raises(data.DataError, match="tokenizer_path.*no <\\|endoftext\\|> token"):
        data.TextBatches(cfg, "train")


@pytest.mark.parametrize("make, problem", [
    (lambda p: None, "does not exist"),
    (lambda p: p.mkdir(), "is a directory, not a file"),
    (lambda p: p.write_bytes(b""), "is empty"),
    (lambda p: p.symlink_to(p.parent / "gone.json"), "is a link to .*gone.json, which does not "
                                                      "exist"),
])
def test_tokenizer_path_that_cannot_be_read_says_why(tmp_path, corpus, make, problem):
    """Checked before HF tokenizers parses it: the problem with the path itself, not a parser's
    complaint."""
    root, _ = corpus
    make(tmp_path / "tok.json")
    cfg = text_config(tmp_path, root, tokenizer_path=str(tmp_path / "tok.json"))
    with pytest.raises(data.DataError, match=f"^config key `tokenizer_path`: '.*tok.json' "
                                             f"{problem}; give a tokenizer.json or '' to train"):
        data.TextBatches(cfg, "train")
