"""XLA's memory plan of a config's training step compiled for a TPU topology on this machine: no
chip, no device time.

The compilation is `moebalance plan --compile`'s (training/compiled.py: the trainer's own step on
an abstract model and optimizer sharded on a mesh of the topology's devices, which needs `libtpu`
importable, e.g. `pip install --target /tmp/libtpu "libtpu==0.0.42.*"` and PYTHONPATH=/tmp/libtpu
for this process only); this script adds what the compiler's dump says of its peak. Prints one
JSON object:

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

The model is traced as on the chip: the mesh's devices are the topology's, so every choice the
code makes by platform (`moe_dispatch` / `moe_kernel` auto, a Pallas kernel's interpret mode) is
the chip's. `--topology cpu` compiles for this machine's CPU instead (what the tests run).
Gradient accumulation:
`gradient_accumulation_steps=A` runs A micro-batches of `--batch` rows each per step.

    PYTHONPATH=/tmp/libtpu python benchmarks/aot_memory.py CONFIG [key=value ...]
        [--topology v5e:1x1] [--batch 8] [--seq 2048] [--top 12] [--no-plan]
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path

import jax

from moebalance.config import load_config
from moebalance.training import compiled, plan
from moebalance.training.topology import topology_devices
from moebalance.training.plan import GIB

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


def analyse(config: str, overrides: list[str], topology: str, batch: int, seq: int, top: int,
            with_plan: bool = True) -> dict:
    devices, buffers = topology_devices(topology), []
    cfg = load_config(config, [*overrides, f"max_target_length={seq}",
                               f"per_device_batch_size={batch // len(devices)}"])
    with tempfile.TemporaryDirectory() as dump:
        memory, compile_s, step = compiled.compiled_memory(
            cfg, devices, {"xla_dump_to": dump, "xla_dump_hlo_as_text": True})
        if step is not None:
            live_range = next(Path(dump).glob("*after_optimizations-live-range.txt")).read_text()
            buffers = peak_buffers(live_range, step.as_text(), top)
    # the planner traces the GPUs' layout for `auto`: give it the one compiled here
    planned = plan.plan(compiled.traced_layout(cfg, devices), len(devices)) if with_plan else None
    memory = {k: round(v / GIB, 3) if isinstance(v, int) else v for k, v in memory.items()}
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
        if step is not None:
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
