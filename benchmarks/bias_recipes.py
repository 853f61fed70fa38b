"""Issue 60's toy, the bias recipes compared without a model (simulate.Windows: a fixed router,
32 experts top-6, 8 windows of 1,024 tokens a step, each window one of 64 domains): 2,000 steps
per recipe and seed, then MaxVio_global of 384 held-out windows (393,216 tokens) routed by the
last online bias (the one the last step routed with) and by the mean of the biases the last half
and the last quarter of the steps routed with (as routed_bias_average_fraction 0.5 and 0.25, one
step earlier), and by the bias that balances the stream itself
(simulate.population_bias: the held-out set's own floor). Seeded: the same numbers every run
(~20 minutes on a busy 2-core CPU).

    python benchmarks/bias_recipes.py [--out benchmarks/results/bias-recipes-sim.json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from moebalance import balancing, simulate

STEPS, SEEDS = 2000, (0, 1, 2)
SIM = simulate.Windows()
RECIPES = {  # the proportional rule's rate: 0.05 / (N*K/E) for N*K/E = 1,536 (balancing.py)
    "sign 1e-3": simulate.Recipe("sign", 1e-3),
    "sign 3e-4": simulate.Recipe("sign", 3e-4),
    "proportional 3.3e-5": simulate.Recipe("proportional", 0.05 / 1536),
    "quantile 0.5": simulate.Recipe("quantile", 0.5),
    "sign 1e-3 cosine to 0.1": simulate.Recipe("sign", 1e-3, final_fraction=0.1),
    "sign 1e-3 counts of 8 steps": simulate.Recipe("sign", 1e-3, accumulate=8),
}
USED = {"last": None, "avg50": 0.5, "avg75": 0.25}  # the bias read: last, or the mean of a part


def one(recipe: simulate.Recipe, seed: int) -> dict:
    out = simulate.run_windows(SIM, recipe, steps=STEPS, seed=seed)
    result = {"batch": float(out["maxvio"][-200:].mean())}
    for name, fraction in USED.items():
        bias = (out["bias"][-1] if fraction is None else
                out["bias"][balancing.average_start(STEPS, fraction):].mean(0))
        result[name] = simulate.held_out_maxvio(SIM, bias)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/bias-recipes-sim.json")
    args = parser.parse_args()
    runs = {}
    for name, recipe in RECIPES.items():
        runs[name] = [one(recipe, seed) for seed in SEEDS]
        print(name, *(f"{key} {np.mean([r[key] for r in runs[name]]):.3f}"
                      for key in (*USED, "batch")), flush=True)
    floor = simulate.held_out_maxvio(SIM, simulate.population_bias(SIM, windows=256, fits=10))
    print(f"the population's bias {floor:.3f}")
    with open(args.out, "w") as f:
        json.dump({"steps": STEPS, "seeds": list(SEEDS), "population": floor, "runs": runs}, f,
                  indent=1)


if __name__ == "__main__":
    main()
