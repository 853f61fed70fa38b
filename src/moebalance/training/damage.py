"""Whether a checkpoint's files are whole, checked without asking Orbax to read it: a checkpoint
whose files are missing or short is found here, in one plain sentence, before any read of its
arrays fails. Such a read fails inside Orbax's own event loop, which Orbax closes while the
other arrays' reads are still in flight; their callbacks then arrive at a closed loop, each
printing "Event loop is closed" with its traceback, some of the time (issue 61). Checked here,
the reads that would fail are never started.

What a checkpoint written by `checkpoint.save` holds and what its load reads:

    meta/metadata      the step, JSON
    state/_METADATA    the state's tree, JSON
    state/             an OCDBT database (TensorStore): manifest.ocdbt names the root node of a
                       B+tree, whose nodes and values lie at byte ranges of files under state/
                       (ocdbt.process_<i>/d/..., one set per process that wrote)

The check reads the two JSON files, the manifest and the B+tree's nodes (kilobytes: the keys and
the locations of the values, not the values), and compares each file's size with the end of the
furthest byte range that the tree places in it.
"""

from __future__ import annotations

import json
from pathlib import Path

import tensorstore as ts

# TensorStore's status codes for a file that is not there, is shorter than a range read from it
# or holds bytes that do not decode; any other (PERMISSION_DENIED, RESOURCE_EXHAUSTED,
# UNAVAILABLE, ...) is not the file's fault.
DAMAGE_STATUSES = ("DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND", "FAILED_PRECONDITION")
# Of those, what a read of a checkpoint that `problem` found whole can still meet: bytes that do
# not decode (overwritten in place). A key not found there is not damage but another layout
# (an Orbax that names its arrays otherwise), to be stopped at, not set aside.
UNDECODABLE_STATUSES = ("DATA_LOSS", "FAILED_PRECONDITION")


def stored_data_error(err: BaseException) -> str | None:
    """The first line of the TensorStore error in err's chain that says bytes read from an OCDBT
    database do not decode (e.g. 'FAILED_PRECONDITION: Error reading "x/0.0" in OCDBT database
    at local file "...": ZSTD_decompressStream() failed'); None when the chain holds no such
    error (an out-of-memory, a permission, a mismatch of Orbax's API)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        first = str(err).split("\n", 1)[0]
        if (isinstance(err, ValueError) and first.startswith(UNDECODABLE_STATUSES)
                and 'Error reading "' in first and " in OCDBT database at " in first):
            return first.split(" [tensorstore_spec", 1)[0]
        err = err.__cause__ or err.__context__
    return None


def _json_problem(path: Path, name: str) -> str | None:
    if not path.is_file():
        return f"{name} is missing"
    try:
        json.loads(path.read_bytes())
    except ValueError as err:
        return f"the file {name} ({path.stat().st_size:,} bytes) is not whole JSON ({err})"
    return None


def _place(location: str) -> tuple[str, int]:
    """('ocdbt.process_0/d/1f..', end) of a node or value location of ts.ocdbt.dump,
    '<kind>:<base>:<path>:<offset>:<length>'."""
    head, offset, length = location.rsplit(":", 2)
    _, base, path = head.split(":", 2)
    return base + path, int(offset) + int(length)


def _ocdbt_problem(root: Path, item: str) -> str | None:
    """What of the OCDBT database in `root` is missing or short, or None: its manifest, then
    each B+tree node (read) and each value (its file's size), level by level."""
    if not (root / "manifest.ocdbt").is_file():
        return f"{item}/manifest.ocdbt is missing"
    store = ts.KvStore.open({"driver": "file", "path": f"{root}/"}).result()
    ends: dict[str, int] = {}  # file under root -> the end of the furthest range placed in it

    def short(name: str) -> str | None:
        path = root / name
        if not path.is_file():
            return f"{item}/{name} is missing"
        size = path.stat().st_size
        if size < ends[name]:
            return (f"the file {item}/{name} is {size:,} bytes, shorter than the {ends[name]:,} "
                    "that the checkpoint's index places in it")
        return None

    def dump(location: str | None, name: str):
        try:
            return ts.ocdbt.dump(store, location).result()
        except ValueError as err:
            why = str(err).split("\n", 1)[0]
            if not why.startswith(DAMAGE_STATUSES):
                raise
            return f"the file {item}/{name} does not decode ({why})"

    manifest = dump(None, "manifest.ocdbt")
    if isinstance(manifest, str):
        return manifest
    nodes = [manifest["versions"][-1]["root"].get("location")] if manifest["versions"] else []
    while nodes := [n for n in nodes if n]:
        children = []
        for location in nodes:
            name, end = _place(location)
            ends[name] = max(ends.get(name, 0), end)
            node = short(name) or dump(location, name)
            if isinstance(node, str):
                return node
            children += [e.get("location") for e in node["entries"]]
            for value in (e["indirect_value"] for e in node["entries"] if "indirect_value" in e):
                name, end = _place(value)
                ends[name] = max(ends.get(name, 0), end)
        nodes = children
    return next(filter(None, map(short, sorted(ends))), None)


def problem(directory: Path) -> str | None:
    """The first thing found missing or short in the checkpoint `directory` (one of a run's
    checkpoints/<step>), in words ('the file state/ocdbt.process_0/d/a0.. is 1,041,161 bytes,
    shorter than the 2,082,322 that the checkpoint's index places in it', 'meta/metadata is
    missing'); None when every file its load reads is there and long enough. An error that says
    nothing of the files (a permission, an I/O fault) is raised as it is."""
    directory = Path(directory)
    return (_json_problem(directory / "meta" / "metadata", "meta/metadata")
            or _json_problem(directory / "state" / "_METADATA", "state/_METADATA")
            or _ocdbt_problem(directory / "state", "state"))
