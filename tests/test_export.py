"""`moebalance export`, checked against what transformers itself read from an export of the same
run: tests/fixtures/export/ holds a tiny text run (config.yaml, tokenizer.json, its checkpoint)
and transformers' tokenizer ids and float32 logits of its export (made by
tools/make_export_fixture.py; no torch here)."""

import dataclasses
import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import yaml
from flax import nnx

from conftest import tolerance
from moebalance import cli, hf
from moebalance import safetensors_io as st
from moebalance.config import load_config
from moebalance.data.tokenizer import EOT, encode_documents, load_tokenizer
from moebalance.hf.export import transformers_differences
from moebalance.rundir import RunDir
from moebalance.training import checkpoint

FIXTURE = Path(__file__).parent / "fixtures" / "export"
RUN = RunDir(FIXTURE / "run")
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
TEXT_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
pytestmark = pytest.mark.usefixtures("moebalance_logger")  # cli.main sets its handlers


@pytest.fixture(scope="module")
def exported(tmp_path_factory, moebalance_logger):
    out = tmp_path_factory.mktemp("export") / "out"
    assert cli.main(["export", str(RUN.path), str(out), "-q"]) == 0
    return out


@nnx.jit
def _logits(model, tokens):
    return model(tokens).logits


def _texts():
    arrays = np.load(FIXTURE / "expected.npz")
    return [(text, arrays[f"ids_{i}"], arrays[f"logits_{i}"])
            for i, text in enumerate(EXPECTED["texts"])]


def _run_copy(tmp_path, tokenizer=True, **config) -> Path:
    """The fixture run copied to tmp_path/run, with `config` keys changed in its config.yaml."""
    run = tmp_path / "run"
    shutil.copytree(RUN.path, run, ignore=None if tokenizer else shutil.ignore_patterns(
        "tokenizer.json"))
    (run / "config.yaml").write_text(yaml.safe_dump({**RUN.config_dict(), **config}))
    return run


def _json(path):
    return json.loads(path.read_text())


def test_export_writes_what_transformers_loads(exported):
    assert sorted(p.name for p in exported.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", *TEXT_FILES])
    assert not Path(f"{exported}.partial").exists()
    assert (exported / "tokenizer.json").read_bytes() == RUN.tokenizer.read_bytes()
    config = _json(exported / "config.json")
    assert config["architectures"] == ["DeepseekV4ForCausalLM"] and config["dtype"] == "float32"
    assert config["bos_token_id"] == config["eos_token_id"] == EXPECTED["eos_token_id"] == 0
    assert _json(exported / "generation_config.json") == {
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "do_sample": False}
    tokenizer = _json(exported / "tokenizer_config.json")
    assert tokenizer["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tokenizer["eos_token"] == tokenizer["bos_token"] == tokenizer["pad_token"] == EOT
    assert tokenizer["split_special_tokens"] is True and tokenizer["add_bos_token"] is False
    assert tokenizer["model_max_length"] == RUN.config().max_target_length == 32
    assert _json(exported / "special_tokens_map.json")["eos_token"] == EOT


def test_our_tokenizer_gives_transformers_ids():
    """The ids training gives each text (the run's tokenizer loaded as training loads it, then
    encoded as documents are) are those transformers' AutoTokenizer gave for the export."""
    cfg = dataclasses.replace(RUN.config(), tokenizer_path=str(RUN.tokenizer))
    tokenizer, _ = load_tokenizer(cfg, [])
    eot = tokenizer.token_to_id(EOT)
    for text, ids, _ in _texts():
        assert encode_documents(tokenizer, [text], eot).tolist() == [*ids.tolist(), eot], text
    literal, ids, _ = _texts()[-1]  # literal '<|endoftext|>' is text here and in training,
    assert EOT in literal and eot not in ids  # not with transformers' default:
    assert eot in EXPECTED["split_special_tokens_false_ids"][literal]


def test_logits_match_transformers(exported):
    """Our model loaded back from the export gives transformers' logits, and the same logits as
    the run's own checkpoint: the export is the checkpoint, calibrated biases included."""
    cfg, model = hf.load(exported)
    checkpoint_model, step = checkpoint.restore_model(RUN.config(), RUN.checkpoints)
    assert step == 4
    texts = _texts()  # one batch padded to the full length: logits are causal
    tokens = np.zeros((len(texts), cfg.max_target_length), np.int32)
    for row, (_, ids, _) in zip(tokens, texts):
        row[:len(ids) + 1] = [EXPECTED["eos_token_id"], *ids]
    got = np.asarray(_logits(model, jnp.asarray(tokens)))
    for (text, _, want), ours in zip(texts, got):
        np.testing.assert_allclose(ours[:len(want)], want,
                                   **tolerance(want, atol=1e-5 * np.abs(want).max()), err_msg=text)
    np.testing.assert_array_equal(np.asarray(_logits(checkpoint_model, jnp.asarray(tokens))), got)


def test_an_out_holding_files_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for extra, reason in (([], "already holds files"), (["--overwrite"], "no earlier export")):
        assert cli.main(["export", str(RUN.path), str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"moebalance: {out} ") and reason in err
        assert len(err.splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert not Path(f"{out}.partial").exists()
    (tmp_path / "file").write_text("x")
    assert cli.main(["export", str(RUN.path), str(tmp_path / "file")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_overwrite_replaces_an_earlier_export(exported, tmp_path, capsys):
    """--overwrite replaces an export whole (nothing of it is left); --step and --dtype."""
    out = tmp_path / "out"
    shutil.copytree(exported, out)
    (out / "stale.bin").write_bytes(b"old")
    assert cli.main(["export", str(RUN.path), str(out)]) == 2
    assert "already holds files" in capsys.readouterr().err
    assert cli.main(["export", str(RUN.path), str(out), "--overwrite", "--step", "4",
                     "--dtype", "bfloat16"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out} (step 4, bfloat16, with tokenizer)"
    assert not (out / "stale.bin").exists() and _json(out / "config.json")["dtype"] == "bfloat16"
    tensors = st.load(out / "model.safetensors")
    assert tensors["model.embed_tokens.weight"].dtype == ml_dtypes.bfloat16
    assert tensors["model.layers.2.ffn.gate.bias"].dtype == np.float32  # fp32 island kept
    want = st.load(exported / "model.safetensors")["model.embed_tokens.weight"]
    np.testing.assert_array_equal(tensors["model.embed_tokens.weight"],
                                  want.astype(ml_dtypes.bfloat16))


def test_a_missing_step_is_named(tmp_path, capsys):
    assert cli.main(["export", str(RUN.path), str(tmp_path / "out"), "--step", "3"]) == 2
    err = capsys.readouterr().err
    assert f"{RUN.checkpoints} has no checkpoint of step 3 (it holds steps [4])" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_an_interrupted_export_leaves_no_complete_looking_out(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"

    def interrupted(*args):
        raise OSError("disk full")

    monkeypatch.setattr("moebalance.hf.export.shutil.copyfile", interrupted)
    assert cli.main(["export", str(RUN.path), str(out)]) == 2
    assert "disk full" in capsys.readouterr().err
    assert not out.exists() and (tmp_path / "out.partial" / "config.json").exists()
    monkeypatch.undo()
    assert cli.main(["export", str(RUN.path), str(out), "-q"]) == 0  # the leftover is replaced
    assert not (tmp_path / "out.partial").exists() and (out / "tokenizer.json").exists()


def test_a_synthetic_run_exports_weights_without_a_tokenizer(tmp_path, capsys):
    run = _run_copy(tmp_path, tokenizer=False, dataset_type="synthetic", dataset_path=[])
    out = tmp_path / "out"
    assert cli.main(["export", str(run), str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err == (f"{run}/tokenizer.json does not exist (a synthetic-data run has "
                            "none): exported the weights without a tokenizer\n")
    assert captured.out.strip() == f"wrote {out} (step 4, float32, no tokenizer)"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json",
                                                    "model.safetensors"]
    config = _json(out / "config.json")  # not transformers' defaults (bos 0, eos 1)
    assert config["bos_token_id"] is None and config["eos_token_id"] is None
    assert _json(out / "generation_config.json") == {"do_sample": False}


def test_a_setting_transformers_cannot_express_is_refused_first(tmp_path, capsys):
    """Refused in one line before the checkpoint is read (this copy has none) or OUT written."""
    run = _run_copy(tmp_path, norm_topk_prob=False)
    shutil.rmtree(run / "checkpoints")
    assert cli.main(["export", str(run), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == ("moebalance: transformers' DeepSeek-V4 cannot express this run's "
                   "norm_topk_prob false (transformers always renormalises the chosen experts' "
                   "weights); not exported\n")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_an_unreadable_tokenizer_is_named(tmp_path, capsys):
    run = _run_copy(tmp_path)
    (run / "tokenizer.json").write_text("{not json")
    assert cli.main(["export", str(run), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moebalance: {run}/tokenizer.json cannot be read as a tokenizer (")
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("overrides, reason", [
    (["norm_topk_prob=false"], "norm_topk_prob false"),
    (["routed_score_func=softmax"], "routed_score_func softmax"),
    (["n_routing_groups=2", "topk_routing_group=1"], "n_routing_groups: group-limited routing "
                                                     "(1 of 2 groups"),
    (["routed_device_limit=1", "ici_expert_parallelism=2"], "routed_device_limit: "
                                                            "group-limited routing (1 of 2"),
    (["compress_ratios=[0,8,16,0]"], "one heavily-compressed ratio"),
])
def test_refused_settings(overrides, reason):
    with pytest.raises(ValueError, match=reason.replace("(", r"\(")):
        transformers_differences(load_config("deepseek4-smoke", overrides))


@pytest.mark.parametrize("overrides, warnings", [
    ([], []),
    (["n_routing_groups=2", "topk_routing_group=2"], []),  # every group kept: plain top-k
    (["routed_score_func=sigmoid", "swiglu_limit=0"], []),  # no clamp: Infinity, exact
    (["capacity_factor=1.25"], ["capacity_factor 1.25: this run drops assignments over an "
                                "expert's capacity, transformers drops none, so its logits "
                                "differ wherever an expert overflows"]),
    (["mtp_num_layers=1"], ["the MTP layer is written as mtp.0.* tensors, which transformers "
                            "does not load: same logits, no multi-token prediction there"]),
])
def test_warned_settings(overrides, warnings):
    assert transformers_differences(load_config("deepseek4-smoke", overrides)) == warnings
