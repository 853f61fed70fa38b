"""`moebalance ab`, `study`, `report` and `demo`: the A/B experiment, the balancing study over a
real run, reports of finished runs and studies, and the model-free balancer simulation."""

from __future__ import annotations

import argparse
import json

from moebalance.cli.options import config_command


def _ab(args) -> int:
    """Run A (no balancing) vs Run B (the config's balancing), then the table, plots, report."""
    from rich.console import Console

    from moebalance.config import load_config
    from moebalance.training.sharding import open_devices_early

    cfg = load_config(args.config, args.overrides)
    open_devices_early(cfg)
    from moebalance.experiment import ab  # imported while the devices open

    ab(cfg, args.out, overwrite=args.overwrite, resume=args.resume, console=Console(),
       progress=not args.quiet, verbose=args.verbose)
    tables = "" if args.verbose else " (-v prints them)"
    print(f"report written to {args.out}/report.html; the per-layer tables: "
          f"{args.out}/table.md{tables}")
    return 0


def _study(args) -> int:
    """Every arm trained from the same weights on the same batches, validated as it goes; the
    table, the figures, the report; the same command continues a stopped study."""
    from rich.console import Console

    from moebalance.study import arms_from, study

    study(args.config, args.overrides, arms_from(args.arm), args.out, seeds=args.seeds,
          overwrite=args.overwrite, console=Console(), progress=not args.quiet)
    return 0


def _report(args) -> int:
    """The comparison table and plots of any finished runs, or a study's report."""
    from pathlib import Path

    from rich.console import Console

    from moebalance.report import compare_report
    from moebalance.report.study import study_report
    from moebalance.study import STUDY

    studies = [path for path in map(Path, args.run_dirs) if (path / STUDY).is_file()]
    if not studies:
        compare_report(args.run_dirs, args.out, Console(), overwrite=args.overwrite)
        print(f"report written to {args.out}/report.html")
        return 0
    if len(args.run_dirs) > 1:
        raise ValueError(f"{studies[0]} is a study: report reads one study at a time (or runs)")
    # a study's own folder holds its own report, rebuilt in place
    study_report(json.loads((studies[0] / STUDY).read_text()), args.out, Console(),
                 overwrite=args.overwrite or Path(args.out).resolve() == studies[0].resolve())
    return 0


def _demo_marks(steps: int) -> list[int]:
    """The steps the demo's table shows: 0, 10, 50, the middle and the last, those that exist."""
    return sorted({0, 10, 50, steps // 2, steps - 1} & set(range(steps)))


def _int_at_least(minimum: int):
    """An argparse type: an int >= minimum, else the usual argparse error naming the option."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its "invalid int value" message
    return parse


def _demo(args) -> int:
    """Run the model-free balancer simulation for every rule and print how MaxVio falls; the
    overshoot statistic where the run is long enough for it (simulate.overshoot_window)."""
    from rich.console import Console
    from rich.table import Table

    from moebalance import balancing, simulate

    sim = simulate.Simulation(num_experts=args.experts, k=args.k, tokens=args.tokens,
                              skew=args.skew, seed=args.seed)
    console = Console()
    console.print(
        f"[bold]Balancer simulation[/]: {sim.tokens} fresh tokens per step, top-{sim.k} of "
        f"{sim.num_experts} experts, {sim.score_fn} scores, skewed drifting logits "
        f"(skew {sim.skew}), {args.steps} steps. MaxVio = (max load - mean) / mean."
    )
    marks = _demo_marks(args.steps)
    window = simulate.overshoot_window(args.steps)
    table = Table(title="MaxVio by step (lower is better)")
    table.add_column("rule")
    table.add_column("rate", justify="right")
    for step in marks:
        table.add_column(f"@{step}", justify="right")
    if window:
        table.add_column("osc", justify="right")
    runs = [("none", "sign", 0.0)] + [(r, r, None) for r in simulate.RULES]
    with console.status("simulating..."):
        for label, rule, rate in runs:
            out = simulate.run(sim, rule, rate, steps=args.steps)
            shown_rate = rate if rate is not None else balancing.DEFAULT_RATES.get(rule, "-")
            maxvio = out["maxvio"]
            osc = [f"{simulate.overshoot(out['counts'][-window:]):+.2f}"] if window else []
            table.add_row(label, str(shown_rate), *(f"{maxvio[s]:.3f}" for s in marks), *osc)
    console.print(table)
    console.print(
        (f"osc = lag-1 autocorrelation of the load errors over the last {window} steps (about 0: "
         "noise; near -1: the rule overshoots every step). " if window else
         f"(osc, how much each rule overshoots, needs at least {simulate.OSC_MIN_STEPS} steps.) ")
        + "Fresh tokens every step keep MaxVio above zero even under perfect balance (the "
        "sampling floor)."
    )
    return 0


def add_parsers(sub, common: argparse.ArgumentParser) -> None:
    """The subcommands ab, report and demo."""
    ab = config_command(sub, "ab", common, "deepseek4-tiny",
                        "the A/B experiment: no balancing vs the config's balancing, with the "
                        "seed's table, plots and an HTML report; prints the result (-v: also "
                        "the per-layer tables)", "key=value overrides (apply to both runs)")
    ab.add_argument("--out", required=True, help="the experiment directory")
    mode = ab.add_mutually_exclusive_group()
    mode.add_argument("--overwrite", action="store_true", help="replace the experiment in --out")
    mode.add_argument("--resume", action="store_true", help="finish the experiment in --out")
    ab.set_defaults(func=_ab)
    study = config_command(sub, "study", common, "deepseek4-tiny",
                           "balancing methods over a real run: arms (default none, aux, "
                           "loss-free) trained from the same weights on the same batches, "
                           "validated every eval_period steps; the table, figures and report; "
                           "the same command continues a stopped study",
                           "key=value overrides (apply to every arm)")
    study.add_argument("--out", required=True, help="the study's directory")
    study.add_argument("--arm", action="append", nargs="+", metavar=("NAME", "KEY=VALUE"),
                       help="an arm: a built-in (none, aux, aux-seq, loss-free, "
                            "loss-free-seq, quantile) or a name and its balancing overrides on "
                            "top of no balancing; repeat for each (default: none, aux, "
                            "loss-free)")
    study.add_argument("--seeds", type=int, nargs="+", metavar="SEED",
                       help="run every arm once per seed (initial weights and data order), "
                            "into DIR/<arm>/seed<S>: the claims then weigh a difference against "
                            "the seed-to-seed spread (default: once, at the config's seed)")
    study.add_argument("--overwrite", action="store_true",
                       help="replace another study (or anything) in --out")
    study.set_defaults(func=_study)
    compare = sub.add_parser("report", parents=[common],
                             help="table and plots comparing finished runs")
    compare.add_argument("run_dirs", nargs="+",
                         help="run directories (from train), an A/B experiment's directory "
                              "(its runs), or a study's directory")
    compare.add_argument("--out", required=True, help="directory for the report")
    compare.add_argument("--overwrite", action="store_true", help="replace a report in --out")
    compare.set_defaults(func=_report)
    demo = sub.add_parser("demo", parents=[common],
                          help="balancer simulation: every bias rule on skewed logits")
    demo.add_argument("--steps", type=_int_at_least(2), default=600,
                      help="steps to simulate (at least 2)")
    demo.add_argument("--experts", type=int, default=16)
    demo.add_argument("--k", type=int, default=4)
    demo.add_argument("--tokens", type=int, default=2048, help="fresh tokens per step")
    demo.add_argument("--skew", type=float, default=1.0, help="strength of the expert preference")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
