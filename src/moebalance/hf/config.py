"""config.json of DeepSeek-V4 checkpoints <-> moebalance's `Config`.

Three styles are read, told apart by their keys:

    transformers 5.x  layer_types (sliding_attention / compressed_sparse_attention /
                      heavily_compressed_attention) + compress_rates, mlp_layer_types (hash_moe /
                      moe), nested rope_parameters {main, compress} (YaRN in compress),
                      partial_rotary_factor, dtype
    flat              compress_ratios, num_hash_layers, qk_rope_head_dim, rope_scaling (YaRN of
                      the compressed layers), torch_dtype: the keys transformers still accepts
                      and moebalance wrote before
    DeepSeek          the release's inference ModelArgs: dim, n_layers, n_heads, ... (has `dim`)

`config_to_hf` writes transformers' style; every key of ours that it does not determine goes
under `moebalance_config`, so a round trip gives the same Config.
"""

from __future__ import annotations

import dataclasses
import math

from moebalance.config import Config, ConfigError

_HF_KEYS = {  # transformers' key -> ours, the same in every style
    "vocab_size": "vocab_size", "hidden_size": "base_emb_dim",
    "num_hidden_layers": "base_num_decoder_layers", "num_attention_heads": "base_num_query_heads",
    "num_key_value_heads": "base_num_kv_heads", "head_dim": "head_dim",
    "q_lora_rank": "q_lora_rank", "o_groups": "o_groups", "o_lora_rank": "o_lora_rank",
    "sliding_window": "sliding_window_size", "rope_theta": "rope_max_timescale",
    "compress_rope_theta": "compress_rope_theta", "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim", "index_topk": "index_topk", "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters", "hc_eps": "hc_eps",
    "rms_norm_eps": "normalization_layer_epsilon", "n_routed_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok", "moe_intermediate_size": "base_moe_mlp_dim",
    "n_shared_experts": "shared_experts", "scoring_func": "routed_score_func",
    "routed_scaling_factor": "routed_scaling_factor", "norm_topk_prob": "norm_topk_prob",
    "num_nextn_predict_layers": "mtp_num_layers",
}
_YARN = {"factor": "rope_factor", "original_max_position_embeddings":
         "original_max_position_embeddings", "beta_fast": "beta_fast", "beta_slow": "beta_slow"}
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
_CSA_RATIO = 4  # moebalance's CSA (overlapping windows + indexer) is the ratio-4 compressor
_DEFAULT_RATES = {CSA: _CSA_RATIO, HCA: 128}  # transformers' defaults

_OFFICIAL_KEYS = {  # DeepSeek's inference config.json (ModelArgs) -> the flat style
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
    """DeepSeek's ModelArgs JSON -> the flat style (ModelArgs defaults: 1 MTP layer, eps 1e-6)."""
    out = {hf: cfg[key] for key, hf in _OFFICIAL_KEYS.items() if key in cfg}
    out["num_nextn_predict_layers"] = cfg.get("n_mtp_layers", 1)
    out["num_key_value_heads"] = 1
    if cfg.get("rope_factor", 1) > 1:
        out["rope_scaling"] = {"type": "yarn", "factor": cfg["rope_factor"],
                               "original_max_position_embeddings": cfg["original_seq_len"],
                               "beta_fast": cfg["beta_fast"], "beta_slow": cfg["beta_slow"]}
    return out


def _check_csa(rate) -> None:
    if rate != _CSA_RATIO:
        raise ConfigError(f"config.json: the {CSA} rate is {rate}; moebalance's CSA layers "
                          f"compress {_CSA_RATIO} tokens per entry")


def _layers(hf: dict) -> dict:
    """compress_ratios and first_num_hash_layers from either style."""
    if "layer_types" in hf:
        rates = {**_DEFAULT_RATES, **(hf.get("compress_rates") or {})}
        used = set(hf["layer_types"]) - {"sliding_attention"}
        if CSA in used:
            _check_csa(rates[CSA])
        if HCA in used and rates[HCA] in (0, 1, _CSA_RATIO):
            raise ConfigError(f"config.json: compress_rates[{HCA}] = {rates[HCA]}; it must be "
                              f">= 2 and not {_CSA_RATIO} (the CSA ratio)")
        ratios = [0 if t == "sliding_attention" else rates[t] for t in hf["layer_types"]]
    elif "compress_ratios" in hf:  # transformers reads 4 / 128 as CSA / HCA at these rates
        rates = {_CSA_RATIO: hf.get("compress_rate_csa", _CSA_RATIO),
                 128: hf.get("compress_rate_hca", 128)}
        _check_csa(rates[_CSA_RATIO])
        ratios = [rates.get(r, r) for r in hf["compress_ratios"]]
    else:
        raise ConfigError("config.json describes no attention layers: it needs layer_types "
                          "(transformers) or compress_ratios")
    kinds = hf.get("mlp_layer_types")
    if kinds is None:
        return {"compress_ratios": ratios, "first_num_hash_layers": hf.get("num_hash_layers", 0)}
    hashed = kinds.count("hash_moe")
    if kinds != ["hash_moe"] * hashed + ["moe"] * (len(kinds) - hashed):
        raise ConfigError(f"config.json: mlp_layer_types {kinds}: moebalance hash-routes only "
                          "leading layers (hash_moe first, then moe)")
    return {"compress_ratios": ratios, "first_num_hash_layers": hashed}


def _rope(hf: dict) -> dict:
    """RoPE thetas, rotary dims and the compressed layers' YaRN from either style."""
    rope = hf.get("rope_parameters") or {}
    nested = isinstance(rope.get("main"), dict)
    values = {}
    if nested:
        main, yarn = rope["main"], rope.get("compress") or {}
        if main.get("rope_type", "default") != "default":
            raise ConfigError(f"config.json: rope_parameters.main is {main.get('rope_type')!r}; "
                              "DeepSeek-V4's uncompressed layers use plain RoPE ('default')")
        values.update(rope_max_timescale=main["rope_theta"],
                      compress_rope_theta=yarn["rope_theta"])
    else:
        yarn = rope or hf.get("rope_scaling") or {}
    factor = hf.get("partial_rotary_factor")
    if factor is not None:
        values["qk_rope_head_dim"] = int(hf["head_dim"] * factor)  # as transformers derives it
    elif "qk_rope_head_dim" in hf:
        values["qk_rope_head_dim"] = hf["qk_rope_head_dim"]
    if yarn.get("rope_type", yarn.get("type")) != "yarn":
        return values
    # transformers fills in 1.0 for the flat style only; a nested YaRN without it scales cos/sin
    attention_factor = yarn.get("attention_factor", None if nested else 1.0)
    if attention_factor != 1.0:
        raise ConfigError(f"config.json: YaRN attention_factor {attention_factor} (None: "
                          "transformers' default 0.1 ln(factor) + 1); DeepSeek-V4 does not scale "
                          "cos/sin: set rope_parameters.compress.attention_factor to 1.0")
    values.update({ours: yarn[key] for key, ours in _YARN.items() if key in yarn})
    return values


def _values(hf: dict) -> dict:
    """Our keys that a config.json of any style determines."""
    if "dim" in hf:
        hf = official_config_to_hf(hf)
    values = {ours: hf[key] for key, ours in _HF_KEYS.items() if key in hf}
    if "swiglu_limit" in hf:  # transformers always clamps: "off" is written as Infinity
        values["swiglu_limit"] = 0.0 if math.isinf(hf["swiglu_limit"]) else hf["swiglu_limit"]
    values.update(_layers(hf), **_rope(hf))
    defaults = dataclasses.asdict(Config())  # a context shorter than our default training length bounds it
    longest = (values.get("original_max_position_embeddings",
                          defaults["original_max_position_embeddings"])
               * values.get("rope_factor", defaults["rope_factor"]))
    values["max_target_length"] = min(defaults["max_target_length"], int(longest))
    dtype = hf.get("dtype", hf.get("torch_dtype"))
    if dtype in ("float32", "bfloat16"):
        values["weight_dtype"] = dtype
    values["model_name"] = hf.get("_name_or_path") or "hf-import"
    return values


def config_from_hf(hf: dict, **overrides) -> Config:
    """A Config from a config.json of any style; `moebalance_config` and `overrides` win."""
    if hf.get("tie_word_embeddings"):
        raise ConfigError("config.json: tied embeddings are not DeepSeek-V4 (tie_word_embeddings)")
    return Config(**{**_values(hf), **hf.get("moebalance_config", {}), **overrides})


def _layer_types(cfg: Config) -> tuple[list[str], dict[str, int]]:
    ratios = cfg.compress_ratios[: cfg.base_num_decoder_layers]
    heavy = sorted({r for r in ratios if r not in (0, _CSA_RATIO)})
    if len(heavy) > 1:
        raise ConfigError(f"compress_ratios: transformers' DeepSeek-V4 has one heavily-compressed "
                          f"ratio, this model uses {heavy}")
    rates = {CSA: _CSA_RATIO, HCA: heavy[0] if heavy else _DEFAULT_RATES[HCA]}
    types = ["sliding_attention" if r == 0 else CSA if r == _CSA_RATIO else HCA for r in ratios]
    return types, rates


def config_to_hf(cfg: Config) -> dict:
    """transformers' config.json for `cfg`, plus `moebalance_config`: our keys it leaves out."""
    layers, hashed = cfg.base_num_decoder_layers, cfg.first_num_hash_layers
    types, rates = _layer_types(cfg)
    partial = cfg.qk_rope_head_dim / cfg.head_dim
    compress = {"rope_type": "default", "rope_theta": cfg.compress_rope_theta,
                "partial_rotary_factor": partial}
    norm = cfg.norm_topk_prob
    out = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        **{key: getattr(cfg, ours) for key, ours in _HF_KEYS.items()},
        "norm_topk_prob": cfg.routed_score_func != "softmax" if norm is None else norm,
        "swiglu_limit": cfg.swiglu_limit or math.inf,
        "layer_types": types, "compress_rates": rates,
        "mlp_layer_types": ["hash_moe"] * hashed + ["moe"] * (layers - hashed),
        "partial_rotary_factor": partial,
        "rope_parameters": {"main": {"rope_type": "default", "rope_theta": cfg.rope_max_timescale,
                                     "partial_rotary_factor": partial},
                            "compress": compress},
        "dtype": cfg.weight_dtype, "tie_word_embeddings": False, "hidden_act": "silu",
    }
    if cfg.rope_factor > 1:  # YaRN on the compressed layers; transformers checks the context
        compress.update(rope_type="yarn", attention_factor=1.0,
                        **{key: getattr(cfg, ours) for key, ours in _YARN.items()})
        out["max_position_embeddings"] = int(cfg.original_max_position_embeddings
                                             * cfg.rope_factor)
    implied = {**dataclasses.asdict(Config()), **_values(out)}
    out["moebalance_config"] = {key: value for key, value in dataclasses.asdict(cfg).items()
                                if implied[key] != value}
    return out
