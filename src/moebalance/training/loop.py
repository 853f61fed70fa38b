"""The training loop: a run directory, synthetic data, the jitted step, per-step balance metrics.

A run directory holds:
    config.yaml           the resolved configuration
    metrics.jsonl         one JSON object per step (loss, lr, grad_norm, tokens_per_s, the balance
                          losses, and `layers`: per MoE block its load statistics and bias stats)
    expert_counts.i32     every step's [L, E] int32 counts, appended raw (row-major);
    expert_counts.json    its row shape [L, E]: numpy.fromfile(...).reshape(-1, L, E) reads it
    checkpoints/N         Orbax checkpoints after N steps (every checkpoint_period, and at the end)

SIGINT / SIGTERM finish the current step, save a checkpoint and return; `resume=True` continues
from the latest checkpoint, bit-exactly (the data of a step is a function of the step).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx

from moebalance.config import Config
from moebalance.metrics import STAT_NAMES, load_stats, maxvio_global
from moebalance.model.transformer import DeepSeekV4, routed_layers
from moebalance.training import checkpoint
from moebalance.training.step import make_eval_step, make_optimizer, make_train_step

RUN_FILES = ("config.yaml", "metrics.jsonl", "expert_counts.i32", "expert_counts.json")


class RunDirError(FileExistsError):
    pass


def prepare_run_dir(out: Path, overwrite: bool) -> None:
    """Create `out`; refuse one that already holds a run unless `overwrite` is given."""
    existing = [f for f in (*RUN_FILES, "checkpoints") if (out / f).exists()]
    if existing and not overwrite:
        raise RunDirError(f"{out} already holds a run ({', '.join(existing)}); pass --resume to "
                          "continue it, --overwrite to replace it, or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    for f in existing:
        if f == "checkpoints":
            shutil.rmtree(out / f)
        else:
            (out / f).unlink()


def rewind_logs(out: Path, step: int, cfg: Config) -> None:
    """Drop what steps >= `step` wrote (they ran after the checkpoint being resumed)."""
    lines = (out / "metrics.jsonl").read_text().splitlines() if (
        out / "metrics.jsonl").exists() else []
    kept = [line for line in lines if json.loads(line)["step"] < step]
    (out / "metrics.jsonl").write_text("".join(line + "\n" for line in kept))
    row = cfg.base_num_decoder_layers * cfg.num_experts * 4
    with open(out / "expert_counts.i32", "ab") as f:
        f.truncate(step * row)


def synthetic_batch(cfg: Config, step: int, *, held_out: bool = False):
    """Seeded random tokens for `step`: [A, B, S+1], with full masks and one segment per row.
    The held-out stream (evaluation) is drawn from another seed."""
    a, b, s = (cfg.gradient_accumulation_steps, cfg.per_device_batch_size * jax.device_count(),
               cfg.max_target_length)
    key = jax.random.fold_in(jax.random.key(cfg.seed), step)
    if held_out:
        key = jax.random.fold_in(jax.random.key(cfg.seed + 1), step)
    tokens = jax.random.randint(key, (a, b, s + 1), 0, cfg.vocab_size, jnp.int32)
    return tokens, jnp.ones((a, b, s), bool), jnp.zeros((a, b, s), jnp.int32)


def layer_metrics(counts: np.ndarray, biases: np.ndarray | None, routed: list[int]) -> list[dict]:
    """Per MoE block: routing kind, load statistics and (top-k blocks) bias statistics."""
    stats = load_stats(counts)
    out = []
    for layer in range(counts.shape[0]):
        row = {"layer": layer, "routing": "topk" if layer in routed else "hash"}
        row.update({name: float(stats[name][layer]) for name in STAT_NAMES})
        if layer in routed and biases is not None:
            b = biases[routed.index(layer)]
            row.update(bias_mean=float(b.mean()), bias_std=float(b.std()),
                       bias_min=float(b.min()), bias_max=float(b.max()))
        out.append(row)
    return out


class _StopRequest:
    """Turns SIGINT/SIGTERM into a flag checked between steps."""

    def __init__(self):
        self.signal = None

    def __enter__(self):
        self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame):
        self.signal = signum

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def train(cfg: Config, out: Path, *, overwrite: bool = False, resume: bool = False,
          progress: bool = True) -> dict:
    """Train `cfg.steps` steps into run directory `out`; returns the last step's record."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    out = Path(out)
    if resume:
        saved = Config(**yaml.safe_load((out / "config.yaml").read_text()))
        if saved != cfg:
            raise RunDirError(f"{out} was started with another config; resume it with its own "
                              f"config.yaml")
    else:
        prepare_run_dir(out, overwrite)
        (out / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
        (out / "expert_counts.json").write_text(json.dumps(
            {"dtype": "int32", "row_shape": [cfg.base_num_decoder_layers, cfg.num_experts]}))
    model = DeepSeekV4(cfg, rngs=nnx.Rngs(cfg.seed))
    optimizer = nnx.Optimizer(model, make_optimizer(cfg), wrt=nnx.Param)
    checkpoints = checkpoint.manager(out, cfg.max_num_checkpoints_to_keep)
    first = checkpoint.restore(checkpoints, model, optimizer) if resume else 0
    if resume:
        rewind_logs(out, first, cfg)
    step_fn = make_train_step(cfg, model)
    routed = routed_layers(model)
    console = Console()
    tokens_per_step = (cfg.gradient_accumulation_steps * cfg.per_device_batch_size *
                       jax.device_count() * cfg.max_target_length)
    record = {}
    with _StopRequest() as stop, Progress(TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(),
                  TextColumn("{task.fields[status]}"), TimeRemainingColumn(), console=console,
                  disable=not progress) as bar, open(out / "metrics.jsonl", "a") as log, open(
            out / "expert_counts.i32", "ab") as counts_file:
        task = bar.add_task("train", total=cfg.steps, completed=first, status="compiling...")
        for step in range(first, cfg.steps):
            start = time.perf_counter()
            metrics = jax.device_get(step_fn(model, optimizer, *synthetic_batch(cfg, step)))
            seconds = time.perf_counter() - start
            if not math.isfinite(float(metrics["loss"])):
                raise FloatingPointError(
                    f"step {step}: the loss is {float(metrics['loss'])}; stopping (lower "
                    "learning_rate or check the data)")
            counts = np.asarray(metrics.pop("counts"), np.int32)
            counts.tofile(counts_file)
            biases = np.asarray(metrics.pop("bias")) if "bias" in metrics else None
            record = {"step": step, **{k: float(v) for k, v in metrics.items()},
                      "tokens_per_s": tokens_per_step / seconds,
                      "layers": layer_metrics(counts, biases, routed)}
            log.write(json.dumps(record) + "\n")
            log.flush()
            maxvio = np.mean([r["maxvio"] for r in record["layers"] if r["routing"] == "topk"]
                             or [0.0])
            bar.update(task, advance=1, status=f"loss {record['loss']:.4f}  "
                       f"{record['tokens_per_s']:.0f} tok/s  MaxVio {maxvio:.3f}")
            done = step + 1
            if done % cfg.checkpoint_period == 0 or done == cfg.steps or stop.signal:
                counts_file.flush()
                checkpoint.save(checkpoints, done, model, optimizer)
            if stop.signal:
                console.print(f"stopped by signal {stop.signal} after step {step}; checkpoint "
                              f"saved, continue with --resume")
                return record
    _summary(console, record, routed)
    return record


def _summary(console, record: dict, routed: list[int]) -> None:
    from rich.table import Table

    if not record:
        return
    table = Table(title=f"after step {record['step']}: loss {record['loss']:.4f}")
    for col in ("layer", "routing", "variance", "maxvio", "cv", "dead", "bias std"):
        table.add_column(col, justify="right")
    for row in record["layers"]:
        table.add_row(str(row["layer"]), row["routing"], f"{row['variance']:.2f}",
                      f"{row['maxvio']:.3f}", f"{row['cv']:.3f}",
                      f"{row['dead_fraction']:.2f}",
                      f"{row['bias_std']:.4f}" if "bias_std" in row else "-")
    console.print(table)


def evaluate(run_dir: Path, batches: int = 4) -> dict:
    """Held-out loss, perplexity and per-layer MaxVio_global of the run's latest checkpoint.

    Counts are accumulated over all evaluation batches before MaxVio is taken; nothing is
    written to the run and the bias is only read.
    """
    run_dir = Path(run_dir)
    cfg = Config(**yaml.safe_load((run_dir / "config.yaml").read_text()))
    model = DeepSeekV4(cfg, rngs=nnx.Rngs(cfg.seed))
    optimizer = nnx.Optimizer(model, make_optimizer(cfg), wrt=nnx.Param)
    step = checkpoint.restore(checkpoint.manager(run_dir, cfg.max_num_checkpoints_to_keep),
                              model, optimizer)
    eval_step = make_eval_step(cfg, model)
    ce_sum = n_tokens = 0.0
    counts = []
    for i in range(batches):
        tokens, mask, seg = synthetic_batch(cfg, i, held_out=True)
        for a in range(tokens.shape[0]):
            out = jax.device_get(eval_step(model, tokens[a], mask[a], seg[a]))
            ce_sum += float(out["ce_sum"])
            n_tokens += float(out["tokens"])
            counts.append(np.asarray(out["counts"]))
    loss = ce_sum / n_tokens
    routed = routed_layers(model)
    maxvio = maxvio_global(np.stack(counts))
    return {"step": step, "loss": loss, "perplexity": math.exp(loss), "tokens": int(n_tokens),
            "layers": [{"layer": i, "routing": "topk" if i in routed else "hash",
                        "maxvio_global": float(maxvio[i])} for i in range(len(maxvio))]}
