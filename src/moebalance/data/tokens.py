"""Pre-tokenized token files (dataset_type 'tokens'): the token streams read from .bin/.npy files
of ids with a sidecar JSON (dtype, end-of-text id), in place of the corpus, the split and the
tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moebalance.config import Config
from moebalance.data.errors import DataError

TOKEN_SUFFIXES = (".bin", ".npy")
TOKEN_DTYPES = ("uint16", "uint32", "int32")
HELD_OUT_STEMS = ("val", "valid", "validation", "eval", "test")


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


def token_stream(cfg: Config, split: str) -> tuple[np.ndarray, int]:
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
