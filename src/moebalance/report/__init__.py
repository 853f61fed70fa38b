"""The A/B load-balancing report: finished runs -> the seed table, plots and one HTML page.

`ab_report` reproduces the table of docs/seed_experiment.md (same columns, same definitions:
population variance of per-expert assignment counts, improvement (Var_A - Var_B) / Var_A, a TOTAL
row over the top-K layers whose improvement is the ratio of the summed variances) and adds the
sampling floor and MaxVio, and beside it the probe set's judge (`set_table`: the summed variance's
mean and spread over `probe_batches` held-out micro-batches). `compare_report` puts any number of
runs side by side. Both write
table.md, table.json, four PNGs and a self-contained report.html, and refuse to overwrite an
earlier report.

Modules (each docstring says more):
    runs.py      a finished run directory, read and checked (Run, load_run)
    tables.py    the A/B and comparison tables: their numbers, cells, Markdown and terminal print;
                 the A/B's headline (its result in four sentences)
    plots.py     the four figures and their captions (matplotlib is imported only when a report
                 draws them)
    page.py      report.html: the headline, the tables, the figures, the configs

`ab_report` and `compare_report` are the entry points; the names below are the package's interface.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from moebalance.report.page import write_html
from moebalance.report.runs import Run, load_run, load_runs
from moebalance.report.tables import (column_groups, compare_table, format_markdown, headline,
                                      layer_table, print_table, set_table, table_cells)

__all__ = ["PLOTS", "REPORT_FILES", "Run", "ab_report", "column_groups", "compare_report",
           "compare_table", "format_markdown", "headline", "layer_table", "load_run", "load_runs",
           "print_table", "set_table", "table_cells", "write_html"]

PLOTS = ("variance.png", "heatmaps.png", "maxvio.png", "loss.png")
REPORT_FILES = ("table.md", "table.json", *PLOTS, "report.html")


def _tokens_per_step(config: dict) -> int:
    """Tokens of one optimizer step as far as config.yaml tells (one device's batch)."""
    return (config["gradient_accumulation_steps"] * config["per_device_batch_size"] *
            config["max_target_length"])


def prepare_out(out: Path, overwrite: bool, files=REPORT_FILES) -> None:
    """Make the directory `out`, refusing (unless overwrite) one that holds any of a report's
    `files` already."""
    existing = [f for f in files if (out / f).exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{out} already holds a report ({', '.join(existing)}); pass "
                              "overwrite=True (--overwrite) or choose another output directory")
    out.mkdir(parents=True, exist_ok=True)


def _write_outputs(out: Path, table: dict, runs: list[tuple[str, Run]], title: str,
                   console) -> None:
    from moebalance.report import plots  # matplotlib is imported only when a report draws

    (out / "table.md").write_text(format_markdown(table))
    (out / "table.json").write_text(json.dumps(table, indent=2) + "\n")
    pngs = [plot(runs, out / name) for plot, name in zip(
        (plots.plot_variance, plots.plot_heatmaps, plots.plot_maxvio, plots.plot_loss), PLOTS)]
    write_html(out, table, list(zip(pngs, plots.captions(runs))),
               {name: run.config for name, run in runs}, title)
    if console is not None:
        print_table(table, console)
        console.print(f"The whole table in one piece: {out / 'table.md'}")


def ab_report(run_a, run_b, out, console=None, *, overwrite: bool = False) -> dict:
    """The seed experiment's table for Run A (no balancing) vs Run B (balancing), with plots.

    Both runs must have measured the same probe batch from the same initial weights (identical
    step-0 counts) and stopped after the same number of steps. Writes table.md, table.json, the
    PNGs and report.html into `out`; prints the table on `console` (a rich Console; None prints
    nothing); returns the table dict.
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
    prepare_out(out, overwrite)
    table = layer_table(a.step0, a.final, b.final, a.routing, a.tokens,
                        a.config["num_experts_per_tok"], max(a.ranks, b.ranks), b.refit,
                        b.online)
    table["total"].update(loss_a=a.metrics[-1]["loss"], loss_b=b.metrics[-1]["loss"],
                          steps=a.final_step, tokens_per_step=_tokens_per_step(a.config))
    if a.probe_set and b.probe_set and a.probe_set["final"].shape == b.probe_set["final"].shape:
        table["set"] = set_table({"step0": a.probe_set["step0"], "a": a.probe_set["final"],
                                  "b": b.probe_set["final"], "online_b": b.probe_set.get("online"),
                                  "refit_b": b.probe_set.get("refit")}, a.routing, a.tokens,
                                 a.config["num_experts_per_tok"])
    runs = [(f"A: {a.name}", a), (f"B: {b.name}", b)]
    _write_outputs(out, table, runs, f"A/B load balancing: {a.config['model_name']}, "
                   f"{a.final_step} steps ({a.name} vs {b.name})", console)
    return table


def compare_report(runs, out, console=None, *, overwrite: bool = False) -> dict:
    """Any number (>= 1) of runs side by side (e.g. sign vs proportional vs quantile vs aux loss);
    `runs` are run directories or directories of them (an A/B experiment's: its two runs).

    Runs may have measured different probe batches (the table then shows each run's own step-0
    variance), but they must share the model shape, routing, probe size and K, since variances of
    different batch sizes or expert counts are not comparable.
    """
    out = Path(out)
    loaded = load_runs(runs)
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
    prepare_out(out, overwrite)
    pairs = [(run.name, run) for run in loaded]
    table = compare_table(pairs)
    if all(run.probe_set for run in loaded) and len(
            {run.probe_set["final"].shape for run in loaded}) == 1:
        sets = {}
        for run in loaded:
            sets.update({run.name: run.probe_set["final"],
                         f"{run.name}, online bias": run.probe_set.get("online"),
                         f"{run.name}, refitted biases": run.probe_set.get("refit")})
        table["set"] = set_table(sets, first.routing, first.tokens,
                                 first.config["num_experts_per_tok"])
    _write_outputs(out, table, pairs, "Load balancing: " + " vs ".join(names), console)
    return table
