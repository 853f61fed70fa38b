"""training/collectives.py: the collectives of a compiled program read from its HLO text, on a
committed fixture whose bytes and trip counts are counted by hand, and on a real compile for 8
simulated CPU devices against what its shapes imply."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from moebalance.training import collectives

FIXTURE = Path(__file__).parent / "fixtures" / "hlo" / "collectives.hlo"
MESH = {"data": 2, "fsdp": 2, "expert": 2}


def test_the_fixtures_collectives_by_hand():
    """tests/fixtures/hlo/collectives.hlo on 8 partitions (data x fsdp x expert = 2 x 2 x 2):
    an async all-to-all of bf16[8,128] (2,048 bytes) in a loop of 3 inside a loop of 4: 12 times;
    an all-gather-start/done pair gathering f32[16] over 2 devices (128 bytes) in the outer loop:
    4 times, once per pair; a reduce-scatter of f32[8,8] (256) and a collective-permute of
    bf16[4,4] (32) once; an all-reduce of f32[10] (40) in each branch of a conditional (both
    counted); an all-reduce of f32[4] (16) in a loop XLA gave no trip count whose counter runs
    from 1 while below 5 (4 times: counted from the loop, as on a TPU); an all-reduce-start of
    f32[2] (8) in a loop of no such form (once, reported)."""
    found, unknown = collectives.count(FIXTURE.read_text())
    assert unknown == 1
    assert sorted((c.kind, c.bytes, c.times) for c in found) == sorted([
        ("all-to-all", 2048, 12), ("all-gather", 128, 4), ("reduce-scatter", 256, 1),
        ("collective-permute", 32, 1), ("all-reduce", 40, 1), ("all-reduce", 40, 1),
        ("all-reduce", 8, 1), ("all-reduce", 16, 4)])
    # partitions are mesh positions in order: 0-3 data 0, 4-7 data 1; within, fsdp then expert
    groups = {c.kind: c.groups for c in found}
    assert groups["all-gather"] == ((0, 2), (1, 3), (4, 6), (5, 7))  # iota [2,2,2]T(0,2,1)
    assert groups["reduce-scatter"] == ((0, 4), (1, 5), (2, 6), (3, 7))  # mesh form {'data'}
    slice_of = [i // 4 for i in range(8)]  # two slices, one per data index
    assert collectives.tally(found, MESH, slice_of) == {
        "kind": {"all-to-all": 12 * 2048, "all-gather": 4 * 128, "reduce-scatter": 256,
                 "all-reduce": 40 + 40 + 8 + 4 * 16, "collective-permute": 32},
        "axis": {"expert": 12 * 2048 + 32 + 4 * 16, "fsdp": 4 * 128, "data": 256,
                 "data+fsdp+expert": 40, "fsdp+expert": 40 + 8},
        # ring: (n-1)/n of the bytes, twice for an all-reduce, all of a permute's; the
        # reduce-scatter over data and the all-reduce over all 8 cross the slices
        "sent": {"ici": 12 * 2048 / 2 + 4 * 128 / 2 + 2 * 40 * 3 / 4 + 2 * 8 * 3 / 4 + 32
                 + 4 * 2 * 16 / 2,
                 "dcn": 256 / 2 + 2 * 40 * 7 / 8}}


def test_array_bytes_and_groups_of_each_form():
    assert collectives.array_bytes("(bf16[2,3]{1,0}, s32[], pred[4])") == 12 + 4 + 4
    assert collectives.replica_groups("replica_groups=[2,4]<=[8], to_apply=%a", 8) == [
        (0, 1, 2, 3), (4, 5, 6, 7)]
    assert collectives.replica_groups("replica_groups=[4,2]<=[2,4]T(1,0)", 8) == [
        (0, 4), (1, 5), (2, 6), (3, 7)]
    # XLA's mesh form over a permuted device order: devices [0,4,1,5,2,6,3,7] on a 4 x 1 x 2 mesh
    assert collectives.replica_groups(
        "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) "
        "{'axis_0'}, dimensions={0}", 8) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert collectives.replica_groups("replica_groups={}", 4) == [(0, 1, 2, 3)]


LOOP = 3  # the scan's length in the compiled program below
ROWS, WIDTH = 4, 16  # one device's block, float32


def _compiled_collectives(out: str) -> None:
    """On 8 CPU devices: a scan of LOOP steps whose body runs, in a shard_map over the trainer's
    (data, fsdp, expert) mesh, an all-to-all over expert, a psum over fsdp and an all-gather over
    data of a [ROWS, WIDTH] float32 block; the counter's tally of its HLO to `out`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from moebalance.config import load_config
    from moebalance.training import sharding

    cfg = load_config("deepseek4-smoke", {"ici_data_parallelism": 2, "ici_fsdp_parallelism": 2,
                                          "ici_expert_parallelism": 2})
    mesh = sharding.make_mesh(cfg, jax.devices())

    def block(x):  # [ROWS, WIDTH] on each device
        def step(carry, _):
            y = jax.lax.all_to_all(carry, "expert", 0, 0, tiled=True)
            y = jax.lax.psum(y * 1.5, "fsdp")
            z = jax.lax.all_gather(y, "data", axis=0, tiled=True)  # [2 ROWS, WIDTH]
            return z[:ROWS] * z[ROWS:], None
        return jax.lax.scan(step, x, None, length=LOOP)[0]

    spec = P(sharding.AXES)
    program = jax.jit(jax.shard_map(block, mesh=mesh, in_specs=spec, out_specs=spec,
                                   check_vma=False))
    x = jax.ShapeDtypeStruct((8 * ROWS, WIDTH), jnp.float32)
    found, unknown = collectives.count(program.lower(x).compile().as_text())
    Path(out).write_text(json.dumps({"unknown": unknown, **collectives.tally(found, MESH)}))


def test_a_real_compile_on_8_devices_counts_what_its_shapes_imply(tmp_path):
    out = tmp_path / "tally.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
           + " --xla_force_host_platform_device_count=8"}
    subprocess.run([sys.executable, __file__, str(out)], env=env, check=True)
    tally = json.loads(out.read_text())
    block = ROWS * WIDTH * 4
    assert tally["unknown"] == 0
    assert tally["kind"] == {"all-to-all": LOOP * block, "all-reduce": LOOP * block,
                             "all-gather": LOOP * 2 * block, "reduce-scatter": 0,
                             "collective-permute": 0}
    assert tally["axis"] == {"expert": LOOP * block, "fsdp": LOOP * block,
                             "data": LOOP * 2 * block}


EXPERT_PARALLEL = {"ici_fsdp_parallelism": 2, "ici_expert_parallelism": 2,
                   "remat_policy": "none"}


def _trainers_step(out: str) -> None:
    """deepseek4-smoke's training step on 4 CPU devices (fsdp 2 x expert 2), compiled as
    `plan --compile` compiles it; the counter's tally of its HLO to `out`."""
    import jax

    from moebalance.config import load_config
    from moebalance.training import compiled

    cfg = load_config("deepseek4-smoke", EXPERT_PARALLEL)
    _, _, step = compiled.compiled_memory(cfg, jax.devices())
    found, unknown = collectives.count(step.as_text())
    tally = collectives.tally(found, {"data": 1, "fsdp": 2, "expert": 2})
    Path(out).write_text(json.dumps({"unknown": unknown, **tally}))


def test_the_trainers_all_to_all_is_the_planners(tmp_path):
    """The expert all-to-all bytes a device sends per step, counted in the compiled trainer's
    step, equal the planner's formula (plan.all_to_all_bytes: rows x slots x ranks per exchange,
    forward and backward), which reads no HLO. On the v5p-8 compile of the same config
    (2026-12-07, libtpu) the counter gave the same 530,432 bytes."""
    from moebalance.config import load_config
    from moebalance.training import plan

    out = tmp_path / "tally.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
           + " --xla_force_host_platform_device_count=4"}
    subprocess.run([sys.executable, __file__, str(out), "step"], env=env, check=True)
    tally = json.loads(out.read_text())
    cfg = load_config("deepseek4-smoke", EXPERT_PARALLEL)
    planned = plan.all_to_all_bytes(cfg, 2)["fast"]["none"]
    assert tally["unknown"] == 0
    assert tally["kind"]["all-to-all"] / 2 == planned  # 2 ranks: half of each buffer leaves


if __name__ == "__main__":
    (_trainers_step if sys.argv[2:] == ["step"] else _compiled_collectives)(sys.argv[1])
