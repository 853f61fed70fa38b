"""The rules a config must satisfy, each refusal naming the key and the fix:

    validate(cfg)              every key in its range, no two keys contradicting each other
                               (`Config` runs it on every instance, a replaced one too)
    moot_keys(values, keys)    which of `keys` the rest of the config makes moot: a key whose
                               field declares what it `Needs` (config.py) takes effect only while
                               those keys hold such values; `load_config` refuses the keys the
                               user gave (overrides and their own YAML, not a preset's defaults)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from moebalance.config import (DISPATCH_MODES, DROP_POLICIES, EXPERT_KERNELS, MATMUL_PRECISIONS,
                               REMAT_POLICIES, STEP_PROGRAMS, Config, ConfigError)


def _require(ok: bool, key: str, message: str):
    if not ok:
        raise ConfigError(f"config key `{key}`: {message}")


def _choice(c: Config, key: str, noun: str, options) -> None:
    """Refuse a value of `key` outside `options`, naming them."""
    value = getattr(c, key)
    _require(value in options, key, f"unknown {noun} {value!r}; choose one of {options}")


def validate(c: Config) -> None:
    """Refuse a config whose keys are out of range or contradict each other (ConfigError, naming
    the key and the fix)."""
    layers = c.base_num_decoder_layers
    for key in ("vocab_size", "base_emb_dim", "base_num_decoder_layers", "base_num_query_heads",
                "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "index_n_heads",
                "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters",
                "max_target_length"):
        _require(getattr(c, key) >= 1, key, f"must be >= 1, got {getattr(c, key)}")
    _require(c.sliding_window_size > 0, "sliding_window_size",
             f"must be > 0, got {c.sliding_window_size}")
    _require(c.base_num_kv_heads == 1, "base_num_kv_heads",
             "DeepSeek-V4 attention has exactly one shared K=V head; set it to 1")
    _require(len(c.compress_ratios) in (layers, layers + c.mtp_num_layers), "compress_ratios",
             f"has {len(c.compress_ratios)} entries for base_num_decoder_layers={layers} "
             f"(give one per layer, optionally + one per MTP layer)")
    _require(all(r == 0 or r >= 2 for r in c.compress_ratios), "compress_ratios",
             f"entries must be 0 (off) or >= 2, got {c.compress_ratios}")
    _require(0 <= c.first_num_hash_layers <= layers, "first_num_hash_layers",
             f"must be in [0, base_num_decoder_layers={layers}], got {c.first_num_hash_layers}")
    _require(c.base_num_query_heads % c.o_groups == 0, "o_groups",
             f"base_num_query_heads={c.base_num_query_heads} is not divisible by "
             f"o_groups={c.o_groups}")
    for key, width in (("head_dim", c.head_dim), ("index_head_dim", c.index_head_dim)):
        _require(0 < c.qk_rope_head_dim <= width and c.qk_rope_head_dim % 2 == 0,
                 "qk_rope_head_dim", f"must be even and in (0, {key}={width}], "
                 f"got {c.qk_rope_head_dim}")
    _require(c.mtp_num_layers in (0, 1), "mtp_num_layers", f"must be 0 or 1, got {c.mtp_num_layers}")
    _choice(c, "remat_policy", "policy", REMAT_POLICIES)
    _choice(c, "step_programs", "value", STEP_PROGRAMS)
    _choice(c, "matmul_precision", "precision", MATMUL_PRECISIONS)
    _require(c.rope_factor >= 1.0, "rope_factor", f"must be >= 1 (1 = no YaRN), got {c.rope_factor}")
    longest = int(c.original_max_position_embeddings * c.rope_factor)
    _require(c.max_target_length <= longest, "max_target_length",
             f"{c.max_target_length} is longer than the model supports: "
             f"original_max_position_embeddings x rope_factor = {longest}; shorten it or raise "
             "rope_factor (YaRN)")
    from moebalance.routing import HASH_TABLES

    _choice(c, "hash_table", "method", sorted(HASH_TABLES))
    from moebalance.balancing import BIAS_RULES

    rules = (*BIAS_RULES, "quantile")
    _choice(c, "routed_bias_update_rule", "rule", rules)
    _require(c.routed_bias_update_rate >= 0 or c.routed_bias_update_rate == -1,
             "routed_bias_update_rate", f"must be >= 0 (or -1: the rule's default), got "
             f"{c.routed_bias_update_rate}")
    _require(c.routed_bias_update_rule != "quantile" or c.routed_bias_update_rate <= 1,
             "routed_bias_update_rate", "for the quantile rule it is the damping: in [0, 1], got "
             f"{c.routed_bias_update_rate}")
    _require(0 <= c.routed_bias_update_rate_final_fraction <= 1,
             "routed_bias_update_rate_final_fraction",
             f"must be in [0, 1] (1: a constant rate), got "
             f"{c.routed_bias_update_rate_final_fraction}")
    _require(0 <= c.routed_bias_average_fraction <= 1, "routed_bias_average_fraction",
             f"must be in [0, 1] (0: keep the online bias), got {c.routed_bias_average_fraction}")
    _require(c.routed_bias_calibration_batches >= 0, "routed_bias_calibration_batches",
             f"must be >= 0 (0 turns the calibration off), got "
             f"{c.routed_bias_calibration_batches}")
    _require(c.probe_batches >= 1, "probe_batches",
             f"must be >= 1 (the first is the probe), got {c.probe_batches}")
    _require(c.probe_refit_batches >= 0, "probe_refit_batches",
             f"must be >= 0 (0 turns the refit off), got {c.probe_refit_batches}")
    for key in ("load_balance_loss_weight",
                "global_balance_loss_weight", "router_z_loss_weight", "learning_rate",
                "adam_weight_decay", "gradient_clipping_threshold"):
        _require(getattr(c, key) >= 0, key, f"must be >= 0, got {getattr(c, key)}")
    _require(c.sequence_loss_mode in ("deepseek", "maxtext"), "sequence_loss_mode",
             f"must be 'deepseek' or 'maxtext', got {c.sequence_loss_mode!r}")
    _require(c.dataset_type in ("synthetic", "text", "tokens"), "dataset_type",
             f"must be 'synthetic', 'text' or 'tokens', got {c.dataset_type!r}")
    _require(c.dataset_type != "tokens" or bool(c.dataset_path), "dataset_path",
             "dataset_type 'tokens' needs the token files (or their directory) in dataset_path")
    _require(0 < c.eval_fraction < 1, "eval_fraction", f"must be in (0, 1), got {c.eval_fraction}")
    _require(2 <= c.tokenizer_vocab_size, "tokenizer_vocab_size",
             f"must be >= 2, got {c.tokenizer_vocab_size}")
    _require(c.dataset_type != "text" or c.tokenizer_path != ""
             or c.tokenizer_vocab_size <= c.vocab_size,
             "tokenizer_vocab_size", f"{c.tokenizer_vocab_size} exceeds the model's "
             f"vocab_size={c.vocab_size}; lower it or raise vocab_size")
    for key in ("steps", "per_device_batch_size", "gradient_accumulation_steps",
                "checkpoint_period", "max_num_checkpoints_to_keep", "eval_batches"):
        _require(getattr(c, key) >= 1, key, f"must be >= 1, got {getattr(c, key)}")
    _require(c.eval_period >= 0, "eval_period", f"must be >= 0 (0 = off), got {c.eval_period}")
    _require(0 <= c.warmup_steps_fraction < 1, "warmup_steps_fraction",
             f"must be in [0, 1), got {c.warmup_steps_fraction}")
    ep = c.ici_expert_parallelism
    _require(ep >= 1 or ep == -1, "ici_expert_parallelism", f"must be >= 1 or -1, got {ep}")
    _require(ep < 1 or c.num_experts % ep == 0, "ici_expert_parallelism",
             f"num_experts={c.num_experts} is not divisible by {ep} expert-parallel ranks; choose "
             f"a divisor of num_experts")
    if c.routed_device_limit:
        _require(ep >= 2, "routed_device_limit", f"needs ici_expert_parallelism >= 2 set "
                 f"explicitly (the ranks are the routing groups), got {ep}")
        _require(c.n_routing_groups == 0, "routed_device_limit",
                 "replaces n_routing_groups / topk_routing_group (groups = expert-parallel "
                 "ranks); set n_routing_groups=0")
    _validate_moe(c)


def _validate_moe(c: Config) -> None:
    """The MoE layer's settings, each error naming its key (model.moe.MoEConfig checks the same
    facts for the layer used on its own)."""
    import jax.numpy as jnp

    from moebalance import routing

    for key in ("num_experts", "base_moe_mlp_dim", "moe_block_size"):
        _require(getattr(c, key) >= 1, key, f"must be >= 1, got {getattr(c, key)}")
    _require(c.shared_experts >= 0, "shared_experts", f"must be >= 0, got {c.shared_experts}")
    _require(c.swiglu_limit >= 0, "swiglu_limit", f"must be >= 0 (0 = off), got {c.swiglu_limit}")
    _choice(c, "drop_policy", "policy", DROP_POLICIES)
    _choice(c, "moe_dispatch", "layout", DISPATCH_MODES)
    _choice(c, "moe_kernel", "kernel", EXPERT_KERNELS)
    _require(not (c.moe_kernel == "pallas" and c.moe_dispatch == "ragged"), "moe_kernel",
             "pallas (Triton) takes blocked rows; set moe_dispatch=blocked or choose another "
             "kernel")
    checks = (("num_experts_per_tok", routing.check_topk, (c.num_experts_per_tok, c.num_experts)),
              ("routed_score_func", routing.check_score_fn, (c.routed_score_func,)),
              ("n_routing_groups", routing.check_groups,
               (c.num_experts, c.num_experts_per_tok, c.n_routing_groups, c.topk_routing_group)),
              ("dtype", jnp.dtype, (c.dtype,)), ("weight_dtype", jnp.dtype, (c.weight_dtype,)))
    for key, check, args in checks:
        try:
            check(*args)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"config key `{key}`: {err}") from err


def moot_keys(values: Mapping[str, Any], keys: Iterable[str]) -> dict[str, str]:
    """{key: why it has no effect and the fix} for each of `keys` that a `Needs` of its field
    finds unmet in `values` (a whole config's values by key, e.g. `vars(cfg)`)."""
    moot = {}
    for field in dataclasses.fields(Config):
        if field.name not in keys:
            continue
        for need in field.metadata["needs"]:
            value = values[need.on]
            if not need.holds(value):
                moot[field.name] = (
                    f"config key `{field.name}`: has no effect with {need.on}={_spell(value)} (it "
                    f"takes effect with {need.on} {need.wanted}); leave {field.name} out, or set "
                    f"{need.on}={need.fix}")
                break
    return moot


def refuse_moot(values: Mapping[str, Any], keys: Iterable[str]) -> None:
    """Raise ConfigError naming every one of `keys` that has no effect in `values`."""
    moot = moot_keys(values, keys)
    if moot:
        raise ConfigError("; ".join(moot.values()))


def _spell(value) -> str:
    """A value as a `key=value` override spells it: true/false, '' for empty text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "''" if value == "" else str(value)
