"""`moebalance export`: a trained run as a transformers model directory.

    export(run_dir, out, step=None, dtype=None, overwrite=False)

writes into `out` what `AutoModelForCausalLM.from_pretrained(out)` and
`AutoTokenizer.from_pretrained(out)` load with nothing else:

    config.json, model*.safetensors   `hf.save` of the run's checkpoint (the latest, or `step`),
                                      biases as the run saved them (calibrated, when it did)
    tokenizer.json                    the run's own byte-level BPE (text runs only)
    tokenizer_config.json             PreTrainedTokenizerFast; <|endoftext|> is bos, eos and pad;
                                      split_special_tokens: literal '<|endoftext|>' in a text is
                                      text, as in training; no token added to what is encoded
    special_tokens_map.json
    generation_config.json            greedy (do_sample false), stopping at <|endoftext|>

Settings that change what the model computes and that transformers' DeepSeek-V4 cannot express
are refused before the checkpoint is read (`transformers_differences`); those that leave its
logits alone, or change them only where our model drops tokens, are exported with a warning.
Everything is written into `<out>.partial`, renamed to `out` once whole.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path

from flax import nnx
from tokenizers import Tokenizer

from moebalance.config import Config
from moebalance.data import EOT, read_tokenizer
from moebalance.hf.checkpoint import save
from moebalance.hf.config import config_to_hf
from moebalance.model.moe import MoEConfig
from moebalance.model.transformer import DeepSeekV4, placeholder_hash_tables
from moebalance.rundir import RunDir
from moebalance.training import checkpoint

log = logging.getLogger(__name__)
TRANSFORMERS_SCORE_FNS = ("sigmoid", "sqrtsoftplus")  # transformers' ACT2FN has no softmax


def transformers_differences(cfg: Config) -> list[str]:
    """What transformers' DeepseekV4ForCausalLM (5.18) would compute otherwise than our model of
    `cfg`: raises ValueError naming a setting it cannot express; returns warnings (one line
    each) for what it leaves out without changing the logits, or only where ours drop tokens."""
    config_to_hf(cfg)  # raises for what its config.json cannot hold (two HCA ratios)
    moe = MoEConfig.from_config(cfg)
    refused = []
    if cfg.routed_score_func not in TRANSFORMERS_SCORE_FNS:
        refused.append(f"routed_score_func {cfg.routed_score_func} (transformers has "
                       f"{' and '.join(TRANSFORMERS_SCORE_FNS)})")
    elif cfg.norm_topk_prob is False:
        refused.append("norm_topk_prob false (transformers always renormalises the chosen "
                       "experts' weights)")
    if moe.n_routing_groups and moe.topk_routing_group < moe.n_routing_groups:
        kind = "routed_device_limit" if cfg.routed_device_limit else "n_routing_groups"
        refused.append(f"{kind}: group-limited routing ({moe.topk_routing_group} of "
                       f"{moe.n_routing_groups} groups; transformers picks among all experts)")
    if refused:
        raise ValueError(f"transformers' DeepSeek-V4 cannot express this run's "
                         f"{'; '.join(refused)}; not exported")
    warnings = []
    if cfg.capacity_factor > 0:
        warnings.append(f"capacity_factor {cfg.capacity_factor}: this run drops assignments "
                        "over an expert's capacity, transformers drops none, so its logits "
                        "differ wherever an expert overflows")
    if cfg.mtp_num_layers:
        warnings.append("the MTP layer is written as mtp.0.* tensors, which transformers does "
                        "not load: same logits, no multi-token prediction there")
    return warnings


def cast(model: DeepSeekV4, cfg: Config) -> None:
    """Give every variable of `model` the dtype it has in a model built from `cfg` (which keeps
    the router biases and other float32 islands in float32)."""
    shapes = nnx.eval_shape(lambda: DeepSeekV4(cfg, hash_tables=placeholder_hash_tables(cfg),
                                               rngs=nnx.Rngs(0)))
    wanted = dict(nnx.to_flat_state(nnx.state(shapes)))
    for path, var in nnx.to_flat_state(nnx.state(model)):
        var.set_value(var[...].astype(wanted[path].dtype))


def tokenizer_files(eot: str, eot_id: int, max_length: int) -> dict[str, dict]:
    """tokenizer_config.json, special_tokens_map.json and the token ids of config.json and
    generation_config.json for a tokenizer whose only special token is `eot` (id `eot_id`)."""
    special = {"bos_token": eot, "eos_token": eot, "pad_token": eot}
    ids = {"bos_token_id": eot_id, "eos_token_id": eot_id}
    return {
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast", **special, "unk_token": None,
            "model_max_length": max_length, "add_bos_token": False, "add_eos_token": False,
            "split_special_tokens": True, "clean_up_tokenization_spaces": False},
        "special_tokens_map.json": special,
        "config.json": ids,
        "generation_config.json": {**ids, "pad_token_id": eot_id, "do_sample": False},
    }


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse an `out` that holds anything, unless --overwrite and it is an earlier export."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not out.is_dir():
        raise FileExistsError(f"{out} is a file; choose a new directory")
    if not overwrite:
        raise FileExistsError(f"{out} already holds files; choose a new directory, or pass "
                              "--overwrite to replace an earlier export")
    if not (out / "config.json").is_file():
        raise FileExistsError(f"{out} holds files but no config.json, so it is no earlier "
                              "export; --overwrite replaces only those: choose a new directory")


def _read_tokenizer(run: RunDir) -> Tokenizer | None:
    if not run.tokenizer.is_file():
        return None
    return read_tokenizer(run.tokenizer, f"{run.tokenizer} cannot be read as a tokenizer "
                          "({reason})")


def export(run_dir, out, *, step: int | None = None, dtype: str | None = None,
           overwrite: bool = False) -> dict:
    """Write the run's checkpoint (`step`, default the latest) and tokenizer to `out` as
    transformers loads them (see the module docstring); weights in `dtype` (default the run's
    weight_dtype). Returns {"step", "dtype", "tokenizer": whether one was written, "warnings"}."""
    run, out = RunDir(run_dir).require(), Path(out)
    cfg = run.config()
    exported = dataclasses.replace(cfg, weight_dtype=dtype or cfg.weight_dtype)
    _check_out(out, overwrite)
    warnings = transformers_differences(cfg)
    tokenizer = _read_tokenizer(run)
    model, step = checkpoint.restore_model(cfg, run.checkpoints, step)
    cast(model, exported)
    files = (tokenizer_files(EOT, tokenizer.token_to_id(EOT), cfg.max_target_length)
             if tokenizer else {"config.json": {"bos_token_id": None, "eos_token_id": None},
                                "generation_config.json": {"do_sample": False}})
    partial = Path(f"{out.absolute()}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted export
    save(model, exported, partial, extra_config=files.pop("config.json"))
    for name, content in files.items():
        (partial / name).write_text(json.dumps(content, indent=2) + "\n")
    if tokenizer:
        shutil.copyfile(run.tokenizer, partial / "tokenizer.json")
    else:
        warnings.append(f"{run.tokenizer} does not exist (a synthetic-data run has none): "
                        "exported the weights without a tokenizer")
    if out.is_dir() and any(out.iterdir()):  # an earlier export, checked by _check_out
        shutil.rmtree(out)
    os.replace(partial, out)
    for warning in warnings:
        log.warning("%s", warning)
    return {"step": step, "dtype": exported.weight_dtype, "tokenizer": tokenizer is not None,
            "warnings": warnings}
