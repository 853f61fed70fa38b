"""Read and write the safetensors format (8-byte header length, JSON header, raw little-endian data).

Why not the `safetensors` package: its NumPy and Flax back ends (0.8) reject F8_E4M3 and F8_E8M0,
the dtypes of DeepSeek's FP8 weights and their block scales. The format is small and documented;
this module covers it with ml_dtypes for the 8-bit floats, memory-mapping tensors on read.

The reader trusts nothing in a file: it applies the format's own validation rules (those of the
reference implementation) before any tensor is mapped, and every violation raises
`SafetensorsError` with a one-line message naming the file, the tensor and the rule broken:
    - the file holds at least the 8-byte little-endian header length N; N <= MAX_HEADER_BYTES
      and 8 + N <= the file's size;
    - the header is UTF-8 JSON, an object, starting with `{`, without duplicate keys;
    - `__metadata__`, if present, is an object of string -> string;
    - every other entry is an object with `dtype` (one of DTYPES), `shape` (a list of
      non-negative integers) and `data_offsets` (two non-negative integers [begin, end],
      begin <= end) whose span end - begin is prod(shape) x the dtype's size;
    - the spans, sorted, start at 0, are contiguous (no gap, no overlap) and end where the file
      ends.
An index (`model.safetensors.index.json`) may only name files inside its directory that exist.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8), "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100_000_000  # the reference implementation's limit
METADATA = "__metadata__"
_SEPARATORS = {"/", "\\", os.sep, os.altsep or "/"}


class SafetensorsError(ValueError):
    """A safetensors file or index that breaks the format's rules (one line: file, tensor, rule)."""


# --- the header -------------------------------------------------------------------------------


def _no_duplicates(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise SafetensorsError(f"duplicate key {_show(key)}")
        seen[key] = value
    return seen


def _no_constant(name):
    raise SafetensorsError(f"{name} is not valid JSON")


def _parse_json(text: str, where: str):
    """Strict JSON (no duplicate keys, no NaN/Infinity); any failure is a SafetensorsError."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except SafetensorsError as err:
        raise SafetensorsError(f"{where}: {err}") from None
    except json.JSONDecodeError as err:
        raise SafetensorsError(f"{where}: invalid JSON ({err})") from None
    except RecursionError:
        raise SafetensorsError(f"{where}: JSON nested too deeply") from None
    except ValueError as err:  # e.g. an integer past Python's digit limit
        raise SafetensorsError(f"{where}: invalid JSON ({err})") from None


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(value), "?")


def _show(value) -> str:
    """A short one-line rendering of a JSON value for messages."""
    if isinstance(value, str):
        return repr(value) if len(value) <= 80 else repr(value[:80]) + "..."
    if isinstance(value, list) and len(value) <= 8 and all(
            v is None or type(v) in (int, float, bool) for v in value):
        text = json.dumps(value)
        return text if len(text) <= 120 else text[:117] + "..."
    return _kind(value)


def _nbytes(shape: list, itemsize: int, limit: int) -> int | None:
    """prod(shape) x itemsize, or None once it exceeds `limit` (no giant products)."""
    if 0 in shape:
        return 0
    total = itemsize
    for d in shape:
        total *= d
        if total > limit:
            return None
    return total


def _is_count(value) -> bool:
    """A non-negative JSON integer (JSON's true/false are not integers)."""
    return type(value) is int and value >= 0


def _entry(path, name: str, info) -> tuple[np.dtype, list, int, int]:
    """(dtype, shape, begin, end) of one header entry, each field checked."""
    where = f"{path}: tensor {_show(name)}"
    if not isinstance(info, dict):
        raise SafetensorsError(f"{where}: entry is {_kind(info)}, not an object with dtype, "
                               "shape and data_offsets")
    for field in ("dtype", "shape", "data_offsets"):
        if field not in info:
            raise SafetensorsError(f"{where}: entry lacks {field!r}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise SafetensorsError(f"{where}: unknown dtype {_show(dtype)} "
                               f"(known: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise SafetensorsError(f"{where}: shape must be a list of non-negative integers, "
                               f"got {_show(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise SafetensorsError(f"{where}: data_offsets must be a list of two non-negative "
                               f"integers [begin, end], got {_show(offsets)}")
    begin, end = offsets
    if begin > end:
        raise SafetensorsError(f"{where}: data_offsets [{begin}, {end}] begin after end")
    limit = max(end - begin, 2**64)
    need = _nbytes(shape, DTYPES[dtype].itemsize, limit)
    if end - begin != need:
        needs = f"needs {need}" if need is not None else f"needs more than {limit}"
        raise SafetensorsError(f"{where}: data_offsets [{begin}, {end}] span {end - begin} "
                               f"bytes, but shape {_show(shape)} x {dtype} {needs}")
    return DTYPES[dtype], shape, begin, end


def _check_layout(path, entries: dict, data_bytes: int) -> None:
    """The spans, sorted by (begin, end), tile the data section exactly."""
    at, previous = 0, None
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda kv: kv[1][2:]):
        span = f"{path}: tensor {_show(name)}: data_offsets [{begin}, {end}]"
        if begin < at:
            raise SafetensorsError(f"{span} overlap tensor {_show(previous)}, which ends at {at}")
        if begin > at:
            after = f"tensor {_show(previous)} ends" if previous is not None else "the data starts"
            raise SafetensorsError(f"{span} leave a gap: {after} at {at}")
        at, previous = end, name
    if at != data_bytes:
        raise SafetensorsError(f"{path}: the tensors cover {at} bytes of data, but the data "
                               f"section holds {data_bytes} (truncated or trailing bytes)")


def read_header(path: Path) -> tuple[dict, int]:
    """({name: (dtype, shape, begin, end)} without __metadata__, byte offset of the data
    section), every rule of the format checked (SafetensorsError otherwise)."""
    total = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SafetensorsError(f"{path}: not a safetensors file: {total} bytes, shorter than "
                                   "the 8-byte header length")
        (size,) = struct.unpack("<Q", raw)
        if size > MAX_HEADER_BYTES:
            raise SafetensorsError(f"{path}: corrupt header: header length {size} exceeds the "
                                   f"limit of {MAX_HEADER_BYTES} bytes")
        if 8 + size > total:
            raise SafetensorsError(f"{path}: corrupt header: header length {size} runs past the "
                                   f"end of the file ({total} bytes)")
        blob = f.read(size)
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SafetensorsError(f"{path}: corrupt header: not valid UTF-8 ({err})") from None
    header = _parse_json(text, f"{path}: corrupt header")
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: corrupt header: top level is {_kind(header)}, "
                               "not an object")
    if not text.startswith("{"):
        raise SafetensorsError(f"{path}: corrupt header: does not start with '{{'")
    metadata = header.pop(METADATA, {})
    if not isinstance(metadata, dict):
        raise SafetensorsError(f"{path}: {METADATA} must be an object of string -> string, "
                               f"got {_kind(metadata)}")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise SafetensorsError(f"{path}: {METADATA} must be an object of string -> string, "
                                   f"but {_show(key)} is {_kind(value)}")
    entries = {name: _entry(path, name, info) for name, info in header.items()}
    _check_layout(path, entries, total - 8 - size)
    return entries, 8 + size


def load(path: Path) -> dict[str, np.ndarray]:
    """All tensors of one file, memory-mapped (read-only); SafetensorsError if it is malformed."""
    entries, start = read_header(path)
    out = {}
    for name, (dtype, shape, begin, end) in entries.items():
        if begin == end:  # nothing to map (np.memmap refuses empty maps)
            out[name] = np.zeros(shape, dtype)
            continue
        data = np.memmap(path, dtype=dtype, mode="r", offset=start + begin,
                         shape=((end - begin) // dtype.itemsize,))
        out[name] = data.reshape(shape)
    return out


# --- index files ------------------------------------------------------------------------------


def read_index(index: Path) -> list[str]:
    """The files an index's weight_map names (sorted, each once); each must be a plain file name
    inside the index's directory that exists (SafetensorsError otherwise)."""
    index = Path(index)
    try:
        text = index.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise SafetensorsError(f"{index}: not valid UTF-8 ({err})") from None
    data = _parse_json(text, str(index))
    if not isinstance(data, dict):
        raise SafetensorsError(f"{index}: top level is {_kind(data)}, not an object")
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict):
        raise SafetensorsError(f"{index}: needs a 'weight_map' object (tensor name -> file), "
                               f"got {_kind(weight_map)}")
    folder = os.path.abspath(index.parent)
    files = set()
    for name, file in weight_map.items():
        where = f"{index}: weight_map entry {_show(name)} -> {_show(file)}"
        if not isinstance(file, str) or not file:
            raise SafetensorsError(f"{where}: the file must be a non-empty string")
        # a lexical check: a symlink inside (the Hugging Face cache's) may point elsewhere
        target = os.path.abspath(os.path.join(folder, file))
        if (os.path.isabs(file) or any(s in file for s in _SEPARATORS) or file in (".", "..")
                or os.path.dirname(target) != folder):
            raise SafetensorsError(f"{where}: the file must be a plain file name inside "
                                   f"{folder}")
        if not os.path.isfile(target):
            raise SafetensorsError(f"{where}: the file does not exist")
        files.add(file)
    return sorted(files)


# --- writing ----------------------------------------------------------------------------------


def save(tensors: dict[str, np.ndarray], path: Path, metadata: dict | None = None) -> None:
    """Write tensors to `path` atomically (a temporary file renamed into place)."""
    header, offset = {}, 0
    arrays = []
    for name in sorted(tensors):
        if name == METADATA:
            raise SafetensorsError(f"tensor {name}: the name is reserved for metadata")
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in NAMES:
            raise SafetensorsError(f"tensor {name}: dtype {arr.dtype} cannot be saved")
        header[name] = {"dtype": NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    if metadata:
        header[METADATA] = {k: str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned
    tmp = Path(f"{path}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())
    os.replace(tmp, path)
