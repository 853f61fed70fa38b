"""Orbax checkpoints of a training run: every variable of the model (parameters, the float32
biases and the hash tables, bit-exact), the optimizer state, and the step (which is also the data
position: synthetic batches are a function of the step). Orbax writes each checkpoint to a
temporary directory and renames it into place, and keeps the last `max_num_checkpoints_to_keep`;
inside `background()` it does so on a thread of its own while the caller goes on.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils

from moebalance.config import Config
from moebalance.model.transformer import DeepSeekV4, placeholder_hash_tables
from moebalance.training import damage
from moebalance.training.step import new_optimizer

log = logging.getLogger(__name__)
_writing: list[ocp.CheckpointManager] | None = None  # inside background(): its managers


@contextlib.contextmanager
def background():
    """Inside the block, checkpoints are written in the background: `save` returns once Orbax
    holds the state on the host (its async checkpointing) and the caller goes on while Orbax
    writes it and renames it into place. Leaving the block, also by an error, waits for every
    write. The A/B saves Run A's state while Run B starts and Run B's while the report is drawn
    (a save of deepseek4-tiny took 1.6-1.9 s on a TPU v5e's host, of which Orbax's write is
    most: on a 2-core CPU 0.65 s, 0.1 s in the background)."""
    global _writing
    outer, _writing = _writing, []
    try:
        yield
    finally:
        managers, _writing = _writing, outer
        for mgr in managers:
            mgr.wait_until_finished()


def manager(directory: Path, keep: int | None = None) -> ocp.CheckpointManager:
    """The checkpoints in `directory` (a run's checkpoints/, created if absent); saving keeps the
    last `keep` (None: all); saving in the background inside `background()`."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=_writing is not None)
    mgr = ocp.CheckpointManager(Path(directory).absolute(), options=options)
    if _writing is not None:
        _writing.append(mgr)
    return mgr


def _pure(model, optimizer) -> dict:
    return {"model": nnx.to_pure_dict(nnx.state(model)),
            "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}


def _finite_here(x) -> bool:
    """Whether every value of `x` that this process holds is finite, read on the host: each
    distinct shard once (replica 0), no program compiled. On a TPU v5e one small jitted check
    per distinct array shape cost 3.5 s of compilation in every process (each under the
    compilation cache's threshold, so none was kept); the host reads the same bytes Orbax is about
    to write (1-5 GB/s checked on one core, bfloat16 the slower)."""
    return all(bool(np.isfinite(np.asarray(shard.data)).all())
               for shard in x.addressable_shards if shard.replica_id == 0)


def non_finite(model, optimizer) -> str | None:
    """The path of the first floating-point variable of model or optimizer state holding a NaN
    or an infinity, or None. Each process reads the shards it holds, stopping at the first such
    variable; in a multi-process run the processes then agree, so that all of them refuse."""
    flat = jax.tree_util.tree_flatten_with_path(_pure(model, optimizer))[0]
    bad = next((jax.tree_util.keystr(path) for path, x in flat
                if jnp.issubdtype(x.dtype, jnp.floating) and not _finite_here(x)), None)
    if jax.process_count() > 1 and multihost_utils.process_allgather(
            np.int32(bad is not None)).any():
        bad = bad or "a variable held by another process"
    return bad


def save(mgr: ocp.CheckpointManager, step: int, model, optimizer) -> None:
    """Checkpoint the state after `step` optimizer steps; a state with a non-finite value is
    refused (FloatingPointError naming the first such variable), so no checkpoint is garbage."""
    bad = non_finite(model, optimizer)
    if bad:
        raise FloatingPointError(f"step {step}: {bad} holds non-finite values; not saved (the "
                                 "last checkpoint is kept; lower learning_rate or check the data)")
    mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_pure(model, optimizer)),
        meta=ocp.args.JsonSave({"step": step})))
    if _writing is None or mgr not in _writing:
        mgr.wait_until_finished()


def load(mgr: ocp.CheckpointManager, step: int, model, optimizer) -> int:
    """Load checkpoint `step` into model and optimizer; returns the step it holds."""
    restored = mgr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(_pure(model, optimizer)), meta=ocp.args.JsonRestore()))
    for obj, key in ((model, "model"), (optimizer, "optimizer")):
        state = nnx.state(obj)
        nnx.replace_by_pure_dict(state, restored["state"][key])
        nnx.update(obj, state)
    return int(restored["meta"]["step"])


class UnreadableCheckpoint(RuntimeError):
    """A checkpoint whose files are whole could not be loaded (out of memory, an I/O fault, an
    Orbax that reads another layout): the error it chains is the cause; nothing was moved."""


def _unreadable(where: Path, err: BaseException) -> UnreadableCheckpoint:
    first_line = str(err).split("\n", 1)[0]
    return UnreadableCheckpoint(
        f"checkpoint {where} could not be loaded, though its files are whole, so nothing was "
        f"moved or skipped: {type(err).__name__}: {first_line} (the whole error is above); fix "
        "its cause and run the command again")


def _first_whole(mgr: ocp.CheckpointManager, steps: list[int], set_aside: bool,
                 skipped: list[tuple[int, str]]) -> int:
    """The first of `steps` (newest first) whose files are whole (damage.problem), -1 if none.
    Process 0 checks and renames each damaged one to `<step>.damaged` (with `set_aside`),
    noting it in `skipped`; the others take its answer, so all load the same step. When process
    0 cannot check or rename (CHECK_FAILED), every process stops, none waiting for an answer."""
    first, failure = -1, None
    if jax.process_index() == 0:
        try:
            first = _check(mgr, steps, set_aside, skipped)
        except Exception as err:  # raised below, once the other processes know
            first, failure = CHECK_FAILED, err
    if jax.process_count() > 1:
        first = int(multihost_utils.broadcast_one_to_all(np.int32(first)))
        mgr.reload()  # process 0 renamed before it answered
    if failure is not None:
        raise failure
    if first == CHECK_FAILED:
        raise UnreadableCheckpoint(f"process 0 could not check the checkpoints in "
                                   f"{mgr.directory} (its error says why); nothing was loaded")
    return first


CHECK_FAILED = -2  # process 0's answer when its check of the files raised


def _check(mgr: ocp.CheckpointManager, steps: list[int], set_aside: bool,
           skipped: list[tuple[int, str]]) -> int:
    """Process 0's part of _first_whole: the first whole step, -1 if none."""
    for step in steps:
        try:
            why = damage.problem(Path(mgr.directory) / str(step))
        except Exception as err:  # the check could not look: the cause, nothing moved
            raise _unreadable(Path(mgr.directory) / str(step), err) from err
        if why is None:
            return step
        _skip(mgr, step, why, set_aside, skipped)
    return -1


def _skip(mgr: ocp.CheckpointManager, step: int, why: str, set_aside: bool,
          skipped: list[tuple[int, str]]) -> None:
    """Note damaged checkpoint `step` and, on process 0 with `set_aside`, move it aside."""
    if set_aside and jax.process_index() == 0:
        where = Path(mgr.directory) / str(step)
        os.replace(where, where.with_name(f"{step}.damaged"))
        mgr.reload()
    skipped.append((step, why))


def _load_or_damage(mgr: ocp.CheckpointManager, step: int, model, optimizer) -> str | None:
    """Load `step`; None when it loaded, else why its stored data is damaged (a read that
    TensorStore says found bytes that do not decode or are not there: damage that the files'
    sizes do not show). Any other error is raised as UnreadableCheckpoint, chaining it."""
    where = Path(mgr.directory) / str(step)
    failure = why = None
    try:
        load(mgr, step, model, optimizer)
    except Exception as err:
        failure, why = err, damage.stored_data_error(err)
    if jax.process_count() > 1:
        failure, why = _agreed(where, failure, why)
    if failure is not None and why is None:
        raise _unreadable(where, failure) from failure
    return why


def _agreed(where: Path, failure: Exception | None, why: str | None):
    """(failure, why) of a load as every process takes it: another error than damage in one
    process stops them all; damage that one process read is damage for all."""
    codes = multihost_utils.process_allgather(np.int32(0 if failure is None else 1 if why else 2))
    worst = int(codes.max())
    first = int(np.argmax(codes == worst))
    if worst == 2 and (failure is None or why):
        return RuntimeError(f"process {first} could not load {where} (its error says why)"), None
    if worst == 1 and why is None:
        return failure, f"process {first} read data of it that does not decode"
    return failure, why


def restore(mgr: ocp.CheckpointManager, model, optimizer, *, set_aside: bool = True) -> int:
    """Load the newest checkpoint that reads back whole into model and optimizer; returns its
    step. A newer one that is damaged (damage.problem: a file missing or cut short by a crash,
    found before Orbax reads anything; or data TensorStore cannot decode) is skipped with one
    line and, with `set_aside`, moved to `<step>.damaged`, so that a resumed run saves its own
    checkpoint of that step later. Any other error (out of memory, a permission, an Orbax API
    mismatch) stops with UnreadableCheckpoint chaining it, and nothing is moved. Process 0
    decides and renames; every process loads the step it chose."""
    steps = every = sorted(mgr.all_steps(), reverse=True)
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {mgr.directory}")
    skipped: list[tuple[int, str]] = []
    while (step := _first_whole(mgr, steps, set_aside, skipped)) >= 0:
        why = _load_or_damage(mgr, step, model, optimizer)
        if why is None:
            break
        _skip(mgr, step, why, set_aside, skipped)
        steps = steps[steps.index(step) + 1:]
    done = (f"resuming from step {step}" if set_aside else f"reading step {step}") if (
        step >= 0) else "no checkpoint before it"
    for bad, why in skipped:
        log.warning("checkpoint %s is damaged: %s; %s; %s", Path(mgr.directory) / str(bad), why,
                    f"moved to {bad}.damaged" if set_aside else "left where it is", done)
    if step < 0:
        raise ValueError(f"no checkpoint in {mgr.directory} can be read (steps {every}); start "
                         "the run again with --overwrite")
    return step


def restore_latest(directory: Path, model, optimizer) -> int:
    """Load the latest checkpoint in `directory` (a run's checkpoints/), creating nothing there;
    returns its step."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} does not exist: the run has not saved a checkpoint "
                                "yet (the trainer saves one every checkpoint_period steps and at "
                                "the end)")
    return restore(manager(directory), model, optimizer, set_aside=False)


def restore_model(cfg: Config, directory: Path,
                  step: int | None = None) -> tuple[DeepSeekV4, int]:
    """(a model of `cfg` on the default device holding checkpoint `step` of `directory`, that
    step); None: the latest that reads whole (`restore_latest`). The checkpoint's optimizer state
    is read alongside, as it is stored with the model, and dropped."""
    model = DeepSeekV4(cfg, hash_tables=placeholder_hash_tables(cfg), rngs=nnx.Rngs(cfg.seed))
    optimizer = new_optimizer(cfg, model)
    if step is None or not Path(directory).is_dir():  # restore_latest names a missing directory
        return model, restore_latest(directory, model, optimizer)
    mgr = manager(directory)
    if step not in mgr.all_steps():
        raise FileNotFoundError(f"{directory} has no checkpoint of step {step} (it holds steps "
                                f"{sorted(mgr.all_steps())})")
    why = damage.problem(Path(directory) / str(step)) or _load_or_damage(mgr, step, model,
                                                                         optimizer)
    if why:
        raise ValueError(f"checkpoint {Path(directory) / str(step)} is damaged: {why}; choose "
                         f"another step (the run holds steps {sorted(mgr.all_steps())})")
    return model, step

