"""The training loop: a run directory, data on the mesh, the jitted step, per-step balance metrics.

A run directory holds:
    config.yaml           the resolved configuration
    metrics.jsonl         one JSON object per step (loss, lr, grad_norm, tokens_per_s, the balance
                          losses, and `layers`: per MoE block its load statistics and bias stats)
    expert_counts.i32     every step's [L, E] int32 counts, appended raw (row-major);
    expert_counts.json    its row shape [L, E]: numpy.fromfile(...).reshape(-1, L, E) reads it
    tokenizer.json        the tokenizer of the text data (not for synthetic data), for sampling
    probe_counts.json     the [L, E] counts of one fixed held-out micro-batch (the probe) before
                          the first step ("0") and after the last (str(steps)): what the A/B
                          table compares; "refit" {str(steps): [L, E]}: the probe after the last
                          step with the top-k biases refitted (`refit_biases`), when configured
    tensorboard/          TensorBoard event files (loss, lr, balance losses, MaxVio per layer)
    checkpoints/N         Orbax checkpoints after N steps (every checkpoint_period, and at the end)

SIGINT / SIGTERM finish the current step, save a checkpoint and return; `resume=True` continues
from the latest checkpoint, bit-exactly (the data of a step is a function of the step, so the step
is the data position; training draws no random numbers). On several hosts every process runs this
loop on its own rows of the batch; process 0 writes the logs.
"""

from __future__ import annotations

import contextlib
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

from moebalance import balancing, data
from moebalance.atomic import write_atomic
from moebalance.config import Config
from moebalance.metrics import STAT_NAMES, load_stats, maxvio_global, rank_loads
from moebalance.model.transformer import DeepSeekV4, get_biases, routed_layers, set_biases
from moebalance.routing import build_hash_table
from moebalance.training import checkpoint, sharding
from moebalance.training.step import (make_eval_step, make_optimizer, make_score_step,
                                      make_train_step)

RUN_FILES = ("config.yaml", "metrics.jsonl", "expert_counts.i32", "expert_counts.json",
             "probe_counts.json", "tokenizer.json", "tensorboard")


class RunDirError(FileExistsError):
    pass


def check_run_dir(out: Path, overwrite: bool) -> list[str]:
    """The run files already in `out`; refuses them unless `overwrite` is given."""
    existing = [f for f in (*RUN_FILES, "checkpoints") if (out / f).exists()]
    if existing and not overwrite:
        raise RunDirError(f"{out} already holds a run ({', '.join(existing)}); pass --resume to "
                          "continue it, --overwrite to replace it, or choose another --out")
    return existing


def prepare_run_dir(out: Path, overwrite: bool) -> None:
    """Create `out`, emptied of an earlier run (only with `overwrite`)."""
    existing = check_run_dir(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    for f in existing:
        if (out / f).is_dir():
            shutil.rmtree(out / f)
        else:
            (out / f).unlink()


def read_run_config(run_dir: Path) -> Config:
    """The config a run directory was trained with; a missing directory or config.yaml raises,
    naming the path and what was expected there."""
    from moebalance.report import run_files  # here: report imports matplotlib, training need not

    return Config(**yaml.safe_load((run_files(run_dir) / "config.yaml").read_text()))


def rewind_logs(out: Path, step: int, cfg: Config) -> None:
    """Drop what steps >= `step` wrote (they ran after the checkpoint being resumed)."""
    lines = (out / "metrics.jsonl").read_text().splitlines() if (
        out / "metrics.jsonl").exists() else []
    kept = [line for line in lines if json.loads(line)["step"] < step]
    (out / "metrics.jsonl").write_text("".join(line + "\n" for line in kept))
    row = cfg.base_num_decoder_layers * cfg.num_experts * 4
    with open(out / "expert_counts.i32", "ab") as f:
        f.truncate(step * row)


def layer_metrics(counts: np.ndarray, biases: np.ndarray | None, routed: list[int],
                  ranks: int = 1) -> list[dict]:
    """Per MoE block: routing kind, load statistics, (top-k blocks) bias statistics and, under
    expert parallelism (ranks > 1), the assignments each rank receives and their max / mean."""
    stats = load_stats(counts)
    loads, imbalance = rank_loads(counts, ranks)
    out = []
    for layer in range(counts.shape[0]):
        row = {"layer": layer, "routing": "topk" if layer in routed else "hash"}
        row.update({name: float(stats[name][layer]) for name in STAT_NAMES})
        if ranks > 1:
            row.update(rank_load=loads[layer].tolist(), rank_imbalance=float(imbalance[layer]))
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


def _probe(cfg: Config, mesh) -> tuple:
    """The fixed measurement batch: micro-batch 0 of held-out batch 0, [B, S+1] / [B, S]."""
    tokens, mask, segment_ids = data.batches(cfg, "eval").batch(0)
    return tuple(x[0] for x in sharding.global_batch(mesh, tokens, mask, segment_ids))


def _hash_tables(cfg: Config, train_data) -> list | None:
    """'balanced' tables from the training split's token frequencies (uniform for synthetic)."""
    if cfg.hash_table != "balanced" or not cfg.first_num_hash_layers:
        return None
    counts = train_data.token_counts(cfg.vocab_size)
    return [build_hash_table(cfg.vocab_size, cfg.num_experts, cfg.num_experts_per_tok,
                             "balanced", token_counts=counts)] * cfg.first_num_hash_layers


def build(cfg: Config, mesh, train_data=None):
    """Model and optimizer, placed on the mesh."""
    model = DeepSeekV4(cfg, hash_tables=_hash_tables(cfg, train_data or data.batches(cfg)),
                       rngs=nnx.Rngs(cfg.seed))
    optimizer = nnx.Optimizer(model, make_optimizer(cfg), wrt=nnx.Param)
    sharding.shard(model, mesh)
    sharding.shard(optimizer, mesh)
    return model, optimizer


def refit_biases(cfg: Config, model: DeepSeekV4, mesh, source, first: int, batches: int,
                 iterations: int = 4) -> jax.Array:
    """[L_routed, E] float32: the top-k biases that balance `batches` batches of `source` (from
    batch `first` on) at the model's current weights, i.e. what a perfectly estimated bias would
    be on that data. Quantile Balancing (undamped) on all their tokens at once, repeated
    `iterations` times, since a block's input depends on the earlier blocks' biases. The model's
    own biases are put back unchanged."""
    score_step = make_score_step(cfg, model, mesh)
    fit_batches = []
    for i in range(first, first + batches):
        tokens, _, segment_ids = sharding.global_batch(mesh, *source.batch(i))
        fit_batches += [(tokens[a], segment_ids[a]) for a in range(tokens.shape[0])]
    fit = get_biases(model)
    for _ in range(iterations):
        with biases_set_to(model, fit):
            scores = jnp.concatenate([score_step(model, t, s) for t, s in fit_batches], axis=1)
        fit = balancing.quantile_bias(scores, fit, cfg.num_experts_per_tok)
    return fit


@contextlib.contextmanager
def biases_set_to(model: DeepSeekV4, biases: jax.Array):
    """The top-k blocks use `biases` [L_routed, E] inside the block; their own come back after it,
    also when it raises."""
    trained = get_biases(model)
    set_biases(model, biases)
    try:
        yield
    finally:
        set_biases(model, trained)


def calibration_batches(cfg: Config, model: DeepSeekV4) -> int:
    """How many of its last training batches a run calibrates its biases on after the last step
    (`routed_bias_calibration_batches`, at most all of them; 0 for runs without routed_bias or
    top-k blocks)."""
    if not (cfg.routed_bias and routed_layers(model)):
        return 0
    return min(cfg.routed_bias_calibration_batches, cfg.steps)


def calibrate_biases(cfg: Config, model: DeepSeekV4, mesh, train_data, batches: int) -> None:
    """After the last step: set every top-k bias to the one that balances the last `batches`
    training batches at the final weights, one undamped fit per block on all their tokens
    (`refit_biases`). The online rule fits each batch with the weights of its own step, which lag
    behind the router, and can only average few batches; this refit sees many batches as the
    final weights route them."""
    set_biases(model, refit_biases(cfg, model, mesh, train_data, cfg.steps - batches, batches,
                                   iterations=1))


def _final_probe(cfg: Config, model, mesh, eval_step, probe, train_data) -> tuple:
    """The probe's [L, E] counts after the last step, and with refitted biases (or None)."""
    counts = jax.device_get(eval_step(model, *probe)["counts"])
    if not (cfg.probe_refit_batches and cfg.routed_bias and routed_layers(model)):
        return counts, None
    with biases_set_to(model, refit_biases(cfg, model, mesh, train_data, cfg.steps,
                                           cfg.probe_refit_batches)):
        return counts, jax.device_get(eval_step(model, *probe)["counts"])


def _write_probe(out: Path, key: int, counts, routed: list[int], tokens: int,
                 refit=None, online=None) -> None:
    path = out / "probe_counts.json"
    probe = json.loads(path.read_text()) if path.exists() else {
        "tokens": tokens, "routing": ["topk" if i in routed else "hash"
                                      for i in range(len(counts))], "counts": {}}
    probe["counts"][str(key)] = np.asarray(counts).tolist()
    if refit is not None:
        probe.setdefault("refit", {})[str(key)] = np.asarray(refit).tolist()
    if online is not None:
        probe.setdefault("online", {})[str(key)] = np.asarray(online).tolist()
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(probe))
    partial.replace(path)  # atomic: a crash leaves the previous file whole


def _tensorboard(writer, record: dict) -> None:
    step = record["step"]
    for key, value in record.items():
        if key not in ("step", "layers"):
            writer.add_scalar(f"train/{key}", value, step)
    for row in record["layers"]:
        for stat in ("maxvio", "variance", "cv", "rank_imbalance"):
            if stat in row:
                writer.add_scalar(f"layer_{row['layer']:02d}/{stat}", row[stat], step)
        if "bias_std" in row:
            writer.add_scalar(f"layer_{row['layer']:02d}/bias_std", row["bias_std"], step)
    writer.flush()


def train(cfg: Config, out: Path, *, overwrite: bool = False, resume: bool = False,
          progress: bool = True, program: Config | None = None) -> dict:
    """Train `cfg.steps` steps into run directory `out`; returns the last step's record.

    program: run on the step compiled for this config (see make_train_step), e.g. Run B's for
    Run A, so that an experiment compiles its step once."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    from tensorboardX import SummaryWriter

    sharding.initialize_distributed(cfg)
    out = Path(out)
    writer_process = jax.process_index() == 0
    if resume:
        saved = read_run_config(out)
        launch = {key: getattr(cfg, key) for key in sharding.LAUNCH_KEYS}  # may differ
        if dataclasses.replace(saved, **launch) != cfg:
            raise RunDirError(f"{out} was started with another config; resume it with its own "
                              f"config.yaml")
    else:
        check_run_dir(out, overwrite)
    mesh = sharding.make_mesh(cfg)
    train_data = data.batches(cfg, "train")  # checks the data before anything is written
    probe = _probe(cfg, mesh)
    sharding.sync_processes("run directory checked")  # by all, before process 0 writes to it
    if writer_process and not resume:
        prepare_run_dir(out, overwrite)
        (out / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
        (out / "expert_counts.json").write_text(json.dumps(
            {"dtype": "int32", "row_shape": [cfg.base_num_decoder_layers, cfg.num_experts]}))
        if train_data.tokenizer is not None:
            write_atomic(out / "tokenizer.json",
                              lambda f: f.write(train_data.tokenizer.to_str().encode()))
    model, optimizer = build(cfg, mesh, train_data)
    checkpoints = checkpoint.manager(out, cfg.max_num_checkpoints_to_keep)
    first = checkpoint.restore(checkpoints, model, optimizer) if resume else 0
    if resume and writer_process:
        rewind_logs(out, first, cfg)
    step_fn = make_train_step(cfg, model, mesh, program)
    eval_step = make_eval_step(cfg, model, mesh)
    routed = routed_layers(model)
    ranks = mesh.shape["expert"]
    probe_tokens = int(np.prod(probe[1].shape))
    if first == 0:
        counts = jax.device_get(eval_step(model, *probe)["counts"])
        if writer_process:
            _write_probe(out, 0, counts, routed, probe_tokens)
    console = Console()
    tokens_per_step = cfg.gradient_accumulation_steps * train_data.global_batch * cfg.max_target_length
    record = {}
    with _StopRequest() as stop, Progress(TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(),
                  TextColumn("{task.fields[status]}"), TimeRemainingColumn(), console=console,
                  disable=not (progress and writer_process)) as bar, contextlib.ExitStack() as files:
        if writer_process:
            log = files.enter_context(open(out / "metrics.jsonl", "a"))
            counts_file = files.enter_context(open(out / "expert_counts.i32", "ab"))
            writer = SummaryWriter(str(out / "tensorboard"), purge_step=first or None)
            files.callback(writer.close)
        task = bar.add_task("train", total=cfg.steps, completed=first, status="compiling...")
        for step in range(first, cfg.steps):
            start = time.perf_counter()
            batch = sharding.global_batch(mesh, *train_data.batch(step))
            metrics = jax.device_get(step_fn(model, optimizer, *batch))
            seconds = time.perf_counter() - start
            if not math.isfinite(float(metrics["loss"])):
                raise FloatingPointError(
                    f"step {step}: the loss is {float(metrics['loss'])}; stopping (lower "
                    "learning_rate or check the data); the last good checkpoint is kept")
            counts = np.asarray(metrics.pop("counts"), np.int32)
            biases = np.asarray(metrics.pop("bias")) if "bias" in metrics else None
            record = {"step": step, **{k: float(v) for k, v in metrics.items()},
                      "tokens_per_s": tokens_per_step / seconds,
                      "layers": layer_metrics(counts, biases, routed, ranks)}
            if writer_process:
                counts.tofile(counts_file)
                log.write(json.dumps(record) + "\n")
                log.flush()
                _tensorboard(writer, record)
            maxvio = np.mean([r["maxvio"] for r in record["layers"] if r["routing"] == "topk"]
                             or [0.0])
            bar.update(task, advance=1, status=f"loss {record['loss']:.4f}  "
                       f"{record['tokens_per_s']:.0f} tok/s  MaxVio {maxvio:.3f}")
            done = step + 1
            if done == cfg.steps:  # every process measures (collectives), process 0 writes
                online, calibration = None, calibration_batches(cfg, model)
                if calibration:
                    online = jax.device_get(eval_step(model, *probe)["counts"])
                    calibrate_biases(cfg, model, mesh, train_data, calibration)
                    if writer_process:
                        console.print(f"biases calibrated on the last {calibration} training "
                                      "batches at the final weights")
                final, refit = _final_probe(cfg, model, mesh, eval_step, probe, train_data)
                if writer_process:
                    _write_probe(out, done, final, routed, probe_tokens, refit, online)
            if done % cfg.checkpoint_period == 0 or done == cfg.steps or stop.signal:
                if writer_process:
                    counts_file.flush()
                checkpoint.save(checkpoints, done, model, optimizer)
            if stop.signal:
                console.print(f"stopped by signal {stop.signal} after step {step}; checkpoint "
                              f"saved, continue with --resume")
                return record
    if writer_process:
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


def evaluate(run_dir: Path, batches: int | None = None, split: str = "eval",
             refit_batches: int = 0) -> dict:
    """Loss, perplexity and per-layer MaxVio_global of the run's latest checkpoint on a split.

    `batches` batches of `split` (default: the whole split once for text, 4 for synthetic data;
    'train' measures balance on the distribution the bias was fitted to, 'eval' on held-out
    text). Counts are accumulated over all of them before MaxVio is taken. With `refit_batches`,
    each layer also gets `maxvio_global_refit`: the same measurement with the top-k biases
    refitted to balance that many fresh training batches (`refit_biases`), i.e. what a perfectly
    estimated bias would reach on this data. Nothing is written to the run; its bias is only read.
    """
    if (batches is not None and batches < 1) or refit_batches < 0:
        raise ValueError(f"evaluate needs batches >= 1 and refit_batches >= 0, got {batches} and "
                         f"{refit_batches}")
    run_dir = Path(run_dir)
    cfg = read_run_config(run_dir)
    mesh = sharding.make_mesh(cfg)
    source = data.batches(cfg, split)
    if batches is None:
        per_batch = cfg.gradient_accumulation_steps * source.global_batch
        batches = max(1, source.num_rows // per_batch) if source.num_rows else 4
    model, optimizer = build(cfg, mesh, source)  # hash tables too come from the checkpoint
    step = checkpoint.restore_latest(run_dir, model, optimizer)
    eval_step = make_eval_step(cfg, model, mesh)

    def measure():  # -> (CE summed over the valid targets, their number, [n, L, E] counts)
        ce_sum = n_tokens = 0.0
        counts = []
        for i in range(batches):
            tokens, mask, seg = sharding.global_batch(mesh, *source.batch(i))
            for a in range(tokens.shape[0]):
                out = jax.device_get(eval_step(model, tokens[a], mask[a], seg[a]))
                ce_sum += float(out["ce_sum"])
                n_tokens += float(out["tokens"])
                counts.append(np.asarray(out["counts"]))
        return ce_sum, n_tokens, np.stack(counts)

    ce_sum, n_tokens, counts = measure()
    loss = ce_sum / n_tokens
    routed = routed_layers(model)
    layers = [{"layer": i, "routing": "topk" if i in routed else "hash",
               "maxvio_global": float(m)} for i, m in enumerate(maxvio_global(counts))]
    if refit_batches and routed:
        with biases_set_to(model, refit_biases(cfg, model, mesh, data.batches(cfg, "train"),
                                               cfg.steps, refit_batches)):
            refit_counts = measure()[2]
        for row, m in zip(layers, maxvio_global(refit_counts)):
            row["maxvio_global_refit"] = float(m)
    return {"step": step, "split": split, "loss": loss, "perplexity": math.exp(loss),
            "tokens": int(n_tokens), "batches": batches, "layers": layers}
