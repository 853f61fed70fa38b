"""training/roofline.py: the modelled step by hand, and its calibration against the one-chip
v5e record (benchmarks/results/tpu-v5e.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moebalance.training import roofline
from moebalance.training.topology import GENERATIONS

RECORD = Path(__file__).parents[1] / "benchmarks" / "results" / "tpu-v5e.json"


def test_the_bounds_by_hand():
    """v5p: 459 TFLOP/s and 1200 GB/s ICI (600 out) and 50 Gb/s DCN per chip; 4 chips, 4.59e15
    model FLOPs at a tenth of the peak: 1e15 FLOPs a chip in 1e15 / 45.9e12 = 21.79 s; 60 GB sent
    over ICI: 0.1 s; 6.25 GB across slices: 1 s."""
    out = roofline.roofline(4.59e15, 1000, 4, "v5p", sent_ici=60e9, sent_dcn=6.25e9,
                            fraction=0.1)
    compute = 4.59e15 / 4 / 45.9e12
    assert out["compute_s"] == pytest.approx(compute)
    assert out["ici_s"] == pytest.approx(0.1) and out["dcn_s"] == pytest.approx(1.0)
    assert out["no_overlap_s"] == pytest.approx(compute + 1.1)
    assert out["full_overlap_s"] == pytest.approx(compute)
    assert out["full_overlap_mfu"] == pytest.approx(0.1)  # all compute: the fraction itself
    assert out["no_overlap_tokens_s_chip"] == pytest.approx(1000 / (compute + 1.1) / 4)


def test_a_tpu7x_chip_is_two_devices_sharing_its_rate_and_links():
    one = roofline.roofline(1e15, 100, 2, "tpu7x", sent_ici=1e9, fraction=1.0)
    assert one["compute_s"] == pytest.approx(1e15 / 2307e12)  # two devices: one chip
    assert one["ici_s"] == pytest.approx(2 * 1e9 / 600e9)


def test_no_roofline_without_published_figures():
    with pytest.raises(ValueError, match="no published peak.*v4"):
        roofline.roofline(1e12, 1, 1, "v4", 0.0)


def test_the_calibration_is_the_records_fastest_d1024_step_and_predicts_its_other_run():
    runs = [r for r in json.loads(RECORD.read_text())["runs"]
            if r["config"].endswith("deepseek4-d1024.yml")]
    fastest = min((r for r in runs if r["layers"] == 8), key=lambda r: r["step_s"])
    assert roofline.CALIBRATION["step_s"] == fastest["step_s"]
    assert f"model TFLOP per step {roofline.CALIBRATION['model_flops'] / 1e12:.4g}" in (
        fastest["notes"])
    assert roofline.CALIBRATED_FRACTION == pytest.approx(fastest["mfu"], abs=5e-4)
    # the 9-layer 2 x 2048 run of the same code (MaxText's shape): one chip, no collectives
    other = min((r for r in runs if r["layers"] == 9), key=lambda r: r["step_s"])
    flops = float(other["notes"].split("model TFLOP per step ")[1].split(" ")[0]) * 1e12
    predicted = roofline.roofline(flops, other["tokens_per_step"], 1, "v5e", 0.0)
    assert predicted["no_overlap_s"] == pytest.approx(other["step_s"], rel=0.25)
    assert GENERATIONS["v5e"].peak_flops == 197e12
