"""A finished run directory, read (through moebalance.rundir, which knows its files) and
checked: `load_run` -> `Run`. The probe's counts (probe_counts.json, see rundir) must be
consistent: step 0 and the last step present, [layers, num_experts] each, K per token (and
the same for every micro-batch of the probe set, when the run measured one).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from moebalance.rundir import METRICS, PROBE, RunDir

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
    # the probe set (probe_batches held-out micro-batches, the probe first), [n, L, E] counts each:
    # "step0", "final" and, when measured, "refit" and "online"; empty for runs measured before it
    probe_set: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


def load_runs(paths) -> list[Run]:
    """The runs of `paths`, each a run directory or a directory of them (an A/B experiment's:
    its run_a and run_b, named `experiment/run_a` and `experiment/run_b`)."""
    runs = []
    for path in map(Path, paths):
        inside = RunDir(path).runs_inside()
        runs += ([load_run(run, f"{path.resolve().name}/{run.name}") for run in inside] if inside
                 else [load_run(path)])
    return runs


def load_run(path, name: str | None = None) -> Run:
    """Read a run directory (named `name`, default its directory's name); a missing file or an
    inconsistent probe raises with the reason."""
    run = RunDir(path).require(METRICS, PROBE)
    path, config, metrics = run.path, run.config_dict(), run.metrics()
    if not metrics:
        raise ValueError(f"{path / METRICS} holds no step")
    probe = run.probe()
    counts = {int(step): np.asarray(c, np.int64) for step, c in probe["counts"].items()}
    if 0 not in counts:
        raise ValueError(f"{path / PROBE} has no step-0 counts (key \"0\")")
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
    probe_set = {}
    stored = probe.get("set", {})
    for part, (key, step) in {"step0": ("counts", 0), "final": ("counts", final_step),
                              "refit": ("refit", final_step),
                              "online": ("online", final_step)}.items():
        value = stored.get(key, {}).get(str(step))
        if value is not None:
            probe_set[part] = checked[f"the probe set's {part}"] = np.asarray(value, np.int64)
    for what, c in checked.items():
        if c.shape[-2:] != shape:
            raise ValueError(f"{path}: probe counts of {what} have shape {c.shape}, expected "
                             f"[layers, num_experts] = {shape}")
        if (c.sum(-1) != tokens * k).any():
            raise ValueError(f"{path}: probe counts of {what} do not sum to tokens * K = "
                             f"{tokens} * {k} in every layer")
    if probe_set and len({c.shape for c in probe_set.values()}) > 1:
        raise ValueError(f"{path}: the probe set's counts differ in their number of batches")
    ranks = len(metrics[-1]["layers"][0].get("rank_load", [0]))
    return Run(name=name or path.resolve().name, config=config, metrics=metrics, step0=counts[0],
               final=counts[final_step], final_step=final_step, routing=routing, tokens=tokens,
               ranks=ranks, refit=refit, online=online, probe_set=probe_set)
