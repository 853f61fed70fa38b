"""TPU slices by the names users know, their abstract devices for an ahead-of-time compile
(`moebalance plan --compile`), and the device mesh laid out on their interconnect.

Names (`parse`):
    MaxText's / Cloud TPU's   `v5p-128`, `v4-64`, `tpu7x-256`: the number counts TensorCores, two a
                              chip (v5p-128 is 64 chips; on v4 and v5p JAX sees a chip's two cores
                              as one device, "megacore"; on TPU7x as two devices);
                              `v5e-256` (also `v5litepod-256`), `v6e-256`: the number counts chips,
                              one core each
    libtpu's                  `v5p:4x4x8`, `v5e:16x16`: the chips along each axis of the slice
    `cpu`                     this machine's CPU (one device)
A name's chips lie as Cloud TPU lays out a slice of that many: a 2D torus for v5e and v6e (1x1,
2x2, 2x4, 4x4, ... 16x16, the pod), a 3D one for v4, v5p and TPU7x (2x2x1, 2x2x2, 2x2x4, 2x4x4,
then whole 4x4x4 cubes, the most cubic arrangement: 4x4x8, 4x8x8, 8x8x8, ...); a host holds 2x2
chips (one for a one-chip slice); an axis wraps around (a torus) where it spans a whole pod edge
(16 on v5e/v6e) or, in 3D, where every axis is whole cubes. These are the conventions of MaxText's
`accelerator_to_spec_map.py` (its `train_compile`'s table of names) and of the Cloud TPU pages
(docs.cloud.google.com/tpu/docs/v5p: "4x4x8 | 256 cores | 128 chips | 32 hosts"; .../v5e and
.../v6e: 2D torus, 256 chips a pod; .../tpu7x: two TensorCores a chip).

`--slices N` joins N such slices over the data-center network (DCN, multi-slice): the devices
come from libtpu with a slice index each, and `device_grid` puts the mesh's `data` axis across
the slices (`mesh_utils.create_hybrid_device_mesh`), every other axis within one slice's ICI.

`GENERATIONS` holds each generation's published figures (the Cloud TPU pages above, read
2026-12-07), for the roofline (training/roofline.py): peak bfloat16 FLOP/s per chip, the
bidirectional ICI bandwidth per chip and the DCN bandwidth per chip (v5e: its pod's 6.4 Tb/s over
256 chips, the 2 x 100 Gb/s NICs of a host of 8 chips).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import numpy as np

from moebalance.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Generation:
    libtpu: str  # the generation's name in libtpu's topology names
    axes: int  # 2 or 3: the torus
    cores_in_name: bool  # whether MaxText's `-N` counts TensorCores (two a chip), else chips
    devices_per_chip: int  # JAX devices a chip is
    chip_config: str  # libtpu's: megacore joins a chip's two cores into one device
    peak_flops: float | None  # bfloat16 FLOP/s per chip
    ici_bytes_s: float | None  # bidirectional ICI bytes/s per chip
    dcn_bytes_s: float | None  # DCN bytes/s per chip


GENERATIONS = {
    "v4": Generation("v4", 3, True, 1, "megacore", None, None, None),
    "v5p": Generation("v5p", 3, True, 1, "megacore", 459e12, 1200e9, 50e9 / 8),
    "v5e": Generation("v5e", 2, False, 1, "default", 197e12, 400e9, 25e9 / 8),
    "v6e": Generation("v6e", 2, False, 1, "default", 918e12, 800e9, 100e9 / 8),
    "tpu7x": Generation("tpu7x", 3, True, 2, "default", 2307e12, 1200e9, 100e9 / 8),
}
ALIASES = {"v5litepod": "v5e", "v5": "v5p"}
POD_EDGE_2D = 16  # a v5e / v6e pod is 16 x 16 chips
SMALL_3D = {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4)}
EXAMPLES = "v5p-128, v5e-256, v6e-256, tpu7x-128, v5p:4x4x8, v5e:1x1 or cpu"


@dataclasses.dataclass(frozen=True)
class Topology:
    """A slice (or `slices` of them) of one TPU generation."""

    name: str  # as the user gave it
    generation: str  # a key of GENERATIONS
    shape: tuple  # chips along each axis of one slice
    slices: int = 1

    @property
    def spec(self) -> Generation:
        return GENERATIONS[self.generation]

    @property
    def chips(self) -> int:  # of one slice
        return math.prod(self.shape)

    @property
    def devices(self) -> int:  # of all slices
        return self.chips * self.spec.devices_per_chip * self.slices

    @property
    def host_bounds(self) -> tuple:
        """Chips a host holds along each axis (libtpu's chips_per_host_bounds)."""
        return (*(min(d, 2) for d in self.shape[:2]), 1)

    @property
    def hosts(self) -> int:  # of all slices
        return self.chips // math.prod(self.host_bounds) * self.slices

    @property
    def libtpu_name(self) -> str:
        return f"{self.spec.libtpu}:{'x'.join(map(str, self.shape))}"

    @property
    def accelerator_type(self) -> str:
        """MaxText's / Cloud TPU's name of one slice (what TPU_ACCELERATOR_TYPE holds on a VM)."""
        cores = 2 if self.spec.cores_in_name else 1
        return f"{self.generation}-{self.chips * cores}"

    @property
    def wrap(self) -> tuple:
        """Whether each axis is a ring (wraps around) or a line."""
        if self.spec.axes == 2:
            return (*(d == POD_EDGE_2D for d in self.shape), False)
        whole_cubes = all(d % 4 == 0 for d in self.shape)
        return (whole_cubes,) * 3

    def describe(self) -> str:
        """'v5p-256: v5p:4x4x8, 128 chips, 128 devices, 32 hosts' (+ ' x 2 slices over DCN')."""
        def counted(n: int, what: str) -> str:
            return f"{n} {what}{'s' if n != 1 else ''}"

        many = f" each, x {self.slices} slices over DCN" if self.slices > 1 else ""
        return (f"{self.accelerator_type}: {self.libtpu_name}, {counted(self.chips, 'chip')}, "
                f"{counted(self.chips * self.spec.devices_per_chip, 'device')}, "
                f"{counted(self.hosts // self.slices, 'host')}{many}")


def slice_shape(generation: str, chips: int, name: str) -> tuple:
    """The chips of a `chips`-chip slice of `generation` along each axis (module docstring)."""
    spec = GENERATIONS[generation]
    if spec.axes == 2:
        log2 = chips.bit_length() - 1
        if chips < 1 or chips != 2**log2 or chips == 2 or chips > POD_EDGE_2D**2:
            raise ConfigError(f"{name} is {chips} chips: no {generation} slice has that many; "
                              f"slices have 1, 4, 8, 16, 32, 64, 128 or 256 chips "
                              f"({generation}-1 ... {generation}-256)")
        return (2 ** (log2 // 2), 2 ** (log2 - log2 // 2))
    if chips in SMALL_3D:
        return SMALL_3D[chips]
    if chips % 64:
        cores = 2 if spec.cores_in_name else 1
        raise ConfigError(f"{name} is {chips} chips: no {generation} slice has that many; slices "
                          f"have 4, 8, 16, 32 or a multiple of 64 chips ({generation}-"
                          f"{4 * cores}, -{8 * cores}, -{16 * cores}, -{32 * cores}, "
                          f"-{64 * cores}, -{128 * cores}, ...)")
    cubes = chips // 64
    triples = [(a, b, cubes // (a * b)) for a in range(1, cubes + 1) for b in range(a, cubes + 1)
               if cubes % (a * b) == 0 and cubes // (a * b) >= b]
    most_cubic = min(triples, key=lambda t: (t[2], -t[0]))  # the shortest longest axis
    return tuple(4 * d for d in most_cubic)


def parse(name: str, slices: int = 1) -> Topology | None:
    """The topology a name gives (module docstring); None for `cpu`."""
    if slices < 1:
        raise ConfigError(f"--slices must be >= 1, got {slices}")
    if name == "cpu":
        if slices > 1:
            raise ConfigError("--slices joins TPU slices: give a TPU topology (e.g. v5p-128)")
        return None
    unknown = ConfigError(f"unknown topology {name!r}: give a TPU slice such as {EXAMPLES}")
    if match := re.fullmatch(r"([a-z0-9]+)-(\d+)", name):
        generation = ALIASES.get(match[1], match[1])
        if generation not in GENERATIONS:
            raise unknown
        number, spec = int(match[2]), GENERATIONS[generation]
        if spec.cores_in_name and number % 2:
            raise ConfigError(f"{name}: the number of a {generation} slice counts TensorCores, "
                              f"two a chip: give an even one ({generation}-{number + 1}?)")
        chips = number // 2 if spec.cores_in_name else number
        return Topology(name, generation, slice_shape(generation, chips, name), slices)
    if match := re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)*)", name):
        generation = ALIASES.get(match[1], match[1])
        shape = tuple(int(d) for d in match[2].split("x"))
        if generation not in GENERATIONS or len(shape) != GENERATIONS[generation].axes:
            raise unknown
        if min(shape) < 1:
            raise ConfigError(f"{name}: every axis needs at least one chip")
        return Topology(name, generation, shape, slices)
    raise unknown


def quiet_libtpu(topology: Topology) -> None:
    """Tell libtpu, before it starts, what a TPU VM's metadata would: without these it prints a
    screen of warnings for a compile that needs no chip (checked 2026-12-07, libtpu 0.0.42.1:
    TPU_ACCELERATOR_TYPE and TPU_WORKER_HOSTNAMES silence them; TPU_SKIP_MDS_QUERY skips asking
    a metadata server there is none of; ALLOW_MULTIPLE_LIBTPU_LOAD lets it start beside another
    process holding /tmp/libtpu_lockfile, which only a process using a chip needs). A value the
    user set is kept."""
    for key, value in (("TPU_ACCELERATOR_TYPE", topology.accelerator_type),
                       ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_SKIP_MDS_QUERY", "1"),
                       ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
        os.environ.setdefault(key, value)


def topology_devices(name: str, slices: int = 1) -> list:
    """The devices to compile for: a TPU topology's abstract devices (libtpu's compiler, no chip
    needed), every host's and slice's, or this machine's first CPU device for `cpu`."""
    import jax

    topology = parse(name, slices)
    if topology is None:
        return jax.devices("cpu")[:1]
    quiet_libtpu(topology)
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(
            platform="tpu", topology_name=topology.libtpu_name,
            chip_config_name=topology.spec.chip_config, chips_per_host_bounds=topology.host_bounds,
            num_slices=slices, wrap=topology.wrap).devices
    except RuntimeError as error:
        raise ConfigError(f"cannot compile for {name} ({topology.libtpu_name}): {error}. Install "
                          "libtpu (pip install \"moebalance[tpu]\"; no chip is needed) or give "
                          "--compile cpu") from error


def device_grid(shape: tuple, devices: list) -> np.ndarray:
    """`devices` as an array of `shape` (data, fsdp, expert) laid out on their interconnect:
    `mesh_utils.create_device_mesh` (on a TPU, each mesh axis on whole physical axes where it can,
    else split across them; elsewhere the devices in order), and on devices of several slices
    `create_hybrid_device_mesh`, the data axis across the slices."""
    from jax.experimental import mesh_utils

    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if slices > 1:
        if shape[0] % slices:
            raise ConfigError(f"the mesh's data axis ({shape[0]}) crosses the {slices} slices: "
                              f"make `ici_data_parallelism` a multiple of {slices} (or -1)")
        within = (shape[0] // slices, *shape[1:])

        def lay_out(**split):
            return mesh_utils.create_hybrid_device_mesh(within, (slices, 1, 1), devices, **split)
    else:
        def lay_out(**split):
            return mesh_utils.create_device_mesh(shape, devices, **split)
    try:
        return lay_out()
    except (ValueError, NotImplementedError):  # an axis no product of whole physical axes makes
        return lay_out(allow_split_physical_axes=True)
