"""`moebalance study`: balancing methods compared over a real training run, as arXiv 2408.15664
compares loss-free balancing with an auxiliary loss (docs/study.md).

Every arm trains the same model from the same initial weights on the same batches; an arm is a
set of config overrides on top of the config with all balancing off (`ARMS` are the built-in
ones). Each validates on the held-out split every `eval_period` steps (training/validation.py):
the validation loss and MaxVio_global, the MaxVio of the counts over all its held-out tokens;
each training step's record has MaxVio_batch, that of the step's global batch. The study's
numbers average the top-k layers (hash-routed layers follow a fixed table, the same in every arm).

DIR holds one run directory per arm (DIR/<arm>), study.json (the plan, then each arm's result)
and the report (report/study.py). Running the same command again continues a stopped study: the
arms study.json records as finished are kept (their run directories are no longer read: a study
can move to another machine as study.json alone), an unfinished one resumes from its latest
checkpoint, bit-exactly.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import shutil
from pathlib import Path

import jax
import numpy as np

from moebalance.atomic import write_atomic
from moebalance.config import Config, load_config, override_keys
from moebalance.config_rules import moot_keys, refuse_moot
from moebalance.rundir import RunDir, RunDirError, RunStopped
from moebalance.training.hooks import mean_topk_maxvio, mean_topk_maxvio_global, terminal
from moebalance.training.loop import train
from moebalance.training.step import shared_programs

STUDY = "study.json"
# All balancing off: the base every arm's overrides apply to.
OFF = ("routed_bias=false", "routed_bias_update_rate=0", "load_balance_loss_weight=0",
       "global_balance_loss_weight=0")
# Every arm keeps its online bias and trains only: no calibration, no refit (the paper's arms).
STUDY_DEFAULTS = ("routed_bias_calibration_batches=0", "probe_refit_batches=0")
ARMS = {
    "none": (),
    # the paper's baseline: the global-batch loss, alpha = 1e-3 (docs/load_balancing.md)
    "aux": ("global_balance_loss_weight=0.001",),
    "aux-seq": ("load_balance_loss_weight=0.001",),  # the same alpha, per sequence
    # the paper's rule: b += u * sign(mean(c) - c), u = 1e-3
    "loss-free": ("routed_bias=true", "routed_bias_update_rule=sign",
                  "routed_bias_update_rate=0.001"),
    # DeepSeek-V3's recipe: the same with a slight sequence-wise loss
    "loss-free-seq": ("routed_bias=true", "routed_bias_update_rule=sign",
                      "routed_bias_update_rate=0.001", "load_balance_loss_weight=0.0001"),
    "quantile": ("routed_bias=true", "routed_bias_update_rule=quantile",
                 "routed_bias_update_rate=-1"),
}
DEFAULT_ARMS = ("none", "aux", "loss-free")
LAST_EVALS = 3  # the spread of an arm's result: over its last this many validations
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    overrides: tuple[str, ...]


def arms_from(specs: list[list[str]] | None) -> list[Arm]:
    """The arms of `--arm NAME [key=value ...]` options (default DEFAULT_ARMS): a name alone is a
    built-in arm (ARMS), a name with overrides an arm of its own."""
    if not specs:
        return [Arm(name, ARMS[name]) for name in DEFAULT_ARMS]
    arms = []
    for name, *overrides in specs:
        if not _NAME.match(name):
            raise ValueError(f"arm name {name!r} must be a folder name: letters, digits, and "
                             "_ . + - after the first")
        if not overrides and name not in ARMS:
            raise ValueError(f"no built-in arm {name!r} (built-in: {', '.join(ARMS)}); give "
                             f"its overrides: --arm {name} key=value ...")
        arms.append(Arm(name, tuple(overrides) or ARMS[name]))
    names = [arm.name for arm in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names must differ, got {names}")
    return arms


def arm_configs(config: str | Path, overrides: list[str], arms: list[Arm]) -> list[Config]:
    """Each arm's config: the study's defaults, the user's overrides, all balancing off, then the
    arm's overrides; validated every one before anything runs. eval_period, when the config
    leaves it 0, becomes a tenth of the steps."""
    cfgs = []
    for arm in arms:
        own = () if arm.overrides == ARMS.get(arm.name) else arm.overrides  # the user's
        cfg = load_config(config, [*STUDY_DEFAULTS, *overrides, *OFF, *arm.overrides],
                          given=override_keys(own))
        if cfg.first_num_hash_layers >= cfg.base_num_decoder_layers:
            raise ValueError(f"every layer of {config} is hash-routed "
                             f"(first_num_hash_layers={cfg.first_num_hash_layers}): no routing "
                             "to balance; lower first_num_hash_layers")
        cfgs.append(cfg if cfg.eval_period else
                    dataclasses.replace(cfg, eval_period=max(1, cfg.steps // 10)))
    moot = [set(moot_keys(vars(c), override_keys(overrides))) for c in cfgs]
    refuse_moot(vars(cfgs[0]), set.intersection(*moot))  # the user's keys moot in every arm
    return cfgs


def study(config: str | Path, overrides: list[str], arms: list[Arm], out: Path, *,
          overwrite: bool = False, console=None, progress: bool = True,
          hooks: list = ()) -> dict:
    """Train every arm into out/<arm> (continuing what an earlier call of the same study left),
    write study.json after each and the report at the end; returns study.json's content.
    overwrite: replace another study (or anything else) in `out`. console: a rich Console to
    show the arms on (None prints nothing). hooks: more sinks of every arm's run (training/
    hooks.py)."""
    from moebalance.report.study import study_report

    out = Path(out)
    cfgs = arm_configs(config, overrides, arms)
    plan = _plan({"config": str(config), "overrides": list(overrides),
                  "arms": [{"name": a.name, "overrides": list(a.overrides)} for a in arms]})
    result = _start(out, plan, cfgs[0], overwrite)
    for i, (arm, cfg, program) in enumerate(zip(arms, cfgs, shared_programs(cfgs))):
        run = RunDir(out / arm.name)
        if result["arms"][i]["finished"]:  # recorded: its run directory is no longer needed
            continue
        if console is not None:
            what = " ".join(arm.overrides) or "no balancing"
            console.rule(f"arm {i + 1}/{len(arms)}, {arm.name}: {what} ({run.path})")
        if not run.finished(cfg.steps):
            shown = terminal(console, bar=progress, per_block=False) if console else []
            try:
                train(cfg, run.path, resume=run.has_checkpoint(), overwrite=True,
                      hooks=[*shown, *hooks], program=program)
            except RunStopped as stop:
                raise RunStopped(stop.signum, stop.step, "run the same command again to "
                                 "continue the study") from None
        result["arms"][i] = summarize(arm, run.metrics())
        _write(out, result)
    if jax.process_index() == 0:
        study_report(result, out, console)
    return result


def _start(out: Path, plan: dict, cfg: Config, overwrite: bool) -> dict:
    """study.json's content to go on from: the earlier one in `out` if it holds the same plan,
    else a new one (over anything in `out` only with `overwrite`)."""
    path = out / STUDY
    if path.exists() and not overwrite:
        earlier = json.loads(path.read_text())
        if _plan(earlier) != plan:
            raise RunDirError(
                f"{out} holds another study (config {earlier.get('config')!r}, overrides "
                f"{earlier.get('overrides')}, arms {[a['name'] for a in earlier['arms']]}); "
                "pass --overwrite to replace it or choose another --out")
        return earlier
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise RunDirError(f"{out} is not empty and holds no {STUDY}; pass --overwrite to "
                          "replace what it holds or choose another --out")
    tokens = (cfg.gradient_accumulation_steps * cfg.per_device_batch_size * jax.device_count()
              * cfg.max_target_length)
    result = {**plan, "date": datetime.date.today().isoformat(), "steps": cfg.steps,
              "eval_period": cfg.eval_period, "tokens_per_step": tokens,
              "arms": [{**arm, "finished": False} for arm in plan["arms"]]}
    for arm in plan["arms"] if overwrite and jax.process_index() == 0 else ():
        if (out / arm["name"]).is_dir():
            shutil.rmtree(out / arm["name"])
    _write(out, result)
    return result


def _plan(study: dict) -> dict:
    """What makes a study the same study: its config, overrides and arms."""
    return {"config": study.get("config"), "overrides": study.get("overrides"),
            "arms": [{"name": arm["name"], "overrides": arm["overrides"]}
                     for arm in study.get("arms", [])]}


def _write(out: Path, result: dict) -> None:
    """study.json, atomically, by process 0 (on several hosts every process runs the study)."""
    if jax.process_index() == 0:
        write_atomic(out / STUDY, lambda f: f.write((json.dumps(result, indent=1) + "\n").encode()))


def summarize(arm: Arm, records: list[dict]) -> dict:
    """An arm's result from its run's step records: the curve (one point per validation: the
    steps done, validation loss and perplexity, MaxVio_global, and the mean MaxVio_batch and
    training cross-entropy (without balance losses) of the steps since the previous point), the
    last point's values, their spread (min, max) over the last LAST_EVALS points, per layer the
    last MaxVio_global and MaxVio_batch, the median tokens/s, and the per-step training
    cross-entropy and MaxVio_batch."""
    routing = [row["routing"] for row in records[0]["layers"]]
    batch = np.array([[row["maxvio"] for row in r["layers"]] for r in records])  # [steps, L]
    per_step = [mean_topk_maxvio(r) for r in records]
    curve, since = [], 0
    for n, r in enumerate(records):
        if "validation" not in r:
            continue
        window = slice(since, n + 1)
        glob = r["validation"]["maxvio_global"]
        curve.append({"step": r["step"] + 1, "val_loss": r["validation"]["loss"],
                      "val_ppl": r["validation"]["perplexity"],
                      "maxvio_global": mean_topk_maxvio_global(r),
                      "maxvio_batch": _mean(per_step[window]),
                      "train_loss": _mean([x["ce"] for x in records[window]]),
                      "layers": {"maxvio_global": glob,
                                 "maxvio_batch": batch[window].mean(0).tolist()}})
        since = n + 1
    if not curve:
        raise ValueError(f"arm {arm.name!r}: its run validated nowhere (eval_period 0?)")
    last, tail = curve[-1], curve[-LAST_EVALS:]
    return {"name": arm.name, "overrides": list(arm.overrides), "finished": True,
            **{key: last[key] for key in ("val_loss", "val_ppl", "maxvio_global",
                                          "maxvio_batch", "train_loss")},
            "spread": {key: [min(p[key] for p in tail), max(p[key] for p in tail)]
                       for key in ("val_loss", "val_ppl", "maxvio_global", "maxvio_batch")},
            "tokens_per_s": float(np.median([r["tokens_per_s"] for r in records])),
            "routing": routing, "layers": last["layers"],
            "curve": [{k: v for k, v in p.items() if k != "layers"} for p in curve],
            "per_step": {"loss": [r["ce"] for r in records],
                         "maxvio_batch": per_step}}


def _mean(values) -> float:
    return float(np.mean(values))
