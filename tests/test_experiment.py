import json
import types

import numpy as np
import pytest

from conftest import run_cli
from moebalance import cli
from moebalance.config import ConfigError, load_config
from moebalance.experiment import ab, without_balancing
from moebalance.metrics import load_stats, sampling_floor
from moebalance.model.transformer import DeepSeekV4
from moebalance.rundir import RunDirError

AB = dict(steps=4, max_target_length=64, per_device_batch_size=8, routed_bias_update_rule="quantile",
          routed_bias_update_rate=0.5, load_balance_loss_weight=1e-3, checkpoint_period=2)
ROW_KEYS = {"layer", "routing", "var_step0", "var_a", "var_b", "improvement", "floor", "maxvio_a",
            "maxvio_b"}


def test_run_a_has_every_balancing_mechanism_off():
    cfg = load_config("deepseek4-smoke", {**AB, "global_balance_loss_weight": 1e-2,
                                          "router_z_loss_weight": 1e-3})
    a = without_balancing(cfg)
    assert (a.routed_bias, a.routed_bias_update_rate, a.load_balance_loss_weight,
            a.global_balance_loss_weight) == (False, 0.0, 0.0, 0.0)
    assert a.router_z_loss_weight == cfg.router_z_loss_weight and a.seed == cfg.seed


def test_the_runs_of_one_program_start_from_one_draw(monkeypatch):
    """loop.shared_draws (the A/B's): Run B's build copies Run A's initial weights instead of
    drawing them again (the model is constructed once), bit for bit a draw of its own, and apart
    from Run A's model; outside the block each build draws."""
    import jax
    from flax import nnx

    from moebalance.training import loop, sharding

    drawn = []
    monkeypatch.setattr(loop, "DeepSeekV4", lambda *a, **k: drawn.append(1) or DeepSeekV4(*a, **k))
    cfg = load_config("deepseek4-smoke", {**OVERRIDES, "dataset_type": "synthetic"})
    mesh = sharding.make_mesh(cfg)

    def weights(model):
        return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))

    with loop.shared_draws():
        run_a, _ = loop.build(without_balancing(cfg), mesh, program=cfg)
        first = weights(run_a)
        run_a.embed[...] = run_a.embed[...] + 1  # Run A trains
        run_b, _ = loop.build(cfg, mesh, program=cfg)
    assert len(drawn) == 1
    alone, _ = loop.build(cfg, mesh, program=cfg)
    assert len(drawn) == 2
    jax.tree.map(np.testing.assert_array_equal, weights(run_b), first)
    jax.tree.map(np.testing.assert_array_equal, weights(alone), first)


# cli.main with the cache on, counting XLA compilations (by function) and persistent-cache hits
COUNT_COMPILES = """
import collections, json, sys
from jax import monitoring
from moebalance import cli

compiles, hits = collections.Counter(), []
monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: event == "/jax/core/compile/backend_compile_duration"
    and compiles.update([kw["fun_name"]]))
monitoring.register_event_listener(
    lambda event, **kw: event == "/jax/compilation_cache/cache_hits" and hits.append(event))
assert cli.main(sys.argv[1:], compile_cache=True) == 0
print(json.dumps({"compiles": compiles, "hits": len(hits)}))
"""
OVERRIDES = {**AB, "hash_table": "balanced"}
COMMAND = ["ab", "deepseek4-smoke", *(f"{key}={value}" for key, value in OVERRIDES.items())]
KEEP_ALL = dict(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")  # every program into the cache


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    """One A/B experiment, `moebalance ab ... -v` in a new process with an empty compilation
    cache, counting its compilations: -> (its folder, the cache, stdout, stderr); the tests of
    this module read it and resume it (finished: nothing is trained again)."""
    tmp = tmp_path_factory.mktemp("ab")
    out, cache = tmp / "exp", tmp / "xla"
    stdout, stderr = run_cli([*COMMAND, "--out", str(out), "-v"], cache,
                             main=("-c", COUNT_COMPILES), **KEEP_ALL)
    return out, cache, stdout, stderr


def test_ab_compiles_each_program_once_and_a_later_train_loads_its_step(experiment, tmp_path):
    _, cache, stdout, _ = experiment
    counted = json.loads(stdout.splitlines()[-1])
    # one training step for Run A and Run B (Run A runs Run B's program with its balancing off)
    assert counted["compiles"]["jit(step)"] == 1  # training/step.py's
    assert counted["compiles"]["jit(eval_step)"] == 1
    # every program went into an empty cache as it was compiled: one compiled twice would have
    # been found there
    assert counted["hits"] == 0 and any(cache.iterdir())
    # a second process training Run B's config compiles no training step: it loads it
    _, log = run_cli(["train", *COMMAND[1:], "--out", str(tmp_path / "train")], cache,
                     JAX_LOG_COMPILES="1", **KEEP_ALL)
    assert "Persistent compilation cache hit for 'jit_step'" in log


def test_ab_end_to_end(experiment, capsys, moebalance_logger):
    out, _, stdout, stderr = experiment
    verbose = types.SimpleNamespace(out=stdout, err=stderr)
    assert verbose.out.count("after step 3") == 2  # -v: each run's per-block table
    assert "Expert load per layer" in verbose.out  # and the report's
    saved = json.loads((out / "table.json").read_text())
    assert [set(r) for r in saved["rows"]] == [ROW_KEYS | {"var_refit_b"}] * 4
    assert ROW_KEYS | {"loss_a", "loss_b", "steps", "tokens_per_step", "var_refit_b"} <= set(
        saved["total"])
    assert [r["routing"] for r in saved["rows"]] == ["hash", "hash", "topk", "topk"]
    # the table is the probe counts' population variance, recomputed here from the raw counts
    probes = {run: json.loads((out / run / "probe_counts.json").read_text())
              for run in ("run_a", "run_b")}
    assert probes["run_a"]["counts"]["0"] == probes["run_b"]["counts"]["0"]
    for run, key in (("run_a", "var_a"), ("run_b", "var_b")):
        var = load_stats(np.asarray(probes[run]["counts"]["4"]))["variance"]
        np.testing.assert_allclose([r[key] for r in saved["rows"]], var)
    # Run B's probe with refitted biases (Run A has no bias to refit)
    refit = load_stats(np.asarray(probes["run_b"]["refit"]["4"]))["variance"]
    np.testing.assert_allclose([r["var_refit_b"] for r in saved["rows"]], refit)
    assert "refit" not in probes["run_a"]
    assert probes["run_a"]["tokens"] == 8 * 64
    assert saved["rows"][0]["floor"] == pytest.approx(sampling_floor(512, 2, 8))
    topk = [r for r in saved["rows"] if r["routing"] == "topk"]
    assert saved["total"]["var_b"] == pytest.approx(sum(r["var_b"] for r in topk))
    # Run B is better balanced than Run A; hash layers are the same in both
    assert saved["total"]["var_b"] < saved["total"]["var_a"]
    assert all(r["var_a"] == r["var_b"] for r in saved["rows"] if r["routing"] == "hash")
    assert "Step 4 Var (Run B)" in (out / "table.md").read_text()
    assert "Refit Var (Run B)" in (out / "table.md").read_text()
    assert (out / "report.html").read_text().count("data:image/png;base64") == 4
    # neither the experiment nor its runs are overwritten silently
    with pytest.raises(RunDirError, match="--resume"):
        ab(load_config("deepseek4-smoke", OVERRIDES), out)
    # a finished experiment resumes to the same table without training again
    again = ab(load_config("deepseek4-smoke", OVERRIDES), out, resume=True)
    assert json.loads(json.dumps(again)) == saved
    # without -v, ab ends with its result: table.json's numbers, no per-layer table; an evenly
    # spread hash table is not reported at all
    assert cli.main([*COMMAND, "--out", str(out), "--resume"]) == 0
    printed = capsys.readouterr()
    assert "hash table" not in verbose.err + printed.err
    assert "Expert load per layer" not in printed.out and "Probe set" not in printed.out
    total = saved["total"]
    loss_change = 100 * (total["loss_b"] - total["loss_a"]) / total["loss_a"]
    # what follows the Result rule, its lines joined (rich wraps at 80 columns)
    result = " ".join(printed.out.split(" Result ")[1].split("\n", 1)[1].split())
    assert result.startswith(
        f"Improvement (A vs B): {100 * total['improvement']:.2f}% of the summed top-K variance "
        f"of the probe batch ({total['var_a']:.2f} -> {total['var_b']:.2f}); ")
    assert (f"MaxVio (mean over the top-K layers): Run A {total['maxvio_a']:.3f}, Run B "
            f"{total['maxvio_b']:.3f}. Run B's summed variance: "
            f"{total['var_b'] / total['floor']:.2f}x the sampling floor, "
            f"{total['var_b'] / total['var_refit_b']:.2f}x Run B with refitted biases. "
            f"Final loss: Run A {total['loss_a']:.4f}, Run B {total['loss_b']:.4f} "
            f"(B vs A {loss_change:+.2f}%). report written to {out}/report.html; ") in result
    assert printed.out.rstrip().endswith(f"{out}/table.md (-v prints them)")


def test_report_command_compares_runs(experiment, tmp_path, capsys, moebalance_logger):
    runs = experiment[0]
    assert cli.main(["report", str(runs / "run_a"), str(runs / "run_b"),
                     "--out", str(tmp_path / "cmp")]) == 0
    table = json.loads((tmp_path / "cmp" / "table.json").read_text())
    assert table["runs"] == ["run_a", "run_b"]
    assert cli.main(["report", str(runs / "run_a"), "--out", str(tmp_path / "cmp")]) == 2
    assert "already" in capsys.readouterr().err
    assert cli.main(["eval", str(runs / "run_b"), "--split", "train", "--batches", "1"]) == 0
    assert "training-split loss" in " ".join(capsys.readouterr().out.split())  # rich wraps
    assert cli.main(["eval", str(runs / "run_b"), "--batches", "1", "--refit-batches", "1"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "refitted bias" in printed and "variance per micro-batch with refitted biases" in printed


def test_rate_checks():
    with pytest.raises(ConfigError, match="routed_bias_update_rate"):
        load_config("deepseek4-smoke", {"routed_bias_update_rule": "quantile",
                                        "routed_bias_update_rate": 2.0})
    with pytest.raises(ConfigError, match="routed_bias_update_rate"):
        load_config("deepseek4-smoke", {"routed_bias_update_rate": -0.5})
    with pytest.raises(ConfigError, match="routed_bias_update_rate_final_fraction.*in \\[0, 1\\]"):
        load_config("deepseek4-smoke", {"routed_bias_update_rate_final_fraction": 1.5})
    with pytest.raises(ConfigError, match="probe_refit_batches.*>= 0"):
        load_config("deepseek4-smoke", {"probe_refit_batches": -1})

