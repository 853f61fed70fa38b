"""The report's tables: per-layer variance and MaxVio of the probe batch, for an A/B pair
(`layer_table`, the seed's table) or any number of runs (`compare_table`), as cells, Markdown and
a printed terminal table."""

from __future__ import annotations

import numpy as np

from moebalance.metrics import load_stats, rank_loads, sampling_floor, summed_variance_spread
from moebalance.report.runs import ROUTING_LABELS, Run

REFIT_NOTE = ("Refit Var: the probe's variance after the last step with every top-K bias "
              "refitted to balance fresh training batches - what a perfectly estimated bias "
              "reaches on this probe; above the floor when the probe's tokens are not "
              "independent draws.")
ONLINE_NOTE = ("Online Var: the probe's variance with the bias the online rule left after the last "
               "step, before the run calibrated it on fresh training batches at the final "
               "weights (routed_bias_calibration_batches).")


def layer_var(counts) -> np.ndarray:
    """[L] population variance of each layer's expert counts."""
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
    var0, var_a, var_b = layer_var(step0), layer_var(final_a), layer_var(final_b)
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
            for row, v in zip(rows, layer_var(counts)):
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
    every run measured its probe with refitted biases, rows and total hold var_refit; when some
    calibrated their biases, var_online for those runs only (the variance before the calibration;
    the others' var is already the online rule's).
    When a run used expert parallelism, rows and total also hold rank_imbalance: {name: busiest
    rank / mean} (1.0 for runs without it).
    """
    first = runs[0][1]
    floor = sampling_floor(first.tokens, first.config["num_experts_per_tok"], first.step0.shape[-1])
    per_run = {name: {"var_step0": layer_var(run.step0), "var": layer_var(run.final),
                      "maxvio": _maxvio(run.final),
                      "rank_imbalance": rank_loads(run.final, run.ranks)[1]}
               for name, run in runs}
    refit = all(run.refit is not None for _, run in runs)
    online = any(run.online is not None for _, run in runs)
    for name, run in runs:
        if run.online is not None:
            per_run[name]["var_online"] = layer_var(run.online)
        if refit:
            per_run[name]["var_refit"] = layer_var(run.refit)
    keys = ("var_step0", "var", *(("var_online",) if online else ()),
            *(("var_refit",) if refit else ()), "maxvio") + (
        ("rank_imbalance",) if any(run.ranks > 1 for _, run in runs) else ())
    rows = [{"layer": layer, "routing": kind,
             **{key: {name: float(stats[key][layer]) for name, stats in per_run.items()
                      if key in stats} for key in keys},
             "floor": floor} for layer, kind in enumerate(first.routing)]
    topk = [r for r in rows if r["routing"] == "topk"]
    variances = [key for key in keys if key.startswith("var")]
    total = {key: {name: sum(r[key][name] for r in topk) for name in rows[0][key]}
             for key in variances}
    for key in keys[len(variances):]:
        total[key] = {name: _mean([r[key][name] for r in topk]) for name in per_run}
    total["floor"] = floor * len(topk)
    total["loss"] = {name: run.metrics[-1]["loss"] for name, run in runs}
    total["steps"] = {name: run.final_step for name, run in runs}
    return {"runs": [name for name, _ in runs],
            "same_probe": all(np.array_equal(run.step0, first.step0) for _, run in runs),
            "rows": rows, "total": total}



def set_table(counts: dict[str, np.ndarray | None], routing, num_tokens: int, k: int) -> dict:
    """The probe set's judge: per micro-batch the variance summed over the top-K layers, and its
    mean, std (ddof=0), min and max over the micro-batches, for each labelled [n, L, E] counts
    (None: not measured, left out). {"batches": n, "tokens": per micro-batch, "floor": the summed
    sampling floor, "var": {label: {"mean", "std", "min", "max"}}}."""
    topk = [i for i, kind in enumerate(routing) if kind == "topk"]
    var = {label: summed_variance_spread(c, topk) for label, c in counts.items() if c is not None}
    n = next(len(c) for c in counts.values() if c is not None)
    floor = sampling_floor(num_tokens, k, next(c for c in counts.values()
                                               if c is not None).shape[-1])
    return {"batches": n, "tokens": num_tokens, "floor": floor * len(topk), "var": var}


def set_cells(table: dict) -> tuple[list[str], list[list[str]], str] | None:
    """Headers, rows and title of the probe set's table (None when the table has no set)."""
    if "set" not in table:
        return None
    s = table["set"]
    labels = {"step0": "Step 0", "a": "Run A", "b": "Run B", "online_b": "Run B, online bias",
              "refit_b": "Run B, refitted biases"}
    headers = ["Probe set", "Mean Var", "Std", "Min", "Max", "Mean / Floor"]
    rows = [[labels.get(key, key), *(f"{v[stat]:.2f}" for stat in ("mean", "std", "min", "max")),
             f"{v['mean'] / s['floor']:.2f}"] for key, v in s["var"].items()]
    rows.append(["Floor", f"{s['floor']:.2f}", "", "", "", "1.00"])
    title = (f"Over the probe set: {s['batches']} held-out micro-batches of {s['tokens']} tokens "
             "(the probe above is the first); per micro-batch the variance summed over the top-K "
             "layers, its mean and spread over them.")
    var = s["var"]
    if "a" in var and "b" in var:
        title += (f" Improvement (A vs B) of the means: "
                  f"{100 * _improvement(var['a']['mean'], var['b']['mean']):.2f}%.")
    for key, name in (("online_b", "the online bias"), ("refit_b", "refitted biases")):
        if "b" in var and key in var:
            title += f" Run B / Run B with {name}: {var['b']['mean'] / var[key]['mean']:.2f}."
    return headers, rows, title

def _loss_note(total: dict) -> str:
    loss_a, loss_b = total["loss_a"], total["loss_b"]
    return (f"Final loss: Run A {loss_a:.4f}, Run B {loss_b:.4f} "
            f"(B vs A {100 * (loss_b - loss_a) / loss_a:+.2f}%).")


def headline(table: dict) -> list[str]:
    """The A/B's result in a few sentences from its table: the improvement of the summed top-K
    variance of the probe (and of the probe set's mean, when measured), the mean top-K MaxVio of
    A and B, Run B's summed variance over the sampling floor and over Run B's with refitted
    biases (when measured), the final losses. Empty for a comparison: no run is the baseline."""
    if "runs" in table:
        return []
    total = table["total"]
    improvement = (f"Improvement (A vs B): {100 * total['improvement']:.2f}% of the summed top-K "
                   f"variance of the probe batch ({total['var_a']:.2f} -> {total['var_b']:.2f})")
    var = table.get("set", {}).get("var", {})
    if "a" in var and "b" in var:
        improvement += (f"; {100 * _improvement(var['a']['mean'], var['b']['mean']):.2f}% over "
                        f"the {table['set']['batches']} micro-batches of the probe set")
    ratios = [f"{total['var_b'] / total[key]:.2f}x {name}" for key, name in (
        ("floor", "the sampling floor"), ("var_refit_b", "Run B with refitted biases"))
        if total.get(key)]
    return [improvement + ".",
            f"MaxVio (mean over the top-K layers): Run A {total['maxvio_a']:.3f}, "
            f"Run B {total['maxvio_b']:.3f}.",
            *([f"Run B's summed variance: {', '.join(ratios)}."] if ratios else []),
            _loss_note(total)]


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
    notes = [_loss_note(total),
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
    columns = [(name, key) for name in names for key in per_run if name in total[key]]
    headers = ["Layer", "Routing", *(["Step 0 Var"] if same else []),
               *(f"{titles[key]} {name}" for name, key in columns), "Floor"]

    def cells(label: str, routing: str, r: dict) -> list[str]:
        fmt = {"var_step0": "{:.2f}", "var": "{:.2f}", "var_online": "{:.2f}",
               "var_refit": "{:.2f}", "maxvio": "{:.3f}", "rank_imbalance": "{:.3f}"}
        return [label, routing, *([f"{r['var_step0'][names[0]]:.2f}"] if same else []),
                *(fmt[key].format(r[key][name]) for name, key in columns),
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
    body += ["", *notes]
    if "set" in table:
        headers, rows, title = set_cells(table)
        body += ["", title, "", line(headers), "|" + "---|" * len(headers),
                 *(line(r) for r in rows)]
    return "\n".join(body) + "\n"


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
    if "set" in table:
        headers, rows, title = set_cells(table)
        out = Table(title=title)
        for i, header in enumerate(headers):
            out.add_column(header, justify="left" if i == 0 else "right")
        for row in rows:
            out.add_row(*row)
        console.print(out)
