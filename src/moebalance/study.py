"""`moebalance study`: balancing methods compared over a real training run, as arXiv 2408.15664
compares loss-free balancing with an auxiliary loss (docs/study.md).

Every arm trains the same model from the same initial weights on the same batches; an arm is a
set of balancing overrides (ARM_KEYS alone: anything else would break that promise) on top of the
config with all balancing off (`ARMS` are the built-in ones). `seeds` runs every arm once per
seed (the initial weights and the data order), for the seed-to-seed spread the claims measure a
difference against. Each run validates on the first `eval_batches` global batches of the
held-out split every `eval_period` steps (training/validation.py): the validation loss and
MaxVio_global, the MaxVio of the counts over those tokens; each training step's record has
MaxVio_batch, that of the step's global batch. The study's numbers average the top-k layers
(hash-routed layers follow a fixed table, the same in every arm).

DIR holds one run directory per arm (DIR/<arm>; with seeds DIR/<arm>/seed<S>), study.json (the
plan, then each run's result) and the report (report/study.py). Running the same command again
continues a stopped study: the runs study.json records as finished are kept (their run
directories are no longer read: a study can move to another machine as study.json alone), an
unfinished one resumes from its latest checkpoint, bit-exactly; a continuation whose global batch
differs (another device count) is refused. Each finished run records the code it ran
(`commit`: runtime.code_commit), and the report says whether every arm ran at one commit.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
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
from moebalance.runtime import code_commit
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
    # issue 60: the paper's rule steering, the bias kept its mean over the last quarter
    "loss-free-avg": ("routed_bias=true", "routed_bias_update_rule=sign",
                      "routed_bias_update_rate=0.001", "routed_bias_average_fraction=0.25"),
}
DEFAULT_ARMS = ("none", "aux", "loss-free")
# The keys an arm may set: the balancing recipe (the bias, its rule and schedule, the balance
# losses, the capacity that drops tokens, what runs after the last step). Every other key shapes
# what all arms must share: the model and its initial weights (seed), the data and batches, the
# steps and learning rate, the evaluation; such a key applies to every arm (before the first
# --arm), seeds vary by `seeds`.
ARM_KEYS = ("routed_bias", "routed_bias_update_rate", "routed_bias_update_rule",
            "routed_bias_freeze_step", "routed_bias_update_rate_final_fraction",
            "routed_bias_average_fraction",
            "routed_bias_calibration_batches", "probe_refit_batches",
            "load_balance_loss_weight", "sequence_loss_mode", "global_balance_loss_weight",
            "router_z_loss_weight", "capacity_factor", "drop_policy")
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
        for override in overrides:
            _check_arm_key(name, override)
        arms.append(Arm(name, tuple(overrides) or ARMS[name]))
    names = [arm.name for arm in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names must differ, got {names}")
    return arms


def _check_arm_key(name: str, override: str) -> None:
    """Refuse an arm's override of anything but ARM_KEYS, naming the key and why."""
    if "=" not in override:
        raise ValueError(f"arm {name!r}: {override!r} is not key=value")
    [key] = override_keys([override])
    if key in ARM_KEYS:
        return
    if key == "seed":
        why = ("every arm starts from the same initial weights and batches; run every arm "
               "with several seeds by --seeds S1 S2 ...")
    elif key in {f.name for f in dataclasses.fields(Config)}:
        why = ("it is not a balancing key, and the arms must share everything else (model, "
               "initial weights, data, batches, steps, evaluation); give it before the first "
               "--arm to apply it to every arm")
    else:
        close = difflib.get_close_matches(key, ARM_KEYS, n=1)
        why = "no such balancing key" + (f"; did you mean {close[0]}?" if close else "")
    raise ValueError(f"arm {name!r} may not set {key}: {why} (an arm sets only "
                     f"{', '.join(ARM_KEYS)})")


def runs_of(arms: list[Arm], seeds: list[int] | None) -> list[tuple[Arm, int | None]]:
    """The study's runs, (arm, seed) in order: every arm once per seed (None: the config's)."""
    return [(arm, seed) for arm in arms for seed in (seeds or [None])]


def run_dir(out: Path, arm: str, seed: int | None) -> Path:
    """A run's directory: DIR/<arm>, with seeds DIR/<arm>/seed<S>."""
    return out / arm if seed is None else out / arm / f"seed{seed}"


def arm_configs(config: str | Path, overrides: list[str], arms: list[Arm],
                seeds: list[int] | None = None) -> list[Config]:
    """Each run's config (runs_of's order): the study's defaults, the user's overrides, all
    balancing off, the arm's overrides, then its seed; validated every one before anything runs.
    eval_period, when the config leaves it 0, becomes a tenth of the steps."""
    if seeds is not None and "seed" in override_keys(overrides):
        raise ValueError("give the seeds by --seeds alone, not also seed=... among the overrides")
    if seeds is not None and (not seeds or len(set(seeds)) != len(seeds)):
        raise ValueError(f"--seeds takes one or more different seeds, got {seeds}")
    cfgs = []
    for arm, seed in runs_of(arms, seeds):
        own = () if arm.overrides == ARMS.get(arm.name) else arm.overrides  # the user's
        cfg = load_config(config, [*STUDY_DEFAULTS, *overrides, *OFF, *arm.overrides,
                                   *([] if seed is None else [f"seed={seed}"])],
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
          seeds: list[int] | None = None, overwrite: bool = False, console=None,
          progress: bool = True, hooks: list = ()) -> dict:
    """Train every arm, once per seed of `seeds` (None: once, at the config's seed), into its
    run_dir (continuing what an earlier call of the same study left), write study.json after
    each run and the report at the end; returns study.json's content. overwrite: replace another
    study (or anything else) in `out`. console: a rich Console to show the runs on (None prints
    nothing). hooks: more sinks of every run (training/hooks.py)."""
    from moebalance.report.study import study_report

    out = Path(out)
    cfgs = arm_configs(config, overrides, arms, seeds)
    runs = runs_of(arms, seeds)
    plan = _plan({"config": str(config), "overrides": list(overrides), "seeds": seeds,
                  "arms": [{"name": a.name, "overrides": list(a.overrides)} for a in arms]})
    result = _start(out, plan, cfgs, overwrite)
    commit = code_commit()
    for i, ((arm, seed), cfg, program) in enumerate(zip(runs, cfgs, shared_programs(cfgs))):
        run = RunDir(run_dir(out, arm.name, seed))
        if result["arms"][i]["finished"]:  # recorded: its run directory is no longer needed
            continue
        if console is not None:
            what = " ".join(arm.overrides) or "no balancing"
            seeded = "" if seed is None else f", seed {seed}"
            console.rule(f"run {i + 1}/{len(runs)}, {arm.name}{seeded}: {what} ({run.path})")
        if not run.finished(cfg.steps):
            shown = terminal(console, bar=progress, per_block=False) if console else []
            try:
                train(cfg, run.path, resume=run.has_checkpoint(), overwrite=True,
                      hooks=[*shown, *hooks], program=program)
            except RunStopped as stop:
                raise RunStopped(stop.signum, stop.step, "run the same command again to "
                                 "continue the study") from None
        result["arms"][i] = {**summarize(arm, run.metrics()), "seed": cfg.seed,
                             "commit": commit}
        _write(out, result)
    if jax.process_index() == 0:
        study_report(result, out, console)
    return result


def _start(out: Path, plan: dict, cfgs: list[Config], overwrite: bool) -> dict:
    """study.json's content to go on from: the earlier one in `out` if it holds the same plan
    and trains on the same global batch, else a new one (over anything in `out` only with
    `overwrite`)."""
    path = out / STUDY
    cfg = cfgs[0]
    batch = global_batch(cfg)
    if path.exists() and not overwrite:
        earlier = json.loads(path.read_text())
        if _plan(earlier) != plan:
            raise RunDirError(
                f"{out} holds another study (config {earlier.get('config')!r}, overrides "
                f"{earlier.get('overrides')}, arms {[a['name'] for a in _plan(earlier)['arms']]}"
                f", seeds {earlier.get('seeds')}); pass --overwrite to replace it or choose "
                "another --out")
        _check_batch(out, earlier, batch)
        return earlier
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise RunDirError(f"{out} is not empty and holds no {STUDY}; pass --overwrite to "
                          "replace what it holds or choose another --out")
    result = {**plan, "date": datetime.date.today().isoformat(), "steps": cfg.steps,
              "eval_period": cfg.eval_period, "eval_batches": cfg.eval_batches,
              "tokens_per_step": (batch["sequences"] * batch["micro_batches"]
                                  * batch["sequence_length"]),
              "batch": batch, "devices": jax.device_count(),
              "experts": cfg.num_experts, "k": cfg.num_experts_per_tok,
              "arms": [{"name": arm.name, "overrides": list(arm.overrides), "seed": c.seed,
                        "finished": False}
                       for (arm, _), c in zip(runs_of(_arms(plan), plan["seeds"]), cfgs)]}
    for arm in plan["arms"] if overwrite and jax.process_index() == 0 else ():
        if (out / arm["name"]).is_dir():
            shutil.rmtree(out / arm["name"])
    _write(out, result)
    return result


def global_batch(cfg: Config) -> dict:
    """What defines a step's batches (data/batching.py): the sequences of a global micro-batch
    (every device's rows), the micro-batches of a step, the sequence length."""
    return {"sequences": cfg.per_device_batch_size * jax.device_count(),
            "micro_batches": cfg.gradient_accumulation_steps,
            "sequence_length": cfg.max_target_length}


def _check_batch(out: Path, earlier: dict, batch: dict) -> None:
    """Refuse to continue a study on another global batch (study.json's `batch`; one written
    before it was recorded: its tokens_per_step)."""
    recorded = earlier.get("batch")
    tokens = batch["sequences"] * batch["micro_batches"] * batch["sequence_length"]
    if recorded == batch or (recorded is None and earlier.get("tokens_per_step") == tokens):
        return
    was = (f"{earlier.get('tokens_per_step'):,} tokens a step" if recorded is None else
           f"{recorded['micro_batches']} micro-batch(es) of {recorded['sequences']} x "
           f"{recorded['sequence_length']} tokens on {earlier.get('devices')} device(s)")
    raise RunDirError(
        f"{out}'s study trained on {was}; here a step would be {batch['micro_batches']} "
        f"micro-batch(es) of {batch['sequences']} x {batch['sequence_length']} tokens on "
        f"{jax.device_count()} device(s): other batches, no longer a comparison; continue it "
        "where the global batch is the same (the same device count), or start a new study "
        "(--overwrite or another --out)")


def _arms(plan: dict) -> list[Arm]:
    return [Arm(arm["name"], tuple(arm["overrides"])) for arm in plan["arms"]]


def _plan(study: dict) -> dict:
    """What makes a study the same study: its config, overrides, seeds and arms (study.json's
    `arms` are its runs: an arm's once per seed)."""
    arms = {arm["name"]: arm["overrides"] for arm in study.get("arms", [])}
    return {"config": study.get("config"), "overrides": study.get("overrides"),
            "seeds": study.get("seeds"),
            "arms": [{"name": name, "overrides": overrides} for name, overrides in arms.items()]}


def _write(out: Path, result: dict) -> None:
    """study.json, atomically, by process 0 (on several hosts every process runs the study)."""
    if jax.process_index() == 0:
        write_atomic(out / STUDY, lambda f: f.write((json.dumps(result, indent=1) + "\n").encode()))


def summarize(arm: Arm, records: list[dict]) -> dict:
    """An arm's result from its run's step records: the curve (one point per validation: the
    steps done, validation loss and perplexity, MaxVio_global, and the mean MaxVio_batch and
    training cross-entropy (without balance losses) of the steps since the previous point), the
    last point's values, their spread (min, max) over the last LAST_EVALS points, per layer the
    last MaxVio_global and MaxVio_batch, the tokens a validation measures, the median tokens/s,
    and the per-step training cross-entropy and MaxVio_batch."""
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
                      "tokens": r["validation"]["tokens"],
                      "layers": {"maxvio_global": glob,
                                 "maxvio_batch": batch[window].mean(0).tolist()}})
        since = n + 1
    if not curve:
        raise ValueError(f"arm {arm.name!r}: its run validated nowhere (eval_period 0?)")
    last, tail = curve[-1], curve[-LAST_EVALS:]
    return {"name": arm.name, "overrides": list(arm.overrides), "finished": True,
            **{key: last[key] for key in ("val_loss", "val_ppl", "maxvio_global",
                                          "maxvio_batch", "train_loss")},
            "val_tokens": last["tokens"],
            "spread": {key: [min(p[key] for p in tail), max(p[key] for p in tail)]
                       for key in ("val_loss", "val_ppl", "maxvio_global", "maxvio_batch")},
            "tokens_per_s": float(np.median([r["tokens_per_s"] for r in records])),
            "routing": routing, "layers": last["layers"],
            "curve": [{k: v for k, v in p.items() if k not in ("layers", "tokens")}
                      for p in curve],
            "per_step": {"loss": [r["ce"] for r in records],
                         "maxvio_batch": per_step}}


def _mean(values) -> float:
    return float(np.mean(values))
