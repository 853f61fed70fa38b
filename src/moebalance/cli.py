"""The `moebalance` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from moebalance import __version__


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
    """Run the model-free balancer simulation for every rule and print how MaxVio falls."""
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
    osc_steps = min(args.steps, 100)
    table = Table(title="MaxVio by step (lower is better)")
    table.add_column("rule")
    table.add_column("rate", justify="right")
    for step in marks:
        table.add_column(f"@{step}", justify="right")
    table.add_column("osc", justify="right")
    runs = [("none", "sign", 0.0)] + [(r, r, None) for r in simulate.RULES]
    with console.status("simulating..."):
        for label, rule, rate in runs:
            out = simulate.run(sim, rule, rate, steps=args.steps)
            shown_rate = rate if rate is not None else balancing.DEFAULT_RATES.get(rule, "-")
            maxvio = out["maxvio"]
            table.add_row(label, str(shown_rate), *(f"{maxvio[s]:.3f}" for s in marks),
                          f"{simulate.overshoot(out['counts'][-osc_steps:]):+.2f}")
    console.print(table)
    console.print(
        f"osc = lag-1 autocorrelation of the load errors over the last {osc_steps} steps "
        "(about 0: noise; near -1: the rule overshoots every step). Fresh tokens every step keep "
        "MaxVio above zero even under perfect balance (the sampling floor)."
    )
    return 0


def _params(args) -> int:
    """Print total and active parameter counts of a config (abstract evaluation, no memory)."""
    from moebalance.config import load_config
    from moebalance.model.transformer import parameter_counts

    counts = parameter_counts(load_config(args.config, args.overrides))
    if args.json:
        print(json.dumps(counts))
    else:
        for key, value in counts.items():
            print(f"{key:>6}: {value:>17,d}  ({value / 1e9:.2f}B)")
    return 0


def _plan(args) -> int:
    """Per-device memory and all-to-all traffic of a config's training step on N devices."""
    from rich.console import Console
    from rich.table import Table

    from moebalance.config import load_config
    from moebalance.training.plan import GIB, plan

    cfg, compiled = load_config(args.config, args.overrides), None
    if args.compile:
        compiled = _compile_for_plan(cfg, args)
        cfg = compiled.pop("traced")
    result = plan(cfg, args.devices, args.device_memory, args.devices_per_host)
    if args.json:
        print(json.dumps({**result.as_dict(), **({"compiled": compiled} if compiled else {})}))
        return 0
    mesh = " x ".join(f"{axis} {size}" for axis, size in result.mesh.items())
    unit, scale = ("GiB", GIB) if result.total("none") >= GIB else ("MiB", 2**20)
    print(f"{args.config} on {args.devices} devices ({mesh}), {unit} per device:")
    table = Table()
    table.add_column("")
    policies = list(result.activations)  # none, full and the config's remat_policy
    for policy in policies:
        table.add_column(f"remat {policy}", justify="right")
    for name in ("parameters", "optimizer", "gradients", "gathered"):
        table.add_row(name, *[f"{getattr(result, name) / scale:,.2f}"] * len(policies))
    for name, values in (("activations", result.activations),
                         ("total", {r: result.total(r) for r in policies}),
                         *((f"all-to-all sent/step ({path})", result.all_to_all[path])
                           for path in ("fast", "worst"))):
        table.add_row(name, *(f"{values[r] / scale:,.2f}" for r in policies))
    if args.device_memory:
        table.add_row(f"fits {args.device_memory:g} GiB",
                      *("yes" if result.fits(r) else "no" for r in policies))
    Console().print(table)
    print(f"largest block's residuals: {result.block / scale:,.2f} {unit}; all-to-all pairs "
          f"across hosts of {args.devices_per_host} devices: {result.cross_host:.0%}")
    if compiled:
        _print_compiled(compiled, result.total(cfg.remat_policy), args.device_memory, unit, scale)
    return 0


def _compile_for_plan(cfg, args) -> dict:
    """plan --compile: XLA's memory of the step compiled for the topology (training/compiled)."""
    from moebalance.config import ConfigError
    from moebalance.training import compiled

    devices = compiled.topology_devices(args.compile)
    if len(devices) != args.devices:
        raise ConfigError(f"--compile {args.compile} has {len(devices)} devices, --devices says "
                          f"{args.devices}: give --devices {len(devices)}")
    logging.getLogger("moebalance").info(
        "compiling the training step for %s (minutes for a large model)", args.compile)
    memory, seconds, _ = compiled.compiled_memory(cfg, devices)
    return {"topology": args.compile, "device": devices[0].device_kind, "remat": cfg.remat_policy,
            "memory": memory, "compile_s": round(seconds, 1),
            "traced": compiled.traced_layout(cfg, devices)}


def _print_compiled(compiled: dict, planned: int, device_memory: float, unit: str,
                    scale: int) -> None:
    from moebalance.training.plan import GIB

    memory = {k: v / scale if isinstance(v, int) else v for k, v in compiled["memory"].items()}
    head = (f"XLA, the step compiled for {compiled['topology']} ({compiled['device']}, remat "
            f"{compiled['remat']}) in {compiled['compile_s']:.0f} s, {unit} per device:")
    if "refused" in memory:
        print(f"{head} refused: its temporaries alone need {memory['temp']:,.2f}\n  "
              f"{memory['refused']}")
        return
    print(f"{head} arguments {memory['argument']:,.2f} + outputs {memory['output']:,.2f} - "
          f"aliased {memory['alias']:,.2f} + temporaries {memory['temp']:,.2f} = needed "
          f"{memory['needed']:,.2f} (heap peak {memory['peak']:,.2f}); plan / needed "
          f"{planned / compiled['memory']['needed']:.2f}")
    if device_memory:
        fits = compiled["memory"]["needed"] <= device_memory * GIB
        print(f"fits {device_memory:g} GiB by XLA's account: {'yes' if fits else 'no'}")


def _convert(args) -> int:
    """Import a DeepSeek-V4 checkpoint (DeepSeek's release or either transformers layout,
    dequantising FP8/FP4) and write it in transformers' layout in float32 or bfloat16."""
    from moebalance import hf

    config, model = hf.load(args.src, weight_dtype=args.dtype)
    hf.save(model, config, args.dst)
    print(f"wrote {args.dst} ({config.base_num_decoder_layers} layers, {args.dtype})")
    return 0


def _export(args) -> int:
    """Write a run's checkpoint and tokenizer as a directory transformers loads."""
    from moebalance.hf.export import export

    result = export(args.run_dir, args.out, step=args.step, dtype=args.dtype,
                    overwrite=args.overwrite)
    print(f"wrote {args.out} (step {result['step']}, {result['dtype']}, "
          f"{'with' if result['tokenizer'] else 'no'} tokenizer)")
    return 0


def _train(args) -> int:
    """Train a config into a run directory, showing progress and balance as it goes."""
    from moebalance.config import load_config
    from moebalance.training.hooks import terminal
    from moebalance.training.loop import train

    train(load_config(args.config, args.overrides), args.out, overwrite=args.overwrite,
          resume=args.resume, hooks=terminal(bar=not args.quiet))
    print(f"run written to {args.out}")
    return 0


def _ab(args) -> int:
    """Run A (no balancing) vs Run B (the config's balancing), then the table, plots, report."""
    from rich.console import Console

    from moebalance.config import load_config
    from moebalance.experiment import ab

    ab(load_config(args.config, args.overrides), args.out, overwrite=args.overwrite,
       resume=args.resume, console=Console(), progress=not args.quiet, verbose=args.verbose)
    tables = "" if args.verbose else " (-v prints them)"
    print(f"report written to {args.out}/report.html; the per-layer tables: "
          f"{args.out}/table.md{tables}")
    return 0


def _report(args) -> int:
    """The comparison table and plots of any finished runs."""
    from rich.console import Console

    from moebalance.report import compare_report

    compare_report(args.run_dirs, args.out, Console(), overwrite=args.overwrite)
    print(f"report written to {args.out}/report.html")
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


def _keys(args) -> int:
    """Every config key with its type, default and meaning."""
    from moebalance.config import describe

    for key, kind, default, help_text in describe():
        if args.filter in key:
            print(f"{key} ({kind}, default {default!r}): {help_text}")
    return 0


def _common_options() -> argparse.ArgumentParser:
    """Every subcommand's: -q / -v (how much goes to stderr besides results and errors) and
    --no-compile-cache."""
    common = argparse.ArgumentParser(add_help=False)
    level = common.add_mutually_exclusive_group()
    level.add_argument("-q", "--quiet", action="store_true",
                       help="only results and errors: no progress bar, no progress notes")
    level.add_argument("-v", "--verbose", action="store_true", help="also debugging notes")
    common.add_argument("--no-compile-cache", dest="compile_cache", action="store_false",
                        help="compile every program afresh and keep none: no persistent "
                             "compilation cache ($MOEBALANCE_CACHE_DIR, default "
                             "~/.cache/moebalance/xla)")
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moebalance",
        description="DeepSeek-V4-style MoE training with first-class expert load balancing.",
    )
    parser.add_argument("--version", action="version", version=f"moebalance {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    common = _common_options()
    demo = sub.add_parser("demo", parents=[common],
                          help="balancer simulation: every bias rule on skewed logits")
    demo.add_argument("--steps", type=_int_at_least(2), default=600,
                      help="steps to simulate (at least 2: osc compares consecutive steps)")
    demo.add_argument("--experts", type=int, default=16)
    demo.add_argument("--k", type=int, default=4)
    demo.add_argument("--tokens", type=int, default=2048, help="fresh tokens per step")
    demo.add_argument("--skew", type=float, default=1.0, help="strength of the expert preference")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    params = sub.add_parser("params", parents=[common],
                            help="total and active parameter counts of a config")
    params.add_argument("config", help="a preset name (e.g. deepseek4-flash) or a YAML path")
    params.add_argument("overrides", nargs="*", help="key=value overrides")
    params.add_argument("--json", action="store_true", help="print {total, active, mtp} as JSON")
    params.set_defaults(func=_params)
    planner = sub.add_parser("plan", parents=[common],
                             help="per-device memory and all-to-all traffic of a training step "
                                  "on N devices, and whether it fits (nothing is allocated)")
    planner.add_argument("config", help="a preset name (e.g. deepseek4-flash) or a YAML path")
    planner.add_argument("overrides", nargs="*", help="key=value overrides (the ici_* keys give "
                                                      "the mesh)")
    planner.add_argument("--devices", type=int, required=True, help="accelerators in the mesh")
    planner.add_argument("--device-memory", type=float, default=0.0,
                         help="GiB of memory per accelerator: say whether it fits")
    planner.add_argument("--devices-per-host", type=int, default=8,
                         help="for the share of all-to-all traffic between hosts (default 8)")
    planner.add_argument("--json", action="store_true", help="print the plan as JSON (bytes)")
    planner.add_argument("--compile", metavar="TOPOLOGY",
                         help="also compile the step for a topology (v5e:1x1, v5e:2x2, ...: needs "
                              "libtpu, not a chip; or cpu) and print XLA's memory of it")
    planner.set_defaults(func=_plan)
    train = sub.add_parser("train", parents=[common],
                           help="train a config; writes a run directory")
    train.add_argument("config", help="a preset name (e.g. deepseek4-tiny) or a YAML path")
    train.add_argument("overrides", nargs="*", help="key=value overrides")
    train.add_argument("--out", required=True, help="the run directory")
    mode = train.add_mutually_exclusive_group()
    mode.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    mode.add_argument("--resume", action="store_true",
                      help="continue the run in --out from its latest checkpoint")
    train.set_defaults(func=_train)
    ab = sub.add_parser("ab", parents=[common],
                        help="the A/B experiment: no balancing vs the config's balancing, "
                        "with the seed's table, plots and an HTML report; prints the result "
                        "(-v: also the per-layer tables)")
    ab.add_argument("config", help="a preset name (e.g. deepseek4-tiny) or a YAML path")
    ab.add_argument("overrides", nargs="*", help="key=value overrides (apply to both runs)")
    ab.add_argument("--out", required=True, help="the experiment directory")
    mode = ab.add_mutually_exclusive_group()
    mode.add_argument("--overwrite", action="store_true", help="replace the experiment in --out")
    mode.add_argument("--resume", action="store_true", help="finish the experiment in --out")
    ab.set_defaults(func=_ab)
    compare = sub.add_parser("report", parents=[common],
                             help="table and plots comparing finished runs")
    compare.add_argument("run_dirs", nargs="+", help="run directories (from train or ab)")
    compare.add_argument("--out", required=True, help="directory for the report")
    compare.add_argument("--overwrite", action="store_true", help="replace a report in --out")
    compare.set_defaults(func=_report)
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
    convert = sub.add_parser("convert", parents=[common],
                             help="re-export a DeepSeek-V4 checkpoint (DeepSeek's or "
                             "transformers' layout, FP8/FP4 dequantised) for transformers")
    convert.add_argument("src", help="directory with config.json and *.safetensors")
    convert.add_argument("dst", help="new directory to write (must not hold a checkpoint)")
    convert.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    convert.set_defaults(func=_convert)
    export = sub.add_parser("export", parents=[common],
                            help="write a run's checkpoint and tokenizer as a directory that "
                                 "transformers' AutoModelForCausalLM and AutoTokenizer load")
    export.add_argument("run_dir", help="a run directory with a checkpoint")
    export.add_argument("out", help="new directory to write (must not hold files)")
    export.add_argument("--step", type=int, default=None,
                        help="the checkpoint of this step (default: the latest)")
    export.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="weight dtype (default: the run's weight_dtype)")
    export.add_argument("--overwrite", action="store_true",
                        help="replace an earlier export in OUT")
    export.set_defaults(func=_export)
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
    keys = sub.add_parser("keys", parents=[common],
                          help="every config key with its type, default and meaning")
    keys.add_argument("filter", nargs="?", default="", help="only keys containing this text")
    keys.set_defaults(func=_keys)
    return parser


class _WarnOnce(logging.Filter):
    """Passes a warning the first time only: `ab` builds both runs' hash tables from the same
    data, and one uneven table is one problem, not two."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        message = record.getMessage()
        first = message not in self.seen
        self.seen.add(message)
        return first


def setup_logging(level: int) -> None:
    """Our progress notes (data building, sampling) on stderr, each once: the `moebalance` logger
    gets one handler and does not pass records on to the root logger, which libraries imported
    here (orbax, tensorboardX) give a handler of their own; a warning repeated within the command
    is shown once."""
    log = logging.getLogger("moebalance")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_WarnOnce())
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(level)


def main(argv: list[str] | None = None, *, compile_cache: bool = False) -> int:
    """Run one subcommand; every error the user can fix ends in one line on stderr and exit code
    2, a run stopped by SIGINT / SIGTERM in 130 / 143 (its checkpoint saved), Ctrl-C elsewhere in
    130. compile_cache: turn on the persistent compilation cache (runtime) unless the command line
    says --no-compile-cache (the installed command does; tests calling main leave it off)."""
    from moebalance.config import ConfigError
    from moebalance.rundir import RunStopped
    from moebalance.runtime import enable_compilation_cache

    args = build_parser().parse_args(argv)
    if compile_cache and args.compile_cache:
        enable_compilation_cache()
    setup_logging(logging.WARNING if args.quiet else logging.DEBUG if args.verbose
                  else logging.INFO)
    try:
        return args.func(args)
    except RunStopped as stop:
        print(f"moebalance: {stop}", file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:
        print("moebalance: interrupted", file=sys.stderr)
        return 130
    except (ConfigError, OSError, FloatingPointError, ValueError) as err:
        print(f"moebalance: {err}", file=sys.stderr)
        return 2


def entry() -> None:
    """The installed `moebalance` command: main() in a process with huge-page malloc and the
    compilation cache on (runtime)."""
    from moebalance.runtime import reexec_with_hugepage_malloc

    reexec_with_hugepage_malloc()
    sys.exit(main(compile_cache=True))


if __name__ == "__main__":
    entry()
