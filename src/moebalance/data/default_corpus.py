"""The embedded default corpus (`dataset_path: []`), a fixed snapshot shipped with the package so
that the default reads the same bytes on every machine and Python version:

    default_corpus.tar.xz        the 1,758 non-empty UTF-8 `*.py` files of CPython 3.11.7's
                                 standard library outside site-packages, unmodified (31.5 MB,
                                 4.6 MB compressed), made by tools/make_default_corpus.py
    default_corpus.LICENSE.txt   their licence, the Python Software Foundation's, beside them

`SHA256` pins the digest of the snapshot's content (`content_digest`: its names and bytes, not the
compressed file). The snapshot is read whole, once per process, and checked against it: a damaged or
altered file stops the run with a message naming it. The tokenizer and token-stream caches of the
default are keyed by this digest (moebalance.data.corpus.Document.version).
"""

from __future__ import annotations

import functools
import hashlib
import lzma
import tarfile
from collections.abc import Iterable
from pathlib import Path

from moebalance.data.errors import DataError

ARCHIVE = Path(__file__).with_name("default_corpus.tar.xz")
LICENCE = Path(__file__).with_name("default_corpus.LICENSE.txt")
SHA256 = "fc5fdc4d91ffdd85f971b8cb626a1f573a830091eef78df3e44609a39551be19"
FIX = ("restore it (`git checkout -- src/moebalance/data/{name}` in a clone of moebalance, or "
       "reinstall the package), or give your own corpus in dataset_path")


def content_digest(members: Iterable[tuple[str, bytes]]) -> str:
    """SHA-256, in hex, of the members sorted by name, each as its UTF-8 name, a NUL, its size in
    decimal, a NUL and its bytes."""
    digest = hashlib.sha256()
    for name, content in sorted(members):
        digest.update(b"%s\0%d\0" % (name.encode(), len(content)))
        digest.update(content)
    return digest.hexdigest()


@functools.lru_cache(maxsize=2)
def members(archive: Path = ARCHIVE) -> tuple[tuple[str, bytes], ...]:
    """(name, bytes) of every file in `archive`, sorted by name, after checking that their
    `content_digest` is `SHA256`."""
    fix = FIX.format(name=archive.name)
    try:
        with tarfile.open(archive, "r:xz") as tar:
            found = [(m.name, tar.extractfile(m).read()) for m in tar if m.isfile()]
    except FileNotFoundError:
        raise DataError(f"the embedded default corpus (dataset_path: []) {archive} is missing; "
                        f"{fix}") from None
    except tarfile.CompressionError as err:  # a Python built without liblzma has no lzma module
        raise DataError(f"cannot read the embedded default corpus {archive}: {err}; use a Python "
                        "built with xz support (liblzma), or give your own corpus in "
                        "dataset_path") from None
    except (OSError, EOFError, lzma.LZMAError, tarfile.TarError) as err:
        raise DataError(f"the embedded default corpus (dataset_path: []) {archive} is damaged "
                        f"({err}); {fix}") from None
    digest = content_digest(found)
    if digest != SHA256:
        raise DataError(f"the embedded default corpus (dataset_path: []) {archive} is not the one "
                        f"moebalance pins: its content's SHA-256 is {digest}, not {SHA256}; "
                        f"{fix}")
    return tuple(sorted(found))
