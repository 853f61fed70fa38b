import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scripts.expert_parallel_run import CASES
from moebalance import cli
from moebalance.config import ConfigError, load_config
from moebalance.metrics import rank_loads
from moebalance.model.moe import MoEConfig

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, dict]:
    """Every case of CASES, run in one process with 8 CPU devices."""
    out = tmp_path_factory.mktemp("cases")
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
           + " --xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, str(HERE / "scripts" / "expert_parallel_run.py"), str(out),
                    *sorted(CASES)], env=env, check=True)
    return {case: dict(np.load(out / f"{case}.npz")) for case in CASES}


@pytest.mark.parametrize("case", sorted(CASES))
def test_expert_parallel_layer_equals_one_device(cases, case):
    """One MoE layer on 8 devices with an `expert` axis: output and every gradient equal the layer
    on one device applied per expert-parallel group; routing and drops exactly."""
    got = cases[case]
    assert got["all_to_all"]  # the tokens really travel between devices
    np.testing.assert_array_equal(got["indices"], got["ref_indices"])
    assert got["dropped"] == got["ref_dropped"]
    for key in ("y", "x_grad", "grad_w1", "grad_w3", "grad_w2", "grad_router"):
        np.testing.assert_allclose(got[key], got[f"ref_{key}"], rtol=1e-5, atol=1e-5, err_msg=key)
    ranks = CASES[case][0][2]
    local = 16 // ranks
    if case == "skewed":  # every assignment on ranks 0-1, past the fast-path buffer
        assert (got["indices"] < 4).all()
    elif case.startswith("capacity"):
        assert got["dropped"] > 0  # the capacity binds, so the per-group definition is tested
    elif case == "device_limited":
        per_token = [len(set(row)) for row in (got["indices"] // local).reshape(-1, 4)]
        assert max(per_token) == 2  # DeepSeek-V3's M = 2 ranks per token, and it binds
    else:
        assert got["dropped"] == 0


def test_rank_loads_hand_case():
    counts = np.array([[3, 1, 0, 4], [0, 0, 0, 0]])
    load, imbalance = rank_loads(counts, 2)
    np.testing.assert_array_equal(load, [[4, 4], [0, 0]])
    np.testing.assert_allclose(imbalance, [1.0, 0.0])
    with pytest.raises(ValueError, match="4 experts do not split over 3"):
        rank_loads(counts, 3)


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_rank_loads_brute_force(data):
    ranks, per_rank, layers = (data.draw(st.integers(1, 4)) for _ in range(3))
    row = st.lists(st.integers(0, 1000), min_size=ranks * per_rank, max_size=ranks * per_rank)
    counts = np.array(data.draw(st.lists(row, min_size=layers, max_size=layers)))
    load, imbalance = rank_loads(counts, ranks)
    for layer, row in enumerate(counts):
        want = [sum(row[r * per_rank:(r + 1) * per_rank]) for r in range(ranks)]
        assert load[layer].tolist() == want
        mean = sum(want) / ranks
        assert imbalance[layer] == pytest.approx(max(want) / mean if mean else 0.0)


def test_device_limited_routing_config():
    cfg = load_config("deepseek4-smoke", {"ici_expert_parallelism": 4, "routed_device_limit": 2})
    moe = MoEConfig.from_config(cfg)
    assert (moe.n_routing_groups, moe.topk_routing_group) == (4, 2)
    with pytest.raises(ConfigError, match="routed_device_limit.*ici_expert_parallelism >= 2"):
        load_config("deepseek4-smoke", {"routed_device_limit": 2})
    with pytest.raises(ConfigError, match="routed_device_limit.*set n_routing_groups=0"):
        load_config("deepseek4-smoke", {"ici_expert_parallelism": 4, "routed_device_limit": 2,
                                        "n_routing_groups": 4, "topk_routing_group": 2})
    with pytest.raises(ConfigError, match="ici_expert_parallelism.*not divisible by 3"):
        load_config("deepseek4-smoke", {"ici_expert_parallelism": 3})
    with pytest.raises(ConfigError, match="ici_expert_parallelism.*-1"):
        load_config("deepseek4-smoke", {"ici_expert_parallelism": 0})


def test_train_and_report_with_expert_parallelism(tmp_path, moebalance_logger):
    """`moebalance train` on 4 devices, all of them on the `expert` axis, then `report` (in this
    process: it reads the run, whatever its devices): the
    trainer's per-rank loads are its own counts summed per rank, and the report shows the busiest
    rank."""
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
           + " --xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu"}
    run = tmp_path / "ep4"
    subprocess.run([sys.executable, "-c", "import sys; from moebalance import cli; "
                    "sys.exit(cli.main(sys.argv[1:]))", "train", "deepseek4-smoke", "steps=3",
                    "max_target_length=32", "per_device_batch_size=2", "ici_fsdp_parallelism=1",
                    "ici_expert_parallelism=4", "probe_batches=1", "probe_refit_batches=0",
                    "--out", str(run)], env=env, check=True)  # the steps' loads
    shape = json.loads((run / "expert_counts.json").read_text())["row_shape"]
    counts = np.fromfile(run / "expert_counts.i32", np.int32).reshape(-1, *shape)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == len(counts) == 3
    for step, record in zip(counts, metrics):
        for layer, row in zip(step, record["layers"]):
            assert row["rank_load"] == row_sums(layer, 4)
            assert row["rank_imbalance"] == pytest.approx(max(row["rank_load"]) * 4
                                                          / sum(row["rank_load"]))
    assert cli.main(["report", str(run), "--out", str(tmp_path / "report")]) == 0
    table = json.loads((tmp_path / "report" / "table.json").read_text())
    assert table["total"]["rank_imbalance"]["ep4"] >= 1.0
    assert "EP max/mean ep4" in (tmp_path / "report" / "table.md").read_text()


def row_sums(counts, ranks):
    per_rank = len(counts) // ranks
    return [int(sum(counts[r * per_rank:(r + 1) * per_rank])) for r in range(ranks)]
