"""Pre-tokenized token files (dataset_type 'tokens'): the token streams read from .bin/.npy files
of ids with a sidecar JSON (dtype, end-of-text id), in place of the corpus, the split and the
tokenizer."""

from __future__ import annotations

import json
import reprlib
from pathlib import Path

import numpy as np

from moebalance.config import Config
from moebalance.data.errors import DataError, checked_path
from moebalance.paths import problem

TOKEN_SUFFIXES = (".bin", ".npy")
TOKEN_DTYPES = ("uint16", "uint32", "int32")
HELD_OUT_STEMS = ("val", "valid", "validation", "eval", "test")
SIDECAR_EXAMPLE = '{"dtype": "uint16", "eot_id": 50256}'


def token_files(cfg: Config) -> tuple[Path, Path | None]:
    """(training file, held-out file or None) named by `dataset_path`: token files (.bin/.npy),
    or directories holding them. A file whose stem is one of HELD_OUT_STEMS (nanoGPT's val.bin)
    is the held-out split; exactly one other file is the training split."""
    found, fix = [], f"give token files ({'/'.join(TOKEN_SUFFIXES)}) or directories holding them"
    for entry in cfg.dataset_path:
        root = checked_path("dataset_path", entry, "either", fix)
        if root.is_dir():
            found += sorted(p for p in root.iterdir() if p.suffix in TOKEN_SUFFIXES)
        elif root.suffix in TOKEN_SUFFIXES:
            found.append(root)
        else:
            raise DataError(f"config key `dataset_path`: {entry!r} is not a token file "
                            f"(its name ends neither in {' nor '.join(TOKEN_SUFFIXES)}); {fix}")
    held = [p for p in found if p.stem in HELD_OUT_STEMS]
    train = [p for p in found if p.stem not in HELD_OUT_STEMS]
    if len(train) != 1 or len(held) > 1:
        raise DataError(f"config key `dataset_path`: dataset_type 'tokens' needs one training "
                        f"token file and at most one held-out file (stem in {HELD_OUT_STEMS}), "
                        f"found {[str(p) for p in found]}")
    return train[0], (held[0] if held else None)


def read_token_file(path: Path, vocab_size: int) -> tuple[np.ndarray, int]:
    """(memory-mapped [N] ids, end-of-text id) of a token file. Its sidecar `<file>.json`, or
    `meta.json` beside it, gives {"dtype": one of TOKEN_DTYPES, "eot_id": the id that ends every
    document (the document boundaries), in [0, vocab_size)}; a .npy file's own header must agree
    on the dtype, a raw file must hold a whole number of tokens."""
    wrong = problem(path, empty=False)
    if wrong:
        raise DataError(f"config key `dataset_path`: token file {path} {wrong}; write its tokens "
                        "again, or leave it out")
    sidecar = next((p for p in (path.with_name(path.name + ".json"), path.with_name("meta.json"))
                    if p.exists()), None)
    if sidecar is None:
        raise DataError(f"{path} has no sidecar: write {path.name}.json (or meta.json beside it) "
                        f"holding {SIDECAR_EXAMPLE} with your dtype and end-of-text id")
    dtype, eot_id = _read_sidecar(sidecar)
    if not 0 <= eot_id < vocab_size:
        raise DataError(f"{sidecar}: eot_id {eot_id} is outside the vocabulary [0, {vocab_size}); "
                        "fix \"eot_id\" in the sidecar, or config key `vocab_size`")
    if eot_id > np.iinfo(dtype).max:
        raise DataError(f"{sidecar}: eot_id {eot_id} does not fit its dtype {dtype}; fix "
                        "\"eot_id\" or \"dtype\" in the sidecar")
    if path.suffix == ".npy":
        return _read_npy(path, dtype, sidecar), eot_id
    size, itemsize = path.stat().st_size, np.dtype(dtype).itemsize
    if size % itemsize:
        raise DataError(f"{path}: {size} bytes is not a whole number of {dtype} tokens "
                        f"({itemsize} bytes each); the file is truncated, or fix \"dtype\" "
                        f"in its sidecar {sidecar.name}")
    return np.memmap(path, dtype=dtype, mode="r"), eot_id


def _read_sidecar(sidecar: Path) -> tuple[str, int]:
    """(dtype, eot_id) of a token file's sidecar JSON."""
    wrong = problem(sidecar, empty=False)
    if wrong:
        raise DataError(f"config key `dataset_path`: the sidecar {sidecar} {wrong}; write a JSON "
                        f"object such as {SIDECAR_EXAMPLE} into it")
    try:
        meta = json.loads(sidecar.read_bytes())
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise DataError(f"{sidecar}: not JSON ({err}); write a JSON object such as "
                        f"{SIDECAR_EXAMPLE}") from None
    if not isinstance(meta, dict):
        raise DataError(f"{sidecar}: holds a JSON {type(meta).__name__}, not an object such as "
                        f"{SIDECAR_EXAMPLE}")
    dtype, eot_id = meta.get("dtype"), meta.get("eot_id")
    if dtype not in TOKEN_DTYPES or not isinstance(eot_id, int) or isinstance(eot_id, bool):
        raise DataError(f"{sidecar}: needs \"dtype\" (one of {', '.join(TOKEN_DTYPES)}) and an "
                        f"integer \"eot_id\", got dtype {reprlib.repr(dtype)} and eot_id "
                        f"{reprlib.repr(eot_id)}")
    return dtype, eot_id


def _read_npy(path: Path, dtype: str, sidecar: Path) -> np.ndarray:
    try:
        with path.open("rb") as f:  # np.load would take a file without the header for a pickle
            np.lib.format.read_magic(f)
        ids = np.load(path, mmap_mode="r")
    except (ValueError, EOFError) as err:  # no .npy header, or fewer bytes than it says
        raise DataError(f"{path}: not a whole .npy array ({err}); write it with numpy.save, or "
                        "give a raw token file the ending .bin") from None
    if ids.dtype != np.dtype(dtype) or ids.ndim != 1:
        raise DataError(f"{path} holds {ids.dtype} of shape {ids.shape}; its sidecar "
                        f"{sidecar.name} says 1-D {dtype}")
    return ids


def token_stream(cfg: Config, split: str) -> tuple[np.ndarray, int]:
    """[N] ids of one split of the token files, and the end-of-text id. Without a held-out file,
    the held-out split is the tail of the training file: its last `eval_fraction` of the tokens,
    from the first document boundary there on (whole documents)."""
    train_file, held_file = token_files(cfg)
    if held_file is not None:
        return read_token_file(train_file if split == "train" else held_file, cfg.vocab_size)
    ids, eot_id = read_token_file(train_file, cfg.vocab_size)
    start = int(len(ids) * (1 - cfg.eval_fraction))
    ends = np.flatnonzero(ids[start:] == eot_id)
    cut = start + int(ends[0]) + 1 if len(ends) else len(ids)
    return (ids[:cut] if split == "train" else ids[cut:]), eot_id
