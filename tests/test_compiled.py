"""training/compiled.py (`moebalance plan --compile`): XLA's memory of the trainer's step compiled
ahead of time, its arithmetic, the compiler's refusal, the topology names, and the compiled
arguments against the planner's independent count of the state; kernels.platform, by which a
step compiled for a TPU topology makes the chip's choices."""

from __future__ import annotations

import dataclasses
import json
import logging
import types

import jax
import numpy as np
import pytest

from moebalance import cli, kernels
from moebalance.config import ConfigError, load_config
from moebalance.training import compiled, plan, topology
from moebalance.training.objective import switches

GIB = 2**30


def test_needed_is_what_the_device_holds_at_once():
    stats = types.SimpleNamespace(argument_size_in_bytes=8 * GIB, output_size_in_bytes=8 * GIB,
                                  alias_size_in_bytes=6 * GIB, temp_size_in_bytes=3 * GIB,
                                  generated_code_size_in_bytes=GIB // 4,
                                  peak_memory_in_bytes=int(13.5 * GIB))
    assert compiled.memory_bytes(stats) == {
        "argument": 8 * GIB, "output": 8 * GIB, "alias": 6 * GIB, "temp": 3 * GIB,
        "generated_code": GIB // 4, "needed": 13 * GIB, "peak": int(13.5 * GIB)}


def test_a_step_the_chip_cannot_hold_is_read_from_the_compilers_refusal():
    message = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
               "temporaries (49.45G) exceeds available HBM (15.75G).\nmore detail")
    assert compiled.refusal(message) == {"temp": round(49.45 * GIB),
                                         "refused": message.splitlines()[0]}
    assert compiled.refusal("INTERNAL: Mosaic failed to compile TPU kernel") is None
    assert compiled.refusal("RESOURCE_EXHAUSTED: host memory") is None


@pytest.mark.parametrize("name", ["v5e", "tpu:1x1", "v5e:1", "v5e:1x1x1x1", "cpu:1"])
def test_a_topology_that_is_not_one_is_refused_with_the_fix(name):
    with pytest.raises(ConfigError, match="unknown topology.*v5e:1x1"):
        topology.topology_devices(name)


def test_the_platform_is_the_meshs_not_the_default_backends(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert kernels.platform() == "tpu"  # no mesh: the backend
    with jax.set_mesh(jax.make_mesh((1,), ("data",), devices=jax.devices("cpu")[:1])):
        assert kernels.platform() == "cpu"
        assert kernels.resolve("auto") == "xla"


SMOKE = ["base_num_decoder_layers=2", "compress_ratios=[0,4]", "first_num_hash_layers=1",
         "max_target_length=32", "per_device_batch_size=2", "gradient_accumulation_steps=2"]


def test_the_compiled_arguments_are_the_planned_state_and_the_batch():
    """XLA's argument bytes = the planner's parameters + optimizer (counted from the abstract
    model, not from the compiled program) + the batch + those of the step's switch scalars the
    program reads (jit drops unused arguments: the smoke config computes no balance loss)."""
    cfg = load_config("deepseek4-smoke", SMOKE)
    memory, seconds, step = compiled.compiled_memory(cfg, topology.topology_devices("cpu"))
    planned = plan.plan(cfg, 1)
    batch = 2 * 2 * (33 * 4 + 32 * 1 + 32 * 4)  # tokens int32, mask bool, segment ids int32
    scalars = sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
                  for x in jax.tree.leaves(jax.eval_shape(lambda: switches(cfg))))
    state = planned.parameters + planned.optimizer
    assert 0 <= memory["argument"] - (state + batch) <= scalars
    assert memory["needed"] == (memory["argument"] + memory["output"] - memory["alias"]
                                + memory["temp"])
    # the step donates the model and optimizer: each new array is written into the old one's
    # buffer (the optimizer's step count, 4 bytes, may be a fresh scalar)
    assert state - 4 <= memory["alias"] <= state
    assert seconds > 0 and step is not None


def test_plan_compile_prints_xlas_account_beside_the_plan(capsys):
    assert cli.main(["plan", "deepseek4-smoke", *SMOKE, "--devices", "1", "--compile", "cpu",
                     "--device-memory", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["compiled"]["topology"] == "cpu" and out["compiled"]["memory"]["needed"] > 0
    assert cli.main(["plan", "deepseek4-smoke", *SMOKE, "--devices", "1", "--compile", "cpu",
                     "--device-memory", "1"]) == 0
    text = capsys.readouterr().out
    assert "XLA, the step compiled for cpu" in text and "fits 1 GiB by XLA's account: yes" in text
    assert cli.main(["plan", "deepseek4-smoke", "--devices", "2", "--compile", "cpu"]) == 2
    assert "--compile cpu has 1 devices, --devices says 2: give --devices 1" in (
        capsys.readouterr().err)


def test_plan_compile_compiles_the_chain_of_programs_the_trainer_runs(capsys):
    """step_programs=segments: the trainer runs a chain of programs per segment, and so does what
    plan --compile compiles: as many distinct programs, called as often, as the trainer's own
    lowering of its step (ahead.lower, each program passed on as it is lowered) gives; the
    step's need at least what every call holds throughout (model, optimizer, batch, the
    switches: the planner's count) and what its program adds."""
    import hashlib

    from moebalance.training.ahead import lower
    from moebalance.training.step import make_train_step

    cfg = load_config("deepseek4-smoke", [*SMOKE, "step_programs=segments"])
    assert cli.main(["plan", "deepseek4-smoke", *SMOKE, "step_programs=segments", "--devices",
                     "1", "--compile", "cpu", "--device-memory", "1", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["compiled"]["memory"]
    model = plan.abstract_model(cfg)
    optimizer = plan.abstract_optimizer(cfg, model)
    batch = [jax.ShapeDtypeStruct((2, 2, 32 + extra), dtype)
             for extra, dtype in ((1, np.int32), (0, np.bool_), (0, np.int32))]
    lowered = []
    lower(make_train_step(cfg, model), lowered.append, model, optimizer, *batch)
    distinct = {hashlib.sha256(x.as_text().encode()).hexdigest() for x in lowered}
    programs = memory["programs"]
    assert len(programs) == len(distinct) > 2 and sum(p["calls"] for p in programs) == len(lowered)
    planned = plan.plan(cfg, 1)
    scalars = sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
                  for x in jax.tree.leaves(jax.eval_shape(lambda: switches(cfg))))
    tokens = 2 * 2 * (33 * 4 + 32 * 1 + 32 * 4)
    assert memory["held"] == planned.parameters + planned.optimizer + tokens + scalars
    adds = max(p["memory"]["needed"] - p["memory"]["argument"] for p in programs)
    assert memory["needed"] >= max(memory["held"] + adds,
                                   *(p["memory"]["needed"] for p in programs))
    assert memory["at"] in {p["name"] for p in programs}
    assert cli.main(["plan", "deepseek4-smoke", *SMOKE, "step_programs=segments", "--devices",
                     "1", "--compile", "cpu"]) == 0
    assert (f"compiled for cpu (cpu, remat none) as a chain of {len(distinct)} programs, as the "
            "trainer runs it there") in capsys.readouterr().out
    # the one program where the trainer runs one (cpu's auto)
    assert cli.main(["plan", "deepseek4-smoke", *SMOKE, "--devices", "1", "--compile", "cpu",
                     "--json"]) == 0
    assert "programs" not in json.loads(capsys.readouterr().out)["compiled"]["memory"]


def test_a_chains_need_is_what_is_live_at_its_fullest_call():
    """By hand: W and X held (1000 and 400 bytes); f(W, X) -> R, Y; g(W, Y) -> Z; h(R, Z) -> G.
    At h, W and X are still held and R (f's, read by h) lives on while Y (read last by g) is
    gone: 1,400 beside h's own 1,940 bytes; at f nothing beside it, at g X and R."""
    def array(nbytes):
        return jax.ShapeDtypeStruct((nbytes // 4,), np.float32)

    w, x, r, y, z, g = map(array, (1000, 400, 800, 40, 40, 1000))
    account = compiled._ChainAccount(None, None)
    for name, argument, output, temp in (("f", 1400, 840, 60), ("g", 1040, 40, 0),
                                         ("h", 840, 1000, 100)):
        account.programs[name] = {"name": f"{name} 1", "calls": 1, "compile_s": 0.0,
                                  "shardings": None,
                                  "memory": {"argument": argument, "temp": temp,
                                             "needed": argument + output + temp}}
    account.calls = [("f", [w, x], [r, y]), ("g", [w, y], [z]), ("h", [r, z], [g])]
    memory = account.memory([w, x])
    assert (memory["needed"], memory["at"], memory["held"]) == (1400 + 1940, "h 1", 1400)
    # a program whose arguments XLA counts larger (a TPU's tiles) is taken at its own count:
    # g's 3,000 + 40, beside X and R
    account.programs["g"]["memory"].update(argument=3000, needed=3040)
    assert (account.memory([w, x])["needed"], account.memory([w, x])["at"]) == (4240, "g 1")
    assert [p["name"] for p in memory["programs"]] == ["f 1", "g 1", "h 1"]


def fake_compiles(monkeypatch, needs: dict):
    """compiled_memory replaced: `needs` {policy: GiB needed, or None: the compiler refuses};
    -> the policies compiled, in order."""
    compiled_for = []

    def compiled_memory(cfg, devices):
        compiled_for.append(cfg.remat_policy)
        gib = needs[cfg.remat_policy]
        stats = ({"temp": 20 * GIB, "refused": "RESOURCE_EXHAUSTED"} if gib is None
                 else {"needed": int(gib * GIB), "temp": int(gib * GIB) // 2})
        return stats, 1.0, None

    monkeypatch.setattr(compiled, "compiled_memory", compiled_memory)
    return compiled_for


def test_auto_takes_the_least_recompute_that_fits_in_that_order(monkeypatch, caplog):
    cfg = load_config("deepseek4-smoke", ["remat_policy=auto"])
    compiled_for = fake_compiles(monkeypatch, {"none": None, "save_experts": 12.0,
                                               "minimal": 9.0, "full": 6.0})
    with caplog.at_level(logging.INFO, logger="moebalance"):
        policy, tried = compiled.least_recompute_that_fits(cfg, [], 10 * GIB)
    # each compile announced before it starts, its outcome after
    assert caplog.messages[:3] == ["remat_policy auto: compiling the step under remat none",
                                   "remat_policy auto: none refused (temporaries 20.00 GiB)",
                                   "remat_policy auto: compiling the step under remat "
                                   "save_experts"]
    assert policy == "minimal" and compiled_for == ["none", "save_experts", "minimal"]
    assert [t["remat"] for t in tried] == compiled_for and tried[-1]["memory"]["needed"] == 9 * GIB
    assert compiled.tried_summary(tried) == ("none refused (temporaries 20.00 GiB), "
                                             "save_experts 12.00 GiB, minimal 9.00 GiB")
    compiled_for.clear()
    assert compiled.least_recompute_that_fits(cfg, [], 12 * GIB)[0] == "save_experts"
    compiled_for.clear()
    assert compiled.least_recompute_that_fits(cfg, [], None) == ("none", [])  # a CPU: no limit
    assert compiled_for == []
    with pytest.raises(ConfigError, match=r"no policy's step fits 5.00 GiB.*full 6.00 GiB\): "
                                          "spread it over more devices"):
        compiled.least_recompute_that_fits(cfg, [], 5 * GIB)


def test_auto_is_chosen_once_for_runs_that_share_a_program(monkeypatch):
    """The A/B's two runs (and a study's arms) differ in their balancing switches only: one
    choice, compiled once; another shape is chosen anew; a given policy is left alone."""
    compiled_for = fake_compiles(monkeypatch, {"none": None, "save_experts": 3.0,
                                               "minimal": 2.0, "full": 1.0})
    device = types.SimpleNamespace(id=7, memory_stats=lambda: {"bytes_limit": 4 * GIB})
    mesh = types.SimpleNamespace(devices=np.array([device]))
    monkeypatch.setattr(compiled, "_CHOSEN", {})
    run_b = load_config("deepseek4-smoke", ["remat_policy=auto", "steps=3"])
    run_a = load_config("deepseek4-smoke", ["remat_policy=auto", "steps=5", "routed_bias=false"])
    assert compiled.resolve_remat(run_b, mesh).remat_policy == "save_experts"
    assert compiled.resolve_remat(run_a, mesh) == dataclasses.replace(run_a,
                                                                      remat_policy="save_experts")
    assert compiled_for == ["none", "save_experts"]
    larger = load_config("deepseek4-smoke", ["remat_policy=auto", "per_device_batch_size=8"])
    assert compiled.resolve_remat(larger, mesh).remat_policy == "save_experts"
    assert compiled_for == ["none", "save_experts"] * 2
    given = load_config("deepseek4-smoke", ["remat_policy=full"])
    assert compiled.resolve_remat(given, mesh) is given and compiled.resolve_remat(None, mesh) is None


def test_a_model_is_not_built_with_auto_and_the_plan_shows_every_policy():
    from flax import nnx

    from moebalance.model.transformer import DeepSeekV4

    cfg = load_config("deepseek4-smoke", ["remat_policy=auto"])
    with pytest.raises(ConfigError, match="remat_policy auto is chosen per run"):
        DeepSeekV4(cfg, rngs=nnx.Rngs(0))
    assert list(plan.plan(cfg, 1).activations) == ["none", "full", "save_experts", "minimal"]
