"""The one typed configuration schema, and loading presets with `key=value` overrides.

Every key, its type, default, a one-line description and what it `Needs` to take effect live in
`Config` below (MaxText's key names where MaxText has the concept). Presets under
`moebalance/configs/*.yml` hold only differences from these defaults. An unknown key, a wrong type,
a contradiction (config_rules.validate) or a key the user gave that the rest of the config makes
moot (config_rules.moot_keys) fails at load time, naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

from moebalance.paths import problem

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


@dataclasses.dataclass(frozen=True)
class Needs:
    """What a key needs to take effect: key `on` holding a value that `holds` accepts (`wanted`
    says which in words; `fix` is one such value, as an override spells it)."""

    on: str
    holds: Callable[[Any], bool]
    wanted: str
    fix: str


TEXT_OR_TOKENS = Needs("dataset_type", lambda v: v != "synthetic", "text or tokens", "text")
TEXT = Needs("dataset_type", lambda v: v == "text", "text", "text")
BIAS = Needs("routed_bias", bool, "true", "true")


def _positive(value) -> bool:
    return value > 0


HASHED = Needs("first_num_hash_layers", _positive, "> 0", "1")
YARN = Needs("rope_factor", lambda v: v > 1, "> 1 (YaRN)", "16")


def _key(default, help: str, *needs: Needs):
    """A field of the schema: its default, its one-line meaning and what it `Needs` to take
    effect (config_rules.moot_keys: a key the user gives without it is refused)."""
    metadata = {"help": help, "needs": needs}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


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
    beta_fast: float = _key(32.0, "YaRN beta_fast", YARN)
    beta_slow: float = _key(1.0, "YaRN beta_slow", YARN)
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
    drop_policy: str = _key("probs", "over capacity, drop lowest weight (probs) or latest "
                            "(position)", Needs("capacity_factor", _positive, "> 0", "1.25"))
    moe_dispatch: str = _key("auto", "blocked | ragged | auto (ragged on TPU, else blocked)")
    moe_block_size: int = _key(256, "rows per block of the blocked dispatch; on the ragged "
                               "one, megablox's row tile")
    moe_kernel: str = _key("auto", "the experts' grouped matmuls: auto (xla, measured fastest on "
                           "every backend) | xla (ragged_dot; on blocks, "
                           "each block's weights picked, then batched matmuls) | megablox (JAX's "
                           "Pallas kernels for TPU) | pallas (Triton kernels for NVIDIA GPUs, "
                           "blocked layout only); Pallas kernels run interpreted off their backend")
    first_num_hash_layers: int = _key(0, "leading blocks routed by a token-id hash table")
    hash_table: str = _key("random", "hash table: zeros | round_robin | random | balanced",
                           HASHED)
    hash_table_seed: int = _key(0, "seed of the random hash table", HASHED,
                                Needs("hash_table", lambda v: v == "random", "random", "random"))
    # --- MTP ---
    mtp_num_layers: int = _key(0, "multi-token-prediction layers (0 or 1)")
    mtp_loss_scaling_factor: float = _key(0.1, "weight of the MTP loss",
                                          Needs("mtp_num_layers", _positive, "1", "1"))
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
                                          "(sign 1e-3, proportional 1e-4, fraction 1, quantile 1)",
                                          BIAS)
    routed_bias_update_rule: str = _key("sign", "sign | proportional | fraction | quantile", BIAS)
    routed_bias_freeze_step: int = _key(-1, "bias rate becomes 0 from this step on (-1: never)",
                                        BIAS)
    routed_bias_update_rate_final_fraction: float = _key(
        1.0, "the bias rate follows a cosine from its value to value * this at the last step "
        "(1: constant)", BIAS)
    routed_bias_average_fraction: float = _key(
        0.0, "the bias the run keeps is the mean of the online bias over the last this fraction "
        "of the steps (Polyak); validations route with it, the online bias keeps steering "
        "training and is replaced by the mean after the last step (0: the online bias)", BIAS)
    routed_bias_calibration_batches: int = _key(
        0, "after the last step, refit every top-k bias at the final weights on the next N "
        "(fresh, never trained on) training batches (undamped Quantile Balancing on all their "
        "tokens) and keep it: the saved bias balances the data as the final weights route it "
        "(0: keep the online bias)", BIAS)
    probe_batches: int = _key(8, "held-out micro-batches measured before the first step and "
                              "after the last (the first is the probe of the seed's table): the "
                              "A/B report's mean summed variance and its spread over them")
    probe_refit_batches: int = _key(8, "after the last step, also measure the probe with every "
                                    "top-k bias refitted to balance this many fresh training "
                                    "batches (after the calibration's): what a perfectly "
                                    "estimated bias reaches (0 = off)", BIAS)
    load_balance_loss_weight: float = _key(0.0, "weight of the sequence-wise balance loss")
    sequence_loss_mode: str = _key("deepseek", "sequence loss: deepseek (paper) | maxtext",
                                   Needs("load_balance_loss_weight", _positive, "> 0", "0.0001"))
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
                                   "corpus (CPython 3.11.7's standard-library sources, fixed)",
                                   TEXT_OR_TOKENS)
    dataset_glob: str = _key("*.py", "file pattern searched inside dataset_path directories", TEXT)
    dataset_text_field: str = _key("text", "the field (JSON Lines) or column (Parquet) holding "
                                   "each record's text", TEXT)
    tokenizer_path: str = _key("", "an existing tokenizer.json ('' : train a byte-level BPE and "
                               "cache it)", TEXT_OR_TOKENS)
    tokenizer_vocab_size: int = _key(8192, "vocabulary of the trained byte-level BPE (<= "
                                     "vocab_size)", TEXT, Needs("tokenizer_path", lambda v: not v,
                                                                "'' (the BPE is trained)", "''"))
    eval_fraction: float = _key(0.02, "share of the text documents held out for evaluation (of "
                                "a token file without a held-out file, its tail)", TEXT_OR_TOKENS)
    eval_period: int = _key(0, "validate every this many steps and after the last: loss, "
                            "perplexity and per-layer MaxVio_global on the held-out split, in "
                            "the step's record (0 = off)")
    eval_batches: int = _key(8, "global batches of the held-out split each validation measures, "
                             "the same ones every time (at most the split's)")
    data_cache_dir: str = _key("", "where tokenizers and token streams are cached "
                               "('' : $XDG_CACHE_HOME/moebalance or ~/.cache/moebalance)", TEXT)
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
        from moebalance.config_rules import validate

        validate(self)


class ConfigError(ValueError):
    """A configuration that cannot be run; the message names the key and the fix."""


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


def load_config(name_or_path: str | Path, overrides: list[str] | dict | None = None, *,
                given: Iterable[str] | None = None) -> Config:
    """A preset name (e.g. 'deepseek4-tiny') or a YAML path, then overrides ('key=value' strings
    read by the key's type (`parse_override`), or a dict). A key the user gave that the config
    makes moot is refused (config_rules.moot_keys); `given` names the user's keys where the
    caller knows better (default: the overrides' keys and a YAML file's, a preset's excepted)."""
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = PRESET_DIR / f"{name_or_path}.yml"
        if not path.exists():
            raise ConfigError(f"no config named {name_or_path!r}; presets: {', '.join(presets())}"
                              " (or give a path to a YAML file)")
    elif wrong := problem(path):
        raise ConfigError(f"config file {str(path)!r} {wrong}; give a YAML file or a preset "
                          f"({', '.join(presets())})")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML ({' '.join(str(err).split())}); quote "
                          "values that start with * & ! or contain ': ', e.g. "
                          "dataset_glob: '*.txt'") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: a config file must be a mapping of keys to values")
    types = _field_types()
    from moebalance.rundir import CONFIG

    # a preset's keys are its defaults; a run's config.yaml (rundir: a directory holds a run once
    # its config.yaml is there), written by the trainer, the record of a config
    record = path.resolve().parent == PRESET_DIR.resolve() or path.name == CONFIG
    mine = set() if record else set(values)
    if isinstance(overrides, dict):
        values.update(overrides)
        mine.update(overrides)
    else:
        for item in overrides or []:
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or not key:
                raise ConfigError(f"override {item!r} must look like key=value")
            if key not in types:
                raise _unknown(key, types)
            values[key] = parse_override(key, raw, types[key])
            mine.add(key)
    for key in values:
        if key not in types:
            raise _unknown(key, types)
    values = {k: _check_type(k, v, types[k]) for k, v in values.items()}
    from moebalance.config_rules import refuse_moot

    refuse_moot({**defaults(), **values}, mine if given is None else set(given))
    try:
        return Config(**values)
    except ConfigError as err:
        missing = _missing_dataset_paths(values)
        if not missing:
            raise
        raise ConfigError(f"{missing_path_message(missing[0])}; then {err}") from None


DATASET_FIX = "give existing files or directories (or [] for the embedded default corpus)"


def missing_path_message(entry: str) -> str:
    """What to say of a `dataset_path` entry that does not exist (data.errors.checked_path says
    the same)."""
    return f"config key `dataset_path`: {entry!r} does not exist; {DATASET_FIX}"


def _missing_dataset_paths(values: dict) -> list[str]:
    """The `dataset_path` entries of a text or tokens config that do not exist. Named first when
    the schema refuses the config too: a check such as tokenizer_vocab_size <= vocab_size is moot
    until the data is there (the data pipeline refuses a missing path of a valid config)."""
    if values.get("dataset_type", Config.dataset_type) == "synthetic":
        return []
    return [e for e in values.get("dataset_path", []) if not Path(e).expanduser().exists()]


def override_keys(overrides: Iterable[str]) -> list[str]:
    """The keys of 'key=value' overrides."""
    return [item.partition("=")[0].strip() for item in overrides]


def defaults() -> dict[str, Any]:
    """Every key's default value."""
    return {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING
            else f.default for f in dataclasses.fields(Config)}


def describe() -> list[tuple[str, str, Any, str, str]]:
    """(key, type, default, help, when it takes effect: its `Needs` in words, '' for always) for
    every key of the schema."""
    types, default = _field_types(), defaults()
    rows = []
    for f in dataclasses.fields(Config):
        kind = types[f.name]
        name = kind.__name__ if isinstance(kind, type) else str(kind).replace("typing.", "")
        when = " and ".join(f"{need.on} {need.wanted}" for need in f.metadata["needs"])
        rows.append((f.name, name, default[f.name], f.metadata["help"], when))
    return rows
