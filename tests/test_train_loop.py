import json

import numpy as np
import pytest

from moebalance.config import load_config
from moebalance.metrics import STAT_NAMES, load_stats
from moebalance.training.loop import RunDirError, train

SMALL = dict(steps=3, max_target_length=16, per_device_batch_size=2,
             load_balance_loss_weight=1e-3, router_z_loss_weight=1e-4)


def test_run_directory_metrics_and_counts(tmp_path):
    cfg = load_config("deepseek4-smoke", SMALL)
    last = train(cfg, tmp_path / "run", progress=False)
    run = tmp_path / "run"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2] and lines[-1] == last
    for r in lines:
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "ce", "sequence_loss", "z_loss"):
            assert np.isfinite(r[key]), key
        assert len(r["layers"]) == 4
        for row in r["layers"]:
            assert {"layer", "routing", *STAT_NAMES} <= set(row)
            assert row["routing"] == ("hash" if row["layer"] < 2 else "topk")
            assert ("bias_std" in row) == (row["routing"] == "topk")
    shape = json.loads((run / "expert_counts.json").read_text())["shape"]
    counts = np.fromfile(run / "expert_counts.i32", np.int32).reshape(shape)
    assert counts.shape == (3, 4, 8)
    assert (counts.sum(-1) == 2 * 16 * 2).all()  # B * S * K per block per step
    # the logged statistics are those of the stored counts
    stats = load_stats(counts[-1])
    for row in lines[-1]["layers"]:
        assert row["variance"] == pytest.approx(stats["variance"][row["layer"]])
    assert load_config(str(run / "config.yaml")) == cfg


def test_refuses_an_existing_run_before_any_work(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("precious\n")
    with pytest.raises(RunDirError, match="already holds a run"):
        train(load_config("deepseek4-smoke", SMALL), run, progress=False)
    assert (run / "metrics.jsonl").read_text() == "precious\n"


def test_non_finite_loss_stops_with_a_clear_message(tmp_path):
    cfg = load_config("deepseek4-smoke", {**SMALL, "learning_rate": 1e38,
                                          "warmup_steps_fraction": 0.0})
    with pytest.raises(FloatingPointError, match="the loss is"):
        train(cfg, tmp_path / "run", progress=False)
