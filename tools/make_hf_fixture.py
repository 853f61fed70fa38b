"""Build the transformers parity fixtures of tests/test_hf.py under tests/fixtures/hf/.

Needs torch and transformers (>= 5.18, with DeepseekV4ForCausalLM), which are no dependencies of
moebalance or of its CI, and this project's venv for the moebalance side:

    PYTHON_WITH_TORCH tools/make_hf_fixture.py [--moebalance-python .venv/bin/python]

For two tiny random DeepSeek-V4 models built with transformers (`tiny4`: 4 layers, sliding / CSA /
HCA, one hash layer; `tiny12`: 12 layers, 3 hash layers, CSA and HCA, YaRN on the compressed RoPE)
it writes under <model>/:
    transformers/         save_pretrained's directory
    memory/               model.state_dict() (transformers' in-memory names) in one safetensors
                          file, with a flat-style config.json (compress_ratios, num_hash_layers,
                          qk_rope_head_dim, rope_scaling) that transformers reads as the same model
    expected.safetensors  input_ids [2, 32] and transformers' logits [2, 32, V] in float32
                          (logits) and, for the size of float32 round-off, in float64
Then moebalance (a subprocess in its own venv) loads each transformers/ directory and writes it
back with hf.save; transformers loads that and its logits are compared with the originals. The
same is done for a model moebalance builds (deepseek4-smoke with an MTP layer and no SwiGLU
clamp), with moebalance's logits as the reference. parity.json records all of it.

Every weight is drawn at O(1) scale (transformers initialises norms to 1 and sinks, biases and
position biases to 0, which would leave them untested), and the indexer has 64 heads: with a few
heads many indexer scores are exactly 0 and torch.topk and jax.lax.top_k break such ties
differently (docs/hf.md, "Ties in the indexer").
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "hf"
BATCH, SEQ = 2, 32

COMMON = dict(  # tiny dims; 64 indexer heads of width 8 (see the module docstring)
    vocab_size=64, hidden_size=16, moe_intermediate_size=8, num_attention_heads=4, head_dim=16,
    partial_rotary_factor=0.5, q_lora_rank=8, o_groups=2, o_lora_rank=8, sliding_window=8,
    n_routed_experts=4, num_experts_per_tok=2, index_n_heads=64, index_head_dim=8, index_topk=4,
    hc_mult=4, routed_scaling_factor=1.5, swiglu_limit=1.0, max_position_embeddings=64,
)
S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
MODELS = {
    "tiny4": dict(num_hidden_layers=4, layer_types=[S, C, H, C],
                  compress_rates={C: 4, H: 8}, mlp_layer_types=["hash_moe"] + ["moe"] * 3),
    "tiny12": dict(num_hidden_layers=12, layer_types=[S, S, C, H, C, H, C, H, C, H, S, C],
                   compress_rates={C: 4, H: 8}, mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 9,
                   rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 16,
                                    "beta_fast": 32, "beta_slow": 1}),
}
# moebalance's own model for the other direction (its hf.save output read by transformers)
OURS = dict(mtp_num_layers=1, compress_ratios=[0, 0, 4, 8], max_target_length=SEQ,
            index_n_heads=64, index_head_dim=8)


# --- the transformers side (run with torch) ---------------------------------------------------


def _randomize(model, seed: int) -> None:
    """O(1)-scale weights: matrices ~ N(0, 1/fan_in), norm weights ~ 1 + N(0, 0.2^2), other
    vectors ~ N(0, 0.5^2); hash tables: distinct random experts per token."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    experts = model.config.n_routed_experts
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("tid2eid"):
                rows = [torch.randperm(experts, generator=gen)[: tensor.shape[1]]
                        for _ in range(tensor.shape[0])]
                tensor.copy_(torch.stack(rows))
            elif name.endswith("norm.weight"):
                tensor.copy_(1 + 0.2 * torch.randn(tensor.shape, generator=gen))
            elif tensor.ndim >= 2:
                tensor.copy_(torch.randn(tensor.shape, generator=gen) / tensor.shape[-1] ** 0.5)
            else:
                tensor.copy_(0.5 * torch.randn(tensor.shape, generator=gen))


def _flat_config(config: dict, hashed: int) -> dict:
    """The same model in the flat style that transformers still accepts."""
    rates = config["compress_rates"]
    out = {k: v for k, v in config.items() if k not in (
        "layer_types", "compress_rates", "mlp_layer_types", "rope_parameters",
        "partial_rotary_factor", "dtype", "qk_rope_head_dim")}
    ratios = {S: 0, C: 4, H: 128}
    out.update(compress_ratios=[ratios[t] for t in config["layer_types"]],
               compress_rate_hca=rates[H], num_hash_layers=hashed,
               qk_rope_head_dim=int(config["head_dim"] * config["partial_rotary_factor"]),
               torch_dtype="float32")
    compress = config["rope_parameters"]["compress"]
    if compress["rope_type"] == "yarn":
        out["rope_scaling"] = {"rope_type": "yarn", **{k: compress[k] for k in (
            "factor", "original_max_position_embeddings", "beta_fast", "beta_slow")}}
    return out


def _logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


def build(name: str, spec: dict, seed: int) -> dict:
    import torch
    from safetensors.torch import save_file
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**COMMON, **spec)).eval()
    _randomize(model, seed)
    ids = np.random.default_rng(seed).integers(0, COMMON["vocab_size"], (BATCH, SEQ))
    logits = _logits(model, ids)
    out = OUT / name
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out / "transformers")
    (out / "transformers" / "generation_config.json").unlink()
    (out / "memory").mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(out / "memory" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "transformers" / "config.json").read_text())
    flat = _flat_config(config, spec["mlp_layer_types"].count("hash_moe"))
    (out / "memory" / "config.json").write_text(json.dumps(flat, indent=2) + "\n")
    same = DeepseekV4Config(**flat)  # transformers reads the flat config as the same model
    for key in ("layer_types", "compress_rates", "mlp_layer_types", "rope_parameters"):
        assert getattr(same, key) == config[key], (key, getattr(same, key), config[key])
    reread = _logits(DeepseekV4ForCausalLM.from_pretrained(out / "memory"), ids)
    assert difference(reread, logits)["max_rel"] < 1e-6, "transformers reads memory/ otherwise"
    exact = DeepseekV4ForCausalLM.from_pretrained(out / "transformers",
                                                  experts_implementation="eager").double()
    with torch.no_grad():
        logits64 = exact(torch.as_tensor(ids)).logits.numpy()
    save_file({"input_ids": torch.as_tensor(ids), "logits": torch.as_tensor(logits),
               "logits_float64": torch.as_tensor(logits64)}, str(out / "expected.safetensors"))
    return {"transformers_float32_vs_float64": difference(logits, logits64)}


def difference(got: np.ndarray, want: np.ndarray) -> dict:
    err = float(np.abs(got - want).max())
    return {"max_abs": err, "max_rel": err / float(np.abs(want).max())}


def check_in_transformers(saved: Path, ids: np.ndarray, want: np.ndarray) -> dict:
    """Load moebalance's hf.save output with from_pretrained; its logits against `want`."""
    from safetensors import safe_open
    from transformers import DeepseekV4ForCausalLM

    model, info = DeepseekV4ForCausalLM.from_pretrained(saved, output_loading_info=True)
    problems = {k: sorted(v) for k, v in info.items() if v}
    assert not problems, f"from_pretrained({saved}): {problems}"
    mtp = [n for n in safe_open(str(saved / "model.safetensors"), "np").keys()
           if n.startswith("mtp.")]  # our MTP layer, which from_pretrained ignores
    result = {**difference(_logits(model.eval(), ids), want), "mtp_tensors_ignored": len(mtp)}
    assert result["max_rel"] <= 1e-5, f"transformers' logits of {saved} differ: {result}"
    return result


# --- the moebalance side (run in the project's venv) ------------------------------------------


def moebalance_side(work: Path) -> None:
    """Write each fixture back with hf.save, and our own model with its logits, under `work`."""
    import jax.numpy as jnp
    from flax import nnx

    from moebalance import hf
    from moebalance.config import load_config
    from moebalance.model.transformer import DeepSeekV4

    for name in MODELS:
        config, model = hf.load(OUT / name / "transformers")
        hf.save(model, config, work / name)
    config = load_config("deepseek4-smoke", OURS)
    model = DeepSeekV4(config, rngs=nnx.Rngs(0))
    hf.save(model, config, work / "ours")
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (BATCH, SEQ))
    np.save(work / "ours_ids.npy", ids)
    np.save(work / "ours_logits.npy", np.asarray(model(jnp.asarray(ids)).logits))


# --- both sides -------------------------------------------------------------------------------


def command_line(doc: str, moebalance_side) -> str | None:
    """The command line of a fixture tool with a moebalance side: in the subprocess that
    `run_moebalance_side` starts, run `moebalance_side(directory)` and return None; otherwise
    return the python of moebalance's venv (--moebalance-python)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--moebalance-python", default=str(ROOT / ".venv" / "bin" / "python"))
    parser.add_argument("--moebalance-side", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.moebalance_side:
        moebalance_side(args.moebalance_side)
        return None
    return args.moebalance_python


def run_moebalance_side(python: str, script: str, work: Path) -> None:
    """`script`'s moebalance side in moebalance's venv, writing into `work`."""
    subprocess.run([python, script, "--moebalance-side", str(work)], check=True, cwd=ROOT)


def main() -> int:
    python = command_line(__doc__, moebalance_side)
    if python is None:
        return 0
    from safetensors.numpy import load_file

    parity = {name: build(name, spec, seed) for seed, (name, spec) in enumerate(MODELS.items())}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        run_moebalance_side(python, __file__, work)
        for name in MODELS:
            expected = load_file(str(OUT / name / "expected.safetensors"))
            parity[name]["moebalance_save_in_transformers"] = check_in_transformers(
                work / name, expected["input_ids"], expected["logits"])
        parity["moebalance-smoke-mtp"] = check_in_transformers(
            work / "ours", np.load(work / "ours_ids.npy"), np.load(work / "ours_logits.npy"))
        assert parity["moebalance-smoke-mtp"]["mtp_tensors_ignored"] > 0, "our MTP was not saved"
    import torch
    import transformers

    parity["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    (OUT / "parity.json").write_text(json.dumps(parity, indent=2) + "\n")
    print(json.dumps(parity, indent=2))
    size = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"fixtures: {size / 1e6:.2f} MB under {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
