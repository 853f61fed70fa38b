"""Our model <-> tensors under DeepSeek's names; dequantisation; reading and writing directories.

Every parameter of ours has one DeepSeek name per layer (and per routed expert): Linear weights
are [out, in] there (ours are [in, out]), routed experts are one tensor each
(`layers.N.ffn.experts.J.w1.weight` [F, D]), hash tables `ffn.gate.tid2eid` [V, K].

Quantised tensors are dequantised on import, by their stored dtype:
    FP8 e4m3 weight + `<module>.scale`: W = w * S[o // 128, i // 128] (the block size is the
        config's quantization_config.weight_block_size)
    FP4 e2m1 packed in int8 (two per byte, low nibble first) + a scale per 32 inputs:
        W[o, i] = E2M1[nibble(o, i)] * S[o, i // 32]
Scales may be float32 or ue8m0 (F8_E8M0, 2^(u-127)).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import ml_dtypes
import numpy as np
from flax import nnx

from moebalance import safetensors_io as st
from moebalance.hf import names
from moebalance.hf.config import config_from_hf, config_to_hf
from moebalance.model.moe import RouterBiasAverage
from moebalance.model.transformer import DeepSeekV4

log = logging.getLogger(__name__)

# --- our parameters and DeepSeek's names ------------------------------------------------------

# Our path inside a block -> (DeepSeek's name inside `layers.N.`, layout); `{}`: one per expert.
_BLOCK = {
    ("attn_norm", "weight"): ("attn_norm.weight", "same"),
    ("ffn_norm", "weight"): ("ffn_norm.weight", "same"),
    ("attn", "wq_a"): ("attn.wq_a.weight", "T"),
    ("attn", "q_norm", "weight"): ("attn.q_norm.weight", "same"),
    ("attn", "wq_b"): ("attn.wq_b.weight", "T"),
    ("attn", "wkv"): ("attn.wkv.weight", "T"),
    ("attn", "kv_norm", "weight"): ("attn.kv_norm.weight", "same"),
    ("attn", "attn_sink"): ("attn.attn_sink", "same"),
    ("attn", "wo_a"): ("attn.wo_a.weight", "wo_a"),
    ("attn", "wo_b"): ("attn.wo_b.weight", "T"),
    ("attn", "indexer", "wq_b"): ("attn.indexer.wq_b.weight", "T"),
    ("attn", "indexer", "weights_proj"): ("attn.indexer.weights_proj.weight", "T"),
    ("ffn", "router"): ("ffn.gate.weight", "T"),
    ("ffn", "bias"): ("ffn.gate.bias", "same"),
    ("ffn", "hash_table"): ("ffn.gate.tid2eid", "ids"),
    ("ffn", "w1"): ("ffn.experts.{}.w1.weight", "T"),
    ("ffn", "w3"): ("ffn.experts.{}.w3.weight", "T"),
    ("ffn", "w2"): ("ffn.experts.{}.w2.weight", "T"),
    ("ffn", "shared", "w1"): ("ffn.shared_experts.w1.weight", "T"),
    ("ffn", "shared", "w3"): ("ffn.shared_experts.w3.weight", "T"),
    ("ffn", "shared", "w2"): ("ffn.shared_experts.w2.weight", "T"),
}
for _sub in ("attn", "ffn"):
    _BLOCK[(f"{_sub}_hc", "fn")] = (f"hc_{_sub}_fn", "T")
    _BLOCK[(f"{_sub}_hc", "base")] = (f"hc_{_sub}_base", "same")
    _BLOCK[(f"{_sub}_hc", "scale")] = (f"hc_{_sub}_scale", "same")
for _ours, _theirs in ((("attn", "compressor"), "attn.compressor"),
                       (("attn", "indexer", "compressor"), "attn.indexer.compressor")):
    _BLOCK[(*_ours, "wkv")] = (f"{_theirs}.wkv.weight", "T")
    _BLOCK[(*_ours, "wgate")] = (f"{_theirs}.wgate.weight", "T")
    _BLOCK[(*_ours, "ape")] = (f"{_theirs}.ape", "same")
    _BLOCK[(*_ours, "norm", "weight")] = (f"{_theirs}.norm.weight", "same")

_TOP = {
    ("embed",): ("embed.weight", "same"),
    ("head",): ("head.weight", "T"),
    ("norm", "weight"): ("norm.weight", "same"),
    ("mtp", "e_proj"): ("mtp.0.e_proj.weight", "T"),
    ("mtp", "h_proj"): ("mtp.0.h_proj.weight", "T"),
}
for _p, _layout in (("fn", "T"), ("base", "same"), ("scale", "same")):
    _TOP[("hc_head", _p)] = (f"hc_head_{_p}", _layout)
    _TOP[("mtp", "hc_head", _p)] = (f"mtp.0.hc_head_{_p}", _layout)
for _n in ("enorm", "hnorm", "norm"):
    _TOP[("mtp", _n, "weight")] = (f"mtp.0.{_n}.weight", "same")


def _to_file(x: np.ndarray, layout: str) -> np.ndarray:
    if layout == "T":
        return x.T
    if layout == "wo_a":  # [G, in/G, r] -> [G*r, in/G]
        return x.transpose(0, 2, 1).reshape(-1, x.shape[1])
    if layout == "ids":  # transformers' tid2eid is int64
        return x.astype(np.int64)
    return x


def _from_file(x: np.ndarray, layout: str, shape) -> np.ndarray:
    if layout == "T":
        return x.T
    if layout == "wo_a":
        return x.reshape(shape[0], shape[2], shape[1]).transpose(0, 2, 1)
    return x


def _file_shape(shape, layout) -> tuple:
    return tuple(_to_file(np.empty(shape, np.bool_), layout).shape)


def _entries(model: DeepSeekV4):
    """(our path, DeepSeek name, layout, index into our variable, Variable) per named tensor;
    a bias's running mean is not one (the run's bias already is that mean)."""
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Not(RouterBiasAverage))):
        if path[0] == "segments":
            start, period, repeats = model.layout[path[1]]
            if repeats == 1:
                rest, places = path[2:], [(start, ())]
            else:  # ('segments', s, 'units', 'blocks', b, *rest), stacked over units
                rest = path[5:]
                places = [(start + r * period + path[4], (r,)) for r in range(repeats)]
            prefixes = [(f"layers.{layer}", index) for layer, index in places]
        elif path[:2] == ("mtp", "block"):
            rest, prefixes = path[2:], [("mtp.0", ())]
        else:
            name, layout = _TOP[path]
            yield path, name, layout, (), var
            continue
        name, layout = _BLOCK[rest]
        for prefix, index in prefixes:
            if "{}" not in name:
                yield path, f"{prefix}.{name}", layout, index, var
                continue
            for e in range(var.shape[len(index)]):  # routed experts: one tensor each
                yield path, f"{prefix}.{name.format(e)}", layout, (*index, e), var


def deepseek_tensors(model: DeepSeekV4) -> dict[str, np.ndarray]:
    """Every tensor of the model under DeepSeek's names, in DeepSeek's layouts."""
    out, arrays = {}, {}
    for path, name, layout, index, var in _entries(model):
        if path not in arrays:
            arrays[path] = np.asarray(var[...])
        out[name] = np.ascontiguousarray(_to_file(arrays[path][index], layout))
    return out


# --- dequantisation ---------------------------------------------------------------------------

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _scale_name(name: str) -> str:
    """DeepSeek's name of the scale of quantised weight `name`: `<module>.scale`."""
    return name.rsplit(".", 1)[0] + ".scale"


def _scale_of(name: str, tensors) -> np.ndarray:
    if _scale_name(name) not in tensors:
        raise ValueError(f"quantised tensor {name} has no scale ({_scale_name(name)})")
    return np.asarray(tensors[_scale_name(name)]).astype(np.float32)


def dequantize(name: str, tensors, expected_shape, block: int = 128) -> np.ndarray:
    """The value of tensor `name`: as stored, or dequantised to float32 from FP8 (block x block
    scales, DeepSeek's weight_block_size) or packed FP4."""
    w = tensors[name]
    if w.dtype == ml_dtypes.float8_e4m3fn:
        scale = _scale_of(name, tensors)
        out = w.astype(np.float32)
        s = np.repeat(np.repeat(scale, block, axis=-2), block, axis=-1)
        return out * s[..., : out.shape[-2], : out.shape[-1]]
    if w.dtype == np.int8 and tuple(expected_shape[:-1]) == w.shape[:-1] and (
            expected_shape[-1] == 2 * w.shape[-1]):
        scale = _scale_of(name, tensors)
        packed = w.view(np.uint8)
        codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*w.shape[:-1], -1)
        block = expected_shape[-1] // scale.shape[-1]
        return E2M1[codes] * np.repeat(scale, block, axis=-1)
    return w


# --- files ------------------------------------------------------------------------------------


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    index = path / "model.safetensors.index.json"
    if index.exists():  # its weight_map may only name existing files inside `path`
        files = st.read_index(index)
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    tensors, source = {}, {}
    for i, file in enumerate(files, 1):
        if len(files) > 1:  # a real checkpoint: tens of shards of a few GB each
            log.info("reading %s (%d of %d, %.2f GB)", file, i, len(files),
                     (path / file).stat().st_size / 1e9)
        for name, value in st.load(path / file).items():
            if name in tensors:
                raise st.SafetensorsError(f"{path}: tensor {name!r} is in both {source[name]} "
                                          f"and {file}")
            tensors[name], source[name] = value, file
    return tensors


def _read_config(path: Path) -> dict:
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist (expected a "
                                "directory with config.json and *.safetensors)")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: no config.json (a checkpoint directory holds "
                                "config.json and *.safetensors)")
    return json.loads((path / "config.json").read_text())


def _write_json(path: Path, data) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _shards(tensors: dict, max_bytes: int) -> list[dict]:
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensors[name]
        size += nbytes
    return [*shards, current]


def save(model: DeepSeekV4, config, path, *, max_shard_bytes: int = 2 * 1024**3,
         extra_config: dict | None = None):
    """Write config.json and the tensors in transformers' save_pretrained layout (what
    `DeepseekV4ForCausalLM.from_pretrained` loads; sharded past max_shard_bytes, with an index).
    The MTP layer keeps DeepSeek's names (`mtp.0.*`), which from_pretrained ignores.
    `extra_config`: keys added to config.json (e.g. the tokenizer's special token ids).

    Refuses a directory that already holds a checkpoint; files are written atomically.
    """
    path = Path(path)
    if (path / "config.json").exists():
        raise FileExistsError(f"{path} already holds a checkpoint; choose a new directory")
    # before any file: a config transformers cannot hold fails
    hf_config = {**config_to_hf(config), **(extra_config or {})}
    path.mkdir(parents=True, exist_ok=True)
    tensors = {names.layout_name(name, "transformers"): value
               for name, value in deepseek_tensors(model).items()}
    shards = _shards(tensors, max_shard_bytes)
    files = ([f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
             if len(shards) > 1 else ["model.safetensors"])
    for i, (shard, file) in enumerate(zip(shards, files), 1):
        if len(shards) > 1:
            log.info("writing %s (%d of %d)", file, i, len(shards))
        st.save(shard, path / file, metadata={"format": "pt"})
    if len(shards) > 1:
        weight_map = {n: f for shard, f in zip(shards, files) for n in shard}
        total = sum(t.nbytes for t in tensors.values())
        _write_json(path / "model.safetensors.index.json",
                    {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(path / "config.json", hf_config)


# --- import -----------------------------------------------------------------------------------

_QUANTISED = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(np.int8))


class _Source:
    """A checkpoint's tensors under DeepSeek's names, and how to name them back in messages."""

    def __init__(self, files: dict):
        self.layout = names.detect_layout(files)
        self.tensors, self.origin = names.to_deepseek(files, self.layout)

    def describe(self, name: str) -> str:
        """The checkpoint's own name for DeepSeek's `name` (and DeepSeek's where it differs)."""
        theirs = self.origin.get(name) or names.layout_name(name, self.layout)
        return theirs if theirs == name else f"{theirs} (DeepSeek's {name})"

    def error(self, message: str) -> ValueError:
        return ValueError(f"{message}; the checkpoint was read as {names.LAYOUTS[self.layout]} "
                          "(guessed from its tensor names)")

    def get(self, name: str) -> np.ndarray:
        if name not in self.tensors:
            raise self.error(f"checkpoint lacks tensor {self.describe(name)}")
        return self.tensors[name]


def _fill(model: DeepSeekV4, source: _Source, block: int) -> None:
    """Set every variable of `model` from the checkpoint; any tensor left over is an error."""
    arrays, used = {}, set()
    for path, name, layout, index, var in _entries(model):
        stored = source.get(name)
        shape = var.shape[len(index):]
        want = _file_shape(shape, layout)
        value = np.asarray(dequantize(name, source.tensors, want, block))
        if value.shape != want:
            raise source.error(f"tensor {source.describe(name)} has shape {stored.shape}, the "
                               f"config needs {want}")
        used.update([name, _scale_name(name)] if stored.dtype in _QUANTISED else [name])
        if path not in arrays:
            arrays[path] = np.empty(var.shape, var.dtype)
        arrays[path][index] = _from_file(value, layout, shape).astype(var.dtype)
    unknown = sorted(set(source.tensors) - used)
    if unknown:
        raise source.error(f"checkpoint tensor {source.origin[unknown[0]]} matches nothing in "
                           f"the config ({len(unknown)} such tensors)")
    for path, var in nnx.to_flat_state(nnx.state(model)):
        var[...] = arrays[path]


def load(path, **overrides):
    """Import a checkpoint directory: (Config, DeepSeekV4).

    Any of the three layouts (`names.LAYOUTS`, told apart by the tensor names) with a config.json
    of any style (`hf.config`); `overrides` are Config keys. The MTP layer is built when the
    checkpoint holds one (transformers' never do). A tensor missing, left over or of the wrong
    shape raises an error naming it as the checkpoint does, and the layout taken.
    """
    path = Path(path)
    raw_config = _read_config(path)
    source = _Source(_read_tensors(path))
    if not any(name.startswith("mtp.") for name in source.tensors):
        overrides = {"mtp_num_layers": 0, **overrides}
    config = config_from_hf(raw_config, **overrides)
    block = (raw_config.get("quantization_config") or {}).get("weight_block_size", [128])[0]
    tables = [source.get(f"layers.{i}.ffn.gate.tid2eid")
              for i in range(config.first_num_hash_layers)]
    model = DeepSeekV4(config, hash_tables=tables, rngs=nnx.Rngs(0))
    _fill(model, source, block)
    return config, model
