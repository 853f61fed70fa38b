"""training/topology.py: TPU slices by MaxText's and libtpu's names (chips, devices, hosts, the
torus), the errors for a name that is no slice, and the mesh laid out on the interconnect
(mesh_utils' ICI-aware layout, the data axis across slices) on stand-in TPU devices."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from moebalance import cli
from moebalance.config import ConfigError, load_config
from moebalance.training import sharding, topology

# (name, libtpu name, chips, devices, hosts) as the Cloud TPU pages list them (v5p: "4x4x4 | 128
# cores | 64 chips | 16 hosts", "4x4x8 | 256 | 128 | 32", "4x8x8 | 512 | 256 | 64"; v5e / v6e:
# 16 x 16 chips a pod; TPU7x: two devices a chip) and MaxText's accelerator_to_spec_map
SLICES = [
    ("v5p-8", "v5p:2x2x1", 4, 4, 1), ("v5p-128", "v5p:4x4x4", 64, 64, 16),
    ("v5p-256", "v5p:4x4x8", 128, 128, 32), ("v5p-512", "v5p:4x8x8", 256, 256, 64),
    ("v5p-1024", "v5p:8x8x8", 512, 512, 128), ("v5p-11008", "v5p:4x8x172", 5504, 5504, 1376),
    ("v4-64", "v4:2x4x4", 32, 32, 8), ("v5e-1", "v5e:1x1", 1, 1, 1),
    ("v5e-8", "v5e:2x4", 8, 8, 2), ("v5e-256", "v5e:16x16", 256, 256, 64),
    ("v5litepod-16", "v5e:4x4", 16, 16, 4), ("v6e-128", "v6e:8x16", 128, 128, 32),
    ("tpu7x-128", "tpu7x:4x4x4", 64, 128, 16), ("tpu7x-640", "tpu7x:4x4x20", 320, 640, 80),
    ("v5p:4x4x8", "v5p:4x4x8", 128, 128, 32), ("v5e:2x2", "v5e:2x2", 4, 4, 1),
]


@pytest.mark.parametrize("name, libtpu, chips, devices, hosts", SLICES)
def test_a_name_is_the_slice_cloud_tpu_lays_out(name, libtpu, chips, devices, hosts):
    slice_ = topology.parse(name)
    assert (slice_.libtpu_name, slice_.chips, slice_.devices, slice_.hosts) == (
        libtpu, chips, devices, hosts)


def test_slices_multiply_devices_and_hosts_and_the_torus_wraps_on_whole_edges():
    two = topology.parse("v5p-256", slices=2)
    assert (two.devices, two.hosts, two.accelerator_type) == (256, 64, "v5p-256")
    assert topology.parse("v5p-128").wrap == (True, True, True)  # whole 4x4x4 cubes
    assert topology.parse("v5p-64").wrap == (False, False, False)  # 2x4x4: part of a cube
    assert topology.parse("v5e-128").wrap == (False, True, False)  # 8 x 16: one whole edge
    assert topology.parse("cpu") is None


@pytest.mark.parametrize("name, problem", [
    ("v5p-96", "48 chips: no v5p slice has that many.*multiple of 64"),
    ("v5p-7", "counts TensorCores, two a chip: give an even one"),
    ("v5e-2", "2 chips: no v5e slice.*1, 4, 8"),
    ("v6e-512", "512 chips: no v6e slice"),
    ("v3-8", "unknown topology 'v3-8'.*v5p-128"),
    ("v5e:1x1x1", "unknown topology"),
    ("v5p:4x4", "unknown topology"),
])
def test_a_name_that_is_no_slice_is_refused_with_the_fix(name, problem):
    with pytest.raises(ConfigError, match=problem):
        topology.parse(name)


def test_slices_need_a_tpu_and_a_data_axis_that_crosses_them():
    with pytest.raises(ConfigError, match="--slices joins TPU slices"):
        topology.parse("cpu", slices=2)
    with pytest.raises(ConfigError, match="--slices must be >= 1"):
        topology.parse("v5p-8", slices=0)


@dataclasses.dataclass(frozen=True)
class StandIn:
    """What mesh_utils reads of a TPU device (libtpu's abstract ones need libtpu)."""
    id: int
    coords: tuple
    slice_index: int = 0
    core_on_chip: int = 0
    platform: str = "tpu"
    device_kind: str = "TPU v4"
    process_index: int = 0


def stand_ins(shape=(2, 2, 2), slices=1) -> list:
    cube = list(itertools.product(*(range(d) for d in reversed(shape))))
    return [StandIn(s * len(cube) + i, tuple(reversed(c)), s)
            for s in range(slices) for i, c in enumerate(cube)]


def test_the_mesh_lies_on_whole_physical_axes_not_the_device_order():
    """A 1 x 2 x 4 mesh of a 2x2x2 slice: each expert group of 4 devices is a whole 2x2 face of
    the cube (two physical axes), each fsdp pair one physical axis; reshaping the device list
    would make the expert groups id 0-3 and 4-7, which is also a face here, so the test reads
    the layout's axes rather than comparing with the reshape."""
    grid = topology.device_grid((1, 2, 4), stand_ins())
    for group in grid.reshape(-1, 4):
        spans = [len({d.coords[axis] for d in group}) for axis in range(3)]
        assert sorted(spans) == [1, 2, 2]
    for pair in grid.transpose(0, 2, 1).reshape(-1, 2):
        assert sum(a != b for a, b in zip(pair[0].coords, pair[1].coords)) == 1


def test_the_data_axis_crosses_slices_and_the_others_stay_within_one():
    grid = topology.device_grid((2, 2, 2), stand_ins((2, 2, 1), slices=2))
    for i in range(2):
        assert {d.slice_index for d in grid[i].flat} == {i}  # fsdp x expert within slice i
    with pytest.raises(ConfigError, match="data axis .1. crosses the 2 slices.*multiple of 2"):
        topology.device_grid((1, 4, 4), stand_ins(slices=2))


def test_the_trainers_mesh_on_cpu_devices_keeps_their_order():
    cfg = load_config("deepseek4-smoke", {"ici_fsdp_parallelism": 1})
    devices = jax.devices("cpu")[:1]
    assert list(sharding.make_mesh(cfg, devices).devices.flat) == devices
    assert np.asarray(topology.device_grid((1, 1, 1), devices)).shape == (1, 1, 1)


def test_plan_names_the_slice_it_cannot_compile_for(capsys):
    assert cli.main(["plan", "deepseek4-smoke", "--compile", "v5p-96"]) == 2
    assert "v5p-96 is 48 chips: no v5p slice has that many" in capsys.readouterr().err
    assert cli.main(["plan", "deepseek4-smoke", "--compile", "cpu", "--slices", "2"]) == 2
    assert "--slices joins TPU slices" in capsys.readouterr().err
    assert cli.main(["plan", "deepseek4-smoke", "--slices", "2"]) == 2
    assert "give --compile with a TPU slice" in capsys.readouterr().err


LIBTPU_SLICES = """
from moebalance.config import load_config
from moebalance.training import sharding, topology
devices = topology.topology_devices("v5p-16", 2)
cfg = load_config("deepseek4-smoke", {"ici_data_parallelism": -1, "ici_fsdp_parallelism": 4,
                                      "ici_expert_parallelism": 2})
mesh = sharding.make_mesh(cfg, devices)
print(len(devices), len({d.process_index for d in devices}),
      [sorted({d.slice_index for d in row.flat}) for row in mesh.devices])
"""


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu not installed (the tpu extra)")
def test_libtpus_devices_of_two_slices_quietly_with_the_data_axis_across_them():
    """Two v5p-16 slices (8 chips, 2 hosts each) from libtpu: 16 devices on 4 hosts, the mesh's
    data axis one slice a row, and nothing on stderr (libtpu's start-up warnings silenced)."""
    run = subprocess.run([sys.executable, "-c", LIBTPU_SLICES], capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, check=True)
    assert run.stdout.split(" ", 2) == ["16", "4", "[[0], [1]]\n"] and run.stderr == ""
