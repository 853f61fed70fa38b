"""A model-free balancer simulation: a stream of skewed, slowly drifting router logits.

Each step draws fresh tokens x ~ N(0, I) [N, H] and routes them with logits

    z[t, i] = (x_t @ W)[i] + skew * (a_i + sin(2*pi*step/period + phi_i))

(W fixed; a, phi random per expert): some experts are popular, and which ones changes slowly, as
in training. The bias is updated after every step from that step's exact counts, with the rule
under test. MaxVio then falls from the skew's level towards the sampling floor of N fresh tokens;
a rule whose rate is too large overshoots and oscillates.

`Windows` is issue 60's toy instead: a fixed router fed batches of a few windows, each window of
one domain, so that one step's counts are bursty as a language model's are; `run_windows` trains
a `Recipe` on it and `held_out_maxvio` reads a bias on held-out windows
(benchmarks/bias_recipes.py compares the recipes).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from moebalance import balancing, routing
from moebalance.metrics import load_stats

RULES = (*balancing.BIAS_RULES, "quantile")
POOL = 256  # noise windows of the Windows simulation (_windows_stream)
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


# ---------------------------------------------------------------------------------------------
# Windows of domains: what a training batch looks like to a router (issue 60's toy)


@dataclasses.dataclass(frozen=True)
class Windows:
    """A fixed router fed batches of `windows` windows of `window_tokens` tokens, each window
    from one of `domains` domains: token x = m_d + n, n ~ N(0, I) [H], with a domain mean m_d ~
    skew * N(0, I) fixed per domain, routed by the logits x @ W (W fixed). A window's tokens share
    its domain, so one step's counts are bursty, as a language model's batch of a few documents
    is; the domains average out only over many windows. The held-out set is `eval_windows` other
    windows, drawn once, the same for every recipe."""

    num_experts: int = 32
    k: int = 6
    windows: int = 8
    window_tokens: int = 1024
    domains: int = 64
    hidden: int = 32
    skew: float = 0.5
    score_fn: str = "sqrtsoftplus"
    eval_windows: int = 384
    seed: int = 0

    def __post_init__(self):
        for name in ("num_experts", "windows", "window_tokens", "domains", "hidden",
                     "eval_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"the simulation needs {name} >= 1, got {getattr(self, name)}")
        routing.check_topk(self.k, self.num_experts)
        routing.check_score_fn(self.score_fn)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A bias recipe as it trains: `rule` at `rate` (None: its default), the rate along a
    cosine to rate * final_fraction at the last step, the counts of `accumulate` steps summed
    before each update (the bias moves every `accumulate` steps)."""

    rule: str = "sign"
    rate: float | None = None
    final_fraction: float = 1.0
    accumulate: int = 1


def _windows_stream(sim: Windows):
    """batch(key, windows) -> logits [windows * window_tokens, E], and the held-out logits. A
    window's token noise is one of a pool of `POOL` windows' (drawn once), its domain drawn
    afresh: 64 domains x 256 noise windows are more distinct windows than a run draws, at a
    fraction of the cost of fresh noise every step."""
    kw, km, kn, _, ke = jax.random.split(jax.random.key(sim.seed), 5)
    w = jax.random.normal(kw, (sim.hidden, sim.num_experts)) / np.sqrt(sim.hidden)
    offsets = sim.skew * jax.random.normal(km, (sim.domains, sim.hidden)) @ w  # [D, E]
    noise = jax.random.normal(kn, (POOL, sim.window_tokens, sim.hidden)) @ w  # [P, T, E]

    def batch(key, windows):
        kd, kp = jax.random.split(key)
        domain = jax.random.randint(kd, (windows,), 0, sim.domains)
        pool = jax.random.randint(kp, (windows,), 0, POOL)
        return (offsets[domain][:, None] + noise[pool]).reshape(-1, sim.num_experts)

    held_out = batch(ke, sim.eval_windows)
    return batch, held_out


def run_windows(sim: Windows, recipe: Recipe, steps: int = 2000, seed: int = 0) -> dict:
    """Train `recipe`'s bias for `steps` steps on fresh batches (drawn from `seed`) -> numpy:
    maxvio [steps] and bias [steps, E], of the bias each step routed with (before its update:
    row 0 is zeros; the last step's update, which no step routes with, is not kept)."""
    if recipe.rule not in RULES:
        raise ValueError(f"unknown rule {recipe.rule!r}; choose one of {RULES}")
    if recipe.accumulate < 1:
        raise ValueError(f"accumulate must be >= 1, got {recipe.accumulate}")
    rate = balancing.DEFAULT_RATES[recipe.rule] if recipe.rate is None else recipe.rate
    schedule = balancing.rate_schedule(rate, decay_steps=max(steps - 1, 1),
                                       final_fraction=recipe.final_fraction)
    batch, _ = _windows_stream(sim)

    def step(state, inputs):
        bias, acc = state
        i, key = inputs
        indices, _, scores = routing.route(batch(key, sim.windows), bias, k=sim.k,
                                           score_fn=sim.score_fn)
        counts = balancing.expert_counts(indices, sim.num_experts)
        acc = acc + counts
        if recipe.rule == "quantile":
            moved = balancing.quantile_bias(scores, bias, sim.k, center=True, rate=schedule(i))
        else:
            moved = balancing.update_bias(bias, acc, rule=recipe.rule, rate=schedule(i))
        due = (i + 1) % recipe.accumulate == 0
        return (jnp.where(due, moved, bias), jnp.where(due, 0, acc)), (counts, bias)

    keys = jax.random.split(jax.random.key(1000 + seed), steps)
    init = (jnp.zeros(sim.num_experts, jnp.float32), jnp.zeros(sim.num_experts, jnp.int32))
    _, (counts, bias) = jax.jit(lambda s: jax.lax.scan(step, s, (jnp.arange(steps), keys)))(init)
    return {"maxvio": load_stats(np.asarray(counts))["maxvio"], "bias": np.asarray(bias)}


def held_out_maxvio(sim: Windows, bias) -> float:
    """MaxVio_global of the held-out windows routed with `bias` [E]."""
    _, held_out = _windows_stream(sim)
    indices, _, _ = routing.route(held_out, jnp.asarray(bias, jnp.float32), k=sim.k,
                                  score_fn=sim.score_fn)
    counts = np.asarray(balancing.expert_counts(indices, sim.num_experts))
    return float(load_stats(counts)["maxvio"])


def population_bias(sim: Windows, windows: int = 1024, fits: int = 20) -> np.ndarray:
    """The bias that balances the stream itself rather than any run's batches: Quantile
    Balancing fitted `fits` times on one sample of `windows` fresh windows (1M tokens). What it
    reads on the held-out set is the data's own floor: the held-out windows' domains differ from
    the stream's average by chance, which no bias trained on other windows can follow."""
    batch, _ = _windows_stream(sim)
    logits = batch(jax.random.key(999), windows)
    scores = routing.compute_scores(logits, sim.score_fn)
    bias = jnp.zeros(sim.num_experts, jnp.float32)
    fit = jax.jit(lambda b: balancing.quantile_bias(scores, b, sim.k, center=True))
    for _ in range(fits):
        bias = fit(bias)
    return np.asarray(bias)
