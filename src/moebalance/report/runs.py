"""A finished run directory, read and checked: `load_run` -> `Run`.

A run directory (written by the trainer) holds:
    config.yaml          the resolved configuration
    metrics.jsonl        one JSON object per step: loss, ..., and `layers` (per-layer load stats)
    probe_counts.json    the expert counts of ONE fixed evaluation batch, before any update and
                         after the last step: {"tokens": N, "routing": [kind per layer],
                         "counts": {"0": [L][E] ints, "<N>": [L][E] ints}}, and optionally
                         "refit": {"<N>": [L][E] ints}, the last step's probe with the top-k
                         biases refitted to fresh training batches (the best a bias does here),
                         and "online": {"<N>": [L][E] ints} when the run calibrated its biases
                         after the last step: the probe with the bias the online rule left
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import yaml

# the routing kinds a run may hold, and their names in the tables
ROUTING_LABELS = {"hash": "Hash Routed", "topk": "Top-K Routed"}


@dataclasses.dataclass(frozen=True, eq=False)
class Run:
    """One finished training run, as read from its directory."""

    name: str  # the directory name
    config: dict
    metrics: list[dict]  # one record per step, in step order
    step0: np.ndarray  # [L, E] int64 probe counts before any update
    final: np.ndarray  # [L, E] int64 probe counts after the last step
    final_step: int
    routing: tuple[str, ...]  # 'hash' | 'topk' per layer
    tokens: int  # routed tokens of the probe batch
    ranks: int = 1  # expert-parallel ranks the run trained on (1: no expert parallelism)
    refit: np.ndarray | None = None  # [L, E] final probe counts with refitted biases, if measured
    online: np.ndarray | None = None  # [L, E] final probe counts before the calibration, if any


def run_files(run_dir, *names: str) -> Path:
    """Check that `run_dir` is a run directory holding `names` (config.yaml first); a missing
    directory or file raises FileNotFoundError naming it and what was expected there."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist (expected a directory "
                                "written by `moebalance train`, or an A/B experiment's "
                                "run_a/run_b)")
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory: it has no config.yaml (the "
                                "trainer writes one into every run; for an A/B experiment give "
                                "its run_a or run_b)")
    for name in names:
        if not (run_dir / name).is_file():
            raise FileNotFoundError(f"{run_dir / name} is missing: is {run_dir} a finished run?")
    return run_dir


def load_run(path) -> Run:
    """Read a run directory; a missing file or an inconsistent probe raises with the reason."""
    path = run_files(path, "metrics.jsonl", "probe_counts.json")
    config = yaml.safe_load((path / "config.yaml").read_text()) or {}
    metrics = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    if not metrics:
        raise ValueError(f"{path / 'metrics.jsonl'} holds no step")
    probe = json.loads((path / "probe_counts.json").read_text())
    counts = {int(step): np.asarray(c, np.int64) for step, c in probe["counts"].items()}
    if 0 not in counts:
        raise ValueError(f"{path / 'probe_counts.json'} has no step-0 counts (key \"0\")")
    final_step = max(counts)
    routing = tuple(probe["routing"])
    tokens, k = int(probe["tokens"]), config["num_experts_per_tok"]
    shape = (len(routing), config["num_experts"])
    unknown = sorted(set(routing) - set(ROUTING_LABELS))
    if unknown:
        raise ValueError(f"{path}: unknown routing kinds {unknown} (expected 'hash' or 'topk')")
    refit = probe.get("refit", {}).get(str(final_step))
    online = probe.get("online", {}).get(str(final_step))
    checked = {f"step {step}": counts[step] for step in (0, final_step)}
    if refit is not None:
        refit = checked[f"refitted step {final_step}"] = np.asarray(refit, np.int64)
    if online is not None:
        online = checked[f"online-bias step {final_step}"] = np.asarray(online, np.int64)
    for what, c in checked.items():
        if c.shape != shape:
            raise ValueError(f"{path}: probe counts of {what} have shape {c.shape}, expected "
                             f"[layers, num_experts] = {shape}")
        if (c.sum(-1) != tokens * k).any():
            raise ValueError(f"{path}: probe counts of {what} do not sum to tokens * K = "
                             f"{tokens} * {k} in every layer")
    ranks = len(metrics[-1]["layers"][0].get("rank_load", [0]))
    return Run(name=path.resolve().name, config=config, metrics=metrics, step0=counts[0],
               final=counts[final_step], final_step=final_step, routing=routing, tokens=tokens,
               ranks=ranks, refit=refit, online=online)
