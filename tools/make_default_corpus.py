"""Build the embedded default corpus (`dataset_path: []`): src/moebalance/data/default_corpus.tar.xz
and the licence beside it, default_corpus.LICENSE.txt, from the running interpreter's standard
library.

    python tools/make_default_corpus.py               # rewrite both in src/moebalance/data/
    python tools/make_default_corpus.py --out DIR     # write them elsewhere

The files are chosen by the rule the default corpus followed before it was fixed (when it was the
running Python's own standard library): every file under `sysconfig.get_paths()["stdlib"]` whose
relative path matches `*.py`, outside site-packages and dist-packages, non-empty and UTF-8, a file
reached twice (links) once. On CPython 3.11.7 that is 1,758 files, 31.5 MB: the whole set, since
it compresses to 4.6 MB (the 963 files outside test/ would still be 14.4 MB, 2.2 MB compressed, and
would change every figure measured on the default).

The archive is reproducible: a USTAR tar of the files sorted by name, each with mode 0644, mtime 0,
uid/gid 0 and no owner names, compressed by xz at preset 9e. What moebalance pins and checks is
the digest of the content (`moebalance.data.default_corpus.content_digest`: the names and bytes),
not of the archive, so another liblzma giving other compressed bytes changes nothing. Built from
another Python, the content differs: the script says so, and `SHA256` in
moebalance/data/default_corpus.py (with every figure measured on the default) would have to follow.
"""

from __future__ import annotations

import argparse
import io
import lzma
import os
import sys
import sysconfig
import tarfile
from collections.abc import Iterable
from pathlib import Path

from moebalance.data import default_corpus

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "src" / "moebalance" / "data"
EXCLUDED_DIRS = ("site-packages", "dist-packages")  # third-party code inside the stdlib tree
GLOB = "*.py"
PRESET = 9 | lzma.PRESET_EXTREME

NOTICE = """\
default_corpus.tar.xz, shipped with moebalance as its default training corpus, holds {count:,} files
({size:.1f} MB) of the standard library of CPython {version}: its non-empty UTF-8 *.py files
outside site-packages, unmodified, collected into one archive by tools/make_default_corpus.py.
That is the only change made to them. They are distributed under the licence of Python that
follows, copied verbatim from that Python's LICENSE.txt; moebalance's own licence (Apache-2.0)
does not apply to them.

"""


def stdlib_files(root: Path) -> list[tuple[str, bytes]]:
    """(name, bytes) of the files of the stdlib at `root` that the rule selects (module
    docstring), sorted by name."""
    candidates = []
    for folder, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in EXCLUDED_DIRS)
        candidates += [Path(folder, file) for file in files]
    chosen: dict[Path, tuple[str, bytes]] = {}
    for path in sorted(candidates):  # of two paths to one file, the first is kept
        rel = path.relative_to(root)
        if rel.match(GLOB) and path.is_file() and path.resolve() not in chosen:
            content = path.read_bytes()
            try:
                content.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if content:
                chosen[path.resolve()] = (rel.as_posix(), content)
    return sorted(chosen.values())


def write_snapshot(members: Iterable[tuple[str, bytes]], path: Path) -> None:
    """The tar.xz of `members` at `path`, reproducible (module docstring)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, content in sorted(members):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(content), 0o644, 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(content))
    path.write_bytes(lzma.compress(raw.getvalue(), format=lzma.FORMAT_XZ, preset=PRESET))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="directory to write the two files")
    args = parser.parse_args(argv)
    root = Path(sysconfig.get_paths()["stdlib"])
    members = stdlib_files(root)
    size = sum(len(content) for _, content in members)
    args.out.mkdir(parents=True, exist_ok=True)
    archive = args.out / default_corpus.ARCHIVE.name
    write_snapshot(members, archive)
    version = sys.version.split()[0]
    notice = NOTICE.format(count=len(members), size=size / 1e6, version=version)
    licence = (root / "LICENSE.txt").read_text(encoding="utf-8")
    (args.out / default_corpus.LICENCE.name).write_text(notice + licence, encoding="utf-8")
    digest = default_corpus.content_digest(members)
    print(f"{archive}: {len(members)} files of {root} (Python {version}), {size / 1e6:.1f} MB, "
          f"{archive.stat().st_size / 1e6:.2f} MB compressed\ncontent sha256 {digest}")
    if digest != default_corpus.SHA256:
        print(f"not the pinned corpus ({default_corpus.SHA256}, CPython 3.11.7): set SHA256 in "
              "moebalance/data/default_corpus.py to use it, and measure the default again")
        return 1
    print("the pinned corpus")
    return 0


if __name__ == "__main__":
    sys.exit(main())
