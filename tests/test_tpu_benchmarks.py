"""The TPU benchmarks' CPU-side parts: aot_memory.py reading the compiler's live-range
dump and HLO (the formats of the TPU compiler's files, abridged) and the whole script compiling
the smoke step for the CPU; tpu_record.py's peer and A/B parts of the record; program_log.py's
reading of JAX's timing lines; tpu.sh's syntax."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import jax
import pytest
from flax import nnx

from moebalance.config import load_config
from moebalance.training import plan
from test_benchmarks import ROOT, _benchmark

LIVE_RANGE = """HloLiveRange (max 15):
  InstructionSequence:
    0:a.1
  BufferLiveRange:
    a.1{}:0-15
    copy-start{0}:1-14
  Live ranges at 14 (peak):
    a.1{}: 33554432 bytes (cumulative: 33554432 bytes)
    fusion.4{1}: 1024 bytes (cumulative: 33555456 bytes)
    convolution_add_fusion{}: 67108864 bytes (cumulative: 100664320 bytes)
    copy-start{0}: 8192 bytes (cumulative: 100672512 bytes)
  Stack trace breakdown for peak usage: 100 672 512 bytes
    main.1 (100.0%, total: 100 672 512 bytes, current: 0 bytes, remaining: 100 672 512 bytes)
"""

HLO = """HloModule jit_train_step, is_scheduled=true

ENTRY %main.2 (a.1: bf16[4096,4096]) -> bf16[4096,4096] {
  %a.1 = bf16[4096,4096]{1,0:T(8,128)(2,1)} parameter(0), sharding={replicated}, metadata={op_name="model"}
  %copy-start = (bf16[2048]{0:T(1024)S(1)}, bf16[2048]{0:T(1024)}, u32[]{:S(2)}) copy-start(%a.1), cross_program_prefetch_index=0
  %fusion.4 = (bf16[4096]{0:T(1024)(128)(2,1)S(1)}, /*index=1*/bf16[8,64]{1,0:T(8,128)(2,1)}) fusion(%a.1), kind=kLoop, calls=%f, metadata={op_name="jit(train_step)/while/body/mhc/mul" stack_frame_id=2}
  ROOT %convolution_add_fusion = f32[4096,4096]{1,0:T(8,128)} fusion(%a.1), kind=kOutput, calls=%g, metadata={op_name="jit(train_step)/transpose(jvp(experts))/dot_general" stack_frame_id=3}
}
"""


@pytest.fixture(scope="module")
def aot():
    return _benchmark("aot_memory")


def test_peak_values_are_the_peak_section_only(aot):
    assert aot.peak_values(LIVE_RANGE) == [("a.1", "{}", 33554432), ("fusion.4", "{1}", 1024),
                                           ("convolution_add_fusion", "{}", 67108864),
                                           ("copy-start", "{0}", 8192)]
    assert aot.peak_values("HloLiveRange (max 0):\n") == []


def test_tuple_elements_and_instructions(aot):
    shape = "(bf16[4096]{0:T(1024)}, /*index=1*/bf16[8,64]{1,0}, (s32[], f32[2]{0}))"
    assert aot.tuple_element(shape, "{1}") == "/*index=1*/bf16[8,64]{1,0}"
    assert aot.tuple_element(shape, "{2,1}") == "f32[2]{0}"
    assert aot.tuple_element("f32[3]{0}", "{}") == "f32[3]{0}"
    named = aot.instructions(HLO)
    assert named["a.1"] == ("bf16[4096,4096]{1,0:T(8,128)(2,1)}", "model")
    assert named["copy-start"][1] == ""  # no metadata
    assert named["copy-start"][0].startswith("(bf16[2048]") and named["copy-start"][0].endswith(
        "u32[]{:S(2)})")
    assert named["convolution_add_fusion"][1].endswith("transpose(jvp(experts))/dot_general")


def test_peak_buffers_largest_first_with_space_shape_and_operation(aot):
    buffers = aot.peak_buffers(LIVE_RANGE, HLO, top=3)
    assert buffers == [
        {"value": "convolution_add_fusion{}", "mib": 64.0, "space": "hbm",
         "shape": "f32[4096,4096]",
         "op_name": "jit(train_step)/transpose(jvp(experts))/dot_general"},
        {"value": "a.1{}", "mib": 32.0, "space": "hbm", "shape": "bf16[4096,4096]",
         "op_name": "model"},
        {"value": "copy-start{0}", "mib": 0.0, "space": "vmem", "shape": "bf16[2048]",
         "op_name": ""}]
    assert aot.peak_buffers(LIVE_RANGE, HLO, top=4)[3]["shape"] == "bf16[8,64]"  # no comment


def test_the_smoke_step_compiled_for_the_cpu():
    """The whole script on this machine's CPU, in a process of its own (its compiler dump options
    stay there): the trainer's step of a two-layer deepseek4-smoke (2 micro-batches of 2 x 32
    tokens), its memory, its largest buffers at the peak, the plan."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "aot_memory.py"),
                          "deepseek4-smoke", "base_num_decoder_layers=2", "compress_ratios=[0,4]",
                          "first_num_hash_layers=1", "gradient_accumulation_steps=2",
                          "remat_policy=minimal", "--topology", "cpu", "--batch", "2", "--seq",
                          "32", "--top", "5"], capture_output=True, text=True, check=True)
    out = json.loads(run.stdout)
    memory = out["memory_gib"]
    assert out["tokens_per_step"] == 128 and out["remat"] == "minimal"
    assert memory["argument"] > 0 and memory["temp"] > 0
    assert memory["needed"] == pytest.approx(memory["argument"] + memory["output"]
                                             - memory["alias"] + memory["temp"], abs=2e-3)
    buffers = out["peak_buffers"]
    assert len(buffers) == 5 and [b["mib"] for b in buffers] == sorted(
        (b["mib"] for b in buffers), reverse=True)
    assert all(b["shape"] and b["space"] == "hbm" and b["op_name"] for b in buffers)
    assert 0.5 < out["plan_gib"]["plan / needed"] < 2  # the planner, near XLA's account


MAXTEXT_LOG = """I1205 completed step: 0, seconds: 61.210, TFLOP/s/device: 0.111, Tokens/s/device: 66.9, loss: 12.0
I1205 completed step: 1, seconds: 0.335, TFLOP/s/device: 20.36, Tokens/s/device: 12227.0, loss: 11.9
I1205 completed step: 2, seconds: 0.010, TFLOP/s/device: 682.0, Tokens/s/device: 409600.0, loss: 11.8
I1205 completed step: 3, seconds: 0.332, TFLOP/s/device: 20.54, Tokens/s/device: 12337.3, loss: 11.7
I1205 completed step: 4, seconds: 0.331, TFLOP/s/device: 20.61, Tokens/s/device: 12374.6, loss: 11.6
"""


@pytest.fixture(scope="module")
def tpu_record():
    return _benchmark("tpu_record")


def test_peer_is_maxtexts_median_step_without_steps_0_and_2(tpu_record):
    run = tpu_record.maxtext_run(MAXTEXT_LOG, "d1024")
    assert (run["step_s"], run["tokens_per_s"], run["model_tflops"]) == (0.332, 12337.3, 20.54)
    assert [s["step"] for s in run["steps"]] == [1, 3, 4]
    with pytest.raises(ValueError, match="no step lines"):
        tpu_record.maxtext_run(MAXTEXT_LOG.splitlines()[0], "d1024")


def test_peer_and_ab_parts_join_the_record_that_model_step_appends_to(tpu_record, tmp_path):
    log, record = tmp_path / "maxtext.log", tmp_path / "tpu-v5e.json"
    log.write_text(MAXTEXT_LOG)
    tpu_record.main(["peer", str(record), str(log)])
    experiment = tmp_path / "ab"
    experiment.mkdir()
    total = {"layer": "TOTAL/AVG", "routing": "topk", "improvement": 0.978, "loss_a": 8.89,
             "loss_b": 8.90, "steps": 20, "tokens_per_step": 2048}
    (experiment / "table.json").write_text(json.dumps({"rows": [], "total": total}))
    tpu_record.main(["ab", str(record), str(experiment), "2026-12-05", "140", "70"])
    _set_ab_profile(record, {"total_s": 191.2})
    tpu_record.main(["ab", str(record), str(experiment), "2026-12-06", "131.4", "60.04"])
    _benchmark("model_step").append_record(record, {"step_s": 0.5}, device="TPU v5 lite",
                                           date="2026-12-06", jax_version="0.10.2",
                                           flax_version="0.12.8")
    got = json.loads(record.read_text())
    assert list(got) == ["device", "date", "jax", "flax", "runs", "peer", "ab"]
    assert got["peer"][0]["system"] == "MaxText" and got["runs"] == [{"step_s": 0.5}]
    # the latest result, dated; the one it replaced in "earlier"; the profile kept
    assert got["ab"] == {"first_s": 131.4, "second_s": 60.0, "improvement": 0.978, "loss_a": 8.89,
                         "loss_b": 8.90, "steps": 20, "tokens_per_step": 2048,
                         "date": "2026-12-06", "first_profile": {"total_s": 191.2},
                         "earlier": [{"first_s": 140.0, "second_s": 70.0, "date": "2026-12-05"}]}


def _set_ab_profile(record, profile):
    """record["ab"]["first_profile"] = profile, as a hand-added profile of the A/B is kept."""
    got = json.loads(record.read_text())
    got["ab"]["first_profile"] = profile
    record.write_text(json.dumps(got))


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0"
failures="1" skipped="1" tests="{n}" time="{t}">{cases}</testsuite></testsuites>"""


def _junit(t, **outcomes):
    """A JUnit XML of tests named `file.name` with outcome '' (passed), 'failure' or 'skipped'."""
    cases = "".join(f'<testcase classname="tests.{name.split(".")[0]}" name="{name.split(".")[1]}" '
                    f'time="0.1">{"<" + o + "/>" if o else ""}</testcase>'
                    for name, o in outcomes.items())
    return JUNIT.format(n=len(outcomes), t=t, cases=cases)


def test_device_test_parts_add_up_and_a_part_run_again_replaces_its_earlier_run(tpu_record,
                                                                              tmp_path):
    record, xml = tmp_path / "tpu-v5e.json", tmp_path / "tests.xml"
    xml.write_text(_junit(300.5, **{"test_a.one": "", "test_a.two": "failure",
                                    "test_b.three": "skipped", "test_b.four": ""}))
    tpu_record.main(["tests", str(record), str(xml), "2026-12-06"])
    first = json.loads(record.read_text())["tests"]
    assert {k: first[k] for k in ("passed", "failed", "skipped", "wall_s", "date")} == {
        "passed": 2, "failed": 1, "skipped": 1, "wall_s": 300.5, "date": "2026-12-06"}
    assert first["parts"][0]["files"] == ["test_a.py", "test_b.py"]
    assert first["parts"][0]["failures"] == ["tests.test_a::two"]
    # pytest stopped by SIGINT (tpu.sh's limit) adds a case without a class: not a test
    xml.write_text(_junit(100.0, **{"test_c.five": "", "test_c.six": ""}).replace(
        "</testsuite>", '<testcase time="0.001" /></testsuite>'))
    tpu_record.main(["tests", str(record), str(xml), "2026-12-07"])
    xml.write_text(_junit(200.0, **{"test_a.one": "", "test_a.two": "", "test_b.three": "",
                                    "test_b.four": ""}))  # the first part again, now passing
    tpu_record.main(["tests", str(record), str(xml), "2026-12-07"])
    tests = json.loads(record.read_text())["tests"]
    assert {k: tests[k] for k in ("passed", "failed", "skipped", "wall_s", "date")} == {
        "passed": 6, "failed": 0, "skipped": 0, "wall_s": 300.0, "date": "2026-12-07"}
    assert len(tests["parts"]) == 2
    # a part of other files that runs a test again: that test counted once, as it last ended
    xml.write_text(_junit(50.0, **{"test_a.two": "failure", "test_d.seven": ""}))
    tpu_record.main(["tests", str(record), str(xml), "2026-12-08"])
    tests = json.loads(record.read_text())["tests"]
    assert {k: tests[k] for k in ("passed", "failed", "skipped", "wall_s")} == {
        "passed": 6, "failed": 1, "skipped": 0, "wall_s": 350.0}


def test_parts_recorded_without_outcomes_leave_the_hand_checked_totals(tpu_record, tmp_path):
    record, xml = tmp_path / "tpu-v5e.json", tmp_path / "tests.xml"
    legacy = {"passed": 189, "failed": 0, "skipped": 0, "wall_s": 1593.5, "date": "2026-12-06",
              "parts": [{"files": ["test_z.py"], "passed": 190, "failed": 3, "skipped": 0,
                         "wall_s": 1593.5, "date": "2026-12-06", "failures": []}]}
    record.write_text(json.dumps({"tests": legacy}))
    xml.write_text(_junit(20.0, **{"test_a.one": ""}))
    tpu_record.main(["tests", str(record), str(xml), "2026-12-07"])
    tests = json.loads(record.read_text())["tests"]
    assert {k: tests[k] for k in ("passed", "failed", "wall_s", "date")} == {
        "passed": 189, "failed": 0, "wall_s": 1593.5, "date": "2026-12-07"}
    assert tests["parts"][-1]["outcomes"] == {"tests.test_a::one": "passed"}


def test_left_lists_the_selection_a_run_did_not_finish_in_pytests_order(tpu_record, tmp_path):
    """The second device call's list: the `--device-tests` tests of the files given that the first
    call's XML lacks (not run, or interrupted by the limit), ids as pytest takes them."""
    every = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-n", "0",
                            "--device-tests", "tests/test_metrics.py", "tests/test_docs.py"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout
    ids = [line for line in every.splitlines() if "::" in line]
    assert ids and all(i.startswith("tests/test_metrics.py::") for i in ids)  # not numerics: out
    xml = tmp_path / "tests.xml"
    xml.write_text(_junit(10.0, **{f"test_metrics.{i.split('::')[1]}": "" for i in ids[::2]}))
    left = tmp_path / "left.txt"
    subprocess.run([sys.executable, "benchmarks/tpu_record.py", "left", str(xml), str(left),
                    "tests/test_metrics.py", "tests/test_docs.py"], cwd=ROOT, check=True,
                   capture_output=True)
    assert left.read_text().splitlines() == ids[1::2]


def test_tpu_scripts_parse():
    for script in ("tpu.sh", "tpu_wheels.sh", "accelerator.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / script)], check=True)


def test_a_part_keeps_its_output_and_its_limit(tmp_path):
    """parts.sh: a part's stdout is appended to OUT/NAME.json, its stderr and exit go to the log,
    its stderr also to the screen as it comes (the device tool returns the screen), and a part
    past its limit is stopped (exit 124) without stopping the script."""
    script = ("set -u; . benchmarks/parts.sh; part 5 fast echo '{\"a\": 1}'; "
              "part 5 fast sh -c 'echo more; echo oops >&2'; part 1 slow sleep 5; echo after")
    run = subprocess.run(["bash", "-c", script], cwd=ROOT, env={"OUT": str(tmp_path), "PATH":
                         "/usr/bin:/bin"}, capture_output=True, text=True, timeout=30)
    assert run.stdout.splitlines()[-1] == "after"
    assert (tmp_path / "fast.json").read_text() == '{"a": 1}\nmore\n'
    log = (tmp_path / "log.txt").read_text()
    assert "oops" in log and "== fast: exit 0 after" in log and "== slow: exit 124 after" in log
    assert "oops" in run.stderr and "more" not in run.stderr


@pytest.mark.parametrize("weight_dtype", ["float32", "bfloat16"])
def test_the_record_names_the_dtype_of_adamws_moments(weight_dtype):
    """AdamW keeps its moments in the weights' dtype; the float32 router's are a small part."""
    cfg = load_config("deepseek4-smoke", {"weight_dtype": weight_dtype})
    optimizer = plan.abstract_optimizer(cfg, plan.abstract_model(cfg))
    assert _benchmark("model_step").moment_dtype(optimizer) == weight_dtype
    assert {str(v.dtype) for p, v in nnx.to_flat_state(nnx.state(optimizer))
            if "mu" in p} == {weight_dtype, "float32"}  # not a test of a single dtype


def test_program_log_reads_jaxs_timing_lines_and_sums_each_phase():
    """program_log.py: JAX's own lines for a jitted function (one compile, then a cache hit line
    as the persistent cache writes it), each phase summed per program, tracing left unsummed."""
    program_log = _benchmark("program_log")
    recorder = program_log.Recorder()
    logger = logging.getLogger("jax._src.dispatch")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(recorder)
    try:
        jax.jit(lambda x: x * 3 + 1)(jax.numpy.ones(7))
    finally:
        logger.removeHandler(recorder)
        logger.setLevel(level)
    recorder.emit(logging.makeLogRecord({"msg": "Persistent compilation cache hit for "
                                                "'jit_step' with key 'abc'"}))
    phases = {phase for phase, name, _, _ in recorder.events if "<lambda>" in name}
    assert phases == {"trace", "lower", "compile"}
    events = [("trace", "step", 5.0, 6.0), ("trace", "loss", 2.0, 5.5),
              ("lower", "jit(step)", 1.5, 7.5), ("compile", "jit(step)", 40.0, 47.5),
              ("compile", "jit(add)", 0.25, 1.0), ("compile", "jit(add)", 0.5, 48.0)]
    out = program_log.summary(events, recorder.hits, 60.04, top=1)
    assert out["wall_s"] == 60.0 and out["cache_hits"] == 1
    assert "total_s" not in out["phases"]["trace"]  # nested traces are inside their parent's
    assert out["phases"]["compile"] == {
        "count": 3, "total_s": 40.75,
        "slowest": [{"program": "jit(step)", "count": 1, "s": 40.0, "longest_s": 40.0,
                     "first_ended_at": 47.5, "last_ended_at": 47.5}]}
    add = program_log.summary(events, recorder.hits, 60.0, top=2)["phases"]["compile"]["slowest"]
    assert add[1] == {"program": "jit(add)", "count": 2, "s": 0.75, "longest_s": 0.5,
                      "first_ended_at": 1.0, "last_ended_at": 48.0}
