"""Slow, obvious NumPy references: one token, one expert, one sequence at a time.

Written from the formulas in docs/load_balancing.md, independently of the package (no
import from moebalance). Selection works on float32 values like the package, with ties going to
the lower index, so exact-tie cases compare exactly.
"""

from __future__ import annotations

import math

import numpy as np


def scores(logits, score_fn):
    z = np.asarray(logits, np.float32)
    if score_fn == "softmax":
        e = np.exp(z - z.max(-1, keepdims=True))
        return (e / e.sum(-1, keepdims=True)).astype(np.float32)
    if score_fn == "sigmoid":
        return (1.0 / (1.0 + np.exp(-z.astype(np.float64)))).astype(np.float32)
    if score_fn == "sqrtsoftplus":
        return np.sqrt(np.logaddexp(0.0, z.astype(np.float64))).astype(np.float32)
    raise ValueError(score_fn)


def top_indices(values, k):
    """Indices of the k largest values, largest first, ties to the lower index."""
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    return order[:k]


def _near_tie(values, n, members=None):
    """True when the n-th and (n+1)-th largest values are within float32 rounding of each other
    without being provably equal: which one wins is then up to the order of float operations.
    `members` (optional) lists what each value was summed from; equal multisets tie exactly."""
    order = top_indices(values, len(values))
    if n >= len(values):
        return False
    a, b = order[n - 1], order[n]
    gap = abs(values[a] - values[b])
    if gap >= 1e-5 * max(1.0, abs(values[a])):
        return False
    if members is None:
        return gap != 0.0
    return sorted(members[a]) != sorted(members[b])


def route_token(s, b, k, route_scale, n_groups, topk_groups, normalize):
    """One token: s, b [E] -> (indices [K], weights [K], ambiguous), ambiguous when a float
    near-tie decides the selection (see _near_tie)."""
    num_experts = len(s)
    biased = [float(np.float32(s[i]) + np.float32(b[i])) for i in range(num_experts)]
    allowed = set(range(num_experts))
    if n_groups:
        size = num_experts // n_groups
        m = min(max(1, k // topk_groups), size)
        group_score, group_members = [], []
        for g in range(n_groups):
            members = sorted((biased[i] for i in range(g * size, (g + 1) * size)), reverse=True)
            group_members.append(members[:m])
            group_score.append(sum(members[:m]))
        keep = top_indices(group_score, topk_groups)
        ambiguous = _near_tie(group_score, topk_groups, group_members)
        allowed = {i for g in keep for i in range(g * size, (g + 1) * size)}
    else:
        ambiguous = False
    masked = [biased[i] if i in allowed else -math.inf for i in range(num_experts)]
    idx = top_indices(masked, k)
    ambiguous = ambiguous or _near_tie(masked, k)
    w = np.array([s[i] for i in idx], np.float64)
    if normalize:
        w = w / w.sum()
    return np.array(idx), w * route_scale, ambiguous


def route(logits, bias, k, score_fn, route_scale=1.0, n_groups=0, topk_groups=0, normalize=None):
    """-> (indices, weights, scores, ambiguous) of the logits, scored in float64."""
    if normalize is None:
        normalize = score_fn != "softmax"
    s = scores(logits, score_fn)
    idx, w, ambiguous = route_scores(s, bias, k, route_scale, n_groups, topk_groups, normalize)
    return idx, w, s, ambiguous


def route_scores(s, bias, k, route_scale, n_groups, topk_groups, normalize):
    """The selection and weights given the scores s [..., E] -> (indices, weights, ambiguous)."""
    flat = s.reshape(-1, s.shape[-1])
    b = np.zeros(s.shape[-1], np.float32) if bias is None else np.asarray(bias, np.float32)
    out = [route_token(row, b, k, route_scale, n_groups, topk_groups, normalize) for row in flat]
    idx = np.stack([o[0] for o in out]).reshape(*s.shape[:-1], k)
    w = np.stack([o[1] for o in out]).reshape(*s.shape[:-1], k)
    ambiguous = np.array([o[2] for o in out]).reshape(s.shape[:-1])
    return idx, w, ambiguous


def counts(indices, num_experts, mask=None):
    c = np.zeros(num_experts, np.int64)
    flat = np.asarray(indices).reshape(-1, np.asarray(indices).shape[-1])
    m = np.ones(len(flat), bool) if mask is None else np.asarray(mask).reshape(-1)
    for row, ok in zip(flat, m):
        if ok:
            for e in row:
                c[e] += 1
    return c


def update_bias(bias, c, rule, rate, center=False):
    c = np.asarray(c, np.float64)
    mean = c.mean()
    if rule == "sign":
        delta = rate * np.sign(mean - c)
    elif rule == "proportional":
        delta = rate * (mean - c)
    elif rule == "fraction":
        delta = rate * (1.0 / len(c) - c / c.sum())
    else:
        raise ValueError(rule)
    if center:
        delta = delta - delta.mean()
    return np.asarray(bias, np.float64) + delta


def quantile_bias(s, bias, k, mask=None):
    """b_i = -quantile_{1-K/E} over valid tokens of s[t,i] - (K-th largest biased score of the
    other experts)."""
    s = np.asarray(s, np.float32).reshape(-1, np.asarray(s).shape[-1])
    num_experts = s.shape[1]
    m = np.ones(len(s), bool) if mask is None else np.asarray(mask).reshape(-1)
    out = np.zeros(num_experts)
    for i in range(num_experts):
        margins = []
        for t in range(len(s)):
            if not m[t]:
                continue
            others = sorted((float(s[t, j] + bias[j]) for j in range(num_experts) if j != i),
                            reverse=True)
            margins.append(float(s[t, i]) - others[k - 1])
        out[i] = -np.quantile(margins, 1.0 - k / num_experts)
    return out


def sequence_loss(s, num_experts, k, segment_ids=None, mask=None):
    """DeepSeek-V3 Eqs. 17-20 per sequence (or packed segment) of valid tokens, averaged."""
    s = np.asarray(s, np.float64)
    batch, seq, _ = s.shape
    losses = []
    for b in range(batch):
        ids = np.zeros(seq, int) if segment_ids is None else np.asarray(segment_ids)[b]
        valid = np.ones(seq, bool) if mask is None else np.asarray(mask)[b]
        for seg in sorted(set(ids.tolist())):
            toks = [t for t in range(seq) if ids[t] == seg and valid[t]]
            if not toks:
                continue
            n = len(toks)
            f = np.zeros(num_experts)
            p = np.zeros(num_experts)
            for t in toks:
                for e in top_indices(list(s[b, t].astype(np.float32)), k):
                    f[e] += num_experts / (k * n)
                p += s[b, t] / s[b, t].sum() / n
            losses.append(float((f * p).sum()))
    return float(np.mean(losses))


def maxtext_sequence_loss(s, bias, indices, num_experts):
    s = np.asarray(s, np.float64) + np.asarray(bias, np.float64)
    batch, seq, _ = s.shape
    total = 0.0
    for b in range(batch):
        density = np.zeros(num_experts)
        prob = np.zeros(num_experts)
        for t in range(seq):
            for e in indices[b, t]:
                density[e] += 1.0 / seq
            ex = np.exp(s[b, t] - s[b, t].max())
            prob += ex / ex.sum() / seq
        total += (density * prob).sum()
    return total / (batch * num_experts) * num_experts**2


def global_loss(s, num_experts, k, mask=None):
    s = np.asarray(s, np.float64).reshape(-1, num_experts)
    m = np.ones(len(s), bool) if mask is None else np.asarray(mask).reshape(-1)
    toks = [t for t in range(len(s)) if m[t]]
    f = np.zeros(num_experts)
    p = np.zeros(num_experts)
    for t in toks:
        for e in top_indices(list(s[t].astype(np.float32)), k):
            f[e] += 1.0 / (k * len(toks))
        p += s[t] / s[t].sum() / len(toks)
    return num_experts * float((f * p).sum())


def z_loss(logits, mask=None):
    z = np.asarray(logits, np.float64).reshape(-1, np.asarray(logits).shape[-1])
    m = np.ones(len(z), bool) if mask is None else np.asarray(mask).reshape(-1)
    vals = [np.log(np.exp(row - row.max()).sum()) + row.max() for row, ok in zip(z, m) if ok]
    return float(np.mean(np.square(vals)))


def load_stats(c):
    c = [int(v) for v in c]
    n = len(c)
    mean = sum(c) / n
    var = sum((v - mean) ** 2 for v in c) / n
    total = sum(c)
    h = -sum(v / total * math.log(v / total) for v in c if v > 0)
    return {
        "variance": var,
        "std": math.sqrt(var),
        "cv": math.sqrt(var) / mean,
        "maxvio": (max(c) - mean) / mean,
        "min": min(c),
        "max": max(c),
        "dead_fraction": sum(v == 0 for v in c) / n,
        "entropy": math.exp(h) / n,
    }


def silu(x):
    return x / (1.0 + np.exp(-x))


def swiglu_expert(x, w1, w3, w2, limit, weight=1.0):
    """One token through one expert: w2 (weight * silu(min(g, limit)) * clip(u, +-limit))."""
    g, u = x @ w1, x @ w3
    if limit > 0:
        g = np.minimum(g, limit)
        u = np.clip(u, -limit, limit)
    return (weight * silu(g) * u) @ w2


def moe(x, indices, weights, w1, w3, w2, limit, kept=None):
    """Per-token loop: y[t] = sum_j kept * expert_{indices[t,j]}(x[t], weight[t,j])."""
    x = np.asarray(x, np.float64)
    y = np.zeros_like(x)
    for t in range(len(x)):
        for j, e in enumerate(indices[t]):
            if kept is None or kept[t, j]:
                y[t] += swiglu_expert(x[t], w1[e], w3[e], w2[e], limit, weights[t, j])
    return y


def kept_assignments(indices, weights, valid, num_experts, capacity, policy):
    """Which (t, j) fit in capacity: per expert, by weight desc ('probs') or position ('position'),
    ties to the earlier assignment t*K + j. Padding tokens are never dispatched."""
    num_tokens, k = indices.shape
    kept = np.zeros((num_tokens, k), bool)
    for e in range(num_experts):
        cand = [(t, j) for t in range(num_tokens) for j in range(k) if valid[t] and indices[t, j] == e]
        if policy == "probs":
            cand.sort(key=lambda tj: (-weights[tj], tj[0] * k + tj[1]))
        for t, j in cand[: capacity if capacity else len(cand)]:
            kept[t, j] = True
    return kept
