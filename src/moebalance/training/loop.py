"""The training loop: data on the mesh, the jitted step, per-step balance metrics, checkpoints.

`train` runs `cfg.steps` steps into a run directory (its files: moebalance/rundir.py). What the
run shows and logs attaches as hooks (training/hooks.py); the bias calibration after the last step
and the refit are in training/calibration.py. With `eval_period`, the held-out split is measured
every that many steps and after the last (training/validation.py): the step's record then holds
`validation`.

Once the steps run, SIGINT / SIGTERM finish the current step, save a checkpoint and raise
RunStopped; `resume=True` continues from the latest checkpoint, bit-exactly (the data of a step is
a function of the step, so the step is the data position; training draws no random numbers), or
starts over when the run stopped before its first checkpoint. Resuming with another `steps` (more
than the checkpoint's; also after the run ended) runs to the new total on schedules recomputed for
it, records it in config.yaml and says whether the run still equals one started with it
(`steps_note`). On several hosts every process runs
this loop on its own rows of the batch; process 0 writes the run directory and calls the hooks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moebalance import data
from moebalance.config import Config
from moebalance.metrics import STAT_NAMES, load_stats, rank_loads
from moebalance.model.transformer import DeepSeekV4, placeholder_hash_tables, routed_layers
from moebalance.routing import build_hash_table
from moebalance.rundir import RunDir, RunStopped
from moebalance.training import checkpoint, compiled, sharding
from moebalance.training.ahead import compile_ahead
from moebalance.training.calibration import (calibration_batches, final_probe, probe_counts,
                                             refits)
from moebalance.training.hooks import Hook, Hooks, StepLogFile, TensorBoard
from moebalance.training.objective import SWITCHES
from moebalance.training.step import (BIAS_KEYS, config_key, make_eval_step, make_fit_step,
                                      make_score_step, make_train_step, new_optimizer,
                                      schedule_changes)
from moebalance.training.validation import Validation


def train(cfg: Config, out: Path, *, overwrite: bool = False, resume: bool = False,
          hooks: list[Hook] = (), program: Config | None = None) -> dict:
    """Train `cfg.steps` steps into run directory `out`; returns the last step's record. hooks:
    what to show besides the run's files (e.g. `hooks.terminal()`). program: run on the step
    compiled for this config (make_train_step), e.g. Run B's for Run A: one compilation."""
    sharding.initialize_distributed(cfg)
    writer = jax.process_index() == 0
    with RunDir(out).writing(writer) as run:
        mesh, cfg, program = _on_devices(cfg, program)
        planned = cfg.steps  # the run's own total: another on resume extends or shortens it
        if resume:
            planned = run.check_resumable(cfg, may_differ=sharding.LAUNCH_KEYS).steps
        else:
            run.check_new(overwrite)
        train_data = data.batches(cfg, "train")  # checks the data before anything is written
        probes = probe_set(cfg, mesh)
        sharding.sync_processes("run directory checked")  # by all, before process 0 writes
        if writer and not resume:
            run.create(cfg, overwrite, train_data.tokenizer)
        model, optimizer = build(cfg, mesh, train_data, program=program)
        checkpoints = checkpoint.manager(run.checkpoints, cfg.max_num_checkpoints_to_keep)
        first = checkpoint.restore(checkpoints, model, optimizer) if (
            resume and run.has_checkpoint()) else 0  # stopped before its first: start over
        if resume and writer:
            run.rewind(first)
        changed = _change_steps(cfg, run, planned, first, model) if planned != cfg.steps else None
        step_fn, eval_step = _compiled_steps(cfg, program, mesh, (model, optimizer), probes[0],
                                             train_data.batch(first) if first < cfg.steps else None)
        routing = layer_routing(cfg, model)
        validation = Validation(cfg, mesh, eval_step)
        tokens = cfg.gradient_accumulation_steps * train_data.global_batch * cfg.max_target_length
        if first == 0:  # every process measures (collectives), process 0 writes
            counts = _initial_probe(cfg, program, eval_step, model, probes)
            if writer:
                run.write_probe(0, counts, routing, probes[0][1].size)
        record = {}
        sinks = Hooks([StepLogFile(run), TensorBoard(run), *hooks] if writer else [])
        with StopRequest() as stop, sinks:
            sinks.start(first, cfg.steps)
            if changed:
                sinks.note(changed)
            for step in range(first, cfg.steps):
                start = time.perf_counter()
                batch = sharding.global_batch(mesh, *train_data.batch(step))
                metrics = jax.device_get(step_fn(model, optimizer, *batch))
                record, counts = step_record(step, metrics, time.perf_counter() - start, tokens,
                                             routing, mesh.shape["expert"])
                validation.attach(record, model)
                sinks.step(record, counts)
                if step + 1 == cfg.steps:
                    _measure_final(cfg, model, mesh, eval_step, probes, train_data, run=run,
                                   routing=routing, sinks=sinks)
                if (step + 1) % cfg.checkpoint_period == 0 or step + 1 == cfg.steps or stop.signal:
                    checkpoint.save(checkpoints, step + 1, model, optimizer)
                if stop.signal:
                    raise RunStopped(stop.signal, step)
            if record:
                sinks.end(record)
    return record


def _on_devices(cfg: Config, program: Config | None):
    """(the run's mesh, cfg, program) with their `remat_policy: auto` chosen for its devices."""
    mesh = sharding.make_mesh(cfg)
    return mesh, compiled.resolve_remat(cfg, mesh), compiled.resolve_remat(program, mesh)


def _compiled_steps(cfg: Config, program: Config | None, mesh, state: tuple, probe: tuple,
                    batch: tuple | None) -> tuple:
    """(training step, evaluation step) of the run, compiled side by side before their first call
    (ahead.compile_ahead), and with them, where the program (make_train_step's; default `cfg`)
    calibrates its biases after its last step, the score step, where it refits them, the fit
    step. `batch`: the first step's local rows; None when no step is left."""
    model, optimizer = state
    program = program or cfg
    step_fn = make_train_step(cfg, model, mesh, program)
    eval_step = make_eval_step(cfg, model, mesh)
    with compile_ahead() as ahead:
        if batch is not None:  # the longest compilation first
            tokens, mask, segment_ids = sharding.global_batch(mesh, *batch)
            ahead(step_fn, model, optimizer, tokens, mask, segment_ids)
            if calibration_batches(program, model):  # on micro-batches, as the calibration
                ahead(make_score_step(program, model, mesh), model, tokens[0], segment_ids[0])
            if refits(program, model):  # on all the refit's micro-batches at once
                copies = program.probe_refit_batches * tokens.shape[0]
                ahead(make_fit_step(program, model, mesh), model,
                      *(jnp.concatenate([x[0]] * copies) for x in (tokens, segment_ids)))
        ahead(eval_step, model, *probe)
    return step_fn, eval_step


def layer_routing(cfg: Config, model) -> list[str]:
    """Per MoE block, how it routes: 'topk' (learned, balanced) or 'hash' (a fixed table)."""
    routed = routed_layers(model)
    return ["topk" if i in routed else "hash" for i in range(cfg.base_num_decoder_layers)]


def _change_steps(cfg: Config, run: RunDir, planned: int, first: int, model) -> str:
    """A run planned for `planned` steps resumed after `first` to run `cfg.steps`: config.yaml
    updated (by process 0), and the note that says so (steps_note)."""
    ended = first > 0 and run.finished(first)  # so its biases may have been calibrated
    note = steps_note(cfg, planned, first, calibrated=ended and calibration_batches(cfg, model) > 0)
    if jax.process_index() == 0:
        run.change_steps(cfg.steps, first)
    return note


def _measure_final(cfg: Config, model, mesh, eval_step, probes, train_data, *, run: RunDir,
                   routing: list[str], sinks: Hooks) -> None:
    """After the last step: the probe set measured at the final weights (by every process:
    collectives), the biases calibrated first where the config says (a note), and written by
    process 0."""
    final = final_probe(cfg, model, mesh, eval_step, probes, train_data)
    if final["calibration"]:
        sinks.note(f"biases calibrated on the next {final['calibration']} (fresh) training "
                   "batches at the final weights")
    if jax.process_index() == 0:
        run.write_probe(cfg.steps, final["counts"], routing, probes[0][1].size, final["refit"],
                        final["online"])


def steps_note(cfg: Config, planned: int, first: int, calibrated: bool) -> str:
    """The line that says a run planned for `planned` steps, resumed after `first` (its biases
    `calibrated` after that step, as the run then ended), now runs to `cfg.steps`, and whether it
    ends as a run started with `cfg.steps` would."""
    unlike = [f"steps 0-{first - 1} had the {planned}-step {rate}"
              for rate in schedule_changes(dataclasses.replace(cfg, steps=planned), cfg, first)]
    if calibrated:
        unlike.append(f"the biases were calibrated after step {first}")
    verdict = (f"unlike a run started with steps={cfg.steps}, {' and '.join(unlike)}" if unlike
               else f"the same as a run started with steps={cfg.steps}")
    return (f"steps {planned} -> {cfg.steps} (config.yaml updated): the schedules are recomputed "
            f"for {cfg.steps} steps from step {first} on; {verdict}")


def step_record(step: int, metrics: dict, seconds: float, tokens: int, routing: list[str],
                ranks: int) -> tuple[dict, np.ndarray]:
    """A step's metrics record (metrics.jsonl's line; `tokens` per step) and its [L, E] int32
    expert counts; a non-finite loss or gradient norm (whose update made the weights garbage)
    stops the run here, before its state is saved."""
    for name in ("loss", "grad_norm"):
        if not math.isfinite(float(metrics[name])):
            raise FloatingPointError(
                f"step {step}: the {name.replace('_', ' ')} is {float(metrics[name])}; stopping "
                "before its state is saved (lower learning_rate or check the data); the last "
                "checkpoint is kept")
    counts = np.asarray(metrics.pop("counts"), np.int32)
    biases = np.asarray(metrics.pop("bias")) if "bias" in metrics else None
    record = {"step": step, **{k: float(v) for k, v in metrics.items()},
              "tokens_per_s": tokens / seconds,
              "layers": layer_metrics(counts, biases, routing, ranks)}
    return record, counts


def layer_metrics(counts: np.ndarray, biases: np.ndarray | None, routing: list[str],
                  ranks: int = 1) -> list[dict]:
    """Per MoE block: routing kind, load statistics, (top-k blocks) bias statistics and, under
    expert parallelism (ranks > 1), the assignments each rank receives and their max / mean."""
    stats = load_stats(counts)
    loads, imbalance = rank_loads(counts, ranks)
    routed = [i for i, kind in enumerate(routing) if kind == "topk"]
    out = []
    for layer in range(counts.shape[0]):
        row = {"layer": layer, "routing": routing[layer]}
        row.update({name: float(stats[name][layer]) for name in STAT_NAMES})
        if ranks > 1:
            row.update(rank_load=loads[layer].tolist(), rank_imbalance=float(imbalance[layer]))
        if layer in routed and biases is not None:
            b = biases[routed.index(layer)]
            row.update(bias_mean=float(b.mean()), bias_std=float(b.std()),
                       bias_min=float(b.min()), bias_max=float(b.max()))
        out.append(row)
    return out


class StopRequest:
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


def probe_set(cfg: Config, mesh) -> list[tuple]:
    """The fixed measurement batches: the first `probe_batches` micro-batches of the held-out
    split, in order, each (tokens [B, S+1], mask [B, S], segment_ids [B, S]); the first (micro-batch
    0 of held-out batch 0) is the probe of the seed's table."""
    source, found = data.batches(cfg, "eval"), []
    for i in itertools.count():
        batch = sharding.global_batch(mesh, *source.batch(i))
        found += [tuple(x[a] for x in batch) for a in range(batch[0].shape[0])]
        if len(found) >= cfg.probe_batches:
            return found[:cfg.probe_batches]


def _hash_tables(cfg: Config, train_data) -> list | None:
    """'balanced' tables from the training split's token frequencies (uniform for synthetic)."""
    if cfg.hash_table != "balanced" or not cfg.first_num_hash_layers:
        return None
    counts = train_data.token_counts(cfg.vocab_size)
    return [build_hash_table(cfg.vocab_size, cfg.num_experts, cfg.num_experts_per_tok,
                             "balanced", token_counts=counts)] * cfg.first_num_hash_layers


_draws: dict | None = None  # inside shared_draws(): the models drawn, by their program's config
_probed: dict | None = None  # and their probe set's counts (_initial_probe), by the same key


@contextlib.contextmanager
def shared_draws():
    """Inside the block, the runs of one program (make_train_step's, e.g. the A/B's two) start
    from one draw of the initial weights: the first run's model drawn on the host is kept, and
    the later ones start from a copy of it instead of drawing again (deepseek4-tiny's draw:
    1.1 s on a 2-core CPU, most of Run B's 1.3-2.2 s build on a TPU v5e's host). A program's runs
    differ only in their balancing switches, which no weight depends on."""
    global _draws, _probed
    outer, _draws, _probed = (_draws, _probed), {}, {}
    try:
        yield
    finally:
        _draws, _probed = outer


def _initial_probe(cfg: Config, program: Config | None, eval_step, model, probes) -> np.ndarray:
    """probe_counts before the first step. Inside shared_draws(), runs whose config is their
    program's but for its balancing (SWITCHES, BIAS_KEYS; the A/B's two) start from one draw
    (build) with the same zero biases and measure the same probe set: the first run's counts
    serve the others (Run B's measurement again took 5 s on a 2-core CPU)."""
    key = None
    if _probed is not None and program is not None:
        balancing = {name: getattr(program, name) for name in SWITCHES + BIAS_KEYS}
        if config_key(dataclasses.replace(cfg, **balancing)) == config_key(program):
            key = config_key(program)
    if key not in (_probed or {}):
        counts = probe_counts(eval_step, model, probes)
        if key is None:
            return counts
        _probed[key] = counts
    return _probed[key]


def build(cfg: Config, mesh, train_data=None, *, restoring: bool = False,
          program: Config | None = None):
    """Model and optimizer, placed on the mesh. `restoring`: a checkpoint will supply every
    variable, the hash tables too, so none is built from the data. program: the config of the
    step the run runs (train's), by which shared_draws() shares the draw."""
    key = config_key(program) if program is not None and _draws is not None else None
    if key is not None and key in _draws:
        model = nnx.clone(_draws[key])
    else:
        tables = (placeholder_hash_tables(cfg) if restoring
                  else _hash_tables(cfg, train_data or data.batches(cfg)))
        # drawn on the host, then placed: init_normal takes a seed per parameter from the Rngs
        # stream, three eager key operations and a read each (~1,500 parameters in
        # deepseek4-tiny), which on an accelerator would each be a dispatch to it and a copy back
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            model = DeepSeekV4(cfg, hash_tables=tables, rngs=nnx.Rngs(cfg.seed))
        if key is not None:
            _draws[key] = nnx.clone(model)  # kept on the host, apart from what shard places
    sharding.shard(model, mesh)
    optimizer = new_optimizer(cfg, model)
    sharding.shard(optimizer, mesh)
    return model, optimizer
