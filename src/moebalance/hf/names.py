"""Tensor names of the three DeepSeek-V4 checkpoint layouts, and the renaming between them.

DeepSeek's release names are the pivot: `hf.load` renames a checkpoint to them, `hf.save` renames
from them. The layouts (checked against transformers 5.18's `DeepseekV4ForCausalLM`):

    deepseek             DeepSeek's release: embed.weight, head.weight, norm.weight,
                         hc_head_{fn,base,scale}, layers.N.attn.wq_a.weight,
                         layers.N.attn.kv_norm.weight, layers.N.ffn.experts.J.w1.weight,
                         layers.N.hc_attn_fn, mtp.0.* (the MTP layer), ...
    transformers         transformers' `save_pretrained`: DeepSeek's names under `model.`
                         (model.layers.N.attn.wq_a.weight, model.layers.N.ffn.gate.tid2eid, ...)
                         except model.embed_tokens.weight, head.weight, model.norm.weight,
                         model.hc_head.hc_{fn,base,scale} and model.layers.N.attn.norm.weight for
                         DeepSeek's attn.kv_norm.weight. transformers has no MTP layer; ours keeps
                         DeepSeek's names (mtp.0.*), which `from_pretrained` ignores.
    transformers-memory  transformers' module names (`model.state_dict()`):
                         model.layers.N.self_attn.q_a_proj.weight, lm_head.weight, ..., routed
                         experts fused as mlp.experts.gate_up_proj [E, 2F, D] (w1 rows, then w3)
                         and mlp.experts.down_proj [E, D, F]; an MTP layer under mtp.0. with the
                         same block names (what moebalance wrote before it wrote `transformers`).

FP8 scales named `<module>.weight_scale_inv` (transformers) are DeepSeek's `<module>.scale`.
"""

from __future__ import annotations

import re

import numpy as np

LAYOUTS = {
    "deepseek": "DeepSeek's release layout",
    "transformers": "transformers' save_pretrained layout",
    "transformers-memory": "transformers' in-memory state_dict names",
}

# Names that only one layout has (its head and the block prefix): the layout with most wins.
_MARKERS = {
    "deepseek": re.compile(r"embed\.weight|layers\.\d+\..*"),
    "transformers": re.compile(r"head\.weight|model\.layers\.\d+\.(attn|ffn)\..*"),
    "transformers-memory": re.compile(r"lm_head\.weight|model\.layers\.\d+\.(self_attn|mlp)\..*"),
}


def _memory_block() -> dict[str, str]:
    """transformers' module name inside a block -> DeepSeek's."""
    out = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.sinks": "attn.attn_sink",
        "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
        "self_attn.compressor.indexer.scorer.weights_proj.weight":
            "attn.indexer.weights_proj.weight",
        "mlp.gate.weight": "ffn.gate.weight",
        "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
        "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    }
    for ours, theirs in (("q_a_proj", "wq_a"), ("q_a_norm", "q_norm"), ("q_b_proj", "wq_b"),
                         ("kv_proj", "wkv"), ("kv_norm", "kv_norm"), ("o_a_proj", "wo_a"),
                         ("o_b_proj", "wo_b")):
        out[f"self_attn.{ours}.weight"] = f"attn.{theirs}.weight"
    for ours, theirs in (("self_attn.compressor", "attn.compressor"),
                         ("self_attn.compressor.indexer", "attn.indexer.compressor")):
        out[f"{ours}.position_bias"] = f"{theirs}.ape"
        for part, ds in (("kv_norm", "norm"), ("kv_proj", "wkv"), ("gate_proj", "wgate")):
            out[f"{ours}.{part}.weight"] = f"{theirs}.{ds}.weight"
    for part, w in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        out[f"mlp.shared_experts.{part}.weight"] = f"ffn.shared_experts.{w}.weight"
    for sub in ("attn", "ffn"):
        for p in ("fn", "base", "scale"):
            out[f"{sub}_hc.{p}"] = f"hc_{sub}_{p}"
    return out


_MEMORY_BLOCK = _memory_block()
_SAVED_BLOCK = {"attn.norm.weight": "attn.kv_norm.weight"}  # save_pretrained's exception
_HEAD = {f"model.hc_head.hc_{p}": f"hc_head_{p}" for p in ("fn", "base", "scale")}
_TOP = {  # transformers' names outside the blocks -> DeepSeek's
    "transformers": {"model.embed_tokens.weight": "embed.weight", "head.weight": "head.weight",
                     "model.norm.weight": "norm.weight", **_HEAD},
    "transformers-memory": {
        "model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
        "model.norm.weight": "norm.weight", **_HEAD,
        **{f"mtp.0.hc_head.hc_{p}": f"mtp.0.hc_head_{p}" for p in ("fn", "base", "scale")},
        **{f"mtp.0.{n}.weight": f"mtp.0.{n}.weight"
           for n in ("e_proj", "h_proj", "enorm", "hnorm", "norm")},
    },
}
_INVERSE = {layout: {v: k for k, v in table.items()} for layout, table in
            (("transformers", _TOP["transformers"]),
             ("transformers-memory", _TOP["transformers-memory"]),
             ("saved block", _SAVED_BLOCK), ("memory block", _MEMORY_BLOCK))}
_IN_BLOCK = re.compile(r"(model\.layers\.\d+|mtp\.0)\.(.+)")  # transformers' block names
_IN_DEEPSEEK_BLOCK = re.compile(r"(layers\.\d+|mtp\.0)\.(.+)")
_FUSED = re.compile(r"(model\.layers\.\d+|mtp\.0)\.mlp\.experts\.(gate_up_proj|down_proj)")
_EXPERT = re.compile(r"(layers\.\d+|mtp\.0)\.ffn\.experts\.(\d+)\.(w[123])\.weight")


def detect_layout(names) -> str:
    """The layout whose characteristic names the checkpoint holds most of."""
    counts = {layout: sum(1 for n in names if marker.fullmatch(n))
              for layout, marker in _MARKERS.items()}
    best = max(counts, key=counts.get)
    if counts[best] == 0:
        raise ValueError("cannot tell the checkpoint's layout: no tensor is named like DeepSeek's "
                         "release (embed.weight, layers.N.*), transformers' save_pretrained "
                         "(head.weight, model.layers.N.attn.*) or transformers' state_dict "
                         "(lm_head.weight, model.layers.N.self_attn.*)")
    return best


def deepseek_name(name: str, layout: str) -> str | None:
    """DeepSeek's name of the tensor `name` of a `layout` checkpoint (None: it names nothing)."""
    if name.endswith(".weight_scale_inv"):
        weight = deepseek_name(name.removesuffix("_scale_inv"), layout)
        return weight and weight.removesuffix(".weight") + ".scale"
    if layout == "deepseek":
        return name
    if name in _TOP[layout]:
        return _TOP[layout][name]
    m = _IN_BLOCK.fullmatch(name)
    if m is None:
        return None
    prefix, rest = m[1].removeprefix("model."), m[2]
    if layout == "transformers":
        return name if prefix == "mtp.0" else f"{prefix}.{_SAVED_BLOCK.get(rest, rest)}"
    return f"{prefix}.{_MEMORY_BLOCK[rest]}" if rest in _MEMORY_BLOCK else None


def layout_name(name: str, layout: str) -> str:
    """The name DeepSeek's tensor `name` has in a `layout` checkpoint (a routed expert of the
    in-memory layout: the fused tensor that holds it)."""
    top = _INVERSE.get(layout, {})
    if layout == "deepseek" or name in top:
        return top.get(name, name)
    m = _IN_DEEPSEEK_BLOCK.fullmatch(name)
    if m is None:
        return name
    prefix, rest = ("model." if m[1].startswith("layers") else "") + m[1], m[2]
    if layout == "transformers":
        return name if m[1] == "mtp.0" else f"{prefix}.{_INVERSE['saved block'].get(rest, rest)}"
    expert = _EXPERT.fullmatch(name)
    if expert:
        return f"{prefix}.mlp.experts.{'down_proj' if expert[3] == 'w2' else 'gate_up_proj'}"
    return f"{prefix}.{_INVERSE['memory block'].get(rest, rest)}"


def _split_experts(prefix: str, kind: str, fused: np.ndarray) -> dict[str, np.ndarray]:
    """gate_up_proj [E, 2F, D] -> w1 [F, D] and w3 [F, D] per expert; down_proj [E, D, F] -> w2."""
    base = prefix.removeprefix("model.") + ".ffn.experts"
    if kind == "down_proj":
        return {f"{base}.{e}.w2.weight": fused[e] for e in range(fused.shape[0])}
    f = fused.shape[1] // 2
    out = {}
    for e in range(fused.shape[0]):
        out[f"{base}.{e}.w1.weight"] = fused[e, :f]
        out[f"{base}.{e}.w3.weight"] = fused[e, f:]
    return out


def to_deepseek(tensors: dict, layout: str) -> tuple[dict, dict[str, str]]:
    """(tensors under DeepSeek's names, DeepSeek's name -> the checkpoint's name). Names that fit
    nothing are kept as they are, for the import to report."""
    out, origin = {}, {}
    for name, value in tensors.items():
        fused = _FUSED.fullmatch(name) if layout == "transformers-memory" else None
        renamed = (_split_experts(fused[1], fused[2], value) if fused
                   else {deepseek_name(name, layout) or name: value})
        out.update(renamed)
        origin.update(dict.fromkeys(renamed, name))
    return out, origin

