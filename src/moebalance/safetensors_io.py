"""Read and write the safetensors format (8-byte header length, JSON header, raw little-endian data).

Why not the `safetensors` package: its NumPy and Flax back ends (0.8) reject F8_E4M3 and F8_E8M0,
the dtypes of DeepSeek's FP8 weights and their block scales. The format is small and documented;
this module covers it with ml_dtypes for the 8-bit floats, memory-mapping tensors on read.
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
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsError(ValueError):
    pass


def read_header(path: Path) -> tuple[dict, int]:
    """(header without __metadata__, byte offset of the data section)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SafetensorsError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (size,) = struct.unpack("<Q", raw)
        if size > os.path.getsize(path) - 8:
            raise SafetensorsError(f"{path}: corrupt safetensors header (length {size})")
        try:
            header = json.loads(f.read(size))
        except json.JSONDecodeError as err:
            raise SafetensorsError(f"{path}: corrupt safetensors header ({err})") from err
    header.pop("__metadata__", None)
    return header, 8 + size


def load(path: Path) -> dict[str, np.ndarray]:
    """All tensors of one file, memory-mapped (read-only)."""
    header, start = read_header(path)
    total = os.path.getsize(path)
    out = {}
    for name, info in header.items():
        if info["dtype"] not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        dtype = DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        count = int(np.prod(info["shape"], dtype=np.int64))
        if end - begin != count * dtype.itemsize or start + end > total:
            raise SafetensorsError(f"{path}: tensor {name} is truncated or its size is wrong")
        data = np.memmap(path, dtype=dtype, mode="r", offset=start + begin, shape=(count,))
        out[name] = data.reshape(info["shape"])
    return out


def save(tensors: dict[str, np.ndarray], path: Path, metadata: dict | None = None) -> None:
    """Write tensors to `path` atomically (a temporary file renamed into place)."""
    header, offset = {}, 0
    arrays = []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in NAMES:
            raise SafetensorsError(f"tensor {name}: dtype {arr.dtype} cannot be saved")
        header[name] = {"dtype": NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned
    tmp = Path(f"{path}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())
    os.replace(tmp, path)
