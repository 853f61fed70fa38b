"""The run directory: the one module that knows its files, and reads and writes them.

    config.yaml           the resolved configuration; a run resumed with another `steps` has
                          the new total, and a comment line above per change keeps the old one
    metrics.jsonl         one JSON object per step (loss, lr, grad_norm, tokens_per_s, the balance
                          losses, and `layers`: per MoE block its load statistics and bias stats)
    expert_counts.i32     every step's [L, E] int32 counts, appended raw (row-major);
    expert_counts.json    its row shape [L, E]: numpy.fromfile(...).reshape(-1, L, E) reads it
    tokenizer.json        the tokenizer of the text data (not for synthetic data), for sampling
    probe_counts.json     the [L, E] counts of one fixed held-out micro-batch (the probe) before
                          the first step ("0") and after the last (str(steps)): what the A/B
                          table compares: {"tokens": N, "routing": [kind per layer], "counts":
                          {"0": [L][E], "<N>": [L][E]}}, optionally "refit": {"<N>": [L][E]}
                          (the probe with the top-k biases refitted to fresh training batches)
                          and "online": {"<N>": [L][E]} (with the bias the online rule left,
                          when the run calibrated its biases after the last step); "set": the
                          same three for all `probe_batches` held-out micro-batches, [n][L][E]
                          each (the first is the probe)
    tensorboard/          TensorBoard event files (loss, lr, balance losses, MaxVio per layer)
    checkpoints/N         Orbax checkpoints after N steps (training/checkpoint.py writes them)

One process writes a run directory at a time: the writer holds an OS file lock on `.lock` inside
it for the run's life (`RunDir.writing`); a second writer is refused naming the process that holds
it. (On several hosts only process 0 writes here; every process may read.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

import numpy as np
import yaml

from moebalance.atomic import write_atomic
from moebalance.config import Config

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
COUNTS = "expert_counts.i32"
COUNTS_SHAPE = "expert_counts.json"
PROBE = "probe_counts.json"
TOKENIZER = "tokenizer.json"
TENSORBOARD = "tensorboard"
CHECKPOINTS = "checkpoints"
LOCK = ".lock"
RUN_FILES = (CONFIG, METRICS, COUNTS, COUNTS_SHAPE, PROBE, TOKENIZER, TENSORBOARD, CHECKPOINTS)


log = logging.getLogger(__name__)


class RunDirError(FileExistsError):
    """A run directory that cannot be used as asked (it holds a run, another config's, or another
    process writes it)."""


class RunStopped(Exception):
    """SIGINT or SIGTERM stopped a run after a step, whose checkpoint was saved: `--resume`
    continues it. `exit_code` is the shell's for a process ended by that signal (130 for SIGINT,
    143 for SIGTERM), so that schedulers see the run as stopped, not finished."""

    def __init__(self, signum: int, step: int, how: str = "continue with --resume"):
        super().__init__(f"stopped by signal {signum} after step {step}; checkpoint saved, {how}")
        self.signum, self.step = signum, step
        self.exit_code = 128 + signum


class RunDir:
    """One run directory at `path`."""

    def __init__(self, path):
        self.path = Path(path)
        self.tensorboard = self.path / TENSORBOARD
        self.checkpoints = self.path / CHECKPOINTS
        self.tokenizer = self.path / TOKENIZER
        self._lock = None  # the open .lock file while this process is the writer

    # ---- one writer ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def writing(self, writer: bool = True):
        """The block writes this run directory (when `writer`; other processes of a multi-process
        run only read): it holds the directory's lock from now (or from `create`, for a directory
        that does not exist yet) until the block ends. Fails early when the directory cannot be
        written."""
        if writer:
            self._check_writable()
            if self.path.is_dir():
                self._acquire()
        try:
            yield self
        finally:
            if self._lock is not None:
                self._lock.close()  # closing the file releases the lock
                self._lock = None

    def _check_writable(self) -> None:
        """Raise PermissionError unless this directory, or where it will be made, takes files:
        tried with a temporary directory in the nearest existing one, removed at once."""
        existing = next(p for p in (self.path, *self.path.parents) if p.exists())
        if not existing.is_dir():
            raise PermissionError(f"{self.path} cannot be written: {existing} is not a directory; "
                                  "choose another --out")
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".moebalance-", dir=existing))
        except OSError as err:
            raise PermissionError(f"{self.path} cannot be written ({existing}: {err.strerror}); "
                                  "choose another --out") from None

    def _acquire(self) -> None:
        if self._lock is not None:
            return
        lock = open(self.path / LOCK, "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise RunDirError(f"{self.path} is being written by {holder}; wait for it to finish "
                              "or stop it, or choose another --out") from None
        lock.truncate(0)
        lock.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        lock.flush()
        self._lock = lock

    # ---- starting, resuming ------------------------------------------------------------------

    def check_new(self, overwrite: bool) -> list[str]:
        """The run files already here; refuses them unless `overwrite` is given."""
        existing = [f for f in RUN_FILES if (self.path / f).exists()]
        if existing and not overwrite:
            raise RunDirError(f"{self.path} already holds a run ({', '.join(existing)}); pass "
                              "--resume to continue it, --overwrite to replace it, or choose "
                              "another --out")
        return existing

    def check_resumable(self, cfg: Config, may_differ: tuple[str, ...] = ()) -> Config:
        """Refuses to resume with a config other than the run's own, naming every key that
        differs with both values; `may_differ` may, and so may `steps` while it is above the
        steps already done (the newest checkpoint's; the run ends at the new total). Returns the
        run's config."""
        saved, path = self.config(), self.path / CONFIG
        differ = [f"{key}: {json.dumps(getattr(saved, key))} in {path}, "
                  f"{json.dumps(getattr(cfg, key))} given"
                  for key in (f.name for f in dataclasses.fields(Config))
                  if key not in (*may_differ, "steps") and getattr(saved, key) != getattr(cfg, key)]
        if differ:
            raise RunDirError(f"{self.path} was started with another config ({'; '.join(differ)})"
                              "; resume it with its own config.yaml (only `steps` may change)")
        done = self.checkpointed_steps()
        if cfg.steps != saved.steps and cfg.steps <= done:
            raise RunDirError(f"steps: {saved.steps} in {path}, {cfg.steps} given, but "
                              f"{self.path} has already done {done} steps (checkpoints/{done}); "
                              f"resume it with steps > {done}")
        return saved

    def create(self, cfg: Config, overwrite: bool, tokenizer=None) -> None:
        """Start a run here: empty an earlier one (only with `overwrite`), write the counts' row
        shape, the tokenizer (a `tokenizers.Tokenizer`, or None) and, last and atomically, the
        config: a directory holds a run once its config.yaml is there."""
        self.path.mkdir(parents=True, exist_ok=True)
        self._acquire()
        for f in self.check_new(overwrite):
            if (self.path / f).is_dir():
                shutil.rmtree(self.path / f)
            else:
                (self.path / f).unlink()
        (self.path / COUNTS_SHAPE).write_text(json.dumps(
            {"dtype": "int32", "row_shape": [cfg.base_num_decoder_layers, cfg.num_experts]}))
        if tokenizer is not None:
            write_atomic(self.tokenizer, lambda f: f.write(tokenizer.to_str().encode()))
        self._write_config(dataclasses.asdict(cfg))

    def change_steps(self, steps: int, done: int) -> None:
        """Record in config.yaml (atomically) that the run, resumed after `done` steps, now ends
        at `steps`: the new value, and a comment line above the config keeping the old one (one
        per change, the earliest first)."""
        history = [line + "\n" for line in (self.path / CONFIG).read_text().splitlines()
                   if line.startswith("#")]
        values = self.config_dict()
        history.append(f"# steps: {values['steps']} -> {steps} on resume after step {done}\n")
        self._write_config({**values, "steps": steps}, "".join(history))

    def _write_config(self, values: dict, comments: str = "") -> None:
        config = comments + yaml.safe_dump(values, sort_keys=False)
        write_atomic(self.path / CONFIG, lambda f: f.write(config.encode()))

    def rewind(self, step: int) -> None:
        """Drop what steps >= `step` wrote (they ran after the checkpoint being resumed)."""
        kept = [line for line, record in self._metric_rows() if record["step"] < step]
        (self.path / METRICS).write_text("".join(line + "\n" for line in kept))
        with open(self.path / COUNTS, "ab") as f:
            f.truncate(step * int(np.prod(self._counts_row())) * 4)

    def step_log(self) -> StepLog:
        """The per-step log, opened for appending."""
        return StepLog(self.path / METRICS, self.path / COUNTS)

    def write_probe(self, key: int, counts, routing: list[str], tokens: int, refit=None,
                    online=None) -> None:
        """Add the probe set's [n, L, E] counts after `key` steps (with refitted and online biases
        when given): the first micro-batch's as the probe, all n as the set; atomic: a crash
        leaves the previous file whole."""
        probe = self.probe() if (self.path / PROBE).exists() else {
            "tokens": tokens, "routing": list(routing), "counts": {}}
        for name, value in (("counts", counts), ("refit", refit), ("online", online)):
            if value is not None:
                value = np.asarray(value)
                probe.setdefault(name, {})[str(key)] = value[0].tolist()
                probe.setdefault("set", {}).setdefault(name, {})[str(key)] = value.tolist()
        write_atomic(self.path / PROBE, lambda f: f.write(json.dumps(probe).encode()))

    # ---- reading -----------------------------------------------------------------------------

    def require(self, *names: str) -> RunDir:
        """Check that this is a run directory holding `names` (config.yaml first); a missing
        directory or file raises FileNotFoundError naming it and what was expected there."""
        if not self.path.is_dir():
            raise FileNotFoundError(f"run directory {self.path} does not exist (expected a "
                                    "directory written by `moebalance train`, or an A/B "
                                    "experiment's run_a/run_b)")
        if not (self.path / CONFIG).is_file():
            raise FileNotFoundError(f"{self.path} is not a run directory: it has no config.yaml "
                                    "(the trainer writes one into every run; for an A/B "
                                    "experiment give its run_a or run_b, or to `report` the "
                                    "experiment's directory)")
        for name in names:
            if not (self.path / name).is_file():
                raise FileNotFoundError(f"{self.path / name} is missing: is {self.path} a "
                                        "finished run?")
        return self

    def runs_inside(self) -> list[Path]:
        """The run directories directly inside this directory when it is not one itself (an A/B
        experiment's run_a and run_b), in name order; [] otherwise."""
        if (self.path / CONFIG).is_file() or not self.path.is_dir():
            return []
        return sorted(p for p in self.path.iterdir() if (p / CONFIG).is_file())

    def config_dict(self) -> dict:
        """config.yaml as written (keys of older versions included)."""
        return yaml.safe_load((self.require().path / CONFIG).read_text()) or {}

    def config(self) -> Config:
        """The config the run was trained with."""
        return Config(**self.config_dict())

    def metrics(self) -> list[dict]:
        """metrics.jsonl: one record per step, in step order."""
        return [record for _, record in self._metric_rows()]

    def probe(self) -> dict:
        """probe_counts.json as written (see the module docstring)."""
        return json.loads((self.path / PROBE).read_text())

    def has_checkpoint(self) -> bool:
        return self.checkpoints.is_dir() and any(self.checkpoints.iterdir())

    def checkpointed_steps(self) -> int:
        """The step of the newest checkpoint, checkpoints/N (0: none); resume may fall back to an
        older one when it does not read back whole."""
        names = [p.name for p in self.checkpoints.iterdir()] if self.checkpoints.is_dir() else []
        return max((int(name) for name in names if name.isdigit()), default=0)

    def finished(self, steps: int) -> bool:
        """A run is finished once its probe was measured after the last step."""
        return (self.path / PROBE).exists() and str(steps) in self.probe()["counts"]

    def _metric_rows(self) -> list[tuple[str, dict]]:
        """metrics.jsonl's (line, record) pairs; a last line that is not JSON (a crash mid-write)
        is dropped with a warning, any other line that is not JSON raises naming the file and
        the line."""
        path = self.path / METRICS
        lines = [line for line in path.read_text().splitlines() if line.strip()] if (
            path.exists()) else []
        rows = []
        for number, line in enumerate(lines, 1):
            try:
                rows.append((line, json.loads(line)))
            except json.JSONDecodeError as err:
                if number < len(lines):
                    raise ValueError(f"{path}, line {number}, is not JSON ({err}); the file is "
                                     "damaged") from None
                log.warning("%s: dropped its last line, a record cut short (%d characters; the "
                            "run stopped while writing it)", path, len(line))
        return rows

    def _counts_row(self) -> list[int]:
        return json.loads((self.path / COUNTS_SHAPE).read_text())["row_shape"]


class StepLog:
    """metrics.jsonl and expert_counts.i32, appended one step at a time and flushed each step."""

    def __init__(self, metrics: Path, counts: Path):
        self.metrics = open(metrics, "a")
        self.counts = open(counts, "ab")

    def append(self, record: dict, counts: np.ndarray) -> None:
        np.asarray(counts, np.int32).tofile(self.counts)
        self.counts.flush()
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()

    def close(self) -> None:
        self.metrics.close()
        self.counts.close()
