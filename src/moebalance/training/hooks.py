"""What a training run shows and writes, as small sinks the loop calls (the loop knows none).

    Hook           the interface: start, step, note, end, close (each a no-op unless overridden)
    Hooks          several hooks called in order, closed together
    StepLogFile    metrics.jsonl + expert_counts.i32 of the run directory
    TensorBoard    TensorBoard scalars: the step's metrics and per layer MaxVio, variance, CV...
    ProgressBar    a rich progress bar: step, loss, tokens/s, mean MaxVio of the top-k blocks
    Printer        notes as they come, and (optionally) the per-block table after the last step
    terminal(...)  what the command line shows: [ProgressBar,] Printer on one console

Used as a library, `training.loop.train` writes its run directory and prints nothing; the command
line adds `terminal()`.
"""

from __future__ import annotations

import numpy as np

from moebalance.rundir import RunDir


class Hook:
    """One sink of a run's outputs. The loop calls `start` once before the first step it runs,
    `step` after every step, `note` for a message, `end` after the last step (not when the run is
    stopped early), and `close` always, also on a stop or an error."""

    def start(self, first: int, steps: int) -> None:
        """Steps `first` .. `steps - 1` are about to run."""

    def step(self, record: dict, counts: np.ndarray) -> None:
        """After a step: its metrics record and [L, E] int32 expert counts."""

    def note(self, text: str) -> None:
        """A message for whoever watches the run."""

    def end(self, record: dict) -> None:
        """After the last step, with its record."""

    def close(self) -> None:
        """Release what the hook holds."""


class Hooks(Hook):
    """Hooks called in the given order; a context manager that closes them all."""

    def __init__(self, hooks):
        self.hooks = list(hooks)

    def start(self, first, steps):
        for hook in self.hooks:
            hook.start(first, steps)

    def step(self, record, counts):
        for hook in self.hooks:
            hook.step(record, counts)

    def note(self, text):
        for hook in self.hooks:
            hook.note(text)

    def end(self, record):
        for hook in self.hooks:
            hook.end(record)

    def close(self):
        for hook in self.hooks:
            hook.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class StepLogFile(Hook):
    """Every step's record and expert counts into the run directory."""

    def __init__(self, run: RunDir):
        self.log = run.step_log()

    def step(self, record, counts):
        self.log.append(record, counts)

    def close(self):
        self.log.close()


class TensorBoard(Hook):
    """The scalars of each record, and per layer MaxVio, variance, CV, rank imbalance, bias std."""

    def __init__(self, run: RunDir):
        self.directory = run.tensorboard
        self.writer = None

    def start(self, first, steps):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(str(self.directory), purge_step=first or None)

    def step(self, record, counts):
        scalars = [(f"train/{key}", value) for key, value in record.items()
                   if key not in ("step", "layers", "validation")]
        scalars += [(f"layer_{row['layer']:02d}/{stat}", row[stat]) for row in record["layers"]
                    for stat in ("maxvio", "variance", "cv", "rank_imbalance", "bias_std")
                    if stat in row]
        if "validation" in record:
            val = record["validation"]
            scalars += [("validation/loss", val["loss"]),
                        ("validation/perplexity", val["perplexity"])]
            scalars += [(f"layer_{layer:02d}/maxvio_global", value)
                        for layer, value in enumerate(val["maxvio_global"])]
        self.writer.file_writer.add_summary(merged_scalars(scalars), record["step"])
        self.writer.flush()

    def close(self):
        if self.writer is not None:
            self.writer.close()


def merged_scalars(scalars: list[tuple[str, float]]):
    """One TensorBoard Summary holding every (tag, value): a step's ~175 scalars (deepseek4-tiny)
    as one event, not one each (SummaryWriter.add_scalar's 7,000 events took 3.1 of the A/B's
    74 s under cProfile on a TPU v5e's host)."""
    from tensorboardX.proto.summary_pb2 import Summary
    from tensorboardX.summary import scalar

    return Summary(value=[value for tag, x in scalars for value in scalar(tag, x).value])


def mean_topk_maxvio(record: dict) -> float:
    """Mean MaxVio over the top-k blocks of a step's record (0 without any)."""
    return float(np.mean([r["maxvio"] for r in record["layers"] if r["routing"] == "topk"]
                         or [0.0]))


def mean_topk_maxvio_global(record: dict) -> float:
    """Mean MaxVio_global of the record's validation over its top-k blocks (0 without any)."""
    routing = [r["routing"] for r in record["layers"]]
    return float(np.mean([m for m, kind in zip(record["validation"]["maxvio_global"], routing)
                          if kind == "topk"] or [0.0]))


class ProgressBar(Hook):
    """step k/N, a bar, loss, tokens/s and mean top-k MaxVio, the time remaining."""

    def __init__(self, console):
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(),
                            TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                            console=console)
        self.running = False

    def start(self, first, steps):
        self.bar.start()
        self.running = True
        self.task = self.bar.add_task("train", total=steps, completed=first,
                                      status="compiling...")

    def step(self, record, counts):
        self.bar.update(self.task, advance=1, status=f"loss {record['loss']:.4f}  "
                        f"{record['tokens_per_s']:.0f} tok/s  MaxVio {mean_topk_maxvio(record):.3f}")

    def end(self, record):
        self.close()

    def close(self):
        if self.running:  # rich prints a line at every stop on a non-terminal console
            self.bar.stop()
            self.running = False


class Printer(Hook):
    """Notes as they come; each validation's line; after the last step, a table of its per-block balance (unless
    `per_block` is off)."""

    def __init__(self, console, *, per_block: bool = True):
        self.console = console
        self.per_block = per_block

    def note(self, text):
        self.console.print(text)

    def step(self, record, counts):
        if "validation" in record:
            val = record["validation"]
            self.console.print(f"after step {record['step']}: validation loss {val['loss']:.4f} "
                               f"(perplexity {val['perplexity']:.2f}, {val['tokens']} tokens), "
                               f"MaxVio_global {mean_topk_maxvio_global(record):.3f} (top-k mean)")

    def end(self, record):
        if not self.per_block:
            return
        from rich.table import Table

        table = Table(title=f"after step {record['step']}: loss {record['loss']:.4f}")
        for col in ("layer", "routing", "variance", "maxvio", "cv", "dead", "bias std"):
            table.add_column(col, justify="right")
        for row in record["layers"]:
            table.add_row(str(row["layer"]), row["routing"], f"{row['variance']:.2f}",
                          f"{row['maxvio']:.3f}", f"{row['cv']:.3f}",
                          f"{row['dead_fraction']:.2f}",
                          f"{row['bias_std']:.4f}" if "bias_std" in row else "-")
        self.console.print(table)


def terminal(console=None, *, bar: bool = True, per_block: bool = True) -> list[Hook]:
    """What the command line shows of a run: the progress bar (unless `bar` is off, e.g. --quiet)
    and the printer (with its per-block table unless `per_block` is off), on `console` (default:
    a new rich Console on stdout)."""
    from rich.console import Console

    console = console or Console()
    return [*([ProgressBar(console)] if bar else []), Printer(console, per_block=per_block)]
