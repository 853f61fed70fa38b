"""The A/B load-balancing experiment (docs/seed_experiment.md) in one call.

    Run A   the config with every balancing mechanism off: no bias updates, balance-loss weights 0
            (the router z-loss, a stability term, is kept as configured in both runs)
    Run B   the config as given: its balancing recipe

Both start from the same initial weights (the same seed) and see the same batches in the same
order; both measure the same held-out probe batch before the first step and after the last. Both
run one compiled step (Run B's, with Run A's balancing switched off as traced values). DIR
holds run_a/ and run_b/ (ordinary run directories) and the report: table.md, table.json, the plots
and report.html (moebalance.report).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from moebalance import report
from moebalance.config import Config
from moebalance.rundir import RunDir, RunDirError
from moebalance.training import checkpoint, loop
from moebalance.training.hooks import terminal


def without_balancing(cfg: Config) -> Config:
    """Run A: the same model, data and optimizer, no load balancing at all."""
    return dataclasses.replace(cfg, routed_bias=False, routed_bias_update_rate=0.0,
                               load_balance_loss_weight=0.0, global_balance_loss_weight=0.0)


def ab(cfg: Config, out: Path, *, overwrite: bool = False, resume: bool = False,
       console=None, progress: bool = True, verbose: bool = False) -> dict:
    """Train Run A and Run B into out/run_a and out/run_b, then write the report into out.

    resume: continue whatever is unfinished (a run with no checkpoint starts over); overwrite:
    replace an earlier experiment in `out`. console: a rich Console to show the runs on (with a
    progress bar unless `progress` is off), ending with the result (report.headline); None prints
    nothing. verbose: also print each run's per-block table after its last step and the
    report's per-layer tables (table.md holds them either way). Returns the table (table.json's
    content)."""
    out = Path(out)
    earlier = [f for f in ("run_a", "run_b", *report.REPORT_FILES) if (out / f).exists()]
    if earlier and not (overwrite or resume):
        raise RunDirError(f"{out} already holds an experiment ({', '.join(earlier)}); pass "
                          "--resume to finish it, --overwrite to replace it, or choose another --out")
    runs = (("A (no balancing)", without_balancing(cfg)), ("B (balancing)", cfg))
    # Run B starts from a copy of Run A's initial draw; Run A's state is written as Run B starts,
    # Run B's as the report is drawn
    with loop.shared_draws(), checkpoint.background():
        for name, run_cfg in runs:
            run = RunDir(out / f"run_{name[0].lower()}")
            hooks = (terminal(console, bar=progress, per_block=verbose) if console is not None
                     else [])
            if console is not None:
                console.rule(f"Run {name}: {run.path}")
            if resume and run.has_checkpoint():
                if run.finished(run_cfg.steps):
                    if console is not None:
                        console.print("already finished")
                    continue
                loop.train(run_cfg, run.path, resume=True, hooks=hooks, program=cfg)
            else:
                loop.train(run_cfg, run.path, overwrite=True, hooks=hooks, program=cfg)
        table = report.ab_report(out / "run_a", out / "run_b", out, console if verbose else None,
                                 overwrite=overwrite or resume)
    if console is not None:
        console.rule("Result")
        for line in report.headline(table):
            console.print(line)
    return table
