"""A model-free balancer simulation: a stream of skewed, slowly drifting router logits.

Each step draws fresh tokens x ~ N(0, I) [N, H] and routes them with logits

    z[t, i] = (x_t @ W)[i] + skew * (a_i + sin(2*pi*step/period + phi_i))

(W fixed; a, phi random per expert): some experts are popular, and which ones changes slowly, as
in training. The bias is updated after every step from that step's exact counts, with the rule
under test. MaxVio then falls from the skew's level towards the sampling floor of N fresh tokens;
a rule whose rate is too large overshoots and oscillates.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from moebalance import balancing, routing
from moebalance.metrics import load_stats

RULES = (*balancing.BIAS_RULES, "quantile")
OSC_MIN_STEPS = 40  # the shortest run whose overshoot the demo reports (overshoot_window)


@dataclasses.dataclass(frozen=True)
class Simulation:
    num_experts: int = 16
    k: int = 4
    tokens: int = 2048  # N per step
    hidden: int = 32  # H
    score_fn: str = "sigmoid"
    skew: float = 1.0
    period: int = 2000  # steps per full drift cycle
    seed: int = 0

    def __post_init__(self):
        for name in ("num_experts", "tokens", "hidden", "period"):
            if getattr(self, name) < 1:
                raise ValueError(f"the simulation needs {name} >= 1, got {getattr(self, name)}")
        routing.check_topk(self.k, self.num_experts)
        routing.check_score_fn(self.score_fn)


def _stream(sim: Simulation):
    """The fixed parts of the logit stream, and logits(step, key) -> [N, E]."""
    kw, ka, kp = jax.random.split(jax.random.key(sim.seed), 3)
    w = jax.random.normal(kw, (sim.hidden, sim.num_experts)) / np.sqrt(sim.hidden)
    a = jax.random.normal(ka, (sim.num_experts,))
    phi = jax.random.uniform(kp, (sim.num_experts,), maxval=2 * np.pi)

    def logits(step, key):
        x = jax.random.normal(key, (sim.tokens, sim.hidden))
        drift = a + jnp.sin(2 * np.pi * step / sim.period + phi)
        return x @ w + sim.skew * drift

    return logits


def run(sim: Simulation, rule: str, rate: float | None = None, steps: int = 300) -> dict:
    """Simulate `steps` steps of balancing with `rule` at `rate` (None: its default; for
    Quantile Balancing the damping, 1.0 = as published).

    Returns numpy arrays: counts [steps, E] (the routing of each step, before its update),
    bias [steps, E] (after each step's update), maxvio [steps].
    """
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; choose one of {RULES}")
    rate = balancing.DEFAULT_RATES.get(rule, 0.0) if rate is None else rate
    balancing.check_rate(rate)
    logits_at = _stream(sim)

    def step(bias, inputs):
        i, key = inputs
        indices, _, scores = routing.route(logits_at(i, key), bias, k=sim.k, score_fn=sim.score_fn)
        counts = balancing.expert_counts(indices, sim.num_experts)
        if rule == "quantile":
            new_bias = balancing.quantile_bias(scores, bias, sim.k, center=True, rate=rate)
        else:
            new_bias = balancing.update_bias(bias, counts, rule=rule, rate=rate)
        return new_bias, (counts, new_bias)

    keys = jax.random.split(jax.random.key(sim.seed + 1), steps)
    scan = jax.jit(lambda b: jax.lax.scan(step, b, (jnp.arange(steps), keys)))
    _, (counts, bias) = scan(jnp.zeros(sim.num_experts, jnp.float32))
    counts = np.asarray(counts)
    return {"counts": counts, "bias": np.asarray(bias), "maxvio": load_stats(counts)["maxvio"]}


def overshoot_window(steps: int) -> int:
    """How many of a run's last steps its overshoot is measured over: the second half, at most
    100 steps, so that the first half's settling from the initial skew (which reads as positive
    autocorrelation) stays out; 0 for a run shorter than OSC_MIN_STEPS, whose window would hold
    too few consecutive steps to tell an oscillation from noise (two steps give +1 or -1)."""
    return min(100, steps // 2) if steps >= OSC_MIN_STEPS else 0


def overshoot(counts: np.ndarray) -> float:
    """Lag-1 autocorrelation of the load errors c[s, i] - mean(c[s]), pooled over experts.

    Around 0 when errors are sampling noise around a steady state, positive while a slow rule is
    still converging, and near -1 when a rule overshoots every step (an expert flips between
    overloaded and starved). The returned value is that autocorrelation.
    """
    c = np.asarray(counts, np.float64)
    err = c - c.mean(-1, keepdims=True)
    a, b = err[:-1].ravel(), err[1:].ravel()
    denom = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / denom) if denom > 0 else 0.0
