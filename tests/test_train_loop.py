import dataclasses
import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from flax import nnx

from moebalance import cli, generate
from moebalance.config import ConfigError, load_config
from moebalance.data import batches
from moebalance.metrics import STAT_NAMES, load_stats
from moebalance.model.transformer import DeepSeekV4
from moebalance.rundir import RunDir, RunDirError
from moebalance.training import checkpoint, loop
from moebalance.training.evaluate import evaluate
from moebalance.training.hooks import Hook
from moebalance.training.loop import train
from moebalance.training.step import new_optimizer

SMALL = dict(steps=3, max_target_length=16, per_device_batch_size=2,
             load_balance_loss_weight=1e-3, router_z_loss_weight=1e-4)


class Recorder(Hook):
    """Every call the loop makes, in order."""

    def __init__(self):
        self.calls = []

    def start(self, first, steps):
        self.calls.append(("start", first, steps))

    def step(self, record, counts):
        self.calls.append(("step", record, counts.copy()))

    def end(self, record):
        self.calls.append(("end", record))

    def close(self):
        self.calls.append(("close",))


def test_run_directory_metrics_and_counts(tmp_path, capfd, monkeypatch):
    cfg = load_config("deepseek4-smoke", {**SMALL, "remat_policy": "auto"})
    capfd.readouterr()
    recorder = Recorder()
    last = train(cfg, tmp_path / "run", hooks=[recorder])
    assert capfd.readouterr() == ("", "")  # a library call prints nothing
    run = tmp_path / "run"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2] and lines[-1] == last
    # the hooks see what the run directory holds, then the end, then the close
    assert [c[0] for c in recorder.calls] == ["start", "step", "step", "step", "end", "close"]
    assert recorder.calls[0] == ("start", 0, 3) and recorder.calls[4] == ("end", last)
    assert [c[1] for c in recorder.calls[1:4]] == lines
    for r in lines:
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "ce", "sequence_loss", "z_loss"):
            assert np.isfinite(r[key]), key
        assert len(r["layers"]) == 4
        for row in r["layers"]:
            assert {"layer", "routing", *STAT_NAMES} <= set(row)
            assert row["routing"] == ("hash" if row["layer"] < 2 else "topk")
            assert ("bias_std" in row) == (row["routing"] == "topk")
    row = json.loads((run / "expert_counts.json").read_text())["row_shape"]
    counts = np.fromfile(run / "expert_counts.i32", np.int32).reshape(-1, *row)
    assert counts.shape == (3, 4, 8)
    assert (counts.sum(-1) == 2 * 16 * 2).all()  # B * S * K per block per step
    np.testing.assert_array_equal(np.stack([c[2] for c in recorder.calls[1:4]]), counts)
    # the logged statistics are those of the stored counts
    stats = load_stats(counts[-1])
    for row in lines[-1]["layers"]:
        assert row["variance"] == pytest.approx(stats["variance"][row["layer"]])
    # remat_policy auto on a CPU (no memory limit reported): none, as the run records
    assert load_config(str(run / "config.yaml")) == dataclasses.replace(cfg, remat_policy="none")
    # evaluation: held-out loss, perplexity, MaxVio_global per layer; the run is left as it was
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with monkeypatch.context() as patch:  # the checkpoint's hash tables, none built from data
        patch.setattr(loop, "_hash_tables", lambda *a: pytest.fail("eval built hash tables"))
        result = evaluate(run, batches=2)
    assert result["step"] == 3 and result["tokens"] == 2 * 2 * 16
    assert result["perplexity"] == pytest.approx(np.exp(result["loss"]))
    # random tokens: nothing to learn, so held-out CE stays close to the training CE
    assert abs(result["loss"] - last["ce"]) < 0.5
    assert [r["routing"] for r in result["layers"]] == ["hash", "hash", "topk", "topk"]
    assert all(r["maxvio_global"] >= 0 for r in result["layers"])
    # its two micro-batches are the first two of the run's final probe set, measured the same way
    probe_set = np.asarray(json.loads((run / "probe_counts.json").read_text())["set"]["counts"]["3"])
    summed = [load_stats(c)["variance"][2:].sum() for c in probe_set[:2]]
    assert result["variance"] == pytest.approx({"mean": np.mean(summed), "std": np.std(summed),
                                                "min": min(summed), "max": max(summed)})
    # with refitted top-k biases: the hash blocks (before any top-k block) cannot change
    seen = []
    refit = evaluate(run, batches=2, refit_batches=2, on_batch=lambda *a: seen.append(a))
    assert seen == [("measuring", 1, 2), ("measuring", 2, 2),  # progress of each pass
                    ("with refitted biases", 1, 2), ("with refitted biases", 2, 2)]
    assert refit["loss"] == result["loss"]
    for plain, row in zip(result["layers"], refit["layers"]):
        assert row["maxvio_global"] == plain["maxvio_global"]
        if row["routing"] == "hash":
            assert row["maxvio_global_refit"] == row["maxvio_global"]
    assert any(r["maxvio_global_refit"] != r["maxvio_global"] for r in refit["layers"][2:])
    assert refit["variance"] == result["variance"] != refit["variance_refit"]
    with pytest.raises(ValueError, match="refit_batches >= 0"):
        evaluate(run, refit_batches=-1)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_refuses_an_existing_run_before_any_work(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("precious\n")
    with pytest.raises(RunDirError, match="already holds a run"):
        train(load_config("deepseek4-smoke", SMALL), run)
    assert (run / "metrics.jsonl").read_text() == "precious\n"


def test_non_finite_loss_stops_with_a_clear_message(tmp_path):
    cfg = load_config("deepseek4-smoke", {**SMALL, "learning_rate": 1e38,
                                          "warmup_steps_fraction": 0.0})
    with pytest.raises(FloatingPointError, match="the loss is"):
        train(cfg, tmp_path / "run")


def test_sigint_saves_a_checkpoint_and_resume_is_bit_exact(tmp_path):
    """Train 40 steps straight; train the same config in a subprocess, interrupt it with SIGINT
    after its first step, resume it: metrics, counts and the final state are identical."""
    over = {**SMALL, "steps": 40, "checkpoint_period": 100}
    cfg = load_config("deepseek4-smoke", over)
    train(cfg, tmp_path / "a")
    run = tmp_path / "b"
    args = [sys.executable, "-m", "moebalance.cli", "train", "deepseek4-smoke",
            *[f"{k}={v}" for k, v in over.items()], "--out", str(run)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read().decode()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == 128 + signal.SIGINT, output  # what a shell reports for Ctrl-C
    assert "checkpoint saved" in output
    stopped = len((run / "metrics.jsonl").read_text().splitlines())
    assert stopped < 40  # really interrupted
    with pytest.raises(RunDirError, match="--resume"):
        train(cfg, run)
    train(cfg, run, resume=True)

    def logs(path):
        rows = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]

    assert logs(run) == logs(tmp_path / "a")
    np.testing.assert_array_equal(np.fromfile(run / "expert_counts.i32", np.int32),
                                  np.fromfile(tmp_path / "a" / "expert_counts.i32", np.int32))
    states = []
    for path in (tmp_path / "a", run):
        model = DeepSeekV4(cfg, rngs=nnx.Rngs(1))  # other init: the restore must overwrite it
        opt = new_optimizer(cfg, model)
        mgr = checkpoint.manager(RunDir(path).checkpoints, 3)
        assert checkpoint.restore(mgr, model, opt) == 40
        states.append(nnx.to_flat_state(nnx.state(model)))
    for (p, va), (_, vb) in zip(*states):
        np.testing.assert_array_equal(np.asarray(va[...]), np.asarray(vb[...]), err_msg=str(p))


def _tensorboard_events(directory) -> list:
    """Read TensorBoard event files (TFRecord framing + Event protos) -> their Events."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    events = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        raw = path.read_bytes()
        at = 0
        while at < len(raw):
            (length,) = struct.unpack("<Q", raw[at:at + 8])
            events.append(Event.FromString(raw[at + 12: at + 12 + length]))
            at += 12 + length + 4
    return events


def _tensorboard_tags(directory) -> dict[str, list[int]]:
    """{tag: [steps]} of a TensorBoard directory's scalars."""
    tags = {}
    for event in _tensorboard_events(directory):
        for value in event.summary.value:
            tags.setdefault(value.tag, []).append(event.step)
    return tags


def test_tensorboard_writes_each_steps_scalars_as_one_event(tmp_path):
    from moebalance.training.hooks import TensorBoard

    layers = [{"layer": 0, "routing": "hash", "maxvio": 0.5, "variance": 2.0, "cv": 0.25},
              {"layer": 1, "routing": "topk", "maxvio": 1.5, "variance": 8.0, "cv": 0.75,
               "bias_std": 0.125}]
    records = [{"step": 4, "loss": 7.5, "grad_norm": 0.5, "layers": layers},
               {"step": 5, "loss": 7.25, "grad_norm": 0.25, "layers": layers,
                "validation": {"loss": 7.0, "perplexity": 1096.5, "maxvio_global": [0.0, 0.75]}}]
    hook = TensorBoard(RunDir(tmp_path / "run"))
    hook.start(4, 6)
    for record in records:
        hook.step(record, None)
    hook.close()
    written = {event.step: {v.tag: v.simple_value for v in event.summary.value}
               for event in _tensorboard_events(tmp_path / "run" / "tensorboard")
               if event.summary.value}
    per_layer = {"layer_00/maxvio": 0.5, "layer_00/variance": 2.0, "layer_00/cv": 0.25,
                 "layer_01/maxvio": 1.5, "layer_01/variance": 8.0, "layer_01/cv": 0.75,
                 "layer_01/bias_std": 0.125}
    assert written == {
        4: {"train/loss": 7.5, "train/grad_norm": 0.5, **per_layer},
        5: {"train/loss": 7.25, "train/grad_norm": 0.25, **per_layer, "validation/loss": 7.0,
            "validation/perplexity": 1096.5, "layer_00/maxvio_global": 0.0,
            "layer_01/maxvio_global": 0.75}}
    assert sum(bool(event.summary.value)
               for event in _tensorboard_events(tmp_path / "run" / "tensorboard")) == 2


def test_text_run_packs_documents_writes_tensorboard_evaluates_and_generates(tmp_path,
                                                                             capsys):
    from data_fixtures import text_config, write_corpus

    root = tmp_path / "corpus"
    write_corpus(root, n_docs=12)
    cfg = text_config(tmp_path, root, steps=3, per_device_batch_size=2,
                      gradient_accumulation_steps=1, hash_table="balanced")
    train(cfg, tmp_path / "run")
    run = tmp_path / "run"
    tags = _tensorboard_tags(run / "tensorboard")
    assert tags["train/loss"] == [0, 1, 2] and tags["layer_03/maxvio"] == [0, 1, 2]
    assert "layer_02/bias_std" in tags and "layer_00/bias_std" not in tags  # hash: no bias
    probe = json.loads((run / "probe_counts.json").read_text())
    assert list(probe["counts"]) == ["0", "3"] and probe["tokens"] == 2 * 16
    result = evaluate(run)
    assert result["step"] == 3 and np.isfinite(result["loss"]) and result["batches"] >= 1
    assert result["split"] == "eval"
    # the training split instead: its first 3 batches, every counted target recounted from the data
    seen = evaluate(run, batches=3, split="train")
    train_data = batches(cfg, "train")
    assert seen["split"] == "train" and seen["batches"] == 3
    assert seen["tokens"] == sum(int(train_data.batch(i)[1].sum()) for i in range(3))
    assert seen["loss"] != result["loss"]
    # the run keeps its tokenizer; `generate` samples from the latest checkpoint through it
    assert (run / "tokenizer.json").read_text() == train_data.tokenizer.to_str()
    generator = generate.load(run)
    assert generator.step == 3
    want = generator.complete("def f(", max_new_tokens=5, temperature=0.8, top_p=0.9, seed=1)
    capsys.readouterr()
    assert cli.main(["generate", str(run), "--prompt", "def f(", "--max-new-tokens", "5",
                     "--temperature", "0.8", "--top-p", "0.9", "--seed", "1", "-q"]) == 0
    assert capsys.readouterr().out == want + "\n"


def test_bad_data_fails_before_the_run_directory_is_touched(tmp_path):
    from data_fixtures import text_config, write_corpus

    from moebalance.data import DataError

    root = tmp_path / "corpus"
    write_corpus(root)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="dataset_path"):
        train(text_config(tmp_path, empty), tmp_path / "run")
    with pytest.raises(DataError, match="max_target_length"):
        train(text_config(tmp_path, root, max_target_length=4096), tmp_path / "run")
    with pytest.raises(ConfigError, match="tokenizer_vocab_size"):
        text_config(tmp_path, root, vocab_size=256)
    with pytest.raises(ConfigError, match="max_target_length"):
        load_config("deepseek4-smoke", {"max_target_length": 10**6})
    assert not (tmp_path / "run").exists()
