"""Slow, obvious NumPy (float64) references for the DeepSeek-V4 model pieces: one query, one key,
one entry at a time, written from docs/architecture.md. No import from moebalance."""

from __future__ import annotations

import math

import numpy as np


def rms(x, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rope(x, pos, freqs, inverse=False):
    """Rotate the last 2*len(freqs) dims of vector x as pairs (x[2i], x[2i+1]) by pos*freqs[i]."""
    x = np.array(x, np.float64)
    start = x.shape[-1] - 2 * len(freqs)
    for i, f in enumerate(freqs):
        angle = -pos * f if inverse else pos * f
        a, b = x[start + 2 * i], x[start + 2 * i + 1]
        x[start + 2 * i] = a * math.cos(angle) - b * math.sin(angle)
        x[start + 2 * i + 1] = a * math.sin(angle) + b * math.cos(angle)
    return x


def softmax(v):
    v = np.asarray(v, np.float64)
    e = np.exp(v - v.max())
    return e / e.sum()


def sinkhorn(logits, iters, eps):
    m = logits.shape[0]
    c = np.stack([softmax(row) for row in logits]) + eps
    for col in range(m):
        c[:, col] = c[:, col] / (c[:, col].sum() + eps)
    for _ in range(iters - 1):
        for row in range(m):
            c[row] = c[row] / (c[row].sum() + eps)
        for col in range(m):
            c[:, col] = c[:, col] / (c[:, col].sum() + eps)
    return c


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def hc_pre(h, fn, base, scale, iters, eps, norm_eps):
    """One token: h [m, D] -> y [D], post [m], comb [m, m]; fn is [m*D, (2+m)*m]."""
    m = h.shape[0]
    mixes = rms(h.reshape(-1), norm_eps) @ fn
    pre = sigmoid(mixes[:m] * scale[0] + base[:m]) + eps
    post = 2 * sigmoid(mixes[m:2 * m] * scale[1] + base[m:2 * m])
    comb = sinkhorn((mixes[2 * m:] * scale[2] + base[2 * m:]).reshape(m, m), iters, eps)
    y = sum(pre[j] * h[j] for j in range(m))
    return y, post, comb


def hc_post(fy, h, post, comb):
    m = h.shape[0]
    return np.stack([post[i] * fy + sum(comb[j, i] * h[j] for j in range(m)) for i in range(m)])


def compressor(x, wkv, wgate, ape, norm_w, ratio, freqs, eps):
    """x [S, D] -> [S // ratio, d]: entry i pools block i (and block i-1 when ratio == 4)."""
    s = x.shape[0]
    overlap = ratio == 4
    d = wkv.shape[1] // (2 if overlap else 1)
    kv, score = x @ wkv, x @ wgate
    out = []
    for i in range(s // ratio):
        slots_kv, slots_score = [], []
        if overlap and i > 0:
            for j in range(ratio):
                t = (i - 1) * ratio + j
                slots_kv.append(kv[t, :d])
                slots_score.append(score[t, :d] + ape[j, :d])
        for j in range(ratio):
            t = i * ratio + j
            lo = d if overlap else 0
            slots_kv.append(kv[t, lo:lo + d])
            slots_score.append(score[t, lo:lo + d] + ape[j, lo:lo + d])
        slots_kv, slots_score = np.array(slots_kv), np.array(slots_score)
        pooled = np.array([np.dot(softmax(slots_score[:, ch]), slots_kv[:, ch]) for ch in range(d)])
        out.append(rope(norm_w * rms(pooled, eps), i * ratio, freqs))
    return np.array(out).reshape(-1, d)


def visible(t, i, ratio, seg):
    """Entry i is complete by t and every token it pools lies in t's segment."""
    pooled = range(max(0, (i - 1) * ratio) if ratio == 4 else i * ratio, (i + 1) * ratio)
    return t >= (i + 1) * ratio - 1 and all(seg[u] == seg[t] for u in pooled)


def indexer(x, qr, p, ratio, freqs, heads, dim, topk, eps, seg):
    """-> per query t, the set of compressed entries kept."""
    keys = compressor(x, p["wkv"], p["wgate"], p["ape"], p["norm"], ratio, freqs, eps)
    kept = []
    for t in range(x.shape[0]):
        q = (qr[t] @ p["wq_b"]).reshape(heads, dim)
        q = np.stack([rope(q[h], t, freqs) for h in range(heads)])
        w = (x[t] @ p["weights_proj"]) / math.sqrt(dim * heads)
        cand = [i for i in range(len(keys)) if visible(t, i, ratio, seg)]
        score = {i: sum(w[h] * max(0.0, float(q[h] @ keys[i])) for h in range(heads)) for i in cand}
        best = sorted(cand, key=lambda i: (-score[i], i))[:topk]
        kept.append(set(best))
    return kept


def attention(x, p, c, freqs, seg=None):
    """x [S, D] (one sequence), params p, dims c (dict), seg [S] segment ids -> [S, D]."""
    s = x.shape[0]
    seg = np.zeros(s, int) if seg is None else seg
    heads, hd, eps = c["heads"], c["head_dim"], c["eps"]
    qr = c["q_norm"] * rms(x @ p["wq_a"], eps)
    kv = np.stack([rope(v, t, freqs) for t, v in enumerate(c["kv_norm"] * rms(x @ p["wkv"], eps))])
    ratio = c["ratio"]
    ckv = np.zeros((0, hd))
    kept = [set() for _ in range(s)]
    if ratio:
        cp = p["compressor"]
        ckv = compressor(x, cp["wkv"], cp["wgate"], cp["ape"], cp["norm"], ratio, freqs, eps)
        if ratio == 4:
            kept = indexer(x, qr, p["indexer"], ratio, freqs, c["index_heads"], c["index_head_dim"],
                           c["index_topk"], eps, seg)
        else:
            kept = [{i for i in range(len(ckv)) if visible(t, i, ratio, seg)} for t in range(s)]
    out = np.zeros((s, heads, hd))
    for t in range(s):
        q = (qr[t] @ p["wq_b"]).reshape(heads, hd)
        for h in range(heads):
            qh = rope(rms(q[h], eps), t, freqs)
            keys = [kv[j] for j in range(max(0, t - c["window"] + 1), t + 1) if seg[j] == seg[t]]
            keys += [ckv[i] for i in sorted(kept[t])]
            logits = [float(qh @ k) / math.sqrt(hd) for k in keys] + [float(p["attn_sink"][h])]
            probs = softmax(logits)[:-1]
            o = sum(pr * k for pr, k in zip(probs, keys))
            out[t, h] = rope(o, t, freqs, inverse=True)
    groups = c["o_groups"]
    grouped = out.reshape(s, groups, -1)
    low = np.concatenate([grouped[:, g] @ p["wo_a"][g] for g in range(groups)], axis=-1)
    return low @ p["wo_b"]
