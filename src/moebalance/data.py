"""Text data: a corpus of local files, a cached byte-level BPE, packed rows, and seeded batches.

The pipeline, each stage cached on disk under `data_cache_dir` so a second run starts at once:
    1. corpus      every non-empty file matching `dataset_glob` under `dataset_path` (default: the
                   running interpreter's standard library sources): a UTF-8 text file is one
                   document; a JSON Lines or Parquet file holds one document per record, in its
                   `dataset_text_field` (moebalance.records: formats and the bad-record rule)
    2. split       each document goes to the training or the held-out split by a stable hash of
                   its name (a file's path, or path#row for a record) and the seed, so the split
                   never depends on listing order
    3. tokenizer   a byte-level BPE trained on the training split only (or `tokenizer_path`)
    4. streams     per split, every document's ids followed by <|endoftext|>, concatenated (int32)
    5. rows        stream[r*S : r*S + S + 1]: consecutive rows share one token, so every token is
                   the target of exactly one input
    6. batches     rows in a seeded order reshuffled every epoch (Grain), each split its own.
                   The batch of a step is a function of (config, step) alone, which makes
                   resuming bit-exact.

On the default corpus (CPython 3.11: 1,758 usable files, 31 MB) with 8,192 tokens, building
everything takes 25-35 s on two cores (BPE training 9-15 s, encoding 13-19 s; 8.5M tokens), so
the BPE is trained on the whole training split, without a cap. Later runs load the cache in
~1.5 s for both splits (listing and reading the corpus to check it; ~0.7 s once the process has
read each file). Several processes may build the same cache at once:
every file is written to a temporary name and renamed into place, and all of them write the same
bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import logging
import os
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

import grain
import jax
import numpy as np
import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moebalance.atomic import write_atomic
from moebalance.config import Config
from moebalance.records import is_record_file, read_records
from moebalance.runtime import user_cache_root

log = logging.getLogger(__name__)

EOT = "<|endoftext|>"
CACHE_VERSION = 1  # bump when the tokenizer recipe or the stream layout changes
EXCLUDED_DIRS = ("site-packages", "dist-packages")  # third-party code inside the stdlib tree
ENCODE_CHUNK = 256  # documents per encode call: bounds the memory of the Encoding objects
TOKEN_SUFFIXES = (".bin", ".npy")
TOKEN_DTYPES = ("uint16", "uint32", "int32")
HELD_OUT_STEMS = ("val", "valid", "validation", "eval", "test")


class DataError(ValueError):
    """Text data that cannot be used; the message names the config key and the fix."""


# ---------------------------------------------------------------------------------------------
# 1. Corpus


@dataclasses.dataclass(frozen=True)
class Document:
    """One corpus file: a text file (one document) or a record file (one per record). `name` is
    its path relative to its `dataset_path` entry ('/'-separated; the file name for a file given
    directly): the identity used by the split and the cache keys."""

    name: str
    path: Path

    @property
    def records(self) -> bool:
        return is_record_file(self.path)

    def text(self) -> str:
        return self.path.read_bytes().decode("utf-8")


def _read_utf8(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None


def _candidates(cfg: Config) -> Iterator[tuple[str, Path]]:
    """(name, path) of every file matching the config, valid or not, in no particular order."""
    if not cfg.dataset_path:  # walked without descending into third-party code: rglob would list
        root = sysconfig.get_paths()["stdlib"]  # (and filter) 10k+ files of site-packages
        for folder, subdirs, files in os.walk(root):
            subdirs[:] = sorted(d for d in subdirs if d not in EXCLUDED_DIRS)
            for name in files:
                path = Path(folder, name)
                rel = path.relative_to(root)
                if rel.match(cfg.dataset_glob) and path.is_file():
                    yield rel.as_posix(), path
        return
    for entry in sorted(cfg.dataset_path):
        root = Path(entry).expanduser()
        if root.is_file():
            yield root.name, root
        elif root.is_dir():
            for path in root.rglob(cfg.dataset_glob):
                if path.is_file():
                    yield path.relative_to(root).as_posix(), path
        else:
            raise DataError(f"config key `dataset_path`: {entry!r} does not exist; give existing "
                            "files or directories (or [] for the Python standard library)")


def corpus_documents(cfg: Config) -> list[Document]:
    """The files of the corpus, sorted by path: files named by `dataset_path` (directories
    searched recursively for `dataset_glob`), without empty files and text files that are not
    UTF-8. A file reached twice (nested entries, links) counts once."""
    docs: dict[Path, Document] = {}
    for name, path in sorted(_candidates(cfg), key=lambda c: (c[1], c[0])):
        resolved = path.resolve()
        usable = path.stat().st_size > 0 if is_record_file(path) else _is_text(resolved)
        if resolved not in docs and usable:
            docs[resolved] = Document(name, path)
    if not docs:
        where = cfg.dataset_path or [sysconfig.get_paths()["stdlib"]]
        raise DataError(f"config keys `dataset_path`/`dataset_glob`: no non-empty UTF-8 file "
                        f"matches {cfg.dataset_glob!r} in {where}; point dataset_path at text "
                        "files or directories, or change dataset_glob (e.g. '*.txt')")
    return sorted(docs.values(), key=lambda d: d.path)


def _is_text(path: Path) -> bool:
    """Non-empty UTF-8; read once per process and file version (a run lists the corpus for both
    splits, an experiment for both runs)."""
    stat = path.stat()
    return _is_text_version(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=None)
def _is_text_version(path: Path, size: int, mtime_ns: int) -> bool:
    return bool(_read_utf8(path))


def corpus_files(cfg: Config) -> list[Path]:
    """Paths of `corpus_documents(cfg)`, sorted."""
    return [doc.path for doc in corpus_documents(cfg)]


# ---------------------------------------------------------------------------------------------
# 2. Train / held-out split


def _unit_hash(*parts) -> float:
    """A stable hash of `parts` (sha256, not Python's salted hash) as a float in [0, 1)."""
    digest = hashlib.sha256("\0".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_documents(docs: list[Document], eval_fraction: float, seed: int
                    ) -> tuple[list[Document], list[Document]]:
    """(train, held_out) files, each sorted by path. A text file is held out iff
    sha256(seed, name) / 2**64 < eval_fraction, so the split depends on neither the listing order
    nor the other documents. Record files are on both sides: their records are split one by one
    by the same rule (`held_out`). In a corpus of text files only, each side gets at least one
    file: if one side comes out empty, the file whose hash is nearest the threshold moves
    across."""
    records = [d for d in docs if d.records]
    files = [d for d in docs if not d.records]
    if len(files) < 2 and not records:
        raise DataError(f"config key `dataset_path`: the corpus has {len(docs)} document(s); a "
                        "training and a held-out split need at least 2 files (or records)")
    ranked = sorted(files, key=lambda d: (_unit_hash(seed, d.name), d.name, d.path))
    held = sum(held_out(seed, d.name, eval_fraction) for d in ranked)
    if not records:
        held = min(max(held, 1), len(ranked) - 1)

    def by_path(part: list[Document]) -> list[Document]:
        return sorted(part, key=lambda d: d.path)

    return by_path(ranked[held:] + records), by_path(ranked[:held] + records)


def held_out(seed: int, name: str, eval_fraction: float) -> bool:
    """Whether the document called `name` belongs to the held-out split."""
    return _unit_hash(seed, name) < eval_fraction


def split_texts(docs: list[Document], split: str, cfg: Config, *,
                note: bool = True) -> Iterator[str]:
    """The texts of one split's documents (`split_documents`), in path then record order, read
    lazily; a record file yields its records of this split, each named `path#row`. Records without
    text are skipped and counted in one progress note (`note`: False for a second pass over the
    same split, e.g. the tokenizer's, so that the count is given once)."""
    empty = 0
    for doc in docs:
        if not doc.records:
            yield doc.text()
            continue
        for row, text in read_records(doc.path, cfg.dataset_text_field):
            if held_out(cfg.seed, f"{doc.name}#{row}", cfg.eval_fraction) != (split == "eval"):
                continue
            if text is None:
                empty += 1
                continue
            yield text
    if empty and note:
        log.info("skipped %d %s-split records with no text (null or empty %r)", empty, split,
                 cfg.dataset_text_field)


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


def _fingerprint(docs: list[Document], cfg: Config) -> list:
    """What identifies one split's documents for caching: sorted (name, size, mtime_ns) of the
    files, and with record files what splits and reads their records."""
    stats = [(d.name, d.path.stat()) for d in docs]
    files = sorted((name, stat.st_size, stat.st_mtime_ns) for name, stat in stats)
    if any(d.records for d in docs):
        return [files, cfg.seed, cfg.eval_fraction, cfg.dataset_text_field]
    return files


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of `vocab_size` entries trained on `texts`: every byte is in the initial
    alphabet (any text is encodable, nothing is unknown), <|endoftext|> is id 0, and the
    pre-tokenizer adds no prefix space, so decode(encode(text)) == text."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise DataError(f"config key `tokenizer_vocab_size`: a byte-level BPE needs at least "
                        f"{len(alphabet) + 1} entries (256 bytes + {EOT}), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def load_tokenizer(cfg: Config, train_docs: list[Document]) -> tuple[Tokenizer, Path]:
    """(tokenizer, its cache directory). With `tokenizer_path` that file (the directory is keyed
    by its content); otherwise the BPE of `train_tokenizer` on `train_docs`, cached in a directory
    keyed by the training files (names, sizes, mtimes), `tokenizer_vocab_size` and the
    `tokenizers` version, and trained only when absent. Literal '<|endoftext|>' in a text is
    encoded as text (`encode_special_tokens`), so only the pipeline places end-of-text ids."""
    if cfg.tokenizer_path:
        source = Path(cfg.tokenizer_path).expanduser()
        if not source.is_file():
            raise DataError(f"config key `tokenizer_path`: {cfg.tokenizer_path!r} is not a file; "
                            "give a tokenizer.json or '' to train a byte-level BPE")
        tokenizer = Tokenizer.from_file(str(source))
        content = hashlib.sha256(source.read_bytes()).hexdigest()[:20]
        directory = cache_root(cfg) / f"tokenizer-{content}"
    else:
        key = [CACHE_VERSION, _fingerprint(train_docs, cfg), cfg.tokenizer_vocab_size,
               tokenizers.__version__]
        directory = cache_root(cfg) / f"bpe-{_digest(key)}"
        path = directory / "tokenizer.json"
        if not path.exists():
            size = sum(d.path.stat().st_size for d in train_docs) / 1e6
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
    """[N] int32: each text's ids (no added special tokens) followed by `eot_id`, concatenated;
    `texts` is read ENCODE_CHUNK at a time, so only the ids are ever all in memory."""
    pieces = [np.zeros(0, np.int32)]
    texts = iter(texts)
    while chunk := list(itertools.islice(texts, ENCODE_CHUNK)):
        for encoding in tokenizer.encode_batch_fast(chunk, add_special_tokens=False):
            pieces += [np.asarray(encoding.ids, np.int32), np.array([eot_id], np.int32)]
    return np.concatenate(pieces)


def load_stream(cfg: Config, tokenizer: Tokenizer, directory: Path, docs: list[Document],
                split: str) -> np.ndarray:
    """[N] int32 token stream of `docs` (see `encode_documents`), cached as
    `directory/{split}-{key}.npy`, the key covering the documents (names, sizes, mtimes)."""
    path = directory / f"{split}-{_digest([CACHE_VERSION, split, _fingerprint(docs, cfg)])}.npy"
    if not path.exists():
        log.info("encoding the %s split: %d files", split, len(docs))
        stream = encode_documents(tokenizer, split_texts(docs, split, cfg),
                                  tokenizer.token_to_id(EOT))
        write_atomic(path, lambda f: np.save(f, stream))
    return np.load(path, mmap_mode="r")


# ---------------------------------------------------------------------------------------------
# 4b. Pre-tokenized token files (dataset_type: tokens)


def token_files(cfg: Config) -> tuple[Path, Path | None]:
    """(training file, held-out file or None) named by `dataset_path`: token files (.bin/.npy),
    or directories holding them. A file whose stem is one of HELD_OUT_STEMS (nanoGPT's val.bin)
    is the held-out split; exactly one other file is the training split."""
    found = []
    for entry in cfg.dataset_path:
        root = Path(entry).expanduser()
        if root.is_dir():
            found += sorted(p for p in root.iterdir() if p.suffix in TOKEN_SUFFIXES)
        elif root.is_file() and root.suffix in TOKEN_SUFFIXES:
            found.append(root)
        else:
            raise DataError(f"config key `dataset_path`: {entry!r} is not a token file "
                            f"({'/'.join(TOKEN_SUFFIXES)}) or a directory holding them")
    held = [p for p in found if p.stem in HELD_OUT_STEMS]
    train = [p for p in found if p.stem not in HELD_OUT_STEMS]
    if len(train) != 1 or len(held) > 1:
        raise DataError(f"config key `dataset_path`: dataset_type 'tokens' needs one training "
                        f"token file and at most one held-out file (stem in {HELD_OUT_STEMS}), "
                        f"found {[str(p) for p in found]}")
    return train[0], (held[0] if held else None)


def read_token_file(path: Path) -> tuple[np.ndarray, int]:
    """(memory-mapped [N] ids, end-of-text id) of a token file. Its sidecar `<file>.json`, or
    `meta.json` beside it, gives {"dtype": one of TOKEN_DTYPES, "eot_id": the id that ends every
    document (the document boundaries)}; a .npy file's own header must agree on the dtype."""
    sidecar = next((p for p in (path.with_name(path.name + ".json"), path.with_name("meta.json"))
                    if p.is_file()), None)
    if sidecar is None:
        raise DataError(f"{path} has no sidecar: write {path.name}.json (or meta.json beside it) "
                        'holding {"dtype": "uint16", "eot_id": 50256} with your dtype and '
                        "end-of-text id")
    meta = json.loads(sidecar.read_text())
    if meta.get("dtype") not in TOKEN_DTYPES or not isinstance(meta.get("eot_id"), int):
        raise DataError(f"{sidecar}: needs \"dtype\" (one of {TOKEN_DTYPES}) and an integer "
                        f"\"eot_id\", got {meta}")
    if path.suffix == ".npy":
        ids = np.load(path, mmap_mode="r")
        if ids.dtype != np.dtype(meta["dtype"]) or ids.ndim != 1:
            raise DataError(f"{path} holds {ids.dtype} of shape {ids.shape}; its sidecar "
                            f"{sidecar.name} says 1-D {meta['dtype']}")
    else:
        ids = np.memmap(path, dtype=meta["dtype"], mode="r")
    return ids, meta["eot_id"]


def _token_stream(cfg: Config, split: str) -> tuple[np.ndarray, int]:
    """[N] ids of one split of the token files, and the end-of-text id. Without a held-out file,
    the held-out split is the tail of the training file: its last `eval_fraction` of the tokens,
    from the first document boundary there on (whole documents)."""
    train_file, held_file = token_files(cfg)
    if held_file is not None:
        return read_token_file(train_file if split == "train" else held_file)
    ids, eot_id = read_token_file(train_file)
    start = int(len(ids) * (1 - cfg.eval_fraction))
    ends = np.flatnonzero(ids[start:] == eot_id)
    cut = start + int(ends[0]) + 1 if len(ends) else len(ids)
    return (ids[:cut] if split == "train" else ids[cut:]), eot_id


def _check_ids(stream: np.ndarray, split: str, cfg: Config) -> None:
    if stream.size and int(stream.max()) >= cfg.vocab_size:
        raise DataError(f"the {split} stream has token ids >= vocab_size={cfg.vocab_size} (up to "
                        f"{int(stream.max())}): the tokenizer does not fit the model; lower "
                        "`tokenizer_vocab_size` / change `tokenizer_path` or raise `vocab_size`")


# ---------------------------------------------------------------------------------------------
# 5. Packing


def num_rows(stream_len: int, seq_len: int) -> int:
    """Rows of S + 1 tokens, consecutive rows overlapping by one token, that fit the stream."""
    return max(stream_len - 1, 0) // seq_len


def pack_row(stream: np.ndarray, row: int, seq_len: int, eot_id: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row `row` of the stream as (tokens [S+1] int32, mask [S] bool, segment_ids [S] int32).

    tokens = stream[row*S : row*S + S + 1]; input t = tokens[t], target t = tokens[t + 1].
    segment_ids[t]: how many end-of-text tokens precede input t in the row (0 for the first,
    possibly continued, document; the token after end-of-text starts the next segment).
    mask[t]: the target is in the same document as the input, i.e. input t is not end-of-text
    (the end-of-text token itself is predicted; nothing is predicted across documents)."""
    tokens = np.asarray(stream[row * seq_len: row * seq_len + seq_len + 1], np.int32)
    is_eot = tokens[:-1] == eot_id  # [S]
    segment_ids = np.concatenate([[0], np.cumsum(is_eot[:-1])]).astype(np.int32)
    return tokens, ~is_eot, segment_ids


# ---------------------------------------------------------------------------------------------
# 6. Batches


def process_share(cfg: Config, num_processes: int | None, process_index: int | None,
                  global_batch: int | None) -> tuple[int, int, int]:
    """-> (global_batch, local_batch, first global row of this process). num_processes /
    process_index default to jax.process_count() / jax.process_index(); global_batch to
    per_device_batch_size * jax.device_count()."""
    num_processes = jax.process_count() if num_processes is None else num_processes
    process_index = jax.process_index() if process_index is None else process_index
    if global_batch is None:
        global_batch = cfg.per_device_batch_size * jax.device_count()
    if global_batch % num_processes:
        raise DataError(f"config key `per_device_batch_size`: the global batch {global_batch} "
                        f"does not split evenly over {num_processes} processes")
    if not 0 <= process_index < num_processes:
        raise ValueError(f"process_index {process_index} not in [0, {num_processes})")
    local_batch = global_batch // num_processes
    return global_batch, local_batch, process_index * local_batch


class TextBatches:
    """Batches of packed rows of one split, for this process.

    batch(step) -> (tokens [A, B_local, S+1] int32, mask [A, B_local, S] bool,
                    segment_ids [A, B_local, S] int32), NumPy arrays, where A is
    `gradient_accumulation_steps`, B_local = global_batch // num_processes, and global row j of
    micro-batch a of step s is element (s*A + a)*global_batch + j of the row sequence; this
    process holds global rows [process_index*B_local, (process_index + 1)*B_local).

    Row sequence: the split's rows in a seeded order (Grain's index shuffle, seed `cfg.seed` for
    'train', `cfg.seed + 1` for 'eval'), reshuffled each epoch; every row once per epoch, so the
    first num_rows rows of 'eval' are the whole held-out split and a batch is rows from all over
    it (a held-out split smaller than one batch repeats rows within the batch).

    The split's token stream comes from the text pipeline (dataset_type 'text') or from token
    files ('tokens'; `tokenizer` is then `tokenizer_path`'s, or None).

    Attributes: split, tokenizer, eot_id, num_rows, tokens_in_split, global_batch, local_batch.
    """

    def __init__(self, cfg: Config, split: str = "train", num_processes: int | None = None,
                 process_index: int | None = None, global_batch: int | None = None):
        """num_processes, process_index, global_batch: see `process_share`."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        self.global_batch, self.local_batch, self._first = process_share(
            cfg, num_processes, process_index, global_batch)
        if cfg.dataset_type == "tokens":
            stream, self.eot_id = _token_stream(cfg, split)
            self.tokenizer = load_tokenizer(cfg, [])[0] if cfg.tokenizer_path else None
            if self.tokenizer and self.tokenizer.token_to_id(EOT) != self.eot_id:
                raise DataError(f"config key `tokenizer_path`: the tokenizer's {EOT} is id "
                                f"{self.tokenizer.token_to_id(EOT)}, the token files end their "
                                f"documents with eot_id {self.eot_id}; give the tokenizer the "
                                "files were made with")
        else:
            train_docs, eval_docs = split_documents(corpus_documents(cfg), cfg.eval_fraction,
                                                    cfg.seed)
            self.tokenizer, directory = load_tokenizer(cfg, train_docs)
            self.eot_id = self.tokenizer.token_to_id(EOT)
            docs = train_docs if split == "train" else eval_docs
            stream = load_stream(cfg, self.tokenizer, directory, docs, split)
        _check_ids(stream, split, cfg)
        self._stream = stream
        seq_len = cfg.max_target_length
        self.split, self.tokens_in_split = split, len(stream)
        self.num_rows = num_rows(len(stream), seq_len)
        if self.num_rows == 0:
            raise DataError(f"config key `max_target_length`: the corpus is too small; its {split} "
                            f"split has {len(stream)} tokens, fewer than max_target_length + 1 = "
                            f"{seq_len + 1}; add text to dataset_path, lower max_target_length or "
                            "(for the eval split) raise eval_fraction")
        # Grain takes seeds in [0, 2**32); the held-out split has its own order
        rows = grain.MapDataset.range(self.num_rows).shuffle(
            seed=(cfg.seed + (split == "eval")) % 2**32)
        self._rows = rows.repeat().map(lambda r: pack_row(stream, r, seq_len, self.eot_id))
        self._accum = cfg.gradient_accumulation_steps

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This process's share of the batch of optimizer step `step` (see the class docstring)."""
        a, b = self._accum, self.local_batch
        rows = [self._rows[(step * a + micro) * self.global_batch + self._first + j]
                for micro in range(a) for j in range(b)]
        tokens, mask, segment_ids = (np.stack([row[i] for row in rows]).reshape(a, b, -1)
                                     for i in range(3))
        return tokens, mask, segment_ids  # [A, B_local, S+1], [A, B_local, S], [A, B_local, S]

    def token_counts(self, vocab_size: int) -> np.ndarray:
        """[V] int64: how often each token id occurs in this split (for balanced hash tables)."""
        return np.bincount(self._stream, minlength=vocab_size)


class SyntheticBatches:
    """Seeded uniform random token ids with the interface of TextBatches: one document per row,
    every target counted. The 'eval' split is drawn from another seed (cfg.seed + 1)."""

    def __init__(self, cfg: Config, split: str = "train", num_processes: int | None = None,
                 process_index: int | None = None, global_batch: int | None = None):
        self.global_batch, self.local_batch, self._first = process_share(
            cfg, num_processes, process_index, global_batch)
        self._cfg, self._seed = cfg, cfg.seed + (split == "eval")
        self.split, self.num_rows, self.tokenizer = split, None, None

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        c = self._cfg
        a, s = c.gradient_accumulation_steps, c.max_target_length
        rng = np.random.default_rng([self._seed, step])
        tokens = rng.integers(0, c.vocab_size, (a, self.global_batch, s + 1), dtype=np.int32)
        tokens = tokens[:, self._first: self._first + self.local_batch]
        return tokens, np.ones((a, self.local_batch, s), bool), np.zeros(
            (a, self.local_batch, s), np.int32)

    def token_counts(self, vocab_size: int) -> np.ndarray:
        """Uniform: every id equally likely."""
        return np.ones(vocab_size, np.int64)


def batches(cfg: Config, split: str = "train", **kwargs) -> TextBatches | SyntheticBatches:
    """The data source of `cfg.dataset_type` for a split ('train' or 'eval')."""
    source = SyntheticBatches if cfg.dataset_type == "synthetic" else TextBatches
    return source(cfg, split, **kwargs)
