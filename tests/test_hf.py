import json
import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from moebalance import hf
from moebalance import safetensors_io as st
from moebalance.config import load_config
from moebalance.model.transformer import DeepSeekV4

OVER = dict(mtp_num_layers=1, compress_ratios=[0, 0, 4, 8], max_target_length=16)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = load_config("deepseek4-smoke", OVER)
    model = DeepSeekV4(cfg, rngs=nnx.Rngs(0))
    model.segments[-1].ffn.bias[...] = jnp.linspace(-1, 1, 8)  # a non-zero fp32 bias
    path = tmp_path_factory.mktemp("ckpt") / "smoke"
    hf.save(model, cfg, path, max_shard_bytes=200_000)
    return cfg, model, path


def test_round_trip_is_bit_exact_and_sharded(saved):
    cfg, model, path = saved
    assert (path / "model.safetensors.index.json").exists()
    cfg2, model2 = hf.load(path)
    assert cfg2 == cfg
    before = nnx.to_flat_state(nnx.state(model))
    after = dict(nnx.to_flat_state(nnx.state(model2)))
    assert len(before) == len(after)
    for p, v in before:
        np.testing.assert_array_equal(np.asarray(v[...]), np.asarray(after[p][...]),
                                      err_msg=str(p))
        assert v[...].dtype == after[p][...].dtype
    tokens = jnp.arange(16)[None] % 256
    out1, out2 = model(tokens, mtp_tokens=tokens), model2(tokens, mtp_tokens=tokens)
    np.testing.assert_array_equal(out1.logits, out2.logits)


def test_hf_names_and_layouts(saved):
    cfg, model, path = saved
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for f in set(index.values()):
        tensors.update(st.load(path / f))
    d, e, f_ = cfg.base_emb_dim, cfg.num_experts, cfg.base_moe_mlp_dim
    assert tensors["model.embed_tokens.weight"].shape == (cfg.vocab_size, d)
    assert tensors["lm_head.weight"].shape == (cfg.vocab_size, d)
    assert tensors["model.layers.3.mlp.experts.gate_up_proj"].shape == (e, 2 * f_, d)
    assert tensors["model.layers.3.mlp.experts.down_proj"].shape == (e, d, f_)
    assert tensors["model.layers.0.mlp.gate.tid2eid"].shape == (cfg.vocab_size, 2)
    assert "model.layers.0.mlp.gate.e_score_correction_bias" not in tensors
    np.testing.assert_array_equal(tensors["model.layers.3.mlp.gate.e_score_correction_bias"],
                                  np.asarray(model.segments[-1].ffn.bias[...]))
    q_a = np.asarray(model.segments[-1].attn.wq_a[...])
    np.testing.assert_array_equal(tensors["model.layers.3.self_attn.q_a_proj.weight"], q_a.T)
    assert "model.layers.2.self_attn.compressor.indexer.q_b_proj.weight" in tensors
    assert "mtp.0.e_proj.weight" in tensors
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV4ForCausalLM"]
    assert config["num_hash_layers"] == 2 and config["compress_ratios"] == [0, 0, 4, 8]


def _copy(path, dst, edit):
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for f in set(index.values()):
        tensors.update({k: np.array(v) for k, v in st.load(path / f).items()})
    edit(tensors)
    dst.mkdir()
    st.save(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text((path / "config.json").read_text())


def test_mismatched_checkpoints_name_the_tensor(saved, tmp_path):
    _, _, path = saved
    name = "model.layers.1.self_attn.q_b_proj.weight"
    _copy(path, tmp_path / "a", lambda t: t.update({name: t[name][:-1]}))
    with pytest.raises(ValueError, match=f"tensor {name} has shape"):
        hf.load(tmp_path / "a")
    _copy(path, tmp_path / "b", lambda t: t.pop("model.norm.weight"))
    with pytest.raises(ValueError, match="lacks tensor model.norm.weight"):
        hf.load(tmp_path / "b")
    _copy(path, tmp_path / "c", lambda t: t.update({"model.layers.9.extra": np.zeros(2)}))
    with pytest.raises(ValueError, match="model.layers.9.extra matches nothing"):
        hf.load(tmp_path / "c")


def test_save_refuses_to_overwrite(saved):
    cfg, model, path = saved
    with pytest.raises(FileExistsError, match="already holds a checkpoint"):
        hf.save(model, cfg, path)


def test_corrupt_file_is_reported(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{bad")
    with pytest.raises(st.SafetensorsError, match="corrupt"):
        st.load(tmp_path / "x.safetensors")


def test_fp8_block_dequantization():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(300, 260)).astype(ml_dtypes.float8_e4m3fn)  # exact fp8 values
    exps = rng.integers(-3, 4, size=(3, 3))
    scale = (2.0 ** exps).astype(ml_dtypes.float8_e8m0fnu)
    got = hf.dequantize("a.weight", {"a.weight": w, "a.weight_scale_inv": scale}, (300, 260))
    want = np.zeros((300, 260), np.float32)
    for o in range(300):
        for i in range(260):
            want[o, i] = float(w[o, i]) * 2.0 ** exps[o // 128, i // 128]
    np.testing.assert_array_equal(got, want)
    # DeepSeek's own naming: `<module>.scale`
    got2 = hf.dequantize("a.weight", {"a.weight": w, "a.scale": scale.astype(np.float32)},
                         (300, 260))
    np.testing.assert_array_equal(got2, want)


def test_fp4_dequantization_low_nibble_first():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, size=(4, 64))
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    exps = rng.integers(-2, 3, size=(4, 2))
    scale = (2.0 ** exps).astype(ml_dtypes.float8_e8m0fnu)
    table = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    want = np.array([[table[codes[o, i]] * 2.0 ** exps[o, i // 32] for i in range(64)]
                     for o in range(4)], np.float32)
    got = hf.dequantize("e.weight", {"e.weight": packed, "e.weight_scale_inv": scale}, (4, 64))
    np.testing.assert_array_equal(got, want)


def test_quantized_checkpoint_imports(saved, tmp_path):
    """An FP8-quantised q_b_proj (values exactly representable) imports to the same model."""
    _, model, path = saved
    name = "model.layers.3.self_attn.q_b_proj.weight"

    def quantize(t):
        w = t[name].astype(np.float32)
        q = w.astype(ml_dtypes.float8_e4m3fn)
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


# HF name inside a block -> DeepSeek's release name (from DeepSeek's inference code), written out
# by hand as an independent check of hf.official_to_hf.
OFFICIAL = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight":
    "ffn_norm.weight", "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight", "self_attn.q_a_norm.weight":
    "attn.q_norm.weight", "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight", "self_attn.kv_norm.weight":
    "attn.kv_norm.weight", "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight", "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
}
for _s in ("attn", "ffn"):
    for _p in ("fn", "base", "scale"):
        OFFICIAL[f"{_s}_hc.{_p}"] = f"hc_{_s}_{_p}"


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
    model = DeepSeekV4(cfg, rngs=nnx.Rngs(0))
    tensors = hf.to_hf_tensors(model)
    rng = np.random.default_rng(0)
    official = {}
    top = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
           "model.norm.weight": "norm.weight"}
    for name, value in tensors.items():
        m = re.fullmatch(r"(model\.layers\.\d+|mtp\.0)\.(.*)", name)
        prefix, rest = (m.group(1).removeprefix("model."), m.group(2)) if m else (None, None)
        if rest == "mlp.experts.gate_up_proj":  # per expert, in FP4
            f_ = value.shape[1] // 2
            for e in range(value.shape[0]):
                for w, rows in (("w1", slice(0, f_)), ("w3", slice(f_, None))):
                    packed, scale, exact = _fp4(value[e, rows], rng)
                    official[f"{prefix}.ffn.experts.{e}.{w}.weight"] = packed
                    official[f"{prefix}.ffn.experts.{e}.{w}.scale"] = scale
                    value[e, rows] = exact  # what the import must reproduce
        elif rest == "mlp.experts.down_proj":
            for e in range(value.shape[0]):
                official[f"{prefix}.ffn.experts.{e}.w2.weight"] = value[e]
        elif rest in OFFICIAL:
            official[f"{prefix}.{OFFICIAL[rest]}"] = value
        elif name in top:
            official[top[name]] = value
        elif "hc_head.hc_" in name:
            official[name.replace("model.", "").replace("hc_head.hc_", "hc_head_")] = value
        else:  # mtp.0.e_proj / h_proj / enorm / hnorm / norm keep their names
            official[name] = value
    (tmp_path / "ds").mkdir()
    st.save(official, tmp_path / "ds" / "model.safetensors")
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
    got = hf.to_hf_tensors(model2)
    assert sorted(got) == sorted(tensors)
    for name in tensors:
        np.testing.assert_array_equal(got[name], tensors[name], err_msg=name)
