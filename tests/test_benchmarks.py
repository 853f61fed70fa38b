"""benchmarks/model_step.py's record: the model FLOPs it counts (attention by the entries really
attended) against plain loops, the MFU arithmetic, and the record's schema; moe_layer.py's runs."""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import math
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from moebalance.config import load_config
from moebalance.model.transformer import parameter_counts
from moebalance.training import roofline

ROOT = Path(__file__).resolve().parent.parent
RUN_KEYS = ["config", "layers", "tokens_per_step", "step_s", "tokens_per_s", "model_tflops", "mfu",
            "compile_s", "device_peak_gib", "plan_gib", "expert_layout", "weight_dtype",
            "optimizer_dtype", "remat", "notes"]


def _benchmark(name: str):
    """benchmarks/NAME.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_step():
    return _benchmark("model_step")


@pytest.fixture(scope="module")
def cfg():
    # smoke's shapes with one layer of each kind: window only, CSA (r = 4), HCA (r = 128)
    return load_config("deepseek4-smoke", ["compress_ratios=[0,4,128,0]", "max_target_length=256"])


def _segments() -> np.ndarray:
    """[1, 2, 256]: one row a single document, the other three documents of 100, 7, 149 tokens."""
    return np.stack([np.zeros(256, np.int32),
                     np.repeat(np.arange(3, dtype=np.int32), [100, 7, 149])])[None]


def _loops(cfg, segments: np.ndarray) -> tuple[int, int, int]:
    """(window keys, compressed entries attended, entries the indexer scores) by the definition:
    query t attends key j iff t - W < j <= t in its segment; compressed entry i is visible iff
    t >= (i+1) r - 1 and the first token it pools (max((i-1) r, 0) for r = 4, else i r) is in
    t's segment; CSA keeps at most index_topk of them, HCA all."""
    window = compressed = indexed = 0
    for row in segments.reshape(-1, segments.shape[-1]):
        s = len(row)
        for r in cfg.compress_ratios:
            for t in range(s):
                window += sum(1 for j in range(max(0, t - cfg.sliding_window_size + 1), t + 1)
                              if row[j] == row[t])
                if not r:
                    continue
                visible = sum(1 for i in range(s // r) if t >= (i + 1) * r - 1
                              and row[max((i - 1) * r, 0) if r == 4 else i * r] == row[t])
                if r == 4:
                    indexed += visible
                    visible = min(visible, cfg.index_topk)
                compressed += visible
    return window, compressed, indexed


def test_attended_entries_match_the_definition(model_step, cfg):
    segments = _segments()
    counts = roofline.attended_entries(cfg, segments)
    assert (counts["window"], counts["compressed"], counts["indexed"]) == _loops(cfg, segments)


def test_model_flops_by_hand(model_step, cfg):
    segments = _segments()
    window, compressed, indexed = _loops(cfg, segments)
    # the one CSA layer's indexer: wq_b, weights_proj, and its compressor (wkv, wgate at 2 x
    # index_head_dim for the overlapping r = 4, ape [4, 2 dh], the norm's scale [dh])
    dh = cfg.index_head_dim
    indexer = (cfg.q_lora_rank * cfg.index_n_heads * dh + cfg.base_emb_dim * cfg.index_n_heads
               + 2 * cfg.base_emb_dim * 2 * dh + 4 * 2 * dh + dh)
    assert roofline.indexer_parameters(cfg) == indexer
    tokens = 2 * 256
    expected = {
        "parameters": (6 * parameter_counts(cfg)["active"] - 4 * indexer) * tokens,
        "attention": 12 * cfg.base_num_query_heads * cfg.head_dim * (window + compressed),
        "indexer": 2 * cfg.index_n_heads * (dh + 1) * indexed,
    }
    expected["total"] = sum(expected.values())
    assert roofline.model_flops(cfg, segments) == pytest.approx(expected, rel=1e-12)


def test_mfu_is_model_flops_over_step_time_over_the_peak(model_step):
    assert model_step.mfu(2.5e14, 0.5, "NVIDIA H200", "bfloat16") == round(2.5e14 / 0.5 / 989e12, 4)
    assert model_step.mfu(2.5e14, 0.5, "cpu", "bfloat16") is None
    assert model_step.mfu(2.5e14, 0.5, "NVIDIA H200", "float32") is None
    assert model_step.mfu(2.5e14, 0.5, "TPU v5 lite", "bfloat16") == round(2.5e14 / 0.5 / 197e12, 4)


def test_record_schema_and_append(model_step, cfg, tmp_path):
    flops = roofline.model_flops(cfg, _segments())
    step_s = 0.125
    result = {  # what bench() returns for a run, its measured parts made up
        "config": "deepseek4-smoke", "overrides": ["compress_ratios=[0,4,128,0]"], "layers": 4,
        "dtype": "bfloat16", "weight_dtype": "bfloat16", "optimizer_dtype": "bfloat16",
        "remat": "minimal", "batch": 2, "seq": 256, "accumulation": 4, "tokens_per_step": 2048,
        "step_s": step_s, "tokens_per_s": 16384.0, "compile_s": 12.5, "model_flops": flops,
        "mfu": model_step.mfu(flops["total"], step_s, "NVIDIA H200", "bfloat16"),
        "expert_layout": model_step.expert_layout(cfg), "device_peak_gb": 1.5, "plan_gb": 1.7,
    }
    run = model_step.record_run(result, "a note")
    assert list(run) == RUN_KEYS and (run["device_peak_gib"], run["plan_gib"]) == (1.5, 1.7)
    assert (run["tokens_per_step"], run["tokens_per_s"], run["layers"]) == (2048, 16384.0, 4)
    assert (run["weight_dtype"], run["optimizer_dtype"], run["remat"]) == ("bfloat16", "bfloat16",
                                                                           "minimal")
    assert "4 x 2 x 256 tokens" in run["notes"]
    assert run["mfu"] == round(flops["total"] / step_s / 989e12, 4)
    assert math.isclose(run["model_tflops"], flops["total"] / step_s / 1e12, rel_tol=1e-3)
    assert run["expert_layout"] == "blocked, 256 rows per block, xla matmuls"
    assert run["notes"].endswith("a note") and "compress_ratios" in run["notes"]

    path = tmp_path / "results" / "h200.json"
    stack = dict(device="NVIDIA H200", jax_version="0.11.2", flax_version="0.12.10")
    model_step.append_record(path, run, date="2026-12-05", **stack)
    path.write_text(json.dumps({**json.loads(path.read_text()), "peer": [{"step_s": 0.3}]}))
    model_step.append_record(path, {**run, "step_s": 0.25}, date="2026-12-06", **stack)
    record = json.loads(path.read_text())
    assert list(record) == ["device", "date", "jax", "flax", "runs", "peer"]
    assert record["peer"] == [{"step_s": 0.3}]  # what tpu.sh added is kept
    assert (record["device"], record["date"], record["jax"]) == ("NVIDIA H200", "2026-12-06",
                                                                 "0.11.2")
    assert [r["step_s"] for r in record["runs"]] == [step_s, 0.25]
    assert list(tmp_path.joinpath("results").iterdir()) == [path]  # no temporary file left
    with pytest.raises(ValueError, match="another device"):
        model_step.append_record(path, run, date="2026-12-06",
                                 **{**stack, "device": "NVIDIA H100 80GB HBM3"})


# benchmarks/profile_step.py: reading the compiled HLO and a GPU or TPU trace, without either.
HLO = """HloModule jit_step

%fused_computation.1 (param_0: bf16[8,16], param_1: bf16[16,4]) -> bf16[8,4] {
  %param_0 = bf16[8,16]{1,0} parameter(0)
  %param_1 = bf16[16,4]{1,0} parameter(1)
  ROOT %dot.1 = bf16[8,4]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/experts/dot_general"}
}

ENTRY %main.9 (p0: bf16[8,16], p1: bf16[16,4]) -> bf16[8,4] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %p1 = bf16[16,4]{1,0} parameter(1)
  %custom-call.3 = (bf16[8,4]{1,0}, s8[1024]{0}) custom-call(%p0, %p1), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/transpose(jvp(attention))/window/dot_general"}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %get-tuple-element.1 = bf16[8,4]{1,0} get-tuple-element(%custom-call.3), index=0
  %fusion.2 = bf16[8,4]{1,0} fusion(%p0, %p1), kind=kCustom, calls=%fused_computation.1, metadata={op_name="jit(step)/experts/dot_general"}
  %transpose_fusion.4 = bf16[4,8]{1,0} fusion(%fusion.2), kind=kLoop, calls=%fused_computation.2, metadata={op_name="jit(step)/mhc/transpose"}
  ROOT %copy.5 = bf16[8,4]{0,1} copy(%get-tuple-element.1), metadata={op_name="jit(step)/mhc/sinkhorn/copy"}
}
"""


@pytest.fixture(scope="module")
def profile_step():
    return _benchmark("profile_step")


def _event(pid, tid, dur, name="kernel", ts=0, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": args}


def test_parse_hlo_counts_cublas_calls_and_fusions(profile_step):
    ops, flops = profile_step.parse_hlo(HLO)
    assert ops["custom-call.3"] == ("custom-call",
                                    "jit(step)/transpose(jvp(attention))/window/dot_general")
    gemm = 2 * 8 * 4 * 16
    assert (flops["custom-call.3"], flops["fusion.2"], flops["dot.1"]) == (gemm, gemm, gemm)
    assert flops["copy.5"] == flops["transpose_fusion.4"] == 0


LOOP_HLO = """HloModule jit_step

%inner_body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %w = f32[8,8]{1,0} constant({...})
  %dot.7 = f32[4,8]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %dot.7)
}

%outer_body (q: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %q = (s32[], f32[4,8]{1,0}) parameter(0)
  ROOT %while.2 = (s32[], f32[4,8]{1,0}) while(%q), condition=%cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
}

%called (r: f32[4,8]) -> f32[4,8] {
  %r = f32[4,8]{1,0} parameter(0)
  ROOT %while.3 = (s32[], f32[4,8]{1,0}) while(%r), condition=%cond, body=%outer_body, backend_config={"known_trip_count":{"n":"5"}}
}

ENTRY %main (e: f32[4,8]) -> f32[4,4] {
  %e = f32[4,8]{1,0} parameter(0)
  %call.1 = f32[4,8]{1,0} call(%e), to_apply=%called
  %while.1 = (s32[], f32[4,8]{1,0}) while(%e), condition=%cond, body=%outer_body, backend_config={"known_trip_count":{"n":"2"}}
  ROOT %dot.9 = f32[4,4]{1,0} dot(%e, %e), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}
"""


def test_parse_hlo_counts_every_execution_inside_loops(profile_step):
    # the inner loop body runs 3 times per run of the outer body, which runs 2 times from the
    # entry and 5 times from a called computation: 3 * (2 + 5) = 21 executions of dot.7
    _, flops = profile_step.parse_hlo(LOOP_HLO)
    dot = 2 * 4 * 8 * 8
    assert flops["dot.7"] == 21 * dot
    assert flops["dot.9"] == 2 * 4 * 4 * 8  # in the entry: once
    assert flops["while.1"] == flops["call.1"] == 0


def test_gpu_trace_by_kernel_hlo_op(profile_step):
    ops, flops = profile_step.parse_hlo(HLO)
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name",
             "args": {"name": "Stream #7(Compute)"}},
            {"ph": "M", "pid": 1, "tid": 200, "name": "thread_name", "args": {"name": "XLA Ops"}}]
    kernels = [_event(1, 7, 10, "sm90_xmma_gemm", hlo_op="custom-call.3", hlo_module="jit_step"),
               _event(1, 7, 5, hlo_op="fusion.2", hlo_module="jit_step"),
               _event(1, 7, 4, hlo_op="fusion.2", hlo_module="jit_step"),  # two kernels, one op
               _event(1, 7, 3, hlo_op="transpose_fusion.4", hlo_module="jit_step"),
               _event(1, 7, 2, hlo_op="copy.5", hlo_module="jit_step"),
               _event(1, 7, 6, hlo_op="fusion.2", hlo_module="jit_other"),  # another program
               _event(1, 7, 1, "MemcpyD2D"),  # no operation of the step
               _event(1, 200, 100, "fusion.2"),  # the derived XLA Ops line: not again
               _event(2, 5, 50, "custom-call.3")]  # the host's side of the launch
    times, unmatched = profile_step.op_times({"traceEvents": meta + kernels}, ops)
    assert times == {"custom-call.3": 10, "fusion.2": 9, "transpose_fusion.4": 3, "copy.5": 2}
    assert unmatched == 1
    components, parts = profile_step.summarise(times, ops, flops)
    assert {(r["component"], r["pass"]): r["share"] for r in components} == {
        ("window", "backward"): round(10 / 24, 3), ("experts", "forward"): round(9 / 24, 3),
        ("mhc", "forward"): round(3 / 24, 3), ("sinkhorn", "forward"): round(2 / 24, 3)}
    by_part = {r["part"]: r for r in parts}
    assert set(by_part) == {"attention: window", "experts", "XLA copies + transposes"}
    assert by_part["XLA copies + transposes"]["share"] == round(5 / 24, 3)
    assert by_part["experts"]["share"] == round(9 / 24, 3)


def test_cpu_trace_by_event_name(profile_step):
    ops, _ = profile_step.parse_hlo(HLO)
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}}]
    events = [_event(1, 3, 4, "fusion.2"), _event(1, 3, 2, "copy.5"), _event(1, 4, 9, "main.9"),
              _event(1, 4, 1, "$python frame")]
    times, unmatched = profile_step.op_times({"traceEvents": meta + events}, ops)
    assert times == {"fusion.2": 4, "copy.5": 2} and unmatched == 0


def test_tpu_trace_by_xla_ops_event_name(profile_step):
    # A TPU names each event of its "XLA Ops" thread after its instruction, with no module: the
    # step's run on the "XLA Modules" thread bounds its events. A `while` (or call) event spans
    # its body's events: only these leaves count.
    ops, _ = profile_step.parse_hlo(LOOP_HLO)
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:TPU:0"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}}]
    meta += [{"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": name}}
             for tid, name in ((1, "Steps"), (2, "XLA Modules"), (3, "XLA Ops"))]
    events = [_event(1, 1, 100, "0"), _event(1, 2, 100, "jit_step(1234)"),
              _event(1, 3, 30, "while.1", ts=10),  # holds three runs of its body's dot.7
              _event(1, 3, 5, "dot.7", ts=12), _event(1, 3, 6, "dot.7", ts=20),
              _event(1, 3, 7, "dot.7", ts=28), _event(1, 3, 4, "dot.9", ts=50),
              _event(1, 3, 20, "call.1", ts=60), _event(1, 3, 18, "while.3", ts=61),
              _event(1, 3, 8, "dot.7", ts=62),  # inside while.3 inside call.1
              _event(1, 3, 2, "fusion.99", ts=90),  # no instruction of the step
              _event(1, 2, 50, "jit_other(5678)", ts=200),
              _event(1, 3, 40, "dot.9", ts=210),  # another program's instruction of that name
              _event(2, 5, 50, "dot.9", ts=50)]  # the host's side
    times, unmatched = profile_step.op_times({"traceEvents": meta + events}, ops)
    assert times == {"dot.7": 5 + 6 + 7 + 8, "dot.9": 4}
    assert unmatched == 2


TPU_FIXTURE = ROOT / "tests" / "fixtures" / "tpu-trace"


def test_tpu_trace_slice_by_part(profile_step):
    """A slice of a real TPU trace (the d1024 2 x 2048 step on a v5e) and the HLO lines its events
    name, cut by tools/make_tpu_trace_fixture.py: 286 events of the "XLA Ops" thread, 0.4 ms of
    a layer's backward (Sinkhorn, router top-k, dispatch, the grouped matmul's searchsorted
    loops), of which 7 are `while` events: the layer loop's (100 ms, most of its body not in the
    slice) and six searchsorted loops' (49.3425 us together, 28 body events each). The sums by
    part below were computed from the original trace's own scopes (its events' `tf_op`), without
    the HLO: the reader must give them, every leaf counted once and no `while`."""
    ops, flops = profile_step.parse_hlo((TPU_FIXTURE / "step.hlo.txt").read_text())
    trace = json.loads(gzip.decompress((TPU_FIXTURE / "trace.json.gz").read_bytes()))
    times, unmatched = profile_step.op_times(trace, ops)
    assert unmatched == 0 and not any(name.startswith("while.") for name in times)
    assert sum(times.values()) == pytest.approx(371.370468)  # the 279 leaves, in us
    assert times["gather_fusion.87"] == pytest.approx(7.578906)  # 7 runs of a loop body
    # summarise's ms rounded to 0.1: the slice's times, in us, are given as ns to read as us
    _, parts = profile_step.summarise({name: us * 1e3 for name, us in times.items()}, ops, flops)
    assert {r["part"]: r["ms"] for r in parts} == {
        "router + balancing": 246.4, "hyper-connections": 55.2, "experts": 48.7,
        "XLA copies + transposes": 11.7, "other": 6.4, "dispatch + combine": 3.1}


def test_vs_nemo_names_the_machine_its_ratio_was_measured_on():
    vs_nemo = _benchmark("vs_nemo")
    xeon = ("processor\t: 0\nvendor_id\t: GenuineIntel\n"
            "model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz\n"
            "flags\t\t: fpu sse2 avx avx2 avx512f avx512bw amx_bf16 amx_tile\n\n"
            "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz\n")
    assert vs_nemo.cpu_model(xeon) == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert vs_nemo.cpu_flags(xeon) == ["amx_tile", "avx2", "avx512f"]
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\nModel\t: Raspberry Pi 5\n"
    assert vs_nemo.cpu_model(arm) == "Raspberry Pi 5"
    assert vs_nemo.cpu_flags(arm) == []
    described = vs_nemo.machine()
    assert described["cores"] >= 1 and set(described["threads"]) == set(vs_nemo.THREAD_VARIABLES)


def test_expert_layout_names_the_kernel_auto_runs(model_step, cfg, monkeypatch):
    ragged = dataclasses.replace(cfg, moe_dispatch="ragged", moe_kernel="megablox")
    assert model_step.expert_layout(ragged) == "ragged, megablox matmuls, 256-row tiles"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")  # auto: ragged rows, ragged_dot
    assert model_step.expert_layout(cfg) == "ragged, xla matmuls"
    capacity = dataclasses.replace(cfg, capacity_factor=1.25, moe_kernel="xla")
    assert model_step.expert_layout(capacity) == "capacity (factor 1.25), xla matmuls"


@pytest.fixture(scope="module")
def moe_layer():
    return _benchmark("moe_layer")


def test_moe_layer_times_each_kernel_on_the_rows_it_takes(moe_layer):
    runs = list(moe_layer.configurations(["ragged", "blocked"], ["xla", "megablox", "pallas"],
                                         [128, 256], [256, 512]))
    assert runs == [  # ragged_dot has no tiles; Triton takes no ragged rows; megablox's columns
        ("ragged", "xla", None, None),
        ("ragged", "megablox", 128, 256), ("ragged", "megablox", 128, 512),
        ("ragged", "megablox", 256, 256), ("ragged", "megablox", 256, 512),
        ("blocked", "xla", 128, None), ("blocked", "xla", 256, None),
        ("blocked", "megablox", 128, 256), ("blocked", "megablox", 128, 512),
        ("blocked", "megablox", 256, 256), ("blocked", "megablox", 256, 512),
        ("blocked", "pallas", 128, None), ("blocked", "pallas", 256, None)]


def test_moe_layer_times_megablox_interpreted_on_the_cpu(moe_layer, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [
        "moe_layer.py", "--tokens", "32", "--repeats", "1", "--dispatch", "ragged",
        "--kernels", "xla,megablox", "--block-sizes", "16", "--col-tiles", "128,256",
        "--shapes", "4:2:256:256", "--only-shapes"])
    traced = []
    real = moe_layer.megablox.gmm
    monkeypatch.setattr(moe_layer.megablox, "gmm",
                        lambda *a, **kw: traced.append(a[4]) or real(*a, **kw))
    moe_layer.main()
    *rows, summary = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["dispatch"], r["kernel"], r["block_size"], r["col_tile"]) for r in rows] == [
        ("ragged", "xla", None, None), ("ragged", "megablox", 16, 128),
        ("ragged", "megablox", 16, 256)]
    # each run's kernels took its column tile (rows: the block, 16, rounded up to 128 lanes), and
    # the module's TILE is back at its default
    assert sorted(set(traced)) == [(128, 128, 128), (128, 256, 256)]
    assert moe_layer.megablox.TILE == moe_layer.DEFAULT_COL_TILE
    assert all(r["ratio"] > 0 and r["tokens"] == 32 for r in rows)
    assert summary["backend"] == "cpu"
