"""Unpack wheels into one folder put on PYTHONPATH, side by side: what `pip install --no-deps
--target` leaves there, without pip. For the device machine, whose fresh installation with pip (two
calls, 50 wheels) took over 100 s of a 600-s device call (benchmarks/tpu.sh).

    python3 benchmarks/unpack_wheels.py TARGET WHEEL...

A wheel is a zip of its import tree and its `*.dist-info`; its `*.data/purelib` and
`*.data/platlib` belong to the import tree too (the wheel format, PEP 427); its scripts, headers
and data files are left out (nothing here runs them). The wheels must not overlap (one version of
each project); prints the seconds it took.
"""

import sys
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

LIBRARY = ("purelib", "platlib")


def destination(name: str) -> str | None:
    """Where a wheel member goes, relative to the target; None: left out."""
    head, _, rest = name.partition("/")
    if not head.endswith(".data"):
        return name
    kind, _, inside = rest.partition("/")
    return inside if kind in LIBRARY and inside else None


def unpack(wheel: Path, target: Path) -> int:
    """Unpack one wheel into `target`; -> the number of files written."""
    written = 0
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            where = destination(member.filename)
            if where is None or member.is_dir():
                continue
            path = target / where
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(archive.read(member))
            if member.external_attr >> 16 & 0o111:  # shared objects keep their execute bit
                path.chmod(0o755)
            written += 1
    return written


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit(__doc__)
    start, target = time.perf_counter(), Path(argv[0])
    wheels = [Path(w) for w in argv[1:]]
    projects = [w.name.split("-")[0].lower().replace("_", "-") for w in wheels]
    twice = sorted({p for p in projects if projects.count(p) > 1})
    if twice:
        sys.exit(f"unpack_wheels: more than one wheel of {', '.join(twice)}: keep one version")
    with ThreadPoolExecutor(8) as pool:  # zlib lets go of the GIL while it inflates
        files = sum(pool.map(lambda w: unpack(w, target), wheels))
    print(f"unpacked {len(wheels)} wheels ({files} files) into {target} in "
          f"{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
