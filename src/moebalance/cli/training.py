"""`moebalance train`, `eval` and `generate`: a run directory written, measured and sampled."""

from __future__ import annotations

import argparse
import json
import logging

from moebalance.cli.options import config_command


def _train(args) -> int:
    """Train a config into a run directory, showing progress and balance as it goes."""
    from moebalance.config import load_config
    from moebalance.training.sharding import open_devices_early

    cfg = load_config(args.config, args.overrides)
    open_devices_early(cfg)
    from moebalance.training.hooks import terminal  # imported while the devices open
    from moebalance.training.loop import train

    train(cfg, args.out, overwrite=args.overwrite, resume=args.resume,
          hooks=terminal(bar=not args.quiet))
    print(f"run written to {args.out}")
    return 0


def _eval(args) -> int:
    """Evaluate a run's latest checkpoint on one split's batches; the run is left untouched."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    from rich.table import Table

    from moebalance.training.evaluate import evaluate

    tasks = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  console=Console(stderr=True), transient=True, disable=args.quiet) as bar:
        def on_batch(phase, done, total):
            if phase not in tasks:
                tasks[phase] = bar.add_task(f"eval {args.split} split, {phase}", total=total)
            bar.update(tasks[phase], completed=done)

        result = evaluate(args.run_dir, batches=args.batches, split=args.split,
                          refit_batches=args.refit_batches, on_batch=on_batch)
    if args.json:
        print(json.dumps(result))
        return 0
    split = "held-out" if args.split == "eval" else "training-split"
    table = Table(title=f"{args.run_dir} @ step {result['step']}: {split} loss "
                        f"{result['loss']:.4f}, perplexity {result['perplexity']:.2f} "
                        f"({result['tokens']} tokens)")
    refit = "maxvio_global_refit" in result["layers"][-1]
    for col in ("layer", "routing", "MaxVio_global", *(["refitted bias"] if refit else [])):
        table.add_column(col, justify="right")
    for row in result["layers"]:
        table.add_row(str(row["layer"]), row["routing"], f"{row['maxvio_global']:.4f}",
                      *([f"{row['maxvio_global_refit']:.4f}"] if refit else []))
    console = Console()
    console.print(table)
    for key, name in (("variance", "the run's biases"), ("variance_refit", "refitted biases")):
        if key in result:
            v = result[key]
            console.print(f"Summed top-k variance per micro-batch with {name}: mean {v['mean']:.2f}"
                          f", std {v['std']:.2f} (min {v['min']:.2f}, max {v['max']:.2f})")
    return 0


def _generate(args) -> int:
    """Sample a continuation of a prompt from a run's latest checkpoint."""
    from moebalance import generate

    generator = generate.load(args.run_dir)
    logging.getLogger("moebalance").info("sampling from %s at step %d", args.run_dir,
                                         generator.step)
    print(generator.complete(args.prompt, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_p=args.top_p, seed=args.seed))
    return 0


def add_parsers(sub, common: argparse.ArgumentParser) -> None:
    """The subcommands train, eval and generate."""
    train = config_command(sub, "train", common, "deepseek4-tiny",
                           "train a config; writes a run directory")
    train.add_argument("--out", required=True, help="the run directory")
    mode = train.add_mutually_exclusive_group()
    mode.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    mode.add_argument("--resume", action="store_true",
                      help="continue the run in --out from its latest checkpoint")
    train.set_defaults(func=_train)
    evaluate = sub.add_parser("eval", parents=[common],
                              help="held-out loss, perplexity, MaxVio_global of a run")
    evaluate.add_argument("run_dir")
    evaluate.add_argument("--batches", type=int, default=None,
                          help="global batches (default: the whole split for text, 4 for "
                               "synthetic data)")
    evaluate.add_argument("--split", choices=["eval", "train"], default="eval",
                          help="the held-out split (default), or the training split: balance on "
                               "the distribution the bias was fitted to (give --batches)")
    evaluate.add_argument("--refit-batches", type=int, default=0,
                          help="also measure with the top-k biases refitted to balance this many "
                               "fresh training batches: what a perfectly estimated bias reaches")
    evaluate.add_argument("--json", action="store_true")
    evaluate.set_defaults(func=_eval)
    generate = sub.add_parser("generate", parents=[common],
                              help="sample text from a run's latest checkpoint (KV-cached decoding)")
    generate.add_argument("run_dir", help="a run directory trained on text data")
    generate.add_argument("--prompt", required=True, help="the text to continue")
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0,
                          help="0 (default): greedy, the most likely token each time")
    generate.add_argument("--top-p", type=float, default=1.0,
                          help="nucleus sampling: draw from the most likely tokens holding this "
                               "much probability")
    generate.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    generate.set_defaults(func=_generate)
