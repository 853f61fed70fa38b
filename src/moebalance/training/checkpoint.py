"""Orbax checkpoints of a training run: every variable of the model (parameters, the float32
biases and the hash tables, bit-exact), the optimizer state, and the step (which is also the data
position: synthetic batches are a function of the step). Orbax writes each checkpoint to a
temporary directory and renames it into place, and keeps the last `max_num_checkpoints_to_keep`.
"""

from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp
from flax import nnx


def manager(directory: Path, keep: int | None = None) -> ocp.CheckpointManager:
    """The checkpoints in `directory` (a run's checkpoints/, created if absent); saving keeps the
    last `keep` (None: all)."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=False)
    return ocp.CheckpointManager(Path(directory).absolute(), options=options)


def _pure(model, optimizer) -> dict:
    return {"model": nnx.to_pure_dict(nnx.state(model)),
            "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}


def save(mgr: ocp.CheckpointManager, step: int, model, optimizer) -> None:
    """Checkpoint the state after `step` optimizer steps."""
    mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_pure(model, optimizer)),
        meta=ocp.args.JsonSave({"step": step})))
    mgr.wait_until_finished()


def restore(mgr: ocp.CheckpointManager, model, optimizer) -> int:
    """Load the latest checkpoint into model and optimizer; returns its step."""
    step = mgr.latest_step()
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {mgr.directory}")
    try:
        restored = mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_pure(model, optimizer)),
            meta=ocp.args.JsonRestore()))
    except Exception as err:  # orbax raises many types for a damaged checkpoint
        raise ValueError(f"checkpoint {mgr.directory / str(step)} cannot be read ({err}); "
                         "delete it to resume from the one before") from err
    for obj, key in ((model, "model"), (optimizer, "optimizer")):
        state = nnx.state(obj)
        nnx.replace_by_pure_dict(state, restored["state"][key])
        nnx.update(obj, state)
    return int(restored["meta"]["step"])


def restore_latest(directory: Path, model, optimizer) -> int:
    """Load the latest checkpoint in `directory` (a run's checkpoints/), creating nothing there;
    returns its step."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} does not exist: the run has not saved a checkpoint "
                                "yet (the trainer saves one every checkpoint_period steps and at "
                                "the end)")
    return restore(manager(directory), model, optimizer)
