"""How exactly JAX's default backend computes float32 transcendentals: each function's largest
relative error (and in ulps, and absolute) against float64 NumPy over 450,000 points (200,000 in
[-20, 20], 200,000 in [-1, 1], 50,000 in [-1e-3, 1e-3]; positive-only functions read |x| + 1e-3),
and the softmax of 1,000 rows of 8. The tests' TPU tolerances for values computed through these
functions come from this (tests/conftest.py TPU_FUNCTION_RTOL; docs/distributed.md).

    python benchmarks/tpu_functions.py > functions.json   (on the chip: benchmarks/tpu.sh functions)
"""

import json

import jax
import jax.numpy as jnp
import numpy as np


def points() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-20, 20, 200_000), rng.uniform(-1, 1, 200_000),
                        rng.uniform(-1e-3, 1e-3, 50_000)]).astype(np.float32)
    return x, np.abs(x) + np.float32(1e-3)


def errors(f, inputs: np.ndarray, want: np.ndarray) -> dict:
    """f's float32 values at inputs against the float64 `want`."""
    got = np.asarray(jax.jit(f)(jnp.asarray(inputs))).astype(np.float64)
    err = np.abs(got - want)
    rel = err / np.maximum(np.abs(want), 1e-30)
    ulp = err / np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    return {"max_rel": float(rel.max()), "max_abs": float(err.max()), "max_ulp": float(ulp.max()),
            "p99_ulp": float(np.quantile(ulp, 0.99)),
            "worst_at": float(inputs.ravel()[np.argmax(rel)])}


def main():
    x, pos = points()
    x64, p64 = x.astype(np.float64), pos.astype(np.float64)
    softplus = np.logaddexp(x64, 0.0)
    cases = {
        "exp": (jnp.exp, x, np.exp(x64)),
        "log": (jnp.log, pos, np.log(p64)),
        "log1p": (jnp.log1p, pos, np.log1p(p64)),
        "softplus": (jax.nn.softplus, x, softplus),
        "sqrtsoftplus": (lambda v: jnp.sqrt(jax.nn.softplus(v)), x, np.sqrt(softplus)),
        "sigmoid": (jax.nn.sigmoid, x, 1 / (1 + np.exp(-x64))),
        "tanh": (jnp.tanh, x, np.tanh(x64)),
        "sqrt": (jnp.sqrt, pos, np.sqrt(p64)),
        "rsqrt": (jax.lax.rsqrt, pos, 1 / np.sqrt(p64)),
        "divide": (lambda v: 1.0 / v, pos, 1 / p64),
    }
    out = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
           "jax": jax.__version__, "functions": {}}
    for name, (f, inputs, want) in cases.items():
        out["functions"][name] = errors(f, inputs, want)
    rows = (np.random.default_rng(1).normal(size=(1000, 8)) * 3).astype(np.float32)
    want = np.exp(rows - rows.max(1, keepdims=True))
    out["functions"]["softmax"] = errors(lambda v: jax.nn.softmax(v, axis=-1), rows,
                                         want / want.sum(1, keepdims=True))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
