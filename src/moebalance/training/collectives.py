"""What a compiled step sends between devices, read from its HLO text (`compiled.as_text()`):
bytes per collective kind and per mesh axis, every while loop's trip count applied.

Steps (`count`):
1. Split the module into its computations and note each instruction's result bytes
   (`computations`).
2. How often each computation runs in one call of the program (`call_counts`): ENTRY once; a while
   loop's body and condition as often as its caller times the trip count XLA annotates
   (`backend_config={"known_trip_count":{"n":"4"}}`; where it wrote none, as a TPU's compiler
   does not, the count a `counter < N` loop stepping by 1 from a constant gives:
   `counted_trips`; any other loop counts once and is reported); any other callee (a conditional's branches, an async wrapper, a call) as often as
   its caller. Nested loops multiply. Both branches of a conditional count (an upper bound: the
   expert-parallel layer's `lax.cond` runs one buffer of two).
3. Every collective (`KINDS`; an async `-start` counted, its `-done` not, so a pair counts once):
   `bytes` = its operands' bytes per device, times the group size for an all-gather (the
   gathered result): the whole array each device holds in it; its replica groups (explicit
   `{{0,1},{2,3}}`, iota `[2,4]<=[8]`, or XLA's mesh form `mesh['axis_0'=2,'axis_1'=4]
   {'axis_1'}`) as partition ids, which are positions in the mesh's devices in order (an SPMD
   program's partition i runs on `mesh.devices.flat[i]`).
4. `tally` sums them per kind and per mesh axis: the axes along which a group's devices differ
   (`fsdp`, `data+fsdp`, ...), and `sent`, what a device puts on the links by a ring algorithm
   over n devices ((n - 1) / n of the bytes; twice that for an all-reduce; all of them for a
   collective-permute), split into ICI and DCN (a group whose devices lie in several slices).
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

KINDS = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
               "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8,
               "u64": 8, "f64": 8, "c64": 8, "c128": 16}
ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
CALLEES = re.compile(r"\b(?:condition|body|calls|to_apply|true_computation|false_computation)="
                     r"%?([\w.\-]+)|branch_computations=\{([^}]*)\}")
TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def array_bytes(text: str) -> int:
    """Bytes of every array type written in `text` (`f32[4,16]{1,0}`, a tuple's elements)."""
    return int(sum(DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
                   for dtype, dims in ARRAY.findall(text)))


def computations(text: str) -> tuple[dict, str]:
    """-> ({computation: [(name, result type, opcode, rest of line)]}, the ENTRY's name)."""
    comps, entry, current = {}, "", None
    for line in text.splitlines():
        if current is None:
            if header := HEADER.match(line):
                current = header[2]
                comps[current] = []
                entry = current if header[1] else entry
        elif line.strip() == "}":
            current = None
        elif instruction := INSTRUCTION.match(line):
            comps[current].append(instruction.groups())
    return comps, entry


def call_counts(comps: dict, entry: str) -> tuple[dict, int]:
    """-> ({computation: times it runs per call of the program}, while loops without a known
    trip count). Computations are printed callees first, so callers are walked in reverse."""
    counts, unknown = dict.fromkeys(comps, 0), 0
    counts[entry] = 1
    defs = {name: (opcode, rest) for body in comps.values() for name, _, opcode, rest in body}
    for comp in reversed(list(comps)):
        for _, _, opcode, rest in comps[comp]:
            if counts[comp] == 0 or opcode.endswith(("-done", "-update")):
                continue  # a -done names the same wrapped computation as its -start
            times = 1
            if opcode == "while":
                trip = TRIP_COUNT.search(rest)
                trips = int(trip[1]) if trip else counted_trips(rest, comps, defs)
                unknown += trips is None
                times = 1 if trips is None else trips
            for single, branches in CALLEES.findall(rest):
                for callee in [single] if single else re.findall(r"%?([\w.\-]+)", branches):
                    if callee in counts:
                        counts[callee] += counts[comp] * times
    return counts, unknown


def _operands(rest: str) -> list[str]:
    return re.findall(r"%([\w.\-]+)", rest.split(")")[0])


def _source(name: str, defs: dict) -> str:
    """The instruction a value is a copy or bitcast of (itself if none)."""
    while name in defs and defs[name][0] in ("copy", "bitcast", "copy-done", "copy-start"):
        name = _operands(defs[name][1])[0]
    return name


def _constant(name: str, defs: dict) -> int | None:
    """The integer a scalar constant holds, through copies and bitcasts; None if it is none."""
    opcode, rest = defs.get(_source(name, defs), ("", ""))
    value = re.match(r"(-?\d+)\)", rest) if opcode == "constant" else None
    return int(value[1]) if value else None


def counted_trips(rest: str, comps: dict, defs: dict) -> int | None:
    """A while loop's trip count where XLA wrote none (a TPU's compiled HLO): a loop whose
    condition is `counter < N` on a tuple element that starts at a constant c and whose body adds
    1 to it runs N - c times; None for any other loop."""
    condition = re.search(r"condition=%?([\w.\-]+)", rest)
    body = re.search(r"body=%?([\w.\-]+)", rest)
    if not (condition and body) or condition[1] not in comps or body[1] not in comps:
        return None
    _, _, opcode, compared = comps[condition[1]][-1]
    operands = _operands(compared)
    if opcode != "compare" or "direction=LT" not in compared or len(operands) != 2:
        return None
    index = re.search(r"index=(\d+)", defs.get(operands[0], ("", ""))[1])
    bound = _constant(operands[1], defs)
    init = defs.get(_operands(rest)[0], ("", ""))
    if index is None or bound is None or init[0] != "tuple":
        return None
    start = _constant(_operands(init[1])[int(index[1])], defs)
    counters = {name for name, _, op, args in comps[body[1]]
                if op == "get-tuple-element" and f"index={index[1]}" in args}
    steps = any(op == "add" and {_source(a, defs) for a in _operands(args)} & counters
                and any(_constant(a, defs) == 1 for a in _operands(args))
                for _, _, op, args in comps[body[1]])
    return bound - start if start is not None and steps else None


def _iota_groups(spec: str) -> list[tuple]:
    """`[2,4]<=[8]` or `[4,2]<=[2,4]T(1,0)`: iota over the devices, reshaped, transposed,
    reshaped to [groups, group size]."""
    match = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
    shape, dims = ([int(d) for d in g.split(",")] for g in match.groups()[:2])
    ids = np.arange(math.prod(dims)).reshape(dims)
    if match[3]:
        ids = ids.transpose([int(d) for d in match[3].split(",")])
    return [tuple(map(int, row)) for row in ids.reshape(shape[0], -1)]


def replica_groups(rest: str, devices: int) -> list[tuple]:
    """The device groups of one collective's attributes (`rest` of its line), as partition ids;
    a collective-permute's source-target pairs."""
    if pairs := re.search(r"source_target_pairs=\{(.*?)\}\}", rest):
        return [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)", pairs[1] + "}")]
    if mesh := re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(([^)]*\)?)\))?"
                         r"\s*\{([^}]*)\}", rest):
        names = re.findall(r"'(\w+)'=(\d+)", mesh[1])
        ids = (np.array(_iota_groups(f"[1,{devices}]<={mesh[2]}")[0]) if mesh[2]
               else np.arange(devices)).reshape([int(size) for _, size in names])
        along = [i for i, (name, _) in enumerate(names) if f"'{name}'" in mesh[3]]
        others = [i for i in range(len(names)) if i not in along]
        grouped = ids.transpose(others + along).reshape(-1, math.prod(
            ids.shape[i] for i in along))
        return [tuple(map(int, row)) for row in grouped]
    explicit = re.search(r"replica_groups=(\{\{[\d,{}\s]*\}\}|\{\})", rest)
    if explicit:
        groups = [tuple(int(d) for d in g.split(",") if d.strip())
                  for g in re.findall(r"\{([\d,\s]+)\}", explicit[1])]
        return groups or [tuple(range(devices))]
    iota = re.search(r"replica_groups=(\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", rest)
    return _iota_groups(iota[1]) if iota else [tuple(range(devices))]


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    bytes: int  # per device, one execution (module docstring)
    groups: tuple  # of partition ids
    times: int  # executions per call of the program


def count(text: str) -> tuple[list[Collective], int]:
    """-> (every collective of the HLO module `text` with its executions per call, while loops
    without a known trip count)."""
    comps, entry = computations(text)
    devices = int(re.search(r"num_partitions=(\d+)", text)[1]) if "num_partitions=" in text else 1
    results = {name: result for body in comps.values() for name, result, _, _ in body}
    times, unknown = call_counts(comps, entry)
    found = []
    for comp, body in comps.items():
        for _, result, opcode, rest in body:
            kind = opcode.removesuffix("-start")
            if kind not in KINDS or opcode.endswith("-done") or not times[comp]:
                continue
            operands = rest[:rest.index(")")] if ")" in rest else rest
            size = array_bytes(operands) or sum(array_bytes(results.get(name, ""))
                                                for name in re.findall(r"%([\w.\-]+)", operands))
            groups = tuple(replica_groups(rest, devices))
            if kind == "all-gather":
                size *= len(groups[0])
            found.append(Collective(kind, size, groups, times[comp]))
    return found, unknown


def axes_of(group: tuple, mesh_shape: dict) -> str:
    """The mesh axes along which the devices of `group` (partition ids) differ: 'fsdp',
    'data+expert', ...; 'none' for a group of one."""
    coords = np.array(np.unravel_index(list(group), tuple(mesh_shape.values()))).T
    varying = [name for i, name in enumerate(mesh_shape) if len(set(coords[:, i])) > 1]
    return "+".join(varying) or "none"


def sent_bytes(kind: str, size: int, n: int) -> float:
    """What one device of n puts on the links for a collective over `size` bytes (ring)."""
    if kind == "collective-permute":
        return float(size)
    return size * (n - 1) / n * (2 if kind == "all-reduce" else 1)


def tally(found: list[Collective], mesh_shape: dict, slice_of=None) -> dict:
    """Per device and call of the program: {"kind": {kind: bytes}, "axis": {axes: bytes},
    "sent": {"ici": bytes, "dcn": bytes}}. mesh_shape: {axis: size} in the mesh's order;
    slice_of: each partition's slice (None: one slice)."""
    out = {"kind": dict.fromkeys(KINDS, 0), "axis": {}, "sent": {"ici": 0.0, "dcn": 0.0}}
    for c in found:
        total = c.bytes * c.times
        out["kind"][c.kind] += total
        if c.kind == "collective-permute":
            axes = "+".join(sorted({axes_of(pair, mesh_shape) for pair in c.groups}))
            n = 2
        else:
            axes, n = axes_of(c.groups[0], mesh_shape), len(c.groups[0])
        out["axis"][axes] = out["axis"].get(axes, 0) + total
        link = ("dcn" if slice_of is not None and len({slice_of[i] for i in c.groups[0]}) > 1
                else "ici")
        out["sent"][link] += sent_bytes(c.kind, c.bytes, n) * c.times
    return out
