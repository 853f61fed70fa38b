"""Where one training step's time goes: a per-component profile of the real jitted step.

Traces one step of the trainer's step function with jax.profiler, maps every XLA operation the
CPU ran to the model component whose `jax.named_scope` it carries (the innermost one: embed, mhc,
attention/window/compressor/indexer/compressed, route, dispatch, experts, combine, shared, head,
loss, balance_loss, optimizer, bias_update; `other` for the rest), forward and backward apart,
and counts each operation's matmul FLOPs from the compiled HLO. Prints a table (stderr) and one
JSON object (stdout) with, per component, milliseconds and achieved GFLOP/s, next to the dense
float32 GEMM rate measured in the same run.

    python benchmarks/profile_step.py [--config deepseek4-tiny] [--batch 8] [--seq 256] [key=value ...]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time

COMPONENTS = ("embed", "mhc", "window", "compressor", "indexer", "compressed", "attention",
              "route", "dispatch", "experts", "combine", "shared", "head", "loss",
              "balance_loss", "optimizer", "bias_update")
CONTAINERS = ("while", "call", "conditional")  # their time is their body's operations' time
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\S+) ([\w-]+)\((.*)$")
SHAPE = re.compile(r"^\w+\[([\d,]*)\]")


def parse_hlo(text: str):
    """-> ({instruction: (opcode, op_name)}, {instruction: matmul FLOPs, fusions included})."""
    shapes, ops, dots, calls, body = {}, {}, collections.defaultdict(int), {}, None
    computation_flops = collections.defaultdict(int)
    for line in text.splitlines():
        if line.endswith("{") and "%" in line and "=" not in line.split("(")[0]:
            body = line.split("%")[1].split()[0]  # a computation's first line
            continue
        m = INSTRUCTION.match(line)
        if not m:
            continue
        name, shape, opcode, rest = m.groups()
        shapes[name] = [int(d) for d in SHAPE.match(shape).group(1).split(",") if d] \
            if SHAPE.match(shape) else []
        op_name = re.search(r'op_name="([^"]*)"', rest)
        ops[name] = (opcode, op_name.group(1) if op_name else "")
        if opcode == "dot":
            lhs = rest.split(",")[0].strip().lstrip("%")
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest).group(1)
            size = math.prod(shapes[lhs][int(d)] for d in contracting.split(",") if d)
            dots[name] = 2 * math.prod(shapes[name]) * size
            computation_flops[body] += dots[name]
        called = re.search(r"calls=%([\w.\-]+)", rest)
        if called and opcode == "fusion":
            calls[name] = called.group(1)
    flops = {name: dots.get(name, 0) + computation_flops.get(calls.get(name), 0) for name in ops}
    return ops, flops


def component(op_name: str) -> str:
    """The innermost known named scope of an operation (scopes may sit inside transformation
    names, as in `transpose(jvp(head))/dot_general`)."""
    scopes = [word for word in re.findall(r"\w+", op_name) if word in COMPONENTS]
    return scopes[-1] if scopes else "other"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deepseek4-tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--top", type=int, default=0,
                        help="also print the N slowest XLA operations with their scopes")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()

    from moebalance.runtime import reexec_with_hugepage_malloc

    reexec_with_hugepage_malloc()
    dump = tempfile.mkdtemp(prefix="moebalance-hlo-")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
                               " --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*jit_step.*")
    import jax

    from model_step import dense_gemm_gflops, time_step
    from moebalance.config import load_config
    from moebalance.data import batches
    from moebalance.training import sharding
    from moebalance.training.loop import build
    from moebalance.training.step import make_train_step

    cfg = load_config(args.config, [*args.overrides, f"max_target_length={args.seq}",
                                    f"per_device_batch_size={args.batch // jax.device_count()}"])
    mesh = sharding.make_mesh(cfg)
    data = batches(cfg)
    model, optimizer = build(cfg, mesh, data)
    step = make_train_step(cfg, model, mesh)
    inputs = sharding.global_batch(mesh, *data.batch(0))
    compile_s, step_s, _, _ = time_step(step, model, optimizer, inputs, 2)
    trace_dir = tempfile.mkdtemp(prefix="moebalance-trace-")
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    jax.block_until_ready(step(model, optimizer, *inputs))
    jax.profiler.stop_trace()

    hlo = max(glob.glob(f"{dump}/*jit_step*after_optimizations.txt"), key=os.path.getsize)
    ops, flops = parse_hlo(open(hlo).read())
    trace = json.load(gzip.open(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]))
    for folder in (dump, trace_dir):
        shutil.rmtree(folder)
    ms, gflop, per_op = collections.Counter(), collections.Counter(), collections.Counter()
    for event in trace["traceEvents"]:
        if event.get("ph") != "X" or event["name"] not in ops:
            continue
        opcode, op_name = ops[event["name"]]
        if opcode in CONTAINERS:
            continue
        key = (component(op_name), "backward" if "transpose(" in op_name else "forward")
        ms[key] += event["dur"] / 1e3
        per_op[(event["name"], opcode, op_name)] += event["dur"] / 1e3
        gflop[key] += flops[event["name"]] / 1e9
    gemm = dense_gemm_gflops()
    rows = [{"component": c, "pass": p, "ms": round(t, 1),
             "share": round(t / sum(ms.values()), 3),
             "gflops": round(gflop[(c, p)] / t * 1e3, 1) if gflop[(c, p)] else None}
            for (c, p), t in ms.most_common()]
    tokens = args.batch * args.seq
    print(f"{'component':<14}{'pass':<10}{'ms':>8}{'share':>8}{'GFLOP/s':>9}", file=sys.stderr)
    for r in rows:
        rate = "-" if r["gflops"] is None else f"{r['gflops']:.1f}"
        print(f"{r['component']:<14}{r['pass']:<10}{r['ms']:>8.1f}{r['share']:>8.1%}{rate:>9}",
              file=sys.stderr)
    for (name, opcode, op_name), t in per_op.most_common(args.top):
        print(f"{t:8.1f} ms  {opcode:<14}{name:<28}{op_name[-110:]}", file=sys.stderr)
    total_gflop = sum(gflop.values())
    print(json.dumps({
        "config": args.config, "layers": cfg.base_num_decoder_layers, "dtype": cfg.dtype,
        "batch": args.batch, "seq": args.seq, "compile_s": round(compile_s, 2),
        "step_s": round(step_s, 3), "tokens_per_s": round(tokens / step_s, 1),
        "op_ms": round(sum(ms.values()), 1), "matmul_gflop": round(total_gflop, 2),
        "step_gflops": round(total_gflop / step_s, 1), "dense_gemm_gflops": round(gemm, 1),
        "components": rows}))


if __name__ == "__main__":
    main()
