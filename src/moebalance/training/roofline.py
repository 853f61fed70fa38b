"""A roofline of a training step: a MODEL of its time from its FLOPs and the bytes it sends, not a
measurement.

Per device and step (`roofline`):
    compute = model FLOPs / devices / rate; rate = the generation's published bfloat16 peak per
              chip (topology.GENERATIONS) / devices per chip x CALIBRATED_FRACTION
    ICI     = bytes sent over ICI (collectives.tally: ring algorithms) / (the chip's published
              bidirectional ICI bandwidth / 2, its outgoing half) x devices per chip
    DCN     = bytes sent across slices / the chip's published DCN bandwidth x devices per chip
    no overlap   = compute + ICI + DCN (an upper bound of the step)
    full overlap = the largest of the three (a lower bound)
-> tokens/s per chip and MFU (model FLOP/s over the chips' peak) at either bound.

CALIBRATED_FRACTION is the share of the v5e's peak the measured one-chip d1024 step reached
(benchmarks/results/tpu-v5e.json, its fastest run: 8 layers, 4 x 2 x 2048 tokens, 25.32 model
TFLOP in 0.835 s, 15.4 %, at caaf814): one chip runs no collectives, so its step is all compute, and the same
share is taken of every generation's peak. It predicts the record's fastest 9-layer run (2 x 2048
tokens, 0.246 s at caaf814) at 0.222 s (tests/test_roofline.py). Not modelled: HBM
bandwidth, collectives that wait on each other, the torus's hop count, the links a group does not
use (every collective gets the chip's whole ICI), kernel launch and host time.

Model FLOPs (`model_flops`) = 6 x active parameters x tokens (`parameter_counts`: every matmul a
token runs, the head included, the embedding lookup and unchosen experts not), less the backward
of the lightning indexer's weights (its top-k passes no gradient: 2 x, not 6 x), plus the
attention entries each query really attends, read from the batch's segments: its window keys (at
most `sliding_window_size`), on CSA layers the indexer's top-k of the visible compressed entries,
on HCA layers every visible one (12 x heads x head_dim each: QK and PV, forward and backward),
and the indexer's scoring of every visible CSA entry (forward only). Not counted: the sink,
softmaxes, norms, the compressors' pooling, the hyper-connections' stream mixing, an MTP layer,
and what remat recomputes.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from moebalance.model.transformer import DeepSeekV4, parameter_counts, placeholder_hash_tables
from moebalance.training.topology import GENERATIONS

# benchmarks/results/tpu-v5e.json's fastest d1024 run: model FLOPs / step_s / v5e peak
CALIBRATION = {"model_flops": 25.32e12, "step_s": 0.835, "generation": "v5e"}
CALIBRATED_FRACTION = (CALIBRATION["model_flops"] / CALIBRATION["step_s"]
                       / GENERATIONS[CALIBRATION["generation"]].peak_flops)
# MaxText's published DeepSeek-V3 671B training on a v5p-1024 (its README's table), for a side by
# side with a predicted MFU
MAXTEXT_DEEPSEEK_V3_MFU = 0.332


def indexer_parameters(cfg) -> int:
    """Parameters of the lightning indexers (their projections and compressors), by abstract
    evaluation."""
    model = nnx.eval_shape(lambda: DeepSeekV4(cfg, hash_tables=placeholder_hash_tables(cfg),
                                              rngs=nnx.Rngs(0)))
    return sum(int(np.prod(v.shape)) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
               if "indexer" in path and path[0] != "mtp")


def attended_entries(cfg, segment_ids: np.ndarray) -> dict[str, int]:
    """Summed over every query of the rows segment_ids [..., S] (contiguous segments) and every
    layer: the window keys it attends (`window`), the compressed entries it attends (`compressed`:
    on CSA layers min(index_topk, visible), on HCA layers all visible) and the compressed entries
    the indexer scores (`indexed`: the visible ones of CSA layers). Compressed entry i is visible
    to query t iff t >= (i+1) r - 1 and the first token it pools lies in t's segment (model/
    attention.py)."""
    rows = np.asarray(segment_ids).reshape(-1, np.shape(segment_ids)[-1])
    s = rows.shape[1]
    t = np.arange(s)
    new = np.concatenate([np.ones((len(rows), 1), bool), rows[:, 1:] != rows[:, :-1]], axis=1)
    start = np.maximum.accumulate(np.where(new, t, 0), axis=1)  # first token of t's segment
    counts = {"window": 0, "compressed": 0, "indexed": 0}
    for r in cfg.compress_ratios[:cfg.base_num_decoder_layers]:
        counts["window"] += int(np.minimum(cfg.sliding_window_size, t - start + 1).sum())
        if not r or s < r:
            continue
        # entries pooling only t's segment: i*r >= start (r = 4 pools from (i-1)*r, entry 0 from 0)
        first = -(-start // r) + ((start > 0) if r == 4 else 0)
        visible = np.maximum((t + 1) // r - first, 0)
        if r == 4:
            counts["indexed"] += int(visible.sum())
            visible = np.minimum(visible, min(cfg.index_topk, s // r))
        counts["compressed"] += int(visible.sum())
    return counts


def model_flops(cfg, segment_ids: np.ndarray) -> dict[str, float]:
    """Model FLOPs of one training step on a batch of these segments (module docstring):
    `parameters` (6 x active x tokens, the indexers' weights 2 x), `attention` (12 x heads x
    head_dim per attended entry), `indexer` (2 x index heads x (index head dim + 1) per scored
    entry) and their `total`."""
    tokens = int(np.prod(np.shape(segment_ids)))
    entries = attended_entries(cfg, segment_ids)
    out = {
        "parameters": float(6 * parameter_counts(cfg)["active"] - 4 * indexer_parameters(cfg))
        * tokens,
        "attention": 12.0 * cfg.base_num_query_heads * cfg.head_dim
        * (entries["window"] + entries["compressed"]),
        "indexer": 2.0 * cfg.index_n_heads * (cfg.index_head_dim + 1) * entries["indexed"],
    }
    out["total"] = sum(out.values())
    return out


def roofline(model_flops_per_step: float, tokens_per_step: int, devices: int, generation: str,
             sent_ici: float, sent_dcn: float = 0.0,
             fraction: float = CALIBRATED_FRACTION) -> dict:
    """The step's modelled seconds (module docstring): {"compute_s", "ici_s", "dcn_s",
    "no_overlap_s", "full_overlap_s", and per bound "tokens_s_chip" and "mfu"}. sent_*: bytes
    one device sends per step (collectives.tally's "sent")."""
    spec = GENERATIONS[generation]
    if spec.peak_flops is None:
        raise ValueError(f"no published peak or bandwidths for {generation} in "
                         "topology.GENERATIONS: no roofline")
    per_chip = spec.devices_per_chip
    chips = devices / per_chip
    out = {"compute_s": model_flops_per_step / chips / (spec.peak_flops * fraction),
           "ici_s": sent_ici * per_chip / (spec.ici_bytes_s / 2),
           "dcn_s": sent_dcn * per_chip / spec.dcn_bytes_s}
    parts = (out["compute_s"], out["ici_s"], out["dcn_s"])
    for bound, seconds in (("no_overlap", sum(parts)), ("full_overlap", max(parts))):
        out[f"{bound}_s"] = seconds
        out[f"{bound}_tokens_s_chip"] = tokens_per_step / seconds / chips
        out[f"{bound}_mfu"] = model_flops_per_step / seconds / (chips * spec.peak_flops)
    return out
