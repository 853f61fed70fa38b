"""A study's report (moebalance/study.py): from study.json alone, the table of its runs (as
arXiv 2408.15664's: validation perplexity and MaxVio_global, with MaxVio_batch), the paper's two
claims checked where the study has both an `aux` and a `loss-free` arm (against the seed-to-seed
spread where the arms ran with several seeds), three figures over the steps and one HTML page."""

from __future__ import annotations

import functools
import html
import json
from pathlib import Path

import numpy as np

from matplotlib.figure import Figure

from moebalance.metrics import maxvio_floor
from moebalance.report import prepare_out
from moebalance.report.page import figure_parts, html_table, write_page

STUDY_FILES = ("study.md", "val_loss.png", "maxvio_global.png", "maxvio_batch.png",
               "report.html")
# The paper's 1B-parameter result (arXiv 2408.15664, Table 2): (val PPL, MaxVio_global).
PAPER = {"aux": (9.56, 0.72), "loss-free": (9.50, 0.04)}
COLUMNS = ("arm", "overrides", "val loss", "val PPL", "MaxVio_global", "floor", "MaxVio_batch",
           "train loss", "tokens/s")


def finished_arms(study: dict) -> list[dict]:
    arms = [arm for arm in study["arms"] if arm.get("finished")]
    if not arms:
        raise ValueError("the study has no finished arm yet: run its command again to continue it")
    return arms


def run_label(study: dict, arm: dict) -> str:
    """A run's name: its arm's, and its seed where the study ran several."""
    return arm["name"] if study.get("seeds") is None else f"{arm['name']} (seed {arm['seed']})"


@functools.cache
def _floor(tokens: int, k: int, experts: int) -> float:
    return maxvio_floor(tokens, k, experts)


def floor(study: dict, arm: dict) -> float | None:
    """MaxVio_global of a perfectly balanced router on as many independent tokens as the arm's
    validation measured (metrics.maxvio_floor; None for a study.json that does not record its
    experts)."""
    if "experts" not in study or "val_tokens" not in arm:
        return None
    return _floor(arm["val_tokens"], study["k"], study["experts"])


def table_rows(study: dict) -> list[list[str]]:
    """One row per finished run: the last validation's values, (min-max over the last ones)."""
    def spread(arm, key, digits):
        lo, hi = arm["spread"][key]
        return f"{arm[key]:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"

    return [[run_label(study, arm), " ".join(arm["overrides"]) or "(no balancing)",
             spread(arm, "val_loss", 4), spread(arm, "val_ppl", 2),
             spread(arm, "maxvio_global", 3),
             "-" if floor(study, arm) is None else f"{floor(study, arm):.3f}",
             spread(arm, "maxvio_batch", 3),
             f"{arm['train_loss']:.4f}", f"{arm['tokens_per_s']:,.0f}"]
            for arm in finished_arms(study)]


def claims(study: dict) -> list[str]:
    """The paper's two claims, checked on this study's `loss-free` and `aux` arms (none without
    both), each arm's value the mean over its finished seeds: loss-free's MaxVio_global at most
    1/4 of aux's and at most 0.1; its validation perplexity no worse than aux's. The margin of
    the perplexity claim is the seed-to-seed spread: the larger of the two arms' ranges (max -
    min over their seeds) of the last validation perplexity; a difference within it is no
    difference. An arm with one seed has no spread: the claim then says it rests on one seed."""
    runs = {"aux": [], "loss-free": []}
    for arm in finished_arms(study):
        runs.get(arm["name"], []).append(arm)
    if not all(runs.values()):
        return []
    free, aux = ({key: float(np.mean([r[key] for r in runs[name]]))
                  for key in ("maxvio_global", "val_ppl")} for name in ("loss-free", "aux"))
    ratio = free["maxvio_global"] / aux["maxvio_global"] if aux["maxvio_global"] else float("inf")
    balance = ratio <= 0.25 and free["maxvio_global"] <= 0.1
    seeds = {name: len(arms) for name, arms in runs.items()}
    means = "" if max(seeds.values()) == 1 else (
        f" (means over {seeds['loss-free']} and {seeds['aux']} seeds)")
    ppl = (f"validation perplexity{means}: loss-free {free['val_ppl']:.3f}, aux "
           f"{aux['val_ppl']:.3f} (the paper: {PAPER['loss-free'][0]:.2f} vs "
           f"{PAPER['aux'][0]:.2f}): ")
    difference = free["val_ppl"] - aux["val_ppl"]
    if min(seeds.values()) == 1:
        ppl += (("loss-free's is lower or equal: holds" if difference <= 0 else
                 "loss-free's is higher: does not hold")
                + " on one seed's digits (no seed-to-seed spread measured: run the arms with "
                  "--seeds S1 S2 for a margin)")
    else:
        margin = max(np.ptp([r["val_ppl"] for r in arms]) for arms in runs.values())
        ppl += (f"the difference {difference:+.3f} against a margin of {margin:.3f} (the "
                "larger seed-to-seed range, max - min over an arm's seeds): "
                + ("no worse, within the spread: holds" if abs(difference) <= margin else
                   "lower beyond the spread: holds" if difference < 0 else
                   "higher beyond the spread: does not hold"))
    return [f"MaxVio_global{means}: loss-free {free['maxvio_global']:.3f}, aux "
            f"{aux['maxvio_global']:.3f} ({ratio:.2f}x; the paper: {PAPER['loss-free'][1]:.2f} "
            f"vs {PAPER['aux'][1]:.2f}): "
            + ("holds (<= 1/4 of aux's and <= 0.1)" if balance else
               "does not hold (the claim: <= 1/4 of aux's and <= 0.1)"), ppl]


def title(study: dict) -> str:
    command = " ".join([study["config"], *study["overrides"]])
    return (f"Balancing study: {command}, {study['steps']} steps of "
            f"{study['tokens_per_step']:,} tokens")


def commits(study: dict) -> str:
    """Which code the finished runs ran: one commit, or each run's where they differ (then the
    arms are not one experiment)."""
    ran = {run_label(study, arm): arm.get("commit", "not recorded")
           for arm in finished_arms(study)}
    if len(set(ran.values())) == 1:
        return f"Every run at {next(iter(ran.values()))}."
    return ("The runs ran different code, so they are not one experiment: "
            + ", ".join(f"{label} at {commit}" for label, commit in ran.items()) + ".")


def format_markdown(study: dict) -> str:
    lines = [f"# {title(study)}", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS),
             *("| " + " | ".join(row) + " |" for row in table_rows(study)), "",
             _table_note(study), "", commits(study), "",
             *(f"- {line}" for line in claims(study))]
    return "\n".join(lines).rstrip() + "\n"


def measured(study: dict) -> str:
    """What a validation measured: the first eval_batches held-out batches and their tokens (a
    study.json written before they were recorded: the held-out batches, unnamed)."""
    tokens = {arm["val_tokens"] for arm in finished_arms(study) if "val_tokens" in arm}
    if "eval_batches" not in study or len(tokens) != 1:
        return "the held-out batches each validation measured (eval_batches, not recorded here)"
    batches = study["eval_batches"]
    return (f"the first {batches} held-out global batch{'es' if batches != 1 else ''} "
            f"({tokens.pop():,} tokens, the same at every validation)")


def _table_note(study: dict) -> str:
    return (f"The last validation's values, after step {study['steps']} (in brackets: min-max over "
            "the last 3 validations), averaged over the top-k layers. val loss / PPL: held-out "
            "cross-entropy and its exp; MaxVio_global: (max - mean) / mean of the expert counts "
            f"over {measured(study)}; floor: the mean MaxVio_global of a perfectly balanced "
            "router on as many independent tokens (no bias reads lower on average; tokens in "
            "documents are not independent, so the data's own floor is higher); MaxVio_batch: "
            "that of each training step's batch, "
            f"the mean over the last {study['eval_period']} steps; train loss: the training "
            "cross-entropy (without balance losses) likewise; tokens/s: the median step.")


def _plot(study: dict, path: Path, key: str, label: str, per_step: bool = False) -> Path:
    fig = Figure(figsize=(7.0, 4.2), layout="constrained")
    ax = fig.add_subplot()
    names = list(dict.fromkeys(arm["name"] for arm in finished_arms(study)))
    seen: dict[str, int] = {}
    for arm in finished_arms(study):  # a color per arm, a line style per seed
        color, style = f"C{names.index(arm['name']) % 10}", ("-", "--", ":", "-.")[
            seen.setdefault(arm["name"], 0) % 4]
        seen[arm["name"]] += 1
        if per_step:
            values = arm["per_step"][key]
            ax.plot(range(1, len(values) + 1), values, color=color, ls=style, lw=0.6,
                    alpha=0.35)
        ax.plot([p["step"] for p in arm["curve"]], [p[key] for p in arm["curve"]],
                color=color, ls=style, marker="o", ms=3, label=run_label(study, arm))
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=120)
    return path


def study_report(study: dict, out, console=None, *, overwrite: bool = True) -> None:
    """Write the STUDY_FILES into `out` (replacing earlier ones; overwrite False: refusing to)
    and print the table and the claims on `console` (None prints nothing)."""
    out = Path(out)
    prepare_out(out, overwrite, STUDY_FILES)
    (out / "study.md").write_text(format_markdown(study))
    figures = [
        (_plot(study, out / "val_loss.png", "val_loss", "validation loss"),
         "Validation loss (held-out cross-entropy) at each validation."),
        (_plot(study, out / "maxvio_global.png", "maxvio_global", "MaxVio_global"),
         f"MaxVio_global at each validation: the expert counts over {measured(study)}, the "
         "mean over the top-k layers."),
        (_plot(study, out / "maxvio_batch.png", "maxvio_batch", "MaxVio_batch", per_step=True),
         "MaxVio_batch: each training step's (faint) and its mean between validations (points), "
         "the mean over the top-k layers.")]
    parts = [f"<h1>{html.escape(title(study))}</h1>",
             *(f'<p class="headline">{html.escape(line)}</p>' for line in claims(study)),
             html_table(list(COLUMNS), table_rows(study), "results"),
             f"<p>{html.escape(_table_note(study))}</p>", "<h2>Figures</h2>",
             *figure_parts(figures), "<h2>The study</h2>",
             f"<pre>{html.escape(json.dumps(_plan(study), indent=1))}</pre>"]
    write_page(out, title(study), parts)
    if console is not None:
        _print(study, console)
        console.print(f"report written to {out / 'report.html'}; the whole table (overrides, "
                      f"spreads, losses): {out / 'study.md'}")


def _plan(study: dict) -> dict:
    keys = ("config", "overrides", "seeds", "date", "steps", "eval_period", "eval_batches",
            "tokens_per_step", "batch", "devices")
    return {**{key: study[key] for key in keys if key in study},
            "arms": [{key: a[key] for key in ("name", "overrides", "seed") if key in a}
                     for a in study["arms"]]}


def _print(study: dict, console) -> None:
    from rich.table import Table

    table = Table(title=title(study))
    shown = [COLUMNS.index(c) for c in ("arm", "val PPL", "MaxVio_global", "floor",
                                         "MaxVio_batch", "tokens/s")]
    for i in shown:
        table.add_column(COLUMNS[i], justify="left" if i == 0 else "right")
    for row in table_rows(study):
        table.add_row(row[0], *(row[i].split(" (")[0] for i in shown[1:]))
    console.print(table)
    console.print(commits(study))
    for line in claims(study):
        console.print(line)
