"""The memory and traffic planner (training/plan.py): hand-computed parts, and the parameter and
optimizer bytes of the abstract plan against a real model sharded on 8 simulated devices.

Run as a script (`python tests/test_plan.py OUT.json MESH ...`, 8 devices set by the caller) it
builds that real model for each MESH (data,fsdp,expert) and writes every device's bytes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh

from moebalance.cli import main
from moebalance.config import ConfigError, load_config
from moebalance.training import plan
from moebalance.training.sharding import AXES

MESHES = ["2,2,2"]  # every axis: replication over data, weights over fsdp, experts over expert


def smoke(mesh: str, **overrides):
    data, fsdp, expert = mesh.split(",")
    return load_config("deepseek4-smoke", {"ici_data_parallelism": int(data),
                                           "ici_fsdp_parallelism": int(fsdp),
                                           "ici_expert_parallelism": int(expert), **overrides})


def test_parameter_and_optimizer_bytes_equal_a_sharded_model_on_8_devices(tmp_path):
    out = tmp_path / "bytes.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
           + " --xla_force_host_platform_device_count=8"}
    subprocess.run([sys.executable, __file__, str(out), *MESHES], env=env, check=True)
    measured = json.loads(out.read_text())
    for mesh in MESHES:
        cfg = smoke(mesh)
        abstract = plan.abstract_mesh(cfg, 8)  # no devices: this process has one
        model = plan.abstract_model(cfg)
        expected = {"model": plan.shard_bytes(model, abstract),
                    "optimizer": plan.shard_bytes(plan.abstract_optimizer(cfg, model), abstract)}
        for kind, per_device in measured[mesh].items():
            assert per_device == [expected[kind]] * 8, (mesh, kind)
    # and each axis matters: other meshes of 8 devices hold other amounts
    model = plan.abstract_model(smoke("2,2,2"))
    held = {plan.shard_bytes(model, plan.abstract_mesh(smoke(m), 8))
            for m in ("2,2,2", "1,8,1", "1,2,4", "8,1,1")}
    assert len(held) == 4


def test_residuals_split_batch_arrays_over_the_mesh_and_weight_casts_over_fsdp():
    mesh = AbstractMesh((2, 2, 2), AXES)
    w = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    # d sin(u) = cos(u) du: the backward keeps cos(x @ w) [8, 32] (from the batch: over all 8
    # devices) and cos(w) [16, 32] (from a weight alone: over fsdp = 2); x and w are inputs
    assert plan.residual_bytes(lambda w, x: jnp.sin(x @ w).sum() + jnp.sin(w).sum(), (w, x), {1},
                               mesh) == 8 * 32 * 4 // 8 + 16 * 32 * 4 // 2
    assert plan.residual_bytes(lambda w, x: (x @ w).sum(), (w, x), {1}, mesh) == 0


def test_all_to_all_bytes_by_hand():
    cfg = smoke("1,2,4")  # D = 64 float32, K = 2, 1 row of S = 64, 4 layers, buffer factor 2
    assign = 64 * 2  # a device's token-expert assignments per layer
    slots = {"fast": 2 * assign // 4, "worst": assign}  # per destination rank
    forward = (64 * 4 + 4 + 4) + 64 * 4  # dispatch row + weight + expert id, combine row
    backward = (64 * 4 + 4) + 64 * 4
    got = plan.all_to_all_bytes(cfg, ranks=4)
    for path, s in slots.items():
        assert got[path] == {"none": 4 * s * 3 * (forward + backward),  # 3 other ranks
                             "full": 4 * s * 3 * (2 * forward + backward)}
    assert plan.all_to_all_bytes(cfg, ranks=1)["worst"]["none"] == 0


def test_cross_host_share():
    assert plan.cross_host_share(8, 64, devices_per_host=8) == 0.0  # each group inside a host
    assert plan.cross_host_share(16, 64, devices_per_host=8) == 8 / 15  # half the ranks away
    assert plan.cross_host_share(4, 8, devices_per_host=2) == 2 * 4 / 12
    assert plan.cross_host_share(1, 8, devices_per_host=1) == 0.0


def test_plan_command_json_and_the_fit(capsys):
    assert main(["plan", "deepseek4-smoke", "ici_expert_parallelism=4", "--devices", "8",
                 "--device-memory", "0.01", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["mesh"] == {"data": 1, "fsdp": 2, "expert": 4}
    total = result["total"]
    assert result["fits"] == {r: total[r] <= 0.01 * 2**30 for r in ("none", "full")}
    assert total["full"] < total["none"]  # remat keeps only the blocks' inputs
    assert result["activations"]["none"] > 2 * result["block"]
    assert result["all_to_all"]["fast"]["none"] < result["all_to_all"]["worst"]["none"]


def test_plan_defaults_to_this_machines_devices_and_their_memory(capsys, monkeypatch):
    """Without --devices the plan is for this machine's devices; without --device-memory it says
    whether the step fits the devices' own memory where JAX reports it (an accelerator's), and
    otherwise what to pass for the verdict."""
    from moebalance.cli import configs

    assert main(["plan", "deepseek4-smoke"]) == 0
    out = capsys.readouterr().out
    assert f"deepseek4-smoke on {jax.device_count()} devices" in out
    assert "whether it fits: give --device-memory GiB (JAX reports no memory for cpu devices)" \
        in out and "fits" not in out.split("whether")[0]
    monkeypatch.setattr(configs, "device_memory_gib", lambda: (0.01, "TPU v5 lite"))
    assert main(["plan", "deepseek4-smoke"]) == 0
    out = capsys.readouterr().out
    assert "fits 0.01 GiB (TPU v5 lite memory)" in out and "give --device-memory" not in out
    assert main(["plan", "deepseek4-smoke", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["fits"] == {r: result["total"][r] <= 0.01 * 2**30 for r in ("none", "full")}


def test_planning_a_config_again_reuses_its_traced_loss(monkeypatch):
    """The loss's trace (most of a plan's time) is kept per config and mesh in the process: a
    second plan of the same config traces no loss, one of another config does."""
    traced = []
    original = plan.loss_and_inputs
    monkeypatch.setattr(plan, "loss_and_inputs",
                        lambda cfg, *a: traced.append(cfg.remat_policy) or original(cfg, *a))
    cfg = load_config("deepseek4-smoke", {"max_target_length": 24})
    first = plan.plan(cfg, 1)
    assert traced == ["none", "full"]
    assert plan.plan(cfg, 1) == first and traced == ["none", "full"]
    plan.plan(load_config("deepseek4-smoke", {"max_target_length": 24, "remat_policy": "minimal"}),
              1)
    assert traced == ["none", "full", "minimal"]


def test_remat_policies_keep_less_the_more_they_recompute(capsys):
    """Activations by remat policy (the residuals the policy really saves, traced): none keeps
    everything, save_experts the weight and expert matmuls, minimal the weight matmuls only,
    full the blocks' inputs. `auto` plans every policy (each traced once); the config's own
    policy is planned beside none and full."""
    acts = plan.plan(load_config("deepseek4-smoke", {"moe_dispatch": "ragged",
                                                     "remat_policy": "auto"}), 1).activations
    assert list(acts) == ["none", "full", "save_experts", "minimal"]
    assert acts["none"] > acts["save_experts"] > acts["minimal"] > acts["full"], acts
    assert main(["plan", "deepseek4-smoke", "remat_policy=minimal", "--devices", "1",
                 "--json"]) == 0
    assert list(json.loads(capsys.readouterr().out)["activations"]) == ["none", "full", "minimal"]


def test_a_mesh_that_does_not_fit_the_devices_fails_naming_the_keys(capsys):
    with pytest.raises(ConfigError, match="do not divide the 7 devices"):
        plan.plan(smoke("1,-1,4"), 7)
    assert main(["plan", "deepseek4-smoke", "ici_data_parallelism=2", "ici_fsdp_parallelism=2",
                 "--devices", "8"]) == 2
    assert "`ici_data_parallelism` x `ici_fsdp_parallelism` x `ici_expert_parallelism` = " \
           "2 x 2 x 1 must equal the 8 devices" in capsys.readouterr().err


def measure_sharded(out: str, *meshes: str) -> None:
    """Build the trainer's model and optimizer on the 8 devices for each mesh; write each
    device's bytes of their addressable shards."""
    from flax import nnx

    from moebalance.training import sharding
    from moebalance.training.loop import build

    result = {}
    for mesh in meshes:
        cfg = smoke(mesh)
        model, optimizer = build(cfg, sharding.make_mesh(cfg))
        result[mesh] = {}
        for kind, obj in (("model", model), ("optimizer", optimizer)):
            per_device = dict.fromkeys(jax.devices(), 0)
            for array in jax.tree.leaves(nnx.state(obj)):
                for shard in array.addressable_shards:
                    per_device[shard.device] += shard.data.nbytes
            result[mesh][kind] = list(per_device.values())
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    measure_sharded(*sys.argv[1:])
