"""Where one training step's time goes: a per-component profile of the real jitted step.

Traces one step of the trainer's step function with jax.profiler and reads the trace: on a CPU
the XLA operations the host threads ran, on a GPU the kernels of the device's streams (each names
the XLA operation it belongs to in its `hlo_op`), on a TPU the events of the device's `XLA Ops`
thread (each named after its XLA operation; a loop's event spans its body's operations, which
alone are counted). Every operation is mapped to the model component whose `jax.named_scope` it
carries (the innermost one: embed, mhc, sinkhorn, attention/window/compressor/indexer/compressed,
route, dispatch, experts, combine, shared, head, loss, balance_loss, optimizer, bias_update;
`other` for the rest), forward and backward apart, and its matmul FLOPs are counted from the
compiled HLO (dots, cuBLAS calls and fusions holding dots; a TPU's HLO writes its matmuls as
convolutions, not counted, so no GFLOP/s there). The components are also summed into the parts of
a step (`PARTS`), with the copies and transposes XLA adds (copy and transpose operations and
fusions, whatever their scope) as a part of their own. Prints a table (stderr) and one JSON object
(stdout): per component and part, milliseconds, share of the operations' time and achieved
GFLOP/s, next to a dense GEMM of the step's dtype timed in the same run.

On a GPU, XLA's command buffers (CUDA graphs) are switched off for this run
(`--xla_gpu_enable_command_buffer=`) so that every kernel is launched, and traced, as its own
operation; the step time printed is that of this configuration.

    python benchmarks/profile_step.py [--config deepseek4-tiny] [--batch 8] [--seq 256]
                                      [--top N] [--keep DIR] [key=value ...]

`--keep DIR` also writes the step's optimized HLO and its trace there (gzipped), so that they
can be read again elsewhere (e.g. a TPU's on a CPU).
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

COMPONENTS = ("embed", "mhc", "sinkhorn", "window", "compressor", "indexer", "compressed",
              "attention", "route", "dispatch", "experts", "combine", "shared", "head", "loss",
              "balance_loss", "optimizer", "bias_update")
# The parts of a step, each a set of components; the copies and transposes XLA adds, whatever
# their scope, are the part `XLA_COPIES`; unscoped operations are `other`.
PARTS = (("experts", ("experts",)), ("shared expert", ("shared",)),
         ("dispatch + combine", ("dispatch", "combine")), ("attention: window", ("window",)),
         ("attention: compressor", ("compressor",)), ("attention: indexer", ("indexer",)),
         ("attention: compressed entries", ("compressed",)),
         ("attention: projections + softmax", ("attention",)),
         ("hyper-connections", ("mhc", "sinkhorn")),
         ("router + balancing", ("route", "balance_loss", "bias_update")),
         ("embedding, head + loss", ("embed", "head", "loss")), ("optimizer", ("optimizer",)))
XLA_COPIES = "XLA copies + transposes"
CONTAINERS = ("while", "call", "conditional")  # their time is their body's operations' time
COPY_OPCODES = ("copy", "transpose", "copy-start", "copy-done")
COPY_FUSION = re.compile(r"(^|_)(copy|transpose)(_|$)")
GEMM_CALLS = re.compile(r'custom_call_target="__cublas\$(lt\$matmul|gemm)')
NAME = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
DIMS = re.compile(r"\w+\[([\d,]*)\]")


def split_instruction(line: str):
    """An HLO instruction line -> (name, shape text, opcode, the rest after '('), or None.
    Tuple shapes, e.g. `(bf16[8,4]{1,0}, s8[64]{0})` of a cuBLAS call, are kept whole."""
    m = NAME.match(line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        depth = 0
        for end, char in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                break
        shape, rest = rest[:end + 1], rest[end + 2:]
    else:
        shape, _, rest = rest.partition(" ")
    op = re.match(r"([\w-]+)\((.*)$", rest)
    return (m.group(1), shape, *op.groups()) if op else None


def _dims(shape: str) -> list[int]:
    """The first array shape's dimensions (a tuple's first element)."""
    m = DIMS.search(shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def parse_hlo(text: str):
    """-> ({instruction: (opcode, op_name)}, {instruction: matmul FLOPs, fusions included}).
    Matmuls: `dot` (contracting dimensions from the instruction) and cuBLAS custom calls (from
    their backend config's dot_dimension_numbers); a fusion counts the dots of its computation.
    The FLOPs are those of every execution in one step: an operation inside a `while` body
    (a layer scan, the micro-batch loop) counts its loop's known trip count times, nested loops
    multiplied, as the trace sums the time of every execution."""
    shapes, ops, dots, calls, body = {}, {}, {}, {}, None
    computation_flops = collections.defaultdict(int)
    home, callees = {}, collections.defaultdict(list)  # computation -> [(callee, times)]
    for line in text.splitlines():
        if line.endswith("{") and "%" in line and "=" not in line.split("(")[0]:
            body = line.split("%")[1].split()[0]  # a computation's first line
            continue
        parsed = split_instruction(line)
        if not parsed:
            continue
        name, shape, opcode, rest = parsed
        shapes[name], home[name] = _dims(shape), body
        op_name = re.search(r'op_name="([^"]*)"', rest)
        ops[name] = (opcode, op_name.group(1) if op_name else "")
        contracting = None
        if opcode == "dot":
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest).group(1)
        elif opcode == "custom-call" and GEMM_CALLS.search(rest):
            found = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', rest)
            contracting = found.group(1).replace('"', "") if found else None
        if contracting is not None:
            lhs = re.search(r"%([\w.\-]+)", rest).group(1)
            size = math.prod(shapes[lhs][int(d)] for d in contracting.split(",") if d)
            dots[name] = 2 * math.prod(shapes[name]) * size
            computation_flops[body] += dots[name]
        called = re.search(r"calls=%([\w.\-]+)", rest)
        if called and opcode == "fusion":
            calls[name] = called.group(1)
        elif opcode == "while":
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
            callees[body].append((re.search(r"body=%([\w.\-]+)", rest).group(1),
                                  int(trips.group(1)) if trips else 1))
        elif opcode == "call":
            callees[body].append((re.search(r"to_apply=%([\w.\-]+)", rest).group(1), 1))
        elif opcode == "conditional":  # every branch counted once: an upper bound
            listed = re.search(r"branch_computations=\{([^}]*)\}", rest)
            branches = (re.findall(r"%([\w.\-]+)", listed.group(1)) if listed
                        else re.findall(r"_computation=%([\w.\-]+)", rest))  # true/false form
            callees[body] += [(branch, 1) for branch in branches]
    # A computation is defined before its callers and the entry comes last, so in reverse order
    # every caller's count is final before its callees'.
    times = collections.Counter({body: 1})
    for computation in reversed(list(dict.fromkeys(home.values()))):
        for callee, trips in callees[computation]:
            times[callee] += times[computation] * trips
    flops = {name: (dots.get(name, 0) + computation_flops.get(calls.get(name), 0))
             * times.get(home[name], 1) for name in ops}
    return ops, flops


def op_times(trace: dict, ops: dict, module: str = "jit_step"):
    """Microseconds per HLO instruction of `ops` in a jax.profiler trace (trace.json), and the
    microseconds of device events that name none of them. Containers (`while`, `call`,
    `conditional`) are left out: their time is that of the operations they hold, counted once as
    those. On a device (processes named `/device:...`) only the XLA module `module` counts: on a
    TPU the events of its `XLA Ops` threads, each named after its instruction, that start within
    a run of the module on the device's `XLA Modules` thread; on a GPU the kernels on its
    `Stream #...` threads, by the instruction each names in its `hlo_op`. Elsewhere (a CPU): the
    events named after an instruction, whatever their thread."""
    events = trace["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {pid: name for pid, name in processes.items() if name.startswith("/device:")}
    # the devices' threads only: a host's events at most launch the device's operations
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name" and e["pid"] in devices}
    if any(name.startswith("/device:TPU:") for name in devices.values()):
        named = _tpu_ops(events, threads, module)
    elif devices:
        named = _gpu_kernels(events, threads, module)
    else:
        named = ((e["name"], e["dur"]) for e in events if e.get("ph") == "X")
    times, unmatched = collections.Counter(), 0.0
    for name, us in named:
        if name in ops:
            if ops[name][0] not in CONTAINERS:
                times[name] += us
        elif devices:  # a host's threads run more than XLA's operations: not counted there
            unmatched += us
    return times, unmatched


def _on_threads(events, threads: dict, prefix: str):
    """The complete events on the threads of `threads` whose name starts with `prefix`."""
    return (e for e in events if e.get("ph") == "X"
            and threads.get((e["pid"], e.get("tid")), "").startswith(prefix))


def _tpu_ops(events, threads: dict, module: str):
    """(instruction, us) of the events on a TPU's `XLA Ops` threads within a run of `module`.
    A TPU's events carry no module name: the run's span on the `XLA Modules` thread of the same
    device tells the step's operations from those of other programs."""
    runs = collections.defaultdict(list)
    for e in _on_threads(events, threads, "XLA Modules"):
        if module in e["name"]:  # e.g. `jit_step(18230077167655010019)`
            runs[e["pid"]].append((e["ts"], e["ts"] + e["dur"]))
    return ((e["name"], e["dur"]) for e in _on_threads(events, threads, "XLA Ops")
            if any(start <= e["ts"] < end for start, end in runs[e["pid"]]))


def _gpu_kernels(events, threads: dict, module: str):
    """(instruction, us) of the kernels on a GPU's `Stream #...` threads, by their `hlo_op`, those
    of other XLA modules left out (the device's `XLA Ops` line repeats them, derived)."""
    for e in _on_threads(events, threads, "Stream #"):
        args = e.get("args", {})
        if module in args.get("hlo_module", args.get("hlo module", module)):
            yield args.get("hlo_op", ""), e["dur"]


def component(op_name: str) -> str:
    """The innermost known named scope of an operation (scopes may sit inside transformation
    names, as in `transpose(jvp(head))/dot_general`)."""
    scopes = [word for word in re.findall(r"\w+", op_name) if word in COMPONENTS]
    return scopes[-1] if scopes else "other"


def part(name: str, opcode: str, scope: str) -> str:
    """The part of a step an operation belongs to (PARTS; copies and transposes apart)."""
    if opcode in COPY_OPCODES or (opcode == "fusion" and COPY_FUSION.search(name.split(".")[0])):
        return XLA_COPIES
    return next((p for p, scopes in PARTS if scope in scopes), "other")


def summarise(times: dict, ops: dict, flops: dict):
    """-> (component rows, part rows), each with ms, share and GFLOP/s, largest first."""
    ms, gflop = collections.Counter(), collections.Counter()
    part_ms, part_gflop = collections.Counter(), collections.Counter()
    for name, us in times.items():
        opcode, op_name = ops[name]
        scope = component(op_name)
        key = (scope, "backward" if "transpose(" in op_name else "forward")
        ms[key] += us / 1e3
        gflop[key] += flops[name] / 1e9
        p = part(name, opcode, scope)
        part_ms[p] += us / 1e3
        part_gflop[p] += flops[name] / 1e9
    total = sum(ms.values()) or 1.0

    def rate(g, t):
        return round(g / t * 1e3, 1) if g and t else None

    components = [{"component": c, "pass": p, "ms": round(t, 1), "share": round(t / total, 3),
                   "gflops": rate(gflop[(c, p)], t)} for (c, p), t in ms.most_common()]
    parts = [{"part": p, "ms": round(t, 1), "share": round(t / total, 3),
              "gflops": rate(part_gflop[p], t)} for p, t in part_ms.most_common()]
    return components, parts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deepseek4-tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2, help="timed steps before the traced one")
    parser.add_argument("--top", type=int, default=0,
                        help="also print the N slowest XLA operations with their scopes")
    parser.add_argument("--keep", metavar="DIR",
                        help="also write the optimized HLO and the trace to DIR (gzipped)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()

    from moebalance.runtime import reexec_with_hugepage_malloc

    reexec_with_hugepage_malloc()
    dump = tempfile.mkdtemp(prefix="moebalance-hlo-")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
                               " --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*jit_step.*"
                               " --xla_gpu_enable_command_buffer=")
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
    compile_s, step_s, _, _ = time_step(step, model, optimizer, inputs, args.steps)
    trace_dir = tempfile.mkdtemp(prefix="moebalance-trace-")
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    jax.block_until_ready(step(model, optimizer, *inputs))
    jax.profiler.stop_trace()

    hlo = max(glob.glob(f"{dump}/*jit_step*after_optimizations.txt"), key=os.path.getsize)
    ops, flops = parse_hlo(open(hlo).read())
    trace_file = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
    trace = json.load(gzip.open(trace_file))
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
        shutil.copy(trace_file, os.path.join(args.keep, "step.trace.json.gz"))
        with open(hlo, "rb") as src, gzip.open(os.path.join(args.keep, "step.hlo.txt.gz"),
                                               "wb") as dst:
            shutil.copyfileobj(src, dst)
    for folder in (dump, trace_dir):
        shutil.rmtree(folder)
    times, unmatched = op_times(trace, ops)
    components, parts = summarise(times, ops, flops)
    gemm = dense_gemm_gflops(cfg.dtype)
    print(f"{'component':<14}{'pass':<10}{'ms':>8}{'share':>8}{'GFLOP/s':>9}", file=sys.stderr)
    for r in components:
        rate = "-" if r["gflops"] is None else f"{r['gflops']:.1f}"
        print(f"{r['component']:<14}{r['pass']:<10}{r['ms']:>8.1f}{r['share']:>8.1%}{rate:>9}",
              file=sys.stderr)
    print(f"\n{'part':<34}{'ms':>8}{'share':>8}{'GFLOP/s':>9}", file=sys.stderr)
    for r in parts:
        rate = "-" if r["gflops"] is None else f"{r['gflops']:.1f}"
        print(f"{r['part']:<34}{r['ms']:>8.1f}{r['share']:>8.1%}{rate:>9}", file=sys.stderr)
    for name, t in times.most_common(args.top):
        opcode, op_name = ops[name]
        print(f"{t / 1e3:8.1f} ms  {opcode:<14}{name:<28}{op_name[-110:]}", file=sys.stderr)
    total_gflop = sum(flops[name] for name in times) / 1e9
    tokens = args.batch * args.seq * cfg.gradient_accumulation_steps
    print(json.dumps({
        "config": args.config, "layers": cfg.base_num_decoder_layers, "dtype": cfg.dtype,
        "batch": args.batch, "seq": args.seq, "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind, "compile_s": round(compile_s, 2),
        "step_s": round(step_s, 3), "tokens_per_s": round(tokens / step_s, 1),
        "op_ms": round(sum(times.values()) / 1e3, 1),
        "unmatched_device_ms": round(unmatched / 1e3, 1),
        "matmul_gflop": round(total_gflop, 2), "step_gflops": round(total_gflop / step_s, 1),
        "dense_gemm_gflops": round(gemm, 1), "parts": parts, "components": components}))


if __name__ == "__main__":
    main()
