"""The tokenizer and the token streams (stages 3 and 4 of the pipeline), cached on disk:

    3. tokenizer   a byte-level BPE trained on the training split only (or `tokenizer_path`)
    4. streams     per split, every document's ids followed by <|endoftext|>, concatenated (int32)

A document longer than PIECE_CHARS characters is trained on and encoded in `pieces`, which bounds
the memory of both (a 50 MB one-line document needed 4.8 GB, now 0.8 GB: docs/data.md).

On the embedded default corpus (1,758 files, 31.5 MB) with 8,192 tokens, building
everything takes 25-35 s on two cores (BPE training 9-15 s, encoding 13-19 s; 8.5M tokens), so
the BPE is trained on the whole training split, without a cap. Later runs load the cache in
~1.4 s for both splits (0.7-1 s of it reading and checking the snapshot, once per process; 0.3 s
after that; 2026-12-05, on a loaded machine). Several processes may build the same cache at once:
every file is written to a temporary name and renamed into place, and all of them write the same
bytes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moebalance.atomic import write_atomic
from moebalance.config import Config
from moebalance.data.corpus import Document, split_texts
from moebalance.data.errors import DataError, checked_path
from moebalance.runtime import user_cache_root

log = logging.getLogger(__name__)

EOT = "<|endoftext|>"
CACHE_VERSION = 1  # bump when the tokenizer recipe or the stream layout changes
ENCODE_CHUNK = 256  # pieces per encode call: bounds the memory of the Encoding objects
PIECE_CHARS = 1_000_000  # longer documents are trained on and encoded in pieces of at most this
ENCODE_CHARS = 4 * PIECE_CHARS  # characters per encode call (at least one piece)
# in a reversed text, a space then a non-space: a word's end, the pre-tokenizer's \s (Unicode
# White_Space, which unlike Python's \s leaves out \x1c-\x1f)
BOUNDARY = re.compile(r"[^\S\x1c-\x1f][\S\x1c-\x1f]")


# ---------------------------------------------------------------------------------------------
# Long documents


def pieces(text: str) -> list[str]:
    """`text` in pieces of at most PIECE_CHARS characters that concatenate to it: the memory of
    pre-tokenization and BPE grows with the length of what is encoded at once (~90 bytes per
    character). A text that fits is its own piece. Otherwise each piece ends at the last word end
    (a non-space character followed by a space, a boundary of the byte-level pre-tokenizer, so the
    pieces encode as the whole text does) in the second half of its limit, or at the limit when
    there is none."""
    if len(text) <= PIECE_CHARS:
        return [text]
    out, start = [], 0
    while len(text) - start > PIECE_CHARS:
        window = text[start: start + PIECE_CHARS + 1][::-1]  # [k]: text[start + PIECE_CHARS - k]
        found = BOUNDARY.search(window, 0, PIECE_CHARS // 2 + 1)
        end = start + PIECE_CHARS - (found.start() if found else 0)
        out.append(text[start:end])
        start = end
    return out + [text[start:]]


# ---------------------------------------------------------------------------------------------
# 3. Tokenizer


def cache_root(cfg: Config) -> Path:
    """`data_cache_dir`, else $XDG_CACHE_HOME/moebalance, else ~/.cache/moebalance."""
    if cfg.data_cache_dir:
        return Path(cfg.data_cache_dir).expanduser()
    return user_cache_root()


def _digest(value) -> str:
    """A short stable hex key of a JSON-serialisable value."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:20]


def fingerprint(docs: list[Document], cfg: Config) -> list:
    """What identifies one split's documents for caching: sorted (name, *version) of the
    documents (`Document.version`: a file's size and mtime_ns, the embedded default corpus's
    digest for its members), and with record files what splits and reads their records."""
    files = sorted((d.name, *d.version()) for d in docs)
    if any(d.records for d in docs):
        return [files, cfg.seed, cfg.eval_fraction, cfg.dataset_text_field]
    return files


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of `vocab_size` entries trained on `texts`: every byte is in the initial
    alphabet (any text is encodable, nothing is unknown), <|endoftext|> is id 0, and the
    pre-tokenizer adds no prefix space, so decode(encode(text)) == text. Long texts are read in
    `pieces`."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise DataError(f"config key `tokenizer_vocab_size`: a byte-level BPE needs at least "
                        f"{len(alphabet) + 1} entries (256 bytes + {EOT}), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator((p for text in texts for p in pieces(text)), trainer)
    return tokenizer


def read_tokenizer(path: Path, error: str, kind: type[ValueError] = ValueError) -> Tokenizer:
    """The tokenizer in file `path`; a file that is not one raises `kind(error)`, with the text
    `{reason}` in `error` replaced by the first line of what HF tokenizers said (it raises a bare
    Exception for any file it cannot read)."""
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:
        reason = (str(err) or type(err).__name__).splitlines()[0]
        raise kind(error.replace("{reason}", reason)) from None


def load_tokenizer(cfg: Config, train_docs: list[Document]) -> tuple[Tokenizer, Path]:
    """(tokenizer, its cache directory). With `tokenizer_path` that file (the directory is keyed
    by its content); otherwise the BPE of `train_tokenizer` on `train_docs`, cached in a directory
    keyed by the training files (`fingerprint`), `tokenizer_vocab_size` and the
    `tokenizers` version, and trained only when absent. Literal '<|endoftext|>' in a text is
    encoded as text (`encode_special_tokens`), so only the pipeline places end-of-text ids."""
    if cfg.tokenizer_path:
        source = checked_path("tokenizer_path", cfg.tokenizer_path, "file", "give a "
                              "tokenizer.json or '' to train a byte-level BPE", empty=False)
        tokenizer = read_tokenizer(
            source, f"config key `tokenizer_path`: cannot load {source} as a tokenizer "
            "({reason}); give a tokenizer.json as HF tokenizers' Tokenizer.save writes it, or '' "
            "to train a byte-level BPE", DataError)
        content = hashlib.sha256(source.read_bytes()).hexdigest()[:20]
        directory = cache_root(cfg) / f"tokenizer-{content}"
    else:
        key = [CACHE_VERSION, fingerprint(train_docs, cfg), cfg.tokenizer_vocab_size,
               tokenizers.__version__]
        directory = cache_root(cfg) / f"bpe-{_digest(key)}"
        path = directory / "tokenizer.json"
        if not path.exists():
            size = sum(d.size for d in train_docs) / 1e6
            log.info("training a %d-token byte-level BPE on %d files (%.1f MB)",
                     cfg.tokenizer_vocab_size, len(train_docs), size)
            trained = train_tokenizer(split_texts(train_docs, "train", cfg, note=False),
                                      cfg.tokenizer_vocab_size)
            write_atomic(path, lambda f: f.write(trained.to_str().encode()))
        tokenizer = Tokenizer.from_file(str(path))
    if tokenizer.get_vocab_size() > cfg.vocab_size:
        raise DataError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens but the model's "
                        f"vocab_size is {cfg.vocab_size}; lower `tokenizer_vocab_size` (or pick "
                        "another `tokenizer_path`) or raise `vocab_size`")
    if tokenizer.token_to_id(EOT) is None:
        raise DataError(f"config key `tokenizer_path`: the tokenizer has no {EOT} token; add it "
                        "as a special token, or use '' to train a byte-level BPE")
    tokenizer.encode_special_tokens = True
    return tokenizer, directory


# ---------------------------------------------------------------------------------------------
# 4. Token streams


def encode_documents(tokenizer: Tokenizer, texts: Iterable[str], eot_id: int) -> np.ndarray:
    """[N] int32: each text's ids (no added special tokens) followed by `eot_id`, concatenated; a
    long text is encoded in `pieces`, their ids concatenated. Only the ids are ever all in
    memory: the texts are read and encoded a batch at a time (`_encode_batches`)."""
    ids = [np.zeros(0, np.int32)]
    for batch in _encode_batches(texts):
        encodings = tokenizer.encode_batch_fast([p for p, _ in batch], add_special_tokens=False)
        for (_, last), encoding in zip(batch, encodings):
            ids.append(np.asarray(encoding.ids, np.int32))
            if last:
                ids.append(np.array([eot_id], np.int32))
    return np.concatenate(ids)


def _encode_batches(texts: Iterable[str]) -> Iterator[list[tuple[str, bool]]]:
    """The `pieces` of the texts as lists of (piece, whether it ends its text), each of at most
    ENCODE_CHUNK pieces and (unless one piece) ENCODE_CHARS characters: the memory of an encode
    call."""
    batch, chars = [], 0
    for text in texts:
        parts = pieces(text)
        for i, part in enumerate(parts):
            if batch and (len(batch) == ENCODE_CHUNK or chars + len(part) > ENCODE_CHARS):
                yield batch
                batch, chars = [], 0
            batch.append((part, i == len(parts) - 1))
            chars += len(part)
    if batch:
        yield batch


def load_stream(cfg: Config, tokenizer: Tokenizer, directory: Path, docs: list[Document],
                split: str) -> np.ndarray:
    """[N] int32 token stream of `docs` (see `encode_documents`), cached as
    `directory/{split}-{key}.npy`, the key covering the documents (`fingerprint`)."""
    path = directory / f"{split}-{_digest([CACHE_VERSION, split, fingerprint(docs, cfg)])}.npy"
    if not path.exists():
        log.info("encoding the %s split: %d files", split, len(docs))
        stream = encode_documents(tokenizer, split_texts(docs, split, cfg),
                                  tokenizer.token_to_id(EOT))
        write_atomic(path, lambda f: np.save(f, stream))
    return np.load(path, mmap_mode="r")
