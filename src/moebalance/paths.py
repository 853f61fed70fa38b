"""What keeps a path a user named from being read, in words: checked before anything parses it, so
that an error names the real problem (a missing file is not "not a token file")."""

from __future__ import annotations

import os
import stat
from pathlib import Path

UNREADABLE = "cannot be read (permission denied; chmod a+rX makes it readable)"


def problem(path: Path, want: str = "file", *, empty: bool = True) -> str | None:
    """Why `path` cannot be read as `want` ('file', or 'either': a file or a directory): 'does
    not exist', 'is a directory, not a file', 'cannot be read (permission denied ...)', ...; with
    `empty` False an empty file is a problem too. None when it can be read."""
    try:
        info = path.stat()
    except FileNotFoundError:
        if path.is_symlink():
            return f"is a link to {os.readlink(path)}, which does not exist"
        return "does not exist"
    except NotADirectoryError:
        return "does not exist (a part of the path above it is a file)"
    except PermissionError:
        return "cannot be reached (permission denied on a directory above it)"
    if stat.S_ISDIR(info.st_mode):
        if want == "file":
            return "is a directory, not a file"
        try:
            os.scandir(path).close()
        except PermissionError:
            return UNREADABLE
        return None
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file (a device, pipe or socket)"
    try:
        with path.open("rb") as f:
            first = f.read(1)
    except PermissionError:
        return UNREADABLE
    if not first and not empty:
        return "is empty"
    return None
