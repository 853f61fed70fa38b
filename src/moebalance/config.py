"""The one typed configuration schema, and loading presets with `key=value` overrides.

Every key, its type, default and a one-line description live in `Config` below (MaxText's key names
where MaxText has the concept). Presets under `moebalance/configs/*.yml` hold only differences from
these defaults. An unknown key, a wrong type or a contradiction fails at load time, naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any

import yaml

PRESET_DIR = Path(__file__).parent / "configs"
DISPATCH_MODES = ("auto", "blocked", "ragged")  # the MoE layer's expert layouts (model/moe.py)
EXPERT_KERNELS = ("auto", "xla", "megablox", "pallas")  # the experts' matmuls (kernels/ops.py)
# model/transformer.py, from the least recomputation to the most; `auto` tries them in this order
# (training/compiled.resolve_remat)
REMAT_ORDER = ("none", "save_experts", "minimal", "full")
REMAT_POLICIES = (*REMAT_ORDER, "auto")
STEP_PROGRAMS = ("one", "segments", "auto")
MATMUL_PRECISIONS = ("auto", "default", "high", "highest")  # model/layers.matmul_precision
DROP_POLICIES = ("probs", "position")  # what goes over capacity first (model/dispatch.py)


def _key(default, help: str):
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass
class Config:
    model_name: str = _key("deepseek4-custom", "name of the model preset")
    # --- sizes ---
    vocab_size: int = _key(129280, "vocabulary size V")
    base_emb_dim: int = _key(64, "model width D")
    base_num_decoder_layers: int = _key(4, "number of transformer blocks L")
    base_num_query_heads: int = _key(4, "attention query heads H")
    base_num_kv_heads: int = _key(1, "key/value heads (DeepSeek-V4: one shared K=V head)")
    head_dim: int = _key(32, "width of one attention head")
    qk_rope_head_dim: int = _key(32, "trailing head dims that get RoPE (interleaved pairs)")
    q_lora_rank: int = _key(16, "rank of the low-rank query projection")
    o_groups: int = _key(4, "groups of heads in the grouped low-rank output projection")
    o_lora_rank: int = _key(16, "rank per output group")
    sliding_window_size: int = _key(32, "causal sliding window of every layer (keys incl. self)")
    compress_ratios: list[int] = _key([0, 0, 4, 0],
                                      "per-layer KV compression: 0 none, 4 CSA, 128 HCA")
    rope_max_timescale: float = _key(10000.0, "RoPE theta of uncompressed layers")
    compress_rope_theta: float = _key(160000.0, "RoPE theta of compressed layers")
    rope_factor: float = _key(1.0, "YaRN factor on compressed layers (1 = no YaRN)")
    original_max_position_embeddings: int = _key(65536, "YaRN original context length")
    beta_fast: float = _key(32.0, "YaRN beta_fast")
    beta_slow: float = _key(1.0, "YaRN beta_slow")
    index_n_heads: int = _key(4, "lightning-indexer heads")
    index_head_dim: int = _key(32, "lightning-indexer head width")
    index_topk: int = _key(16, "compressed entries each query keeps on CSA layers")
    hc_mult: int = _key(4, "hyper-connection residual streams")
    hc_sinkhorn_iters: int = _key(20, "Sinkhorn iterations of the hyper-connection mixing")
    hc_eps: float = _key(1e-6, "hyper-connection epsilon")
    normalization_layer_epsilon: float = _key(1e-6, "RMSNorm epsilon")
    # --- MoE ---
    num_experts: int = _key(8, "routed experts E per MoE layer")
    num_experts_per_tok: int = _key(2, "experts K chosen per token")
    base_moe_mlp_dim: int = _key(32, "hidden width F of one expert")
    shared_experts: int = _key(1, "always-on shared experts")
    routed_score_func: str = _key("sqrtsoftplus", "softmax | sigmoid | sqrtsoftplus")
    routed_scaling_factor: float = _key(1.0, "route scale on the combine weights")
    norm_topk_prob: typing.Optional[bool] = _key(None, "renormalise chosen weights (None: all but softmax)")
    n_routing_groups: int = _key(0, "group-limited routing groups (0 = off)")
    topk_routing_group: int = _key(0, "groups kept per token")
    swiglu_limit: float = _key(0.0, "SwiGLU clamp limit (0 = off)")
    capacity_factor: float = _key(-1.0, "expert capacity factor (<= 0: dropless)")
    drop_policy: str = _key("probs", "over capacity, drop lowest weight (probs) or latest (position)")
    moe_dispatch: str = _key("auto", "blocked | ragged | auto (ragged on TPU, else blocked)")
    moe_block_size: int = _key(256, "rows per block of the blocked dispatch; on the ragged "
                               "one, megablox's row tile")
    moe_kernel: str = _key("auto", "the experts' grouped matmuls: auto (xla, measured fastest on "
                           "every backend) | xla (ragged_dot; on blocks, "
                           "each block's weights picked, then batched matmuls) | megablox (JAX's "
                           "Pallas kernels for TPU) | pallas (Triton kernels for NVIDIA GPUs, "
                           "blocked layout only); Pallas kernels run interpreted off their backend")
    first_num_hash_layers: int = _key(0, "leading blocks routed by a token-id hash table")
    hash_table: str = _key("random", "hash table: zeros | round_robin | random | balanced")
    hash_table_seed: int = _key(0, "seed of the random hash table")
    # --- MTP ---
    mtp_num_layers: int = _key(0, "multi-token-prediction layers (0 or 1)")
    mtp_loss_scaling_factor: float = _key(0.1, "weight of the MTP loss")
    # --- numerics and compilation ---
    dtype: str = _key("float32", "activation dtype (router, bias, hyper-connections stay fp32)")
    weight_dtype: str = _key("float32", "parameter dtype")
    matmul_precision: str = _key("auto", "the model's matmuls: auto (highest for a float32 "
                                 "dtype, else default) | default (the backend's: one bfloat16 "
                                 "pass for float32 operands on a TPU) | high | highest")
    scan_layers: bool = _key(True, "run repeated blocks under a scan (fast compile)")
    remat_policy: str = _key("none", "what each block keeps for the backward pass, the rest "
                             "recomputed: none (everything) | full (its inputs only) | minimal "
                             "(+ the weight matmuls' outputs) | save_experts (+ the routed "
                             "experts' matmuls') | auto (the least recompute whose step, "
                             "compiled for the run's devices, fits their memory)")
    step_programs: str = _key("one", "the training step as one program (one) | as a chain of "
                              "programs per model segment, forward and backward, which XLA "
                              "compiles side by side (segments: a model of several block kinds "
                              "compiles sooner; each step then runs ~2 programs per segment) | "
                              "auto (segments on a TPU, else one)")
    max_target_length: int = _key(256, "training sequence length S")
    # --- load balancing (applied by the trainer) ---
    routed_bias: bool = _key(True, "update the aux-loss-free selection bias after each step")
    routed_bias_update_rate: float = _key(-1.0, "bias step size (gamma; for quantile the damping "
                                          "in (0, 1]); 0 freezes the bias; -1: the rule's default "
                                          "(sign 1e-3, proportional 1e-4, fraction 1, quantile 1)")
    routed_bias_update_rule: str = _key("sign", "sign | proportional | fraction | quantile")
    routed_bias_freeze_step: int = _key(-1, "bias rate becomes 0 from this step on (-1: never)")
    routed_bias_update_rate_final_fraction: float = _key(
        1.0, "the bias rate follows a cosine from its value to value * this at the last step "
        "(1: constant)")
    routed_bias_calibration_batches: int = _key(
        0, "after the last step, refit every top-k bias at the final weights on the next N "
        "(fresh, never trained on) training batches (undamped Quantile Balancing on all their "
        "tokens) and keep it: the saved bias balances the data as the final weights route it "
        "(0: keep the online bias; runs without routed_bias skip it)")
    probe_batches: int = _key(8, "held-out micro-batches measured before the first step and "
                              "after the last (the first is the probe of the seed's table): the "
                              "A/B report's mean summed variance and its spread over them")
    probe_refit_batches: int = _key(8, "after the last step, also measure the probe with every "
                                    "top-k bias refitted to balance this many fresh training "
                                    "batches (after the calibration's): what a perfectly "
                                    "estimated bias reaches (0 = off; runs without routed_bias "
                                    "skip it)")
    load_balance_loss_weight: float = _key(0.0, "weight of the sequence-wise balance loss")
    sequence_loss_mode: str = _key("deepseek", "sequence loss: deepseek (paper) | maxtext")
    global_balance_loss_weight: float = _key(0.0, "weight of the global-batch (Switch) loss")
    router_z_loss_weight: float = _key(0.0, "weight of the router z-loss")
    # --- training ---
    steps: int = _key(20, "optimizer steps")
    per_device_batch_size: int = _key(1, "sequences per device per micro-batch")
    gradient_accumulation_steps: int = _key(1, "micro-batches per optimizer step")
    learning_rate: float = _key(3e-4, "peak learning rate")
    warmup_steps_fraction: float = _key(0.1, "share of the steps spent warming up linearly")
    cosine_learning_rate_final_fraction: float = _key(0.1, "final lr / peak lr of the cosine")
    adam_b1: float = _key(0.9, "AdamW beta1")
    adam_b2: float = _key(0.95, "AdamW beta2")
    adam_eps: float = _key(1e-8, "AdamW epsilon")
    adam_weight_decay: float = _key(0.1, "AdamW decoupled weight decay (not on norms, scales)")
    gradient_clipping_threshold: float = _key(1.0, "global-norm gradient clip (0 = off)")
    dataset_type: str = _key("synthetic", "synthetic (seeded random tokens) | text (text, JSON "
                             "Lines, Parquet files) | tokens (pre-tokenized .bin/.npy files)")
    dataset_path: list[str] = _key([], "files or directories (text, JSON Lines, Parquet; token "
                                   "files for dataset_type tokens); empty: the embedded default "
                                   "corpus (CPython 3.11.7's standard-library sources, fixed)")
    dataset_glob: str = _key("*.py", "file pattern searched inside dataset_path directories")
    dataset_text_field: str = _key("text", "the field (JSON Lines) or column (Parquet) holding "
                                   "each record's text")
    tokenizer_path: str = _key("", "an existing tokenizer.json ('' : train a byte-level BPE and cache it)")
    tokenizer_vocab_size: int = _key(8192, "vocabulary of the trained byte-level BPE (<= vocab_size)")
    eval_fraction: float = _key(0.02, "share of the text documents held out for evaluation")
    eval_period: int = _key(0, "validate every this many steps and after the last: loss, "
                            "perplexity and per-layer MaxVio_global on the held-out split, in "
                            "the step's record (0 = off)")
    eval_batches: int = _key(8, "global batches of the held-out split each validation measures, "
                             "the same ones every time (at most the split's)")
    data_cache_dir: str = _key("", "where tokenizers and token streams are cached "
                               "('' : $XDG_CACHE_HOME/moebalance or ~/.cache/moebalance)")
    seed: int = _key(0, "seed of the initial weights and the data order")
    # --- devices ---
    ici_data_parallelism: int = _key(1, "mesh axis `data` size (-1: the devices left)")
    ici_fsdp_parallelism: int = _key(-1, "mesh axis `fsdp` size (-1: the devices left)")
    ici_expert_parallelism: int = _key(1, "mesh axis `expert` size: routed experts split over it "
                                       "(-1: the devices left)")
    ep_buffer_factor: float = _key(2.0, "expert parallelism: fast-path send slots per rank = "
                                   "ceil(f * local assignments / ranks); a step that does not fit "
                                   "takes the worst-case buffer (dropless either way; <= 0: always)")
    routed_device_limit: int = _key(0, "device-limited routing: a token's experts on at most this "
                                    "many expert-parallel ranks (DeepSeek-V3's M; 0 = off)")
    jax_distributed_initialization: bool = _key(False, "call jax.distributed.initialize (multi-host)")
    distributed_coordinator: str = _key("", "coordinator host:port ('' : let JAX discover it)")
    distributed_num_processes: int = _key(0, "number of processes (0: let JAX discover it)")
    distributed_process_id: int = _key(0, "this process's index (with distributed_num_processes)")
    checkpoint_period: int = _key(10, "save a checkpoint every this many steps (and at the end)")
    max_num_checkpoints_to_keep: int = _key(3, "keep the last N checkpoints")

    def __post_init__(self):
        validate(self)


class ConfigError(ValueError):
    """A configuration that cannot be run; the message names the key and the fix."""


def _require(ok: bool, key: str, message: str):
    if not ok:
        raise ConfigError(f"config key `{key}`: {message}")


def validate(c: Config) -> None:
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
    _require(c.remat_policy in REMAT_POLICIES, "remat_policy",
             f"unknown policy {c.remat_policy!r}; choose one of {REMAT_POLICIES}")
    _require(c.step_programs in STEP_PROGRAMS, "step_programs",
             f"unknown value {c.step_programs!r}; choose one of {STEP_PROGRAMS}")
    _require(c.matmul_precision in MATMUL_PRECISIONS, "matmul_precision",
             f"unknown precision {c.matmul_precision!r}; choose one of {MATMUL_PRECISIONS}")
    _require(c.rope_factor >= 1.0, "rope_factor", f"must be >= 1 (1 = no YaRN), got {c.rope_factor}")
    longest = int(c.original_max_position_embeddings * c.rope_factor)
    _require(c.max_target_length <= longest, "max_target_length",
             f"{c.max_target_length} is longer than the model supports: "
             f"original_max_position_embeddings x rope_factor = {longest}; shorten it or raise "
             "rope_factor (YaRN)")
    from moebalance.routing import HASH_TABLES

    _require(c.hash_table in HASH_TABLES, "hash_table",
             f"unknown method {c.hash_table!r}; choose one of {sorted(HASH_TABLES)}")
    from moebalance.balancing import BIAS_RULES

    rules = (*BIAS_RULES, "quantile")
    _require(c.routed_bias_update_rule in rules, "routed_bias_update_rule",
             f"unknown rule {c.routed_bias_update_rule!r}; choose one of {rules}")
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
    for key in ("dataset_path", "tokenizer_path"):
        _require(c.dataset_type != "synthetic" or not getattr(c, key), key,
                 f"has no effect with dataset_type 'synthetic' (seeded random tokens); set "
                 f"dataset_type=text (or tokens) to train on it, or leave {key} out")
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
    _require(c.drop_policy in DROP_POLICIES, "drop_policy",
             f"unknown policy {c.drop_policy!r}; choose one of {DROP_POLICIES}")
    _require(c.moe_dispatch in DISPATCH_MODES, "moe_dispatch",
             f"unknown layout {c.moe_dispatch!r}; choose one of {DISPATCH_MODES}")
    _require(c.moe_kernel in EXPERT_KERNELS, "moe_kernel",
             f"unknown kernel {c.moe_kernel!r}; choose one of {EXPERT_KERNELS}")
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


# ---------------------------------------------------------------------------------------------
# Loading


def presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yml"))


def _field_types() -> dict[str, Any]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def _check_type(key: str, value, hint):
    if typing.get_origin(hint) is list:
        item = typing.get_args(hint)[0]
        if isinstance(value, list) and all(_is_a(v, item) for v in value):
            return value
        raise ConfigError(f"config key `{key}`: expected a list of {item.__name__}, got {value!r}")
    allowed = typing.get_args(hint) or (hint,)
    if value is None and type(None) in allowed:
        return value
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if float in allowed and isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
        try:
            return float(value)
        except ValueError:
            pass
    base = [a for a in allowed if a is not type(None)]
    if any(_is_a(value, b) for b in base):
        return value
    names = " or ".join(b.__name__ for b in base)
    raise ConfigError(f"config key `{key}`: expected {names}, got {value!r}")


def _is_a(value, kind: type) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def parse_override(key: str, raw: str, hint) -> Any:
    """The value of `key=raw` on the command line, read by the key's type: text for a str key as it
    is (globs, paths: nothing YAML would misread; one pair of enclosing quotes is dropped); for a
    list key YAML's `[a, b]`, a comma-separated `a,b` or a single value (list[str] items as text);
    YAML for the rest (numbers, booleans, null)."""
    raw = raw.strip()
    if hint is str:
        return _unquote(raw)
    if typing.get_origin(hint) is list:
        item = typing.get_args(hint)[0]
        bracketed = raw.startswith("[") and raw.endswith("]")
        if bracketed:  # YAML's own list, quoted items and all; else its items as written
            try:
                return [str(v) if item is str else v for v in yaml.safe_load(raw)]
            except yaml.YAMLError:
                pass
        inner = raw[1:-1] if bracketed else raw
        parts = [_unquote(p.strip()) for p in inner.split(",") if p.strip()]
        return parts if item is str else [_yaml_scalar(key, p) for p in parts]
    return _yaml_scalar(key, raw)


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _yaml_scalar(key: str, raw: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        raise ConfigError(f"config key `{key}`: cannot read {raw!r} as a value; write a number, "
                          "true/false, null or text") from None


def _unknown(key: str, known) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return ConfigError(f"unknown config key `{key}`{hint} (`moebalance keys` lists them all)")


def load_config(name_or_path: str | Path, overrides: list[str] | dict | None = None) -> Config:
    """A preset name (e.g. 'deepseek4-tiny') or a YAML path, then overrides ('key=value' strings
    read by the key's type (`parse_override`), or a dict)."""
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = PRESET_DIR / f"{name_or_path}.yml"
        if not path.exists():
            raise ConfigError(f"no config named {name_or_path!r}; presets: {', '.join(presets())}"
                              " (or give a path to a YAML file)")
    elif not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML ({' '.join(str(err).split())}); quote "
                          "values that start with * & ! or contain ': ', e.g. "
                          "dataset_glob: '*.txt'") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: a config file must be a mapping of keys to values")
    types = _field_types()
    if isinstance(overrides, dict):
        values.update(overrides)
    else:
        for item in overrides or []:
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or not key:
                raise ConfigError(f"override {item!r} must look like key=value")
            if key not in types:
                raise _unknown(key, types)
            values[key] = parse_override(key, raw, types[key])
    for key in values:
        if key not in types:
            raise _unknown(key, types)
    values = {k: _check_type(k, v, types[k]) for k, v in values.items()}
    try:
        return Config(**values)
    except ConfigError as err:
        missing = _missing_dataset_paths(values)
        if not missing:
            raise
        raise ConfigError(f"{missing_path_message(missing[0])}; then {err}") from None


def missing_path_message(entry: str) -> str:
    """What to say of a `dataset_path` entry that does not exist."""
    return (f"config key `dataset_path`: {entry!r} does not exist; give existing files or "
            "directories (or [] for the embedded default corpus)")


def _missing_dataset_paths(values: dict) -> list[str]:
    """The `dataset_path` entries of a text or tokens config that do not exist. Named first when
    the schema refuses the config too: a check such as tokenizer_vocab_size <= vocab_size is moot
    until the data is there (the data pipeline refuses a missing path of a valid config)."""
    if values.get("dataset_type", Config.dataset_type) == "synthetic":
        return []
    return [e for e in values.get("dataset_path", []) if not Path(e).expanduser().exists()]


def describe() -> list[tuple[str, str, Any, str]]:
    """(key, type, default, help) for every key of the schema."""
    types = _field_types()
    rows = []
    for f in dataclasses.fields(Config):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        kind = types[f.name]
        name = kind.__name__ if isinstance(kind, type) else str(kind).replace("typing.", "")
        rows.append((f.name, name, default, f.metadata["help"]))
    return rows
