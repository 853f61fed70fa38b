"""`moebalance params`, `plan` and `keys`: what a config is and what its training step costs,
nothing allocated."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

from moebalance.cli.options import config_command


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


def device_memory_gib() -> tuple[float | None, str]:
    """(GiB of memory of one of this machine's devices where JAX reports it (an accelerator's
    bytes_limit), else None; their kind, e.g. 'TPU v5 lite' or 'cpu')."""
    import jax

    from moebalance.training.plan import GIB

    device = jax.devices()[0]
    limit = (device.memory_stats() or {}).get("bytes_limit")
    return (limit / GIB if limit else None), device.device_kind


def _plan(args) -> int:
    """Per-device memory and all-to-all traffic of a config's training step on N devices (default:
    this machine's, or the --compile topology's), and whether it fits --device-memory (default:
    the devices' own memory where JAX reports it)."""
    import jax
    from rich.console import Console
    from rich.table import Table

    from moebalance.config import load_config
    from moebalance.training.plan import GIB, plan

    cfg, compiled, memory_note = load_config(args.config, args.overrides), None, ""
    if args.slices != 1 and not args.compile:
        from moebalance.config import ConfigError

        raise ConfigError(f"--slices {args.slices} is a number of TPU slices to compile for: "
                          "give --compile with a TPU slice (e.g. --compile v5p-128)")
    if args.compile:
        compiled = _compile_for_plan(cfg, args)
        cfg = compiled.pop("traced")
    args.devices = args.devices or jax.device_count()
    if args.device_memory is None:  # a topology compiled for is not this machine's devices
        own, kind = device_memory_gib() if not args.compile else (None, args.compile)
        args.device_memory = own or 0.0
        memory_note = (f" ({kind} memory)" if own else "whether it fits: give --device-memory "
                       f"GiB (JAX reports no memory for {kind} devices)")
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
        table.add_row(f"fits {args.device_memory:g} GiB{memory_note}",
                      *("yes" if result.fits(r) else "no" for r in policies))
    Console().print(table)
    print(f"largest block's residuals: {result.block / scale:,.2f} {unit}; all-to-all pairs "
          f"across hosts of {args.devices_per_host} devices: {result.cross_host:.0%}")
    if not args.device_memory:
        print(memory_note)
    if compiled:
        _print_compiled(compiled, result.total(cfg.remat_policy), args.device_memory, unit, scale)
    return 0


def _compile_for_plan(cfg, args) -> dict:
    """plan --compile: XLA's memory of the step compiled for the topology (training/compiled)."""
    from moebalance.config import ConfigError
    from moebalance.training import compiled, topology
    from moebalance.training.plan import GIB

    devices = topology.topology_devices(args.compile, args.slices)
    args.devices = args.devices or len(devices)
    if len(devices) != args.devices:
        raise ConfigError(f"--compile {args.compile} has {len(devices)} devices, --devices says "
                          f"{args.devices}: give --devices {len(devices)}")
    slice_ = topology.parse(args.compile, args.slices)
    where = slice_.describe() if slice_ else args.compile
    logging.getLogger("moebalance").info(
        "compiling the training step for %s as the trainer runs it there (minutes for a large "
        "model)", where)
    tried = []
    if cfg.remat_policy == "auto":  # the policy a run on those devices would choose
        if args.device_memory is None:
            raise ConfigError(f"remat_policy=auto with --compile {args.compile}: give "
                              "--device-memory, the GiB per device its step must fit (v5e: 15.75)")
        policy, tried = compiled.least_recompute_that_fits(cfg, devices,
                                                           int(args.device_memory * GIB))
        cfg = dataclasses.replace(cfg, remat_policy=policy)
        memory, seconds = tried[-1]["memory"], tried[-1]["compile_s"]
        step = None
    else:
        memory, seconds, step = compiled.compiled_memory(cfg, devices)
    return {"topology": where, "device": devices[0].device_kind, "remat": cfg.remat_policy,
            "memory": memory, "compile_s": round(seconds, 1), "tried": tried,
            "cost": _step_cost(cfg, devices, step, slice_) if step and slice_ else None,
            "traced": compiled.traced_layout(cfg, devices)}


def _step_cost(cfg, devices: list, step, slice_) -> dict:
    """The compiled step's collectives per device (training/collectives.py) and its roofline on
    that slice (training/roofline.py: a model, not a measurement)."""
    import numpy as np

    from moebalance.training import collectives, roofline, sharding

    mesh = sharding.make_mesh(cfg, devices)
    found, unknown = collectives.count(step.as_text())
    tally = collectives.tally(found, dict(mesh.shape),
                              [getattr(d, "slice_index", 0) for d in mesh.devices.flat])
    rows = cfg.gradient_accumulation_steps * cfg.per_device_batch_size * len(devices)
    flops = roofline.model_flops(cfg, np.zeros((rows, cfg.max_target_length), np.int32))
    tokens = rows * cfg.max_target_length
    return {"collectives": tally, "unknown_trip_counts": unknown, "model_flops": flops["total"],
            "tokens": tokens, "roofline": roofline.roofline(
                flops["total"], tokens, len(devices), slice_.generation,
                tally["sent"]["ici"], tally["sent"]["dcn"])}


def _print_compiled(compiled: dict, planned: int, device_memory: float, unit: str,
                    scale: int) -> None:
    from moebalance.training.compiled import tried_summary
    from moebalance.training.plan import GIB

    if compiled["tried"]:
        print(f"remat_policy auto: {compiled['remat']}, the least recompute that fits "
              f"{device_memory:g} GiB ({tried_summary(compiled['tried'])})")
    memory = {k: v / scale if isinstance(v, int) else v for k, v in compiled["memory"].items()}
    programs = memory.get("programs")
    what = (f"as a chain of {len(programs)} programs, as the trainer runs it there "
            "(step_programs)" if programs else "as one program, as the trainer runs it there")
    head = (f"XLA, the step compiled for {compiled['topology']} ({compiled['device']}, remat "
            f"{compiled['remat']}) {what}, in {compiled['compile_s']:.0f} s, {unit} per device:")
    if "refused" in memory:
        print(f"{head} refused: its temporaries alone need {memory['temp']:,.2f}\n  "
              f"{memory['refused']}")
        return
    if programs:
        print(head)
        for program in programs:
            own = program["memory"]
            print(f"  {program['name']:<14} x{program['calls']}: needs {own['needed'] / scale:,.2f}"
                  f" (temporaries {own['temp'] / scale:,.2f}), compiled in "
                  f"{program['compile_s']:.1f} s")
        print(f"needed at the step's peak, in {memory['at']}: {memory['needed']:,.2f} (the model, "
              f"optimizer and batch, {memory['held']:,.2f}, the arrays earlier programs keep "
              "for later ones, and what this one adds); plan / needed "
              f"{planned / compiled['memory']['needed']:.2f}")
    else:
        print(f"{head} arguments {memory['argument']:,.2f} + outputs {memory['output']:,.2f} - "
              f"aliased {memory['alias']:,.2f} + temporaries {memory['temp']:,.2f} = needed "
              f"{memory['needed']:,.2f} (heap peak {memory['peak']:,.2f}); plan / needed "
              f"{planned / compiled['memory']['needed']:.2f}")
    if device_memory:
        fits = compiled["memory"]["needed"] <= device_memory * GIB
        print(f"fits {device_memory:g} GiB by XLA's account: {'yes' if fits else 'no'}")
    if compiled.get("cost"):
        _print_cost(compiled["cost"])


def _print_cost(cost: dict) -> None:
    """The compiled step's collectives and roofline (_step_cost)."""
    from moebalance.training.roofline import MAXTEXT_DEEPSEEK_V3_MFU

    tally, model = cost["collectives"], cost["roofline"]
    print("collectives per device and step, GiB (from the compiled HLO, loops' trip counts "
          "applied): " + (", ".join(f"{kind} {b / 2**30:,.3f}" for kind, b in
                                    tally["kind"].items() if b) or "none")
          + "; by mesh axis: " + (", ".join(f"{axis} {b / 2**30:,.3f}"
                                           for axis, b in tally["axis"].items()) or "none"))
    if cost["unknown_trip_counts"]:
        print(f"  ({cost['unknown_trip_counts']} loops without a known trip count counted once)")
    print(f"roofline (a model, not a measurement): compute {model['compute_s']:.3f} s, ICI "
          f"{model['ici_s']:.3f} s, DCN {model['dcn_s']:.3f} s a step -> "
          f"{model['no_overlap_tokens_s_chip']:,.0f} to {model['full_overlap_tokens_s_chip']:,.0f}"
          f" tokens/s/chip, MFU {model['no_overlap_mfu']:.1%} to {model['full_overlap_mfu']:.1%}"
          f" (no overlap to full overlap; MaxText's DeepSeek-V3 671B on v5p-1024: "
          f"{MAXTEXT_DEEPSEEK_V3_MFU:.1%})")


def _keys(args) -> int:
    """Every config key with its type, default and meaning (and when it takes effect)."""
    from moebalance.config import describe

    for key, kind, default, help_text, when in describe():
        if args.filter in key:
            print(f"{key} ({kind}, default {default!r}): {help_text}"
                  + (f" [takes effect with {when}]" if when else ""))
    return 0


def add_parsers(sub, common: argparse.ArgumentParser) -> None:
    """The subcommands params, plan and keys."""
    params = config_command(sub, "params", common, "deepseek4-flash",
                            "total and active parameter counts of a config")
    params.add_argument("--json", action="store_true", help="print {total, active, mtp} as JSON")
    params.set_defaults(func=_params)
    planner = config_command(sub, "plan", common, "deepseek4-flash",
                             "per-device memory and all-to-all traffic of a training step on N "
                             "devices, and whether it fits (nothing is allocated)",
                             "key=value overrides (the ici_* keys give the mesh)")
    planner.add_argument("--devices", type=int, default=None,
                         help="accelerators in the mesh (default: this machine's devices, or "
                              "the --compile topology's)")
    planner.add_argument("--device-memory", type=float, default=None,
                         help="GiB of memory per accelerator: say whether it fits (default: "
                              "the devices' own, where JAX reports it)")
    planner.add_argument("--devices-per-host", type=int, default=8,
                         help="for the share of all-to-all traffic between hosts (default 8)")
    planner.add_argument("--json", action="store_true", help="print the plan as JSON (bytes)")
    planner.add_argument("--compile", metavar="TOPOLOGY",
                         help="also compile the step for a TPU slice (v5p-128, v5e-256, "
                              "v6e-256, tpu7x-128, v5p:4x4x8, ...: needs libtpu, not a chip; or "
                              "cpu) and print XLA's memory of it")
    planner.add_argument("--slices", type=int, default=1,
                         help="with --compile: that many slices joined over the data-center "
                              "network, the mesh's data axis across them (default 1)")
    planner.set_defaults(func=_plan)
    keys = sub.add_parser("keys", parents=[common],
                          help="every config key with its type, default and meaning")
    keys.add_argument("filter", nargs="?", default="", help="only keys containing this text")
    keys.set_defaults(func=_keys)
