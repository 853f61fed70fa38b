"""Checkpoint interop with the Hugging Face layout of DeepSeek-V4 (transformers'
`DeepseekV4ForCausalLM`): config.json + safetensors (sharded with model.safetensors.index.json).

    save(model, config, path)   -> writes config.json and the tensors, bit-exact on the way back
    load(path)                  -> (Config, DeepSeekV4)

Names and layouts follow transformers' port (Linear weights [out, in]; routed experts fused as
`mlp.experts.gate_up_proj` [E, 2F, D] and `down_proj` [E, D, F]). The MTP layer, which
transformers drops, is kept under `mtp.0.` with the same block names.

Quantised tensors are dequantised on import, by their stored dtype:
    FP8 e4m3 weight + `<name>_scale_inv` (or `<module>.scale`): W = w * S[o // 128, i // 128]
    FP4 e2m1 packed in int8 (two per byte, low nibble first) + a scale per 32 inputs:
        W[o, i] = E2M1[nibble(o, i)] * S[o, i // 32]
Scales may be float32 or ue8m0 (F8_E8M0, 2^(u-127)). DeepSeek's own release layout (its
inference config.json with `dim`, `n_layers`, ...; tensors `layers.N.attn.wq_a.weight` + `.scale`,
one tensor per routed expert in FP4) is read too: `official_to_hf` renames it to the HF layout
(stacking the experts) before the import.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import ml_dtypes
import numpy as np
from flax import nnx

from moebalance import safetensors_io as st
from moebalance.config import Config
from moebalance.model.transformer import DeepSeekV4

# --- config.json ------------------------------------------------------------------------------

_HF_KEYS = {  # HF config key -> our key
    "vocab_size": "vocab_size", "hidden_size": "base_emb_dim",
    "num_hidden_layers": "base_num_decoder_layers", "num_attention_heads": "base_num_query_heads",
    "num_key_value_heads": "base_num_kv_heads", "head_dim": "head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim", "q_lora_rank": "q_lora_rank", "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank", "sliding_window": "sliding_window_size",
    "compress_ratios": "compress_ratios", "rope_theta": "rope_max_timescale",
    "compress_rope_theta": "compress_rope_theta", "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim", "index_topk": "index_topk", "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters", "hc_eps": "hc_eps",
    "rms_norm_eps": "normalization_layer_epsilon", "n_routed_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok", "moe_intermediate_size": "base_moe_mlp_dim",
    "n_shared_experts": "shared_experts", "scoring_func": "routed_score_func",
    "routed_scaling_factor": "routed_scaling_factor", "norm_topk_prob": "norm_topk_prob",
    "swiglu_limit": "swiglu_limit", "num_hash_layers": "first_num_hash_layers",
    "num_nextn_predict_layers": "mtp_num_layers",
}
_YARN = {"factor": "rope_factor", "original_max_position_embeddings":
         "original_max_position_embeddings", "beta_fast": "beta_fast", "beta_slow": "beta_slow"}


_OFFICIAL_KEYS = {  # DeepSeek's inference config.json (ModelArgs) -> HF key
    "vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads", "head_dim": "head_dim", "rope_head_dim": "qk_rope_head_dim",
    "q_lora_rank": "q_lora_rank", "o_groups": "o_groups", "o_lora_rank": "o_lora_rank",
    "window_size": "sliding_window", "compress_ratios": "compress_ratios",
    "rope_theta": "rope_theta", "compress_rope_theta": "compress_rope_theta",
    "index_n_heads": "index_n_heads", "index_head_dim": "index_head_dim",
    "index_topk": "index_topk", "hc_mult": "hc_mult", "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "n_routed_experts": "n_routed_experts", "n_activated_experts": "num_experts_per_tok",
    "moe_inter_dim": "moe_intermediate_size", "n_shared_experts": "n_shared_experts",
    "score_func": "scoring_func", "route_scale": "routed_scaling_factor",
    "swiglu_limit": "swiglu_limit", "n_hash_layers": "num_hash_layers",
}


def official_config_to_hf(cfg: dict) -> dict:
    """DeepSeek's ModelArgs JSON -> HF config keys (ModelArgs defaults: 1 MTP layer, eps 1e-6)."""
    out = {hf: cfg[key] for key, hf in _OFFICIAL_KEYS.items() if key in cfg}
    out["num_nextn_predict_layers"] = cfg.get("n_mtp_layers", 1)
    out["num_key_value_heads"] = 1
    if cfg.get("rope_factor", 1) > 1:
        out["rope_scaling"] = {"type": "yarn", "factor": cfg["rope_factor"],
                               "original_max_position_embeddings": cfg["original_seq_len"],
                               "beta_fast": cfg["beta_fast"], "beta_slow": cfg["beta_slow"]}
    return out


_OFFICIAL_BLOCK = [  # (regex on the name inside a block, replacement)
    (r"attn_norm\.weight", "input_layernorm.weight"),
    (r"ffn_norm\.weight", "post_attention_layernorm.weight"),
    (r"hc_(attn|ffn)_(fn|base|scale)", r"\1_hc.\2"),
    (r"attn\.attn_sink", "self_attn.sinks"),
    (r"attn\.indexer\.compressor\.(.*)", r"self_attn.compressor.indexer.C.\1"),
    (r"attn\.indexer\.weights_proj\.(.*)", r"self_attn.compressor.indexer.scorer.weights_proj.\1"),
    (r"attn\.indexer\.wq_b\.(.*)", r"self_attn.compressor.indexer.q_b_proj.\1"),
    (r"attn\.compressor\.(.*)", r"self_attn.compressor.C.\1"),
    (r"attn\.(wq_a|q_norm|wq_b|wkv|kv_norm|wo_a|wo_b)\.(.*)", r"self_attn.P.\1.\2"),
    (r"ffn\.gate\.bias", "mlp.gate.e_score_correction_bias"),
    (r"ffn\.gate\.(weight|tid2eid)", r"mlp.gate.\1"),
    (r"ffn\.shared_experts\.(w[123])\.(.*)", r"mlp.shared_experts.S.\1.\2"),
]
_PROJ = {"wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj", "wkv": "kv_proj",
         "kv_norm": "kv_norm", "wo_a": "o_a_proj", "wo_b": "o_b_proj"}
_COMPRESSOR = {"ape": "position_bias", "norm.weight": "kv_norm.weight", "wkv.weight":
               "kv_proj.weight", "wgate.weight": "gate_proj.weight"}
_SHARED = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_OFFICIAL_TOP = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
                 "norm.weight": "model.norm.weight"}


def _official_block_name(rest: str) -> str | None:
    for pattern, repl in _OFFICIAL_BLOCK:
        if re.fullmatch(pattern, rest):
            name = re.sub(pattern, repl, rest)
            break
    else:
        return None
    if ".C." in name:  # compressor parts
        head, part = name.split(".C.")
        name = f"{head}.{_COMPRESSOR.get(part, part)}"
    elif ".P." in name:  # attention projections
        head, part = name.split(".P.")
        proj, _, tail = part.partition(".")
        name = f"{head}.{_PROJ[proj]}.{tail}"
    elif ".S." in name:  # shared experts
        head, part = name.split(".S.")
        w, _, tail = part.partition(".")
        name = f"{head}.{_SHARED[w]}.{tail}"
    if name.endswith(".scale") and not name.endswith("hc.scale"):
        name = name[: -len(".scale")] + ".weight_scale_inv"
    return name


def official_to_hf(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rename DeepSeek's release tensors to the HF layout; per-expert w1/w3/w2 (and their scales)
    are stacked into gate_up_proj [E, 2F, .] and down_proj [E, D, .]. Unknown names are kept, so
    the import reports them."""
    out, experts = {}, {}
    for name, value in tensors.items():
        m = re.fullmatch(r"(layers\.\d+|mtp\.0)\.ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)",
                         name)
        if m:
            prefix, e, w, kind = m.groups()
            experts.setdefault((prefix, w, kind), {})[int(e)] = value
            continue
        if name in _OFFICIAL_TOP:
            out[_OFFICIAL_TOP[name]] = value
            continue
        m = re.fullmatch(r"(mtp\.0\.)?hc_head_(fn|base|scale)", name)
        if m:
            out[f"{'mtp.0' if m.group(1) else 'model'}.hc_head.hc_{m.group(2)}"] = value
            continue
        m = re.fullmatch(r"(layers\.\d+|mtp\.0)\.(.*)", name)
        block = _official_block_name(m.group(2)) if m else None
        if block is not None:
            prefix = "model." + m.group(1) if m.group(1).startswith("layers") else m.group(1)
            out[f"{prefix}.{block}"] = value
        elif m and m.group(1) == "mtp.0" and m.group(2).split(".")[0] in (
                "e_proj", "h_proj", "enorm", "hnorm", "norm"):
            rest = m.group(2)
            out["mtp.0." + (rest[: -len(".scale")] + ".weight_scale_inv"
                            if rest.endswith(".scale") else rest)] = value
        else:
            out[name] = value
    for (prefix, w, kind), by_expert in experts.items():
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])
        base = ("model." + prefix if prefix.startswith("layers") else prefix) + ".mlp.experts."
        suffix = "" if kind == "weight" else "_scale_inv"
        if w == "w2":
            out[base + "down_proj" + suffix] = stacked
        else:
            out.setdefault(("fuse", base + "gate_up_proj" + suffix), {})[w] = stacked
    for key in [k for k in out if isinstance(k, tuple)]:
        parts = out.pop(key)
        out[key[1]] = np.concatenate([parts["w1"], parts["w3"]], axis=1)
    return out


def config_to_hf(cfg: Config) -> dict:
    """HF's config.json keys, plus every other key of ours under `moebalance_config`."""
    out = {hf: getattr(cfg, ours) for hf, ours in _HF_KEYS.items()}
    covered = set(_HF_KEYS.values()) | set(_YARN.values())
    out["moebalance_config"] = {k: v for k, v in dataclasses.asdict(cfg).items()
                                if k not in covered}
    out.update(architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4",
               tie_word_embeddings=False, torch_dtype=cfg.weight_dtype, hidden_act="silu")
    if cfg.rope_factor > 1:
        out["rope_scaling"] = {"type": "yarn", **{k: getattr(cfg, v) for k, v in _YARN.items()}}
    return out


def config_from_hf(hf: dict, **overrides) -> Config:
    if hf.get("tie_word_embeddings"):
        raise ValueError("config.json: tied embeddings are not DeepSeek-V4 (tie_word_embeddings)")
    values = {ours: hf[key] for key, ours in _HF_KEYS.items() if key in hf}
    scaling = hf.get("rope_scaling") or {}
    if scaling.get("type", scaling.get("rope_type")) == "yarn":
        values.update({ours: scaling[k] for k, ours in _YARN.items() if k in scaling})
    if hf.get("torch_dtype") in ("float32", "bfloat16"):
        values["weight_dtype"] = hf["torch_dtype"]
    values["model_name"] = hf.get("_name_or_path") or "hf-import"
    values.update(hf.get("moebalance_config", {}))
    values.update(overrides)
    return Config(**values)


# --- tensor names and layouts ---------------------------------------------------------------

# Our path inside a block -> (HF name inside `model.layers.N.`, layout).
_BLOCK = {
    ("attn_norm", "weight"): ("input_layernorm.weight", "same"),
    ("ffn_norm", "weight"): ("post_attention_layernorm.weight", "same"),
    ("attn", "wq_a"): ("self_attn.q_a_proj.weight", "T"),
    ("attn", "q_norm", "weight"): ("self_attn.q_a_norm.weight", "same"),
    ("attn", "wq_b"): ("self_attn.q_b_proj.weight", "T"),
    ("attn", "wkv"): ("self_attn.kv_proj.weight", "T"),
    ("attn", "kv_norm", "weight"): ("self_attn.kv_norm.weight", "same"),
    ("attn", "attn_sink"): ("self_attn.sinks", "same"),
    ("attn", "wo_a"): ("self_attn.o_a_proj.weight", "wo_a"),
    ("attn", "wo_b"): ("self_attn.o_b_proj.weight", "T"),
    ("attn", "indexer", "wq_b"): ("self_attn.compressor.indexer.q_b_proj.weight", "T"),
    ("attn", "indexer", "weights_proj"): (
        "self_attn.compressor.indexer.scorer.weights_proj.weight", "T"),
    ("ffn", "router"): ("mlp.gate.weight", "T"),
    ("ffn", "bias"): ("mlp.gate.e_score_correction_bias", "same"),
    ("ffn", "hash_table"): ("mlp.gate.tid2eid", "same"),
    ("ffn", "w1"): ("mlp.experts.gate_up_proj", "gate"),
    ("ffn", "w3"): ("mlp.experts.gate_up_proj", "up"),
    ("ffn", "w2"): ("mlp.experts.down_proj", "experts"),
    ("ffn", "shared", "w1"): ("mlp.shared_experts.gate_proj.weight", "T"),
    ("ffn", "shared", "w3"): ("mlp.shared_experts.up_proj.weight", "T"),
    ("ffn", "shared", "w2"): ("mlp.shared_experts.down_proj.weight", "T"),
}
for _hc in ("attn_hc", "ffn_hc"):
    _BLOCK[(_hc, "fn")] = (f"{_hc}.fn", "T")
    _BLOCK[(_hc, "base")] = (f"{_hc}.base", "same")
    _BLOCK[(_hc, "scale")] = (f"{_hc}.scale", "same")
for _ours, _hf in ((("attn", "compressor"), "self_attn.compressor"),
                   (("attn", "indexer", "compressor"), "self_attn.compressor.indexer")):
    _BLOCK[(*_ours, "wkv")] = (f"{_hf}.kv_proj.weight", "T")
    _BLOCK[(*_ours, "wgate")] = (f"{_hf}.gate_proj.weight", "T")
    _BLOCK[(*_ours, "ape")] = (f"{_hf}.position_bias", "same")
    _BLOCK[(*_ours, "norm", "weight")] = (f"{_hf}.kv_norm.weight", "same")

_TOP = {
    ("embed",): ("model.embed_tokens.weight", "same"),
    ("head",): ("lm_head.weight", "T"),
    ("norm", "weight"): ("model.norm.weight", "same"),
    ("hc_head", "fn"): ("model.hc_head.hc_fn", "T"),
    ("hc_head", "base"): ("model.hc_head.hc_base", "same"),
    ("hc_head", "scale"): ("model.hc_head.hc_scale", "same"),
    ("mtp", "enorm", "weight"): ("mtp.0.enorm.weight", "same"),
    ("mtp", "hnorm", "weight"): ("mtp.0.hnorm.weight", "same"),
    ("mtp", "norm", "weight"): ("mtp.0.norm.weight", "same"),
    ("mtp", "e_proj"): ("mtp.0.e_proj.weight", "T"),
    ("mtp", "h_proj"): ("mtp.0.h_proj.weight", "T"),
    ("mtp", "hc_head", "fn"): ("mtp.0.hc_head.hc_fn", "T"),
    ("mtp", "hc_head", "base"): ("mtp.0.hc_head.hc_base", "same"),
    ("mtp", "hc_head", "scale"): ("mtp.0.hc_head.hc_scale", "same"),
}


def _to_hf(x: np.ndarray, layout: str) -> np.ndarray:
    if layout == "T":
        return x.T
    if layout == "wo_a":  # [G, in/G, r] -> [G*r, in/G]
        return x.transpose(0, 2, 1).reshape(-1, x.shape[1])
    if layout in ("gate", "up", "experts"):  # [E, a, b] -> [E, b, a]
        return x.transpose(0, 2, 1)
    return x


def _from_hf(x: np.ndarray, layout: str, shape) -> np.ndarray:
    if layout == "T":
        return x.T
    if layout == "wo_a":
        return x.reshape(shape[0], shape[2], shape[1]).transpose(0, 2, 1)
    if layout == "gate":
        return x[:, : shape[2]].transpose(0, 2, 1)
    if layout == "up":
        return x[:, shape[2]:].transpose(0, 2, 1)
    if layout == "experts":
        return x.transpose(0, 2, 1)
    return x


def _hf_shape(shape, layout) -> tuple:
    """The HF shape of one of our tensors (the fused [E, 2F, D] for routed w1/w3)."""
    if layout in ("gate", "up"):
        return (shape[0], 2 * shape[2], shape[1])
    return tuple(_to_hf(np.empty(shape, np.bool_), layout).shape)


def _entries(model: DeepSeekV4):
    """(our path, HF name, layout, layer or None, index into a stacked array or None, Variable)."""
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if path[0] == "segments":
            start, period, repeats = model.layout[path[1]]
            if repeats == 1:
                rest, places = path[2:], [(start, None)]
            else:  # ('segments', s, 'units', 'blocks', b, *rest), stacked over units
                rest = path[5:]
                places = [(start + r * period + path[4], r) for r in range(repeats)]
            name, layout = _BLOCK[rest]
            for layer, index in places:
                yield path, f"model.layers.{layer}.{name}", layout, index, var
        elif path[0] == "mtp" and path[1] == "block":
            name, layout = _BLOCK[path[2:]]
            yield path, f"mtp.0.{name}", layout, None, var
        else:
            name, layout = _TOP[path]
            yield path, name, layout, None, var


def to_hf_tensors(model: DeepSeekV4) -> dict[str, np.ndarray]:
    out, fused = {}, {}
    for _, name, layout, index, var in _entries(model):
        value = np.asarray(var[...])
        value = value if index is None else value[index]
        if layout in ("gate", "up"):
            fused.setdefault(name, {})[layout] = _to_hf(value, layout)
        else:
            out[name] = np.ascontiguousarray(_to_hf(value, layout))
    for name, parts in fused.items():
        out[name] = np.concatenate([parts["gate"], parts["up"]], axis=1)
    return out


# --- dequantisation ---------------------------------------------------------------------------

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def scale_names(name: str) -> tuple[str, str]:
    """Where a quantised weight's scale may be: HF's `<name>_scale_inv`, DeepSeek's `.scale`."""
    return f"{name}_scale_inv", name.rsplit(".", 1)[0] + ".scale"


def _scale_of(name: str, tensors) -> np.ndarray:
    for candidate in scale_names(name):
        if candidate in tensors:
            return np.asarray(tensors[candidate]).astype(np.float32)
    raise ValueError(f"quantised tensor {name} has no scale ({' or '.join(scale_names(name))})")


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
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    tensors = {}
    for file in files:
        tensors.update(st.load(path / file))
    return tensors


def save(model: DeepSeekV4, config: Config, path, *, max_shard_bytes: int = 2 * 1024**3):
    """Write config.json and the tensors (sharded past max_shard_bytes, with an index).

    Refuses a directory that already holds a checkpoint; files are written atomically.
    """
    path = Path(path)
    if (path / "config.json").exists():
        raise FileExistsError(f"{path} already holds a checkpoint; choose a new directory")
    path.mkdir(parents=True, exist_ok=True)
    tensors = to_hf_tensors(model)
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensors[name]
        size += nbytes
    shards.append(current)
    names = ([f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
             if len(shards) > 1 else ["model.safetensors"])
    for shard, file in zip(shards, names):
        st.save(shard, path / file, metadata={"format": "pt"})
    if len(shards) > 1:
        weight_map = {n: f for shard, f in zip(shards, names) for n in shard}
        total = sum(t.nbytes for t in tensors.values())
        _write_json(path / "model.safetensors.index.json",
                    {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(path / "config.json", config_to_hf(config))


def _write_json(path: Path, data) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def load(path, **overrides) -> tuple[Config, DeepSeekV4]:
    """Import a checkpoint in the HF layout. Any tensor whose name or shape does not fit the
    config raises an error naming the first such tensor."""
    path = Path(path)
    raw_config = json.loads((path / "config.json").read_text())
    tensors = _read_tensors(path)
    if "embed.weight" in tensors:  # DeepSeek's own release layout
        tensors = official_to_hf(tensors)
        if "dim" in raw_config:
            raw_config = {**official_config_to_hf(raw_config),
                          "quantization_config": raw_config.get("quantization_config")}
    config = config_from_hf(raw_config, **overrides)
    block = (raw_config.get("quantization_config") or {}).get("weight_block_size", [128])[0]
    tables = [np.asarray(tensors.get(f"model.layers.{i}.mlp.gate.tid2eid"))
              for i in range(config.first_num_hash_layers)]
    for i, t in enumerate(tables):
        if t.ndim != 2:
            raise ValueError(f"missing tensor model.layers.{i}.mlp.gate.tid2eid")
    model = DeepSeekV4(config, hash_tables=tables, rngs=nnx.Rngs(0))
    used, values = set(), {}
    for ours, name, layout, index, var in _entries(model):
        if name not in tensors:
            raise ValueError(f"checkpoint lacks tensor {name} (for {'.'.join(map(str, ours))})")
        shape = var.shape if index is None else var.shape[1:]
        hf_shape = _hf_shape(shape, layout)
        raw = dequantize(name, tensors, hf_shape, block)
        if tuple(raw.shape) != hf_shape:
            raise ValueError(f"tensor {name} has shape {tuple(tensors[name].shape)}, the config "
                             f"needs {hf_shape}")
        used.update({name, *scale_names(name)})
        value = _from_hf(np.asarray(raw), layout, shape).astype(var.dtype)
        values.setdefault(ours, [None] * (1 if index is None else var.shape[0]))[index or 0] = value
    unknown = sorted(set(tensors) - used)
    if unknown:
        raise ValueError(f"checkpoint tensor {unknown[0]} matches nothing in the config "
                         f"({len(unknown)} such tensors)")
    for ours, var in nnx.to_flat_state(nnx.state(model)):
        parts = values[ours]
        var[...] = parts[0] if parts[0].shape == var.shape else np.stack(parts)
    return config, model
