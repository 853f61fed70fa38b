"""The A/B load-balancing report: finished runs -> the seed table, plots and one HTML page.

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

`ab_report` reproduces the table of SEED_EXPERIMENT.md (same columns, same definitions: population
variance of per-expert assignment counts, improvement (Var_A - Var_B) / Var_A, a TOTAL row over the
top-K layers whose improvement is the ratio of the summed variances) and adds the sampling floor and
MaxVio. `compare_report` puts any number of runs side by side. Both write table.md, table.json,
four PNGs and a self-contained report.html, and refuse to overwrite an earlier report.

Figures are built as bare `matplotlib.figure.Figure` objects (rendered by Agg on save): they never
enter pyplot's figure registry, so nothing has to be closed and no global backend is switched.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import json
from pathlib import Path

import numpy as np
import yaml
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from moebalance.metrics import load_stats, rank_loads, sampling_floor

ROUTING_LABELS = {"hash": "Hash Routed", "topk": "Top-K Routed"}
PLOTS = ("variance.png", "heatmaps.png", "maxvio.png", "loss.png")
REPORT_FILES = ("table.md", "table.json", *PLOTS, "report.html")
REFIT_NOTE = ("Refit Var: the probe's variance after the last step with every top-K bias refitted to "
              "balance fresh training batches - what a perfectly estimated bias reaches on this "
              "probe; above the floor when the probe's tokens are not independent draws.")
ONLINE_NOTE = ("Online Var: the probe's variance with the bias the online rule left after the last "
               "step, before the run calibrated it on its last training batches at the final "
               "weights (routed_bias_calibration_batches).")
HEATMAP_MAX = 2.0  # heatmap colour scale: load / mean in [0, 2]; busier experts saturate


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


def _variance(counts) -> np.ndarray:
    return load_stats(counts)["variance"]


def _maxvio(counts) -> np.ndarray:
    return load_stats(counts)["maxvio"]


def _mean(values) -> float:
    """Mean of a possibly empty list (0.0 when empty: a model without top-K layers)."""
    return float(np.mean(values)) if len(values) else 0.0


def _improvement(var_a: float, var_b: float) -> float:
    return (var_a - var_b) / var_a if var_a else 0.0


def layer_table(step0, final_a, final_b, routing, num_tokens: int, k: int,
                ranks: int = 1, refit_b=None, online_b=None) -> dict:
    """The seed's per-layer table from [L, E] counts: {"rows": [...], "total": {...}}.

    Rows: var_step0 / var_a / var_b (population variance of the counts), improvement
    (var_a - var_b) / var_a, floor (the sampling floor of num_tokens tokens), maxvio_a / maxvio_b;
    with ranks > 1 (expert parallelism) also rank_imbalance_a / _b, the busiest rank's load over
    the mean; with `refit_b` (Run B's final probe counts under refitted biases) also var_refit_b;
    with `online_b` (Run B's final probe counts before its calibration) also var_online_b.
    Total (layer 'TOTAL/AVG'), over the top-K layers only: summed variances and floors,
    improvement as the ratio of the sums (the seed's 47.90%), mean MaxVio (and rank imbalance), and
    mean_improvement (the mean of the per-layer ratios, the seed's 50.97%).
    """
    var0, var_a, var_b = _variance(step0), _variance(final_a), _variance(final_b)
    maxvio_a, maxvio_b = _maxvio(final_a), _maxvio(final_b)
    floor = sampling_floor(num_tokens, k, np.shape(step0)[-1])
    rows = [{"layer": layer, "routing": kind, "var_step0": float(var0[layer]),
             "var_a": float(var_a[layer]), "var_b": float(var_b[layer]),
             "improvement": _improvement(float(var_a[layer]), float(var_b[layer])),
             "floor": floor, "maxvio_a": float(maxvio_a[layer]),
             "maxvio_b": float(maxvio_b[layer])} for layer, kind in enumerate(routing)]
    summed = ["var_step0", "var_a", "var_b", "floor"]
    for key, counts in (("var_online_b", online_b), ("var_refit_b", refit_b)):
        if counts is not None:
            summed.append(key)
            for row, v in zip(rows, _variance(counts)):
                row[key] = float(v)
    means = ["maxvio_a", "maxvio_b"]
    if ranks > 1:
        means += ["rank_imbalance_a", "rank_imbalance_b"]
        for key, final in (("rank_imbalance_a", final_a), ("rank_imbalance_b", final_b)):
            imbalance = rank_loads(final, ranks)[1]
            for row in rows:
                row[key] = float(imbalance[row["layer"]])
    topk = [r for r in rows if r["routing"] == "topk"]
    sums = {key: sum(r[key] for r in topk) for key in summed}
    total = {"layer": "TOTAL/AVG", "routing": "topk", **sums,
             "improvement": _improvement(sums["var_a"], sums["var_b"]),
             **{key: _mean([r[key] for r in topk]) for key in means},
             "mean_improvement": _mean([r["improvement"] for r in topk])}
    return {"rows": rows, "total": total}


def compare_table(runs: list[tuple[str, Run]]) -> dict:
    """Several runs side by side: per layer and run the step-0 and final variance and MaxVio.

    {"runs": [names], "same_probe": bool, "rows": [{layer, routing, var_step0: {name: v},
    var: {name: v}, maxvio: {name: v}, floor}], "total": {var_step0, var, maxvio, loss, steps:
    {name: v}, floor}}; totals are over the top-K layers (summed variances, mean MaxVio). When
    every run measured its probe with refitted biases, rows and total hold var_refit; when one
    calibrated its biases, var_online (the variance before the calibration; var for the others).
    When a run used expert parallelism, rows and total also hold rank_imbalance: {name: busiest
    rank / mean} (1.0 for runs without it).
    """
    first = runs[0][1]
    floor = sampling_floor(first.tokens, first.config["num_experts_per_tok"], first.step0.shape[-1])
    per_run = {name: {"var_step0": _variance(run.step0), "var": _variance(run.final),
                      "maxvio": _maxvio(run.final),
                      "rank_imbalance": rank_loads(run.final, run.ranks)[1]}
               for name, run in runs}
    refit = all(run.refit is not None for _, run in runs)
    online = any(run.online is not None for _, run in runs)
    for name, run in runs:
        if online:
            per_run[name]["var_online"] = _variance(run.final if run.online is None else run.online)
        if refit:
            per_run[name]["var_refit"] = _variance(run.refit)
    keys = ("var_step0", "var", *(("var_online",) if online else ()),
            *(("var_refit",) if refit else ()), "maxvio") + (
        ("rank_imbalance",) if any(run.ranks > 1 for _, run in runs) else ())
    rows = [{"layer": layer, "routing": kind,
             **{key: {name: float(stats[key][layer]) for name, stats in per_run.items()}
                for key in keys},
             "floor": floor} for layer, kind in enumerate(first.routing)]
    topk = [r for r in rows if r["routing"] == "topk"]
    variances = [key for key in keys if key.startswith("var")]
    total = {key: {name: sum(r[key][name] for r in topk) for name in per_run} for key in variances}
    for key in keys[len(variances):]:
        total[key] = {name: _mean([r[key][name] for r in topk]) for name in per_run}
    total["floor"] = floor * len(topk)
    total["loss"] = {name: run.metrics[-1]["loss"] for name, run in runs}
    total["steps"] = {name: run.final_step for name, run in runs}
    return {"runs": [name for name, _ in runs],
            "same_probe": all(np.array_equal(run.step0, first.step0) for _, run in runs),
            "rows": rows, "total": total}


def _tokens_per_step(config: dict) -> int:
    """Tokens of one optimizer step as far as config.yaml tells (one device's batch)."""
    return (config["gradient_accumulation_steps"] * config["per_device_batch_size"] *
            config["max_target_length"])


def _ab_cells(table: dict) -> tuple[list[str], list[list[str]], list[str]]:
    total, n = table["total"], table["total"]["steps"]
    ranks, refit = "rank_imbalance_a" in total, "var_refit_b" in total
    online = "var_online_b" in total
    headers = ["Layer", "Routing", "Step 0 Var (Baseline)", f"Step {n} Var (Run A)",
               f"Step {n} Var (Run B)", "Improvement (A vs B)", "Floor",
               *(["Online Var (Run B)"] if online else []),
               *(["Refit Var (Run B)"] if refit else []), "MaxVio A", "MaxVio B",
               *(["EP max/mean A", "EP max/mean B"] if ranks else [])]

    def cells(label: str, routing: str, r: dict) -> list[str]:
        return [label, routing, *(f"{r[key]:.2f}" for key in ("var_step0", "var_a", "var_b")),
                f"{100 * r['improvement']:.2f}%", f"{r['floor']:.2f}",
                *([f"{r['var_online_b']:.2f}"] if online else []),
                *([f"{r['var_refit_b']:.2f}"] if refit else []), f"{r['maxvio_a']:.3f}",
                f"{r['maxvio_b']:.3f}",
                *([f"{r['rank_imbalance_a']:.3f}", f"{r['rank_imbalance_b']:.3f}"] if ranks
                  else [])]

    rows = [cells(str(r["layer"]), ROUTING_LABELS[r["routing"]], r) for r in table["rows"]]
    rows.append(cells("TOTAL/AVG", "Top-K only", total))
    loss_a, loss_b = total["loss_a"], total["loss_b"]
    notes = [f"Final loss: Run A {loss_a:.4f}, Run B {loss_b:.4f} "
             f"(B vs A {100 * (loss_b - loss_a) / loss_a:+.2f}%).",
             f"TOTAL improvement is the ratio of the summed top-K variances; the mean of the "
             f"per-layer improvements is {100 * total['mean_improvement']:.2f}%.",
             f"{n} steps of {total['tokens_per_step']} tokens. Floor: expected variance of "
             f"perfectly balanced random routing of the probe batch, N (K/E) (1 - K/E)."]
    if online:
        notes.append(ONLINE_NOTE)
    if refit:
        notes.append(REFIT_NOTE)
    if ranks:
        notes.append("EP max/mean: assignments of the busiest expert-parallel rank over the mean "
                     "rank (1 = even; the step waits for the busiest device).")
    return headers, rows, notes


def _compare_cells(table: dict) -> tuple[list[str], list[list[str]], list[str]]:
    names, total, same = table["runs"], table["total"], table["same_probe"]
    per_run = ("var",) if same else ("var_step0", "var")
    per_run += tuple(key for key in ("var_online", "var_refit") if key in total) + ("maxvio",)
    per_run += ("rank_imbalance",) if "rank_imbalance" in total else ()
    titles = {"var_step0": "Step 0 Var", "var": "Var", "var_online": "Online Var",
              "var_refit": "Refit Var",
              "maxvio": "MaxVio", "rank_imbalance": "EP max/mean"}
    headers = ["Layer", "Routing", *(["Step 0 Var"] if same else []),
               *(f"{titles[key]} {name}" for name in names for key in per_run), "Floor"]

    def cells(label: str, routing: str, r: dict) -> list[str]:
        fmt = {"var_step0": "{:.2f}", "var": "{:.2f}", "var_online": "{:.2f}",
               "var_refit": "{:.2f}", "maxvio": "{:.3f}", "rank_imbalance": "{:.3f}"}
        return [label, routing, *([f"{r['var_step0'][names[0]]:.2f}"] if same else []),
                *(fmt[key].format(r[key][name]) for name in names for key in per_run),
                f"{r['floor']:.2f}"]

    rows = [cells(str(r["layer"]), ROUTING_LABELS[r["routing"]], r) for r in table["rows"]]
    rows.append(cells("TOTAL/AVG", "Top-K only", total))
    notes = ["Final loss: " + ", ".join(f"{name} {total['loss'][name]:.4f} (step "
                                         f"{total['steps'][name]})" for name in names) + "."]
    if not same:
        notes.append("The runs measured different probe batches (or started from different "
                     "weights): each run's step-0 variance is its own.")
    notes.append("TOTAL sums the top-K variances and averages their MaxVio.")
    if "var_online" in total:
        notes.append(ONLINE_NOTE)
    if "var_refit" in total:
        notes.append(REFIT_NOTE)
    return headers, rows, notes


def table_cells(table: dict) -> tuple[list[str], list[list[str]], list[str]]:
    """Headers, formatted rows (the TOTAL row last) and notes of an A/B or a comparison table."""
    return _compare_cells(table) if "runs" in table else _ab_cells(table)


def format_markdown(table: dict) -> str:
    """The table as Markdown, with the seed's columns first and the notes below it."""
    headers, rows, notes = table_cells(table)

    def line(cells):
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    body = [line(headers), "|" + "---|" * len(headers), *(line(r) for r in rows)]
    return "\n".join([*body, "", *notes]) + "\n"


def column_groups(widths: list[int], keep: int, room: int) -> list[list[int]]:
    """Indices of the columns of each printed part of a table too wide for `room` characters:
    the first `keep` columns (row labels) start every part, the others follow in order, as many
    per part as fit; a column needs its width + 3 (padding and rule) and a part 1 more."""
    base = 1 + sum(w + 3 for w in widths[:keep])
    groups, current, used = [], [], base
    for i in range(keep, len(widths)):
        if current and used + widths[i] + 3 > room:
            groups.append(current)
            current, used = [], base
        current.append(i)
        used += widths[i] + 3
    return [list(range(keep)) + g for g in groups + [current]]


def print_table(table: dict, console) -> None:
    """Print the table (and its notes) to a rich console: every cell whole at the console's width
    (80 columns when the output is not a terminal), in several parts that repeat the layer
    columns when it is too wide for one."""
    from rich.table import Table

    headers, rows, notes = table_cells(table)
    # a header may wrap at its spaces, a cell never: each column is as wide as its longest cell
    # or header word
    widths = [max(max(len(w) for w in h.split()), *(len(r[i]) for r in rows))
              for i, h in enumerate(headers)]
    groups = column_groups(widths, 2, console.width)
    for part, columns in enumerate(groups, 1):
        title = "Expert load per layer (probe batch)" + (
            f", part {part} of {len(groups)}" if len(groups) > 1 else "")
        out = Table(title=title)
        for i in columns:
            out.add_column(headers[i], justify="left" if i == 1 else "right",
                           min_width=widths[i])
        for n, row in enumerate(rows):
            out.add_row(*(row[i] for i in columns), end_section=n == len(rows) - 2)
        console.print(out)
    for note in notes:
        console.print(note)


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
        ax.plot(layers, _variance(first.step0), color="0.4", ls=":", marker="x", label="step 0")
    else:
        for i, (name, run) in enumerate(runs):
            ax.plot(layers, _variance(run.step0), color=_colour(i), ls=":", marker="x",
                    label=f"{name}, step 0")
    for i, (name, run) in enumerate(runs):
        ax.plot(layers, _variance(run.final), color=_colour(i), marker="o", ms=4,
                label=f"{name}, step {run.final_step}")
        if run.online is not None:
            ax.plot(layers, _variance(run.online), color=_colour(i), ls="-.", lw=1,
                    label=f"{name}, online bias")
        if run.refit is not None:
            ax.plot(layers, _variance(run.refit), color=_colour(i), ls="--", lw=1,
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


def _config_differences(configs: dict[str, dict]) -> list[tuple[str, list]]:
    keys = sorted({key for config in configs.values() for key in config})
    values = {key: [config.get(key) for config in configs.values()] for key in keys}
    return [(key, v) for key, v in values.items() if any(x != v[0] for x in v)]


_CSS = ("body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}"
        "table{border-collapse:collapse;margin:1em 0}"
        "th,td{border:1px solid #ccc;padding:2px 8px;text-align:right}"
        "th{background:#f0f0f0}.results tbody tr:last-child{font-weight:bold}"
        "img{max-width:100%;display:block;margin:1em 0}"
        "pre{background:#f6f6f6;padding:1em;overflow:auto}")


def _html_table(headers: list[str], rows: list[list[str]], css_class: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                   for row in rows)
    return (f'<table class="{css_class}"><thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table>")


def write_html(out_dir, table: dict, pngs, configs: dict[str, dict],
               title: str = "moebalance load-balancing report") -> Path:
    """One self-contained report.html: the table, the PNGs embedded as base64, each run's config.

    configs maps a run label to its config dict; settings that differ between runs are listed
    first.
    """
    headers, rows, notes = table_cells(table)
    parts = [f"<h1>{html.escape(title)}</h1>", _html_table(headers, rows, "results"),
             *(f"<p>{html.escape(note)}</p>" for note in notes)]
    differences = _config_differences(configs)
    if len(configs) > 1 and differences:
        parts += ["<h2>Settings that differ</h2>",
                  _html_table(["key", *configs], [[key, *map(json.dumps, v)]
                                                  for key, v in differences], "settings")]
    parts.append("<h2>Figures</h2>")
    for png in map(Path, pngs):
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        parts.append(f'<img alt="{html.escape(png.name)}" src="data:image/png;base64,{data}">')
    parts.append("<h2>Configurations</h2>")
    for label, config in configs.items():
        parts += [f"<h3>{html.escape(label)}</h3>",
                  f"<pre>{html.escape(yaml.safe_dump(config, sort_keys=False))}</pre>"]
    page = (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
            + "\n".join(parts) + "</body></html>\n")
    path = Path(out_dir) / "report.html"
    path.write_text(page, encoding="utf-8")
    return path


def _prepare_out(out: Path, overwrite: bool) -> None:
    existing = [f for f in REPORT_FILES if (out / f).exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{out} already holds a report ({', '.join(existing)}); pass "
                              "overwrite=True (--overwrite) or choose another output directory")
    out.mkdir(parents=True, exist_ok=True)


def _write_outputs(out: Path, table: dict, runs: list[tuple[str, Run]], title: str,
                   console) -> None:
    (out / "table.md").write_text(format_markdown(table))
    (out / "table.json").write_text(json.dumps(table, indent=2) + "\n")
    pngs = [plot(runs, out / name) for plot, name in zip(
        (plot_variance, plot_heatmaps, plot_maxvio, plot_loss), PLOTS)]
    write_html(out, table, pngs, {name: run.config for name, run in runs}, title)
    if console is None:
        from rich.console import Console

        console = Console()
    print_table(table, console)
    console.print(f"The whole table in one piece: {out / 'table.md'}")


def ab_report(run_a, run_b, out, console=None, *, overwrite: bool = False) -> dict:
    """The seed experiment's table for Run A (no balancing) vs Run B (balancing), with plots.

    Both runs must have measured the same probe batch from the same initial weights (identical
    step-0 counts) and stopped after the same number of steps. Writes table.md, table.json, the
    PNGs and report.html into `out`; prints the table; returns the table dict.
    """
    out = Path(out)
    a, b = load_run(run_a), load_run(run_b)
    if a.tokens != b.tokens or not np.array_equal(a.step0, b.step0):
        raise ValueError(f"Run A ({run_a}) and Run B ({run_b}) have different step-0 probe counts: "
                         "A and B must start from the same weights and measure the same probe "
                         "batch (same seed, model and data), otherwise the comparison is void")
    if a.routing != b.routing or a.final_step != b.final_step:
        raise ValueError(f"Run A stopped at step {a.final_step} with routing {a.routing}, Run B at "
                         f"step {b.final_step} with {b.routing}: compare runs of the same length "
                         "and model")
    _prepare_out(out, overwrite)
    table = layer_table(a.step0, a.final, b.final, a.routing, a.tokens,
                        a.config["num_experts_per_tok"], max(a.ranks, b.ranks), b.refit,
                        b.online)
    table["total"].update(loss_a=a.metrics[-1]["loss"], loss_b=b.metrics[-1]["loss"],
                          steps=a.final_step, tokens_per_step=_tokens_per_step(a.config))
    runs = [(f"A: {a.name}", a), (f"B: {b.name}", b)]
    _write_outputs(out, table, runs, f"A/B load balancing: {a.name} vs {b.name}", console)
    return table


def compare_report(runs, out, console=None, *, overwrite: bool = False) -> dict:
    """Any number (>= 1) of runs side by side (e.g. sign vs proportional vs quantile vs aux loss).

    Runs may have measured different probe batches (the table then shows each run's own step-0
    variance), but they must share the model shape, routing, probe size and K, since variances of
    different batch sizes or expert counts are not comparable.
    """
    out = Path(out)
    loaded = [load_run(path) for path in runs]
    if not loaded:
        raise ValueError("compare_report needs at least one run directory")
    names = [run.name for run in loaded]
    if len(set(names)) != len(names):
        raise ValueError(f"run directories must have distinct names, got {names}")
    first = loaded[0]
    for run in loaded[1:]:
        if (run.routing, run.step0.shape, run.tokens, run.config["num_experts_per_tok"]) != (
                first.routing, first.step0.shape, first.tokens,
                first.config["num_experts_per_tok"]):
            raise ValueError(f"{run.name} and {first.name} differ in routing, [layers, experts], "
                             "probe tokens or K: their variances are not comparable")
    _prepare_out(out, overwrite)
    pairs = [(run.name, run) for run in loaded]
    table = compare_table(pairs)
    _write_outputs(out, table, pairs, "Load balancing: " + " vs ".join(names), console)
    return table
