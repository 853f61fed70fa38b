"""The corpus and its train/held-out split (stages 1 and 2 of the pipeline):

    1. corpus      every non-empty file matching `dataset_glob` under `dataset_path` (default: the
                   embedded default corpus, CPython 3.11.7's standard-library sources, fixed:
                   moebalance.data.default_corpus): a UTF-8 text file is one document; a JSON
                   Lines or Parquet file holds one document per record, in its
                   `dataset_text_field` (moebalance.data.records: formats and the bad-record rule)
    2. split       each document goes to the training or the held-out split by a stable hash of
                   its name (a file's path, or path#row for a record) and the seed, so the split
                   never depends on listing order
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from moebalance.config import DATASET_FIX, Config
from moebalance.data import default_corpus
from moebalance.data.errors import DataError, checked_path, unreadable
from moebalance.data.records import is_record_file, read_records

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# 1. Corpus


@dataclasses.dataclass(frozen=True)
class Document:
    """One corpus file: a text file (one document) or a record file (one per record). `name` is
    its path relative to its `dataset_path` entry ('/'-separated; the file name for a file given
    directly): the identity used by the split and the cache keys. A member of the embedded
    default corpus holds its bytes in `content`; its `path` (the archive's, then its name) names
    it and orders it, but is no file."""

    name: str
    path: Path
    content: bytes | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def records(self) -> bool:
        return is_record_file(self.path)

    @property
    def size(self) -> int:
        return len(self.content) if self.content is not None else self.path.stat().st_size

    def text(self) -> str:
        return (self.content if self.content is not None else self.path.read_bytes()
                ).decode("utf-8")

    def version(self) -> tuple:
        """What the caches key these bytes by: a file's (size, mtime_ns); a default-corpus
        member's (size, the corpus's SHA-256), which the snapshot was checked against."""
        if self.content is not None:
            return len(self.content), default_corpus.SHA256
        stat = self.path.stat()
        return stat.st_size, stat.st_mtime_ns


def _read_utf8(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None
    except PermissionError as err:
        raise unreadable(path, err) from None


def _candidates(cfg: Config) -> Iterator[tuple[str, Path]]:
    """(name, path) of every file of `dataset_path` matching the config, valid or not, in no
    particular order."""
    for entry in sorted(cfg.dataset_path):
        root = checked_path("dataset_path", entry, "either", DATASET_FIX)
        if root.is_file():
            yield root.name, root
        else:  # a readable directory (rglob lists an unreadable one as empty)
            for path in root.rglob(cfg.dataset_glob):
                if path.is_file():
                    yield path.relative_to(root).as_posix(), path


def corpus_documents(cfg: Config) -> list[Document]:
    """The files of the corpus, sorted by path: files named by `dataset_path` (directories
    searched recursively for `dataset_glob`), without empty files and text files that are not
    UTF-8. A file reached twice (nested entries, links) counts once. Without `dataset_path`, the
    members of the embedded default corpus whose names match `dataset_glob`."""
    if not cfg.dataset_path:
        return _default_documents(cfg.dataset_glob)
    docs: dict[Path, Document] = {}
    for name, path in sorted(_candidates(cfg), key=lambda c: (c[1], c[0])):
        resolved = path.resolve()
        usable = path.stat().st_size > 0 if is_record_file(path) else _is_text(resolved)
        if resolved not in docs and usable:
            docs[resolved] = Document(name, path)
    named = [Path(entry).expanduser() for entry in cfg.dataset_path]
    if not docs and all(path.is_file() for path in named):  # no glob applies to a named file
        raise DataError("config key `dataset_path`: " + "; ".join(
            f"{path} is {'empty' if path.stat().st_size == 0 else 'not UTF-8 text'}"
            for path in named) + "; give files that hold text")
    if not docs:
        raise DataError(f"config keys `dataset_path`/`dataset_glob`: no non-empty UTF-8 file "
                        f"matches {cfg.dataset_glob!r} in {cfg.dataset_path}; point dataset_path "
                        "at text files or directories, or change dataset_glob (e.g. '*.txt')")
    return sorted(docs.values(), key=lambda d: d.path)


def _default_documents(glob: str) -> list[Document]:
    """The embedded default corpus's members whose names match `glob` (as a path under a
    `dataset_path` directory would), sorted by path. All are non-empty UTF-8 Python sources."""
    archive = default_corpus.ARCHIVE
    docs = [Document(name, archive / name, content)
            for name, content in default_corpus.members() if PurePosixPath(name).match(glob)]
    if not docs:
        raise DataError(f"config key `dataset_glob`: no file of the embedded default corpus "
                        f"(dataset_path: [], Python sources) matches {glob!r}; keep '*.py', or "
                        "point dataset_path at your own files")
    return sorted(docs, key=lambda d: d.path)


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
