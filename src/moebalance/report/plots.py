"""The report's four figures: per-layer variance, load heatmaps, MaxVio and loss over steps.

Figures are built as bare `matplotlib.figure.Figure` objects (rendered by Agg on save): they never
enter pyplot's figure registry, so nothing has to be closed and no global backend is switched.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from moebalance.metrics import sampling_floor
from moebalance.report.runs import Run
from moebalance.report.tables import layer_var

HEATMAP_MAX = 2.0  # heatmap colour scale: load / mean in [0, 2]; busier experts saturate


def captions(runs: list[tuple[str, Run]]) -> list[str]:
    """What each figure shows, in the order variance, heatmaps, MaxVio, loss."""
    probe = (f"the probe batch (micro-batch 0 of the held-out split's first batch, "
             f"{runs[0][1].tokens} tokens)")
    return [f"Per-layer variance of the expert counts of {probe}, log scale: at step 0 and after "
            "each run's last step (also with the online and with refitted biases, where "
            "measured), the sampling floor dashed, hash-routed layers shaded.",
            f"Heatmaps: {probe} routed by each run after its last step, with the biases it ended "
            "with (calibrated ones, for a run that calibrated them); per layer (row) each "
            "expert's (column) assignments over the layer's mean.",
            "MaxVio of each step's training batch, the mean over the top-K layers.",
            "Training loss of each step's batch."]


def _colour(i: int) -> str:
    return f"C{i % 10}"


def _shade_hash_layers(ax, routing) -> None:
    hash_layers = [layer for layer, kind in enumerate(routing) if kind == "hash"]
    for i, layer in enumerate(hash_layers):
        ax.axvspan(layer - 0.5, layer + 0.5, color="0.9", zorder=0,
                   label="hash-routed layer" if i == 0 else None)


def plot_variance(runs: list[tuple[str, Run]], path) -> Path:
    """Per-layer variance at step 0 and after each run (log scale), with the sampling floor."""
    first = runs[0][1]
    layers = np.arange(len(first.routing))
    fig = Figure(figsize=(max(7.0, 0.22 * len(layers) + 3), 4.5), layout="constrained")
    ax = fig.add_subplot()
    _shade_hash_layers(ax, first.routing)
    if all(np.array_equal(run.step0, first.step0) for _, run in runs):
        ax.plot(layers, layer_var(first.step0), color="0.4", ls=":", marker="x", label="step 0")
    else:
        for i, (name, run) in enumerate(runs):
            ax.plot(layers, layer_var(run.step0), color=_colour(i), ls=":", marker="x",
                    label=f"{name}, step 0")
    for i, (name, run) in enumerate(runs):
        ax.plot(layers, layer_var(run.final), color=_colour(i), marker="o", ms=4,
                label=f"{name}, step {run.final_step}")
        if run.online is not None:
            ax.plot(layers, layer_var(run.online), color=_colour(i), ls="-.", lw=1,
                    label=f"{name}, online bias")
        if run.refit is not None:
            ax.plot(layers, layer_var(run.refit), color=_colour(i), ls="--", lw=1,
                    label=f"{name}, refitted bias")
    floor = sampling_floor(first.tokens, first.config["num_experts_per_tok"],
                           first.step0.shape[-1])
    ax.axhline(floor, color="k", ls="--", lw=1, label=f"sampling floor ({floor:.1f})")
    ax.set_yscale("log")
    ax.set_xlim(-0.5, len(layers) - 0.5)
    ax.set_xlabel("layer")
    ax.set_ylabel("variance of per-expert counts (log)")
    ax.set_title(f"Expert load variance on the probe batch ({first.tokens} tokens)")
    ax.grid(True, which="major", axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=120)
    return Path(path)


def _relative_load(counts: np.ndarray) -> np.ndarray:
    """[L, E] counts / the layer's mean count: 1.0 = balanced."""
    mean = counts.mean(-1, keepdims=True)
    return counts / np.where(mean > 0, mean, 1.0)


def plot_heatmaps(runs: list[tuple[str, Run]], path) -> Path:
    """Layer x expert load of each run after its last step, side by side on one colour scale."""
    first = runs[0][1]
    num_layers, num_experts = first.final.shape
    loads = [_relative_load(run.final) for _, run in runs]
    fig = Figure(figsize=(1.5 + 0.2 * num_experts * len(runs) + 1.2 * len(runs),
                          max(3.0, 0.2 * num_layers + 1.5)), layout="constrained")
    axes = fig.subplots(1, len(runs), sharey=True, squeeze=False)[0]
    norm = Normalize(0.0, HEATMAP_MAX)
    for ax, (name, run), load in zip(axes, runs, loads):
        image = ax.imshow(load, cmap="RdBu_r", norm=norm, aspect="auto", interpolation="nearest")
        ax.set_title(f"{name}, step {run.final_step}", fontsize="medium")
        ax.set_xlabel("expert")
    axes[0].set_yticks(np.arange(num_layers),
                       [f"{layer} hash" if kind == "hash" else str(layer)
                        for layer, kind in enumerate(first.routing)], fontsize="small")
    axes[0].set_ylabel("layer")
    saturated = any((load > HEATMAP_MAX).any() for load in loads)
    fig.colorbar(image, ax=list(axes), extend="max" if saturated else "neither",
                 shrink=0.6,
                 label=f"load / mean load (1 = balanced, {HEATMAP_MAX:g} and above saturate)")
    fig.savefig(path, dpi=120)
    return Path(path)


def _mean_topk(record: dict, key: str) -> float:
    values = [layer[key] for layer in record["layers"] if layer["routing"] == "topk"]
    return float(np.mean(values)) if values else float("nan")


def _plot_series(runs, path, values, ylabel: str, title: str) -> Path:
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot()
    for i, (name, run) in enumerate(runs):
        ax.plot([m["step"] for m in run.metrics], [values(m) for m in run.metrics],
                color=_colour(i), label=name)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=120)
    return Path(path)


def plot_maxvio(runs: list[tuple[str, Run]], path) -> Path:
    """MaxVio of each step's training batch, averaged over the top-K layers, for each run."""
    return _plot_series(runs, path, lambda m: _mean_topk(m, "maxvio"),
                        "MaxVio_batch (mean over top-K layers)", "Load imbalance during training")


def plot_loss(runs: list[tuple[str, Run]], path) -> Path:
    """Training loss of each run over steps."""
    return _plot_series(runs, path, lambda m: m["loss"], "loss", "Training loss")
