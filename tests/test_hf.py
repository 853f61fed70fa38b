"""Checkpoint interop, checked against files and logits that transformers itself produced
(tests/fixtures/hf/, made by tools/make_hf_fixture.py; no torch here)."""

import json
import logging
import re
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from moebalance import hf
from moebalance import safetensors_io as st
from moebalance.config import ConfigError, load_config
from moebalance.hf import names
from moebalance.model.transformer import DeepSeekV4

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
MODELS = ("tiny4", "tiny12")
LAYOUT_DIRS = {"transformers": "transformers", "memory": "transformers-memory"}
OVER = dict(mtp_num_layers=1, compress_ratios=[0, 0, 4, 8], max_target_length=16)


@nnx.jit
def _logits(model, tokens):
    return model(tokens).logits


def _expected(name):
    return st.load(FIXTURES / name / "expected.safetensors")


def _config_json(path):
    return json.loads((path / "config.json").read_text())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = load_config("deepseek4-smoke", OVER)
    model = DeepSeekV4(cfg, rngs=nnx.Rngs(0))
    model.segments[-1].ffn.bias[...] = jnp.linspace(-1, 1, 8)  # a non-zero fp32 bias
    path = tmp_path_factory.mktemp("ckpt") / "smoke"
    hf.save(model, cfg, path, max_shard_bytes=200_000)
    return cfg, model, path


@pytest.fixture(scope="module")
def tiny12_saved(tmp_path_factory):
    """The tiny12 fixture loaded from transformers' directory and written back by hf.save."""
    cfg, model = hf.load(FIXTURES / "tiny12" / "transformers")
    path = tmp_path_factory.mktemp("ckpt") / "tiny12"
    hf.save(model, cfg, path)
    return cfg, model, path


def _state(model):
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model))}


def _assert_same_model(a, b):
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for p in sa:
        np.testing.assert_array_equal(sa[p], sb[p], err_msg=str(p))
        assert sa[p].dtype == sb[p].dtype, p


# --- parity with transformers -----------------------------------------------------------------


@pytest.mark.parametrize("layout_dir", LAYOUT_DIRS)
@pytest.mark.parametrize("name", MODELS)
def test_transformers_layouts_load_with_its_logits(name, layout_dir):
    path = FIXTURES / name / layout_dir
    assert names.detect_layout(st.load(path / "model.safetensors")) == LAYOUT_DIRS[layout_dir]
    _, model = hf.load(path)
    expected = _expected(name)
    got = np.asarray(_logits(model, jnp.asarray(expected["input_ids"])))
    for key in ("logits", "logits_float64"):  # float32, and transformers' float64 forward
        want = expected[key]
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), key


@pytest.mark.parametrize("name", MODELS)
def test_both_config_styles_describe_the_same_model(name):
    new = hf.config_from_hf(_config_json(FIXTURES / name / "transformers"))
    flat = hf.config_from_hf(_config_json(FIXTURES / name / "memory"))
    assert new == flat
    assert new.mtp_num_layers == 1  # transformers writes 1; load() drops it without MTP tensors
    if name == "tiny12":
        assert new.first_num_hash_layers == 3 and new.rope_factor == 4.0
        assert new.compress_ratios == [0, 0, 4, 8, 4, 8, 4, 8, 4, 8, 0, 4]
        assert new.qk_rope_head_dim == 8 and new.max_target_length == 64  # 16 x YaRN 4


def test_save_writes_what_transformers_writes(tiny12_saved):
    """hf.save's tensors are save_pretrained's, bit for bit; its config.json keys are
    transformers' with transformers' values (the MTP count aside: transformers writes 1 for a
    model without one)."""
    cfg, model, path = tiny12_saved
    theirs = st.load(FIXTURES / "tiny12" / "transformers" / "model.safetensors")
    ours = st.load(path / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for n in theirs:
        assert ours[n].dtype == theirs[n].dtype, n
        np.testing.assert_array_equal(ours[n], theirs[n], err_msg=n)
    their_config = _config_json(FIXTURES / "tiny12" / "transformers")
    our_config = _config_json(path)
    assert our_config.pop("num_nextn_predict_layers") == 0
    del our_config["moebalance_config"]
    assert {k: their_config[k] for k in our_config} == our_config
    cfg2, model2 = hf.load(path)
    assert cfg2 == cfg
    _assert_same_model(model, model2)


def test_save_pretrained_names_are_deepseeks():
    """transformers' save_pretrained names are DeepSeek's release names under `model.` with the
    exceptions below (written out by hand): an independent check of our DeepSeek names."""
    exceptions = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
                  "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
                  "model.hc_head.hc_scale": "hc_head_scale"}
    files = st.load(FIXTURES / "tiny4" / "transformers" / "model.safetensors")
    release = {exceptions.get(n, n.removeprefix("model.").replace(".attn.norm.", ".attn.kv_norm."))
               for n in files}
    _, model = hf.load(FIXTURES / "tiny4" / "memory")
    assert set(hf.deepseek_tensors(model)) == release


# --- our own round trip, errors ---------------------------------------------------------------


def test_round_trip_is_bit_exact_and_sharded(saved, caplog):
    cfg, model, path = saved
    assert (path / "model.safetensors.index.json").exists()
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    with caplog.at_level(logging.INFO, logger="moebalance"):
        cfg2, model2 = hf.load(path)
    # a sharded checkpoint's load shows its progress, one note per shard
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        f"reading {name}" for name in shards] and len(shards) > 1
    assert caplog.records[-1].getMessage().startswith(f"reading {shards[-1]} ({len(shards)} of "
                                                      f"{len(shards)}, ")
    assert cfg2 == cfg  # incl. swiglu_limit 0 (off), written as transformers' Infinity
    assert _config_json(path)["swiglu_limit"] == float("inf")
    _assert_same_model(model, model2)  # every variable, the MTP layer's too


def test_names_and_layouts(saved):
    cfg, model, path = saved
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for f in set(index.values()):
        tensors.update(st.load(path / f))
    d, e, f_ = cfg.base_emb_dim, cfg.num_experts, cfg.base_moe_mlp_dim
    assert tensors["model.embed_tokens.weight"].shape == (cfg.vocab_size, d)
    assert tensors["head.weight"].shape == (cfg.vocab_size, d)
    w1 = np.asarray(model.segments[-1].ffn.w1[...])  # [E, D, F]
    np.testing.assert_array_equal(tensors["model.layers.3.ffn.experts.5.w1.weight"], w1[5].T)
    assert tensors["model.layers.3.ffn.experts.7.w2.weight"].shape == (d, f_)
    assert tensors["model.layers.0.ffn.gate.tid2eid"].shape == (cfg.vocab_size, 2)
    assert tensors["model.layers.0.ffn.gate.tid2eid"].dtype == np.int64
    assert "model.layers.0.ffn.gate.bias" not in tensors  # hash layers have none
    np.testing.assert_array_equal(tensors["model.layers.3.ffn.gate.bias"],
                                  np.asarray(model.segments[-1].ffn.bias[...]))
    assert "model.layers.2.attn.indexer.compressor.wkv.weight" in tensors
    assert "model.layers.1.attn.norm.weight" in tensors  # DeepSeek's attn.kv_norm.weight
    assert "mtp.0.e_proj.weight" in tensors and "mtp.0.attn.kv_norm.weight" in tensors
    config = _config_json(path)
    assert config["architectures"] == ["DeepseekV4ForCausalLM"]
    assert config["mlp_layer_types"] == ["hash_moe", "hash_moe", "moe", "moe"]
    assert config["compress_rates"]["heavily_compressed_attention"] == 8


def _copy(path, dst, edit):
    tensors = {}
    for f in path.glob("*.safetensors"):
        tensors.update({k: np.array(v) for k, v in st.load(f).items()})
    edit(tensors)
    dst.mkdir()
    st.save(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text((path / "config.json").read_text())


SAVED_LAYOUT = "read as transformers' save_pretrained layout"


def test_mismatched_checkpoints_name_the_tensor_and_layout(saved, tmp_path):
    _, _, path = saved
    name = "model.layers.1.attn.wq_b.weight"
    _copy(path, tmp_path / "a", lambda t: t.update({name: t[name][:-1]}))
    with pytest.raises(ValueError, match=f"tensor {name} .* has shape .*{SAVED_LAYOUT}"):
        hf.load(tmp_path / "a")
    _copy(path, tmp_path / "b", lambda t: t.pop("model.layers.1.attn.norm.weight"))
    with pytest.raises(ValueError, match=r"lacks tensor model.layers.1.attn.norm.weight "
                       rf"\(DeepSeek's layers.1.attn.kv_norm.weight\); .*{SAVED_LAYOUT}"):
        hf.load(tmp_path / "b")
    _copy(path, tmp_path / "c", lambda t: t.update({"model.layers.9.extra": np.zeros(2)}))
    with pytest.raises(ValueError, match=f"model.layers.9.extra matches nothing.*{SAVED_LAYOUT}"):
        hf.load(tmp_path / "c")
    _copy(path, tmp_path / "d", lambda t: [t.pop(n) for n in list(t)])
    with pytest.raises(ValueError, match="cannot tell the checkpoint's layout"):
        hf.load(tmp_path / "d")


def test_in_memory_layout_errors_name_the_fused_tensor(tmp_path):
    fused = "model.layers.2.mlp.experts.down_proj"
    _copy(FIXTURES / "tiny4" / "memory", tmp_path / "m", lambda t: t.pop(fused))
    with pytest.raises(ValueError, match=rf"lacks tensor {fused} \(DeepSeek's "
                       r"layers.2.ffn.experts.0.w2.weight\); .* in-memory state_dict names"):
        hf.load(tmp_path / "m")


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["compress_rates"].update(compressed_sparse_attention=8), "CSA layers compress 4"),
    (lambda c: c["mlp_layer_types"].reverse(), "hash_moe first"),
    (lambda c: c["rope_parameters"]["compress"].pop("attention_factor"), "attention_factor None"),
    (lambda c: c.pop("layer_types"), "no attention layers"),
])
def test_config_json_that_we_cannot_run_is_named(edit, message):
    config = _config_json(FIXTURES / "tiny12" / "transformers")
    edit(config)
    with pytest.raises(ConfigError, match=message):
        hf.config_from_hf(config)


def test_config_transformers_cannot_hold_is_refused(tmp_path):
    cfg = load_config("deepseek4-smoke", dict(compress_ratios=[8, 0, 4, 16]))
    with pytest.raises(ConfigError, match=r"one heavily-compressed ratio, .* \[8, 16\]"):
        hf.save(DeepSeekV4(cfg, rngs=nnx.Rngs(0)), cfg, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_save_refuses_to_overwrite(saved):
    cfg, model, path = saved
    with pytest.raises(FileExistsError, match="already holds a checkpoint"):
        hf.save(model, cfg, path)


def test_corrupt_file_is_reported(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{bad")
    with pytest.raises(st.SafetensorsError, match="corrupt"):
        st.load(tmp_path / "x.safetensors")


# --- quantised weights, DeepSeek's release layout ---------------------------------------------


def test_scale_names_become_deepseeks():
    assert names.deepseek_name("model.layers.0.attn.wq_b.weight_scale_inv", "transformers") == (
        "layers.0.attn.wq_b.scale")
    assert names.deepseek_name("model.layers.0.self_attn.q_b_proj.weight_scale_inv",
                               "transformers-memory") == "layers.0.attn.wq_b.scale"
    assert names.deepseek_name("layers.0.attn.wq_b.weight_scale_inv", "deepseek") == (
        "layers.0.attn.wq_b.scale")


def test_fp8_block_dequantization():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(300, 260)).astype(ml_dtypes.float8_e4m3fn)  # exact fp8 values
    exps = rng.integers(-3, 4, size=(3, 3))
    scale = (2.0 ** exps).astype(ml_dtypes.float8_e8m0fnu)
    want = np.zeros((300, 260), np.float32)
    for o in range(300):
        for i in range(260):
            want[o, i] = float(w[o, i]) * 2.0 ** exps[o // 128, i // 128]
    for s in (scale, scale.astype(np.float32)):  # ue8m0 or float32 scales
        got = hf.dequantize("a.weight", {"a.weight": w, "a.scale": s}, (300, 260))
        np.testing.assert_array_equal(got, want)


def test_fp4_dequantization_low_nibble_first():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, size=(4, 64))
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    exps = rng.integers(-2, 3, size=(4, 2))
    scale = (2.0 ** exps).astype(ml_dtypes.float8_e8m0fnu)
    table = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    want = np.array([[table[codes[o, i]] * 2.0 ** exps[o, i // 32] for i in range(64)]
                     for o in range(4)], np.float32)
    got = hf.dequantize("e.weight", {"e.weight": packed, "e.scale": scale}, (4, 64))
    np.testing.assert_array_equal(got, want)


def test_quantized_checkpoint_imports(saved, tmp_path):
    """An FP8 wq_b with transformers' `weight_scale_inv` (values exactly representable)."""
    _, model, path = saved
    name = "model.layers.3.attn.wq_b.weight"

    def quantize(t):
        q = t[name].astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
        t[name] = q
        t[name + "_scale_inv"] = np.ones((1, 1), ml_dtypes.float8_e8m0fnu)
        quantize.expected = q.astype(np.float32)

    _copy(path, tmp_path / "q", quantize)
    _, model2 = hf.load(tmp_path / "q")
    np.testing.assert_array_equal(np.asarray(model2.segments[-1].attn.wq_b[...]),
                                  quantize.expected.T)


def test_convert_command(saved, tmp_path):
    from moebalance.cli import main

    _, model, path = saved
    assert main(["convert", str(path), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    cfg, model2 = hf.load(tmp_path / "bf16")
    assert cfg.weight_dtype == "bfloat16"
    assert model2.segments[-1].attn.wq_a[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        model2.segments[-1].attn.wq_a[...],
        model.segments[-1].attn.wq_a[...].astype(jnp.bfloat16))
    assert model2.segments[-1].ffn.bias[...].dtype == jnp.float32  # the bias stays fp32
    assert main(["convert", str(path), str(tmp_path / "bf16")]) == 2  # refuses to overwrite


def _fp4(w, rng):
    """Replace w [out, in] by FP4-representable values; return (packed int8, e8m0 scales, w)."""
    codes = rng.integers(0, 16, size=w.shape)
    exps = rng.integers(-6, -2, size=(w.shape[0], w.shape[1] // 32))
    table = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    value = (table[codes] * np.repeat(2.0 ** exps, 32, axis=1)).astype(np.float32)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    return packed, (2.0 ** exps).astype(ml_dtypes.float8_e8m0fnu), value


def test_deepseek_release_layout_with_fp4_experts(tmp_path):
    cfg = load_config("deepseek4-smoke", dict(OVER, base_moe_mlp_dim=64))
    expected = hf.deepseek_tensors(DeepSeekV4(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    release = dict(expected)
    for name in expected:
        if re.fullmatch(r".*\.experts\.\d+\.w[13]\.weight", name):  # routed w1/w3 in FP4
            release[name], release[name[: -len("weight")] + "scale"], expected[name] = _fp4(
                expected[name], rng)
    (tmp_path / "ds").mkdir()
    st.save(release, tmp_path / "ds" / "model.safetensors")
    args = dict(vocab_size=256, dim=64, moe_inter_dim=64, n_layers=4, n_hash_layers=2, n_heads=4,
                n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
                score_func="sqrtsoftplus", route_scale=1.5, swiglu_limit=0.0, q_lora_rank=32,
                head_dim=16, rope_head_dim=8, o_groups=2, o_lora_rank=32, window_size=16,
                original_seq_len=65536, rope_theta=10000.0, rope_factor=1, beta_fast=32,
                beta_slow=1, index_n_heads=2, index_head_dim=16, index_topk=4, hc_mult=4,
                hc_sinkhorn_iters=20, compress_rope_theta=160000.0,
                compress_ratios=[0, 0, 4, 8, 0], n_mtp_layers=1)
    (tmp_path / "ds" / "config.json").write_text(json.dumps(args))
    cfg2, model2 = hf.load(tmp_path / "ds", max_target_length=16)
    assert cfg2.base_num_decoder_layers == 4 and cfg2.first_num_hash_layers == 2
    got = hf.deepseek_tensors(model2)
    assert sorted(got) == sorted(expected)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
