"""Atomic file writes: a reader (or a concurrent writer) never sees a partial file."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: Path, write: Callable) -> None:
    """Write `path` through `write(file)` (a binary file) into a temporary file beside it, then
    rename it into place; on any error the temporary file is removed and `path` is untouched.
    The file gets the mode open() would give it (0o666 less the umask), not the temporary
    file's 0o600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        try:
            write(f)
        except BaseException:
            os.unlink(f.name)
            raise
    os.chmod(f.name, 0o666 & ~_umask())
    os.replace(f.name, path)


def _umask() -> int:
    """The process's umask (which can only be read by setting it)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return umask
