"""XLA's memory plan of a config's training step compiled for a TPU topology on this machine: no
chip, no device time.

The step is the trainer's own (`step.lower_train_step`: forward, losses, backward over the
micro-batches, AdamW, bias update), traced on an abstract model and optimizer (`nnx.eval_shape`)
whose variables carry the trainer's shardings on a mesh of the topology's devices
(`jax.experimental.topologies.get_topology_desc`, which needs `libtpu` importable, e.g.
`pip install --target /tmp/libtpu "libtpu==0.0.42.*"` and PYTHONPATH=/tmp/libtpu for this
process only), lowered and compiled by the TPU compiler. Prints one JSON object:

    memory_gib   XLA's `memory_analysis()` of the compiled step per device: argument, output,
                 alias (outputs sharing an argument's buffer), temp (every other buffer: the
                 activations and the backward's working set), generated_code, and `needed` =
                 argument + output - alias + temp, what HBM must hold at once by that account;
                 `peak` = its `peak_memory_in_bytes` (the heap simulator's peak, which also
                 counts the buffers XLA placed in the chip's 128 MiB of on-chip VMEM)
    peak_buffers the `--top` largest buffers live at that peak (the compiler's live-range dump):
                 HLO value, MiB, memory space, shape and the JAX operation (`op_name`) that
                 made it
    plan_gib     `moebalance plan` of the same config and expert layout on the topology's
                 devices (`total`, the activations) and plan / needed
A step the chip cannot hold is refused by the compiler: then `memory_gib` is the temporaries it
said the step needs (`temp`) and its message (`refused`).
    compile_s    lowering + compilation

The model is traced as on the chip: `jax.default_backend()` reads "tpu" meanwhile, so every choice
the code makes by backend (`moe_dispatch` / `moe_kernel` auto, a Pallas kernel's interpret mode)
is the chip's. `--topology cpu` compiles for this machine's CPU instead (what the tests run).
Gradient accumulation:
`gradient_accumulation_steps=A` runs A micro-batches of `--batch` rows each per step.

    PYTHONPATH=/tmp/libtpu python benchmarks/aot_memory.py CONFIG [key=value ...]
        [--topology v5e:1x1] [--batch 8] [--seq 2048] [--top 12] [--no-plan]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import tempfile
import time
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
from flax import nnx

from moebalance.config import load_config
from moebalance.model.moe import resolve_dispatch
from moebalance.training import plan, sharding
from moebalance.training.step import lower_train_step

GIB = 2**30


def topology_devices(name: str) -> list:
    """The devices of a one-host TPU topology such as `v5e:1x1` or `v5e:2x2`, as abstract
    devices of the TPU compiler (needs libtpu, not a chip); `cpu`: this machine's CPU device."""
    from jax.experimental import topologies

    if name == "cpu":
        return jax.devices("cpu")[:1]
    dims = tuple(int(d) for d in name.split(":")[1].split("x"))
    bounds = (dims + (1, 1))[:3]  # one host holds the whole topology
    return topologies.get_topology_desc(platform="tpu", topology_name=name,
                                        chip_config_name="default", chips_per_host_bounds=bounds,
                                        num_slices=1, wrap=(False, False, False)).devices


def place_abstract(obj, mesh) -> None:
    """Give every variable of an abstract (`nnx.eval_shape`) model or optimizer the trainer's
    sharding on `mesh` (`sharding.variable_sharding`), in place: what `sharding.shard` does to
    real arrays."""
    def place(path, variable):
        return variable.replace(jax.ShapeDtypeStruct(
            variable.shape, variable.dtype,
            sharding=sharding.variable_sharding(path, variable, mesh)))

    nnx.update(obj, jax.tree_util.tree_map_with_path(
        place, nnx.state(obj), is_leaf=lambda x: isinstance(x, nnx.Variable)))


def memory_gib(stats) -> dict:
    """XLA's CompiledMemoryStats in GiB, with `needed` = argument + output - alias + temp."""
    fields = ("argument", "output", "alias", "temp", "generated_code")
    out = {f: getattr(stats, f"{f}_size_in_bytes") / GIB for f in fields}
    out["needed"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    out["peak"] = stats.peak_memory_in_bytes / GIB
    return {k: round(v, 3) for k, v in out.items()}


REFUSED = re.compile(r"memory required for HLO temporaries \(([\d.]+)G\)")


def refusal(message: str) -> dict | None:
    """What a compiler that refused the step for want of memory said ("RESOURCE_EXHAUSTED: ...
    the total memory required for HLO temporaries (49.45G) exceeds available HBM (15.75G)"):
    {"temp": GiB (XLA's G are GiB), "refused": its first line}; None for any other error."""
    match = REFUSED.search(message) if "RESOURCE_EXHAUSTED" in message else None
    return {"temp": float(match[1]), "refused": message.strip().splitlines()[0]} if match else None


PEAK_HEADER = re.compile(r"^\s*Live ranges at \d+ \(peak\):\s*$")
PEAK_LINE = re.compile(r"^\s*(\S+?)(\{[\d,]*\}): (\d+) bytes")
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([^\s=]+) = (.*)$")
OP_NAME = re.compile(r'op_name="([^"]*)"')


def peak_values(live_range: str) -> list[tuple[str, str, int]]:
    """(instruction, shape index, bytes) of every value live at the peak, from the compiler's
    live-range dump (`*-live-range.txt`: "Live ranges at N (peak):" then one indented
    "name{index}: B bytes (cumulative: C bytes)" line each)."""
    out, inside = [], False
    for line in live_range.splitlines():
        if PEAK_HEADER.match(line):
            inside = True
            continue
        match = PEAK_LINE.match(line) if inside else None
        if inside and not match:
            break
        if match:
            out.append((match[1], match[2], int(match[3])))
    return out


def split_shape(text: str) -> tuple[str, str]:
    """An HLO instruction's text after `=` -> (its shape, the rest): the shape is a tuple
    `( ... )` or one array shape up to the first space."""
    if not text.startswith("("):
        shape, _, rest = text.partition(" ")
        return shape, rest
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return text[:i + 1], text[i + 1:]
    raise ValueError(f"unbalanced tuple shape: {text[:80]}")


def tuple_element(shape: str, index: str) -> str:
    """The array shape at ShapeIndex `index` ("{}", "{1}", "{0,2}") of an HLO shape."""
    for i in (int(x) for x in index.strip("{}").split(",") if x):
        depth, parts, start = 0, [], 1
        for j, ch in enumerate(shape):
            depth += {"(": 1, "{": 1, "[": 1, ")": -1, "}": -1, "]": -1}.get(ch, 0)
            if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
                parts.append(shape[start:j].strip())
                start = j + 1
        shape = parts[i]
    return shape


def instructions(hlo: str) -> dict[str, tuple[str, str]]:
    """{instruction name: (shape, op_name)} of an HLO module's text (op_name "" where none)."""
    out = {}
    for line in hlo.splitlines():
        match = INSTRUCTION.match(line)
        if match:
            shape, rest = split_shape(match[2])
            op = OP_NAME.search(rest)
            out[match[1]] = (shape, op[1] if op else "")
    return out


def peak_buffers(live_range: str, hlo: str, top: int) -> list[dict]:
    """The `top` largest values live at the peak, with their shape, memory space (`vmem` where
    the layout says S(1), else `hbm`) and the JAX operation that made each."""
    named = instructions(hlo)
    out = []
    for name, index, size in sorted(peak_values(live_range), key=lambda v: -v[2])[:top]:
        shape, op_name = named.get(name, ("", ""))
        element = tuple_element(shape, index) if shape else ""
        out.append({"value": name + index, "mib": round(size / 2**20, 1),
                    "space": "vmem" if "S(1)" in element else "hbm",
                    "shape": re.sub(r"\{.*\}|/\*.*?\*/", "", element), "op_name": op_name})
    return out


@contextlib.contextmanager
def as_backend(name: str):
    """`jax.default_backend()` returns `name` inside: code that picks by backend picks as there."""
    with mock.patch.object(jax, "default_backend", lambda: name):
        yield


def compile_step(cfg, devices, batch: int, seq: int, dump: Path):
    """Lower and compile the trainer's step of `cfg` for `devices` (abstract TPU devices) on
    [A, batch, seq] tokens, dumping the compiler's files into `dump`."""
    mesh = sharding.make_mesh(cfg, devices)
    model = plan.abstract_model(cfg)
    optimizer = plan.abstract_optimizer(cfg, model)
    place_abstract(model, mesh)
    place_abstract(optimizer, mesh)
    a = cfg.gradient_accumulation_steps
    rows = sharding.batch_sharding(mesh, 3)
    batch_args = [jax.ShapeDtypeStruct((a, batch, seq + length), dtype, sharding=rows)
                  for length, dtype in ((1, jnp.int32), (0, jnp.bool_), (0, jnp.int32))]
    lowered = lower_train_step(cfg, model, optimizer, *batch_args, mesh)
    return lowered.compile({"xla_dump_to": str(dump), "xla_dump_hlo_as_text": True})


def analyse(config: str, overrides: list[str], topology: str, batch: int, seq: int, top: int,
            with_plan: bool = True) -> dict:
    devices, refused, buffers = topology_devices(topology), None, []
    cfg = load_config(config, [*overrides, f"max_target_length={seq}",
                               f"per_device_batch_size={batch // len(devices)}"])
    with tempfile.TemporaryDirectory() as dump, as_backend(devices[0].platform):
        start = time.perf_counter()
        try:
            compiled = compile_step(cfg, devices, batch, seq, Path(dump))
        except jax.errors.JaxRuntimeError as error:
            refused = refusal(str(error))
            if refused is None:
                raise
        compile_s = time.perf_counter() - start
        if refused is None:
            live_range = next(Path(dump).glob("*after_optimizations-live-range.txt")).read_text()
            buffers = peak_buffers(live_range, compiled.as_text(), top)
        # the planner traces the GPUs' layout for `auto`: give it the one compiled here
        traced = dataclasses.replace(cfg, moe_dispatch=resolve_dispatch(cfg.moe_dispatch))
        planned = plan.plan(traced, len(devices)) if with_plan else None
    memory = refused or memory_gib(compiled.memory_analysis())
    out = {"config": config, "overrides": overrides, "topology": topology,
           "device": devices[0].device_kind, "jax": jax.__version__,
           "tokens_per_step": cfg.gradient_accumulation_steps * batch * seq,
           "batch": batch, "seq": seq, "accumulation": cfg.gradient_accumulation_steps,
           "remat": cfg.remat_policy, "dtype": cfg.dtype, "weight_dtype": cfg.weight_dtype,
           "moe_dispatch": cfg.moe_dispatch, "moe_kernel": cfg.moe_kernel,
           "compile_s": round(compile_s, 1),
           "memory_gib": memory, "peak_buffers": buffers}
    if planned:
        total = planned.total(cfg.remat_policy) / GIB
        out["plan_gib"] = {"total": round(total, 3),
                           "activations": round(planned.activations[cfg.remat_policy] / GIB, 3)}
        if not refused:
            out["plan_gib"].update({"plan / needed": round(total / memory["needed"], 3),
                                    "plan / peak": round(total / memory["peak"], 3)})
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--topology", default="v5e:1x1")
    parser.add_argument("--batch", type=int, default=8, help="rows per micro-batch")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--top", type=int, default=12, help="largest buffers at the peak")
    parser.add_argument("--no-plan", action="store_true", help="skip `moebalance plan`")
    args = parser.parse_args()
    print(json.dumps(analyse(args.config, args.overrides, args.topology, args.batch, args.seq,
                             args.top, not args.no_plan), indent=1), flush=True)


if __name__ == "__main__":
    main()
