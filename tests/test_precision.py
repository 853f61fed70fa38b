"""The float32 dots that decide routing run at full float32 precision on every backend.

TPUs compute a float32 dot at the default precision as one bfloat16 pass; the router's logits
and the hyper-connection maps (model/layers.FP32) must not inherit that. Checked on the program
JAX hands to XLA, so on a CPU: every dot_general of the training loss's gradient, by the named
scope it comes from (`route`, `mhc`), carries precision HIGHEST, and no bfloat16 matmul does.
The attention's dots, in turn, take operands in the compute dtype.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from moebalance.config import load_config
from moebalance.model import attention, decode
from moebalance.model.transformer import DeepSeekV4, routed_layers
from moebalance.training.objective import losses

ROUTING_SCOPES = re.compile(r"\b(route|mhc)\b")


def dots(fn, *args) -> list[tuple[str, tuple[str, str], str]]:
    """(precision, operand element types, named-scope path) of every dot_general in the
    StableHLO of jax.jit(fn)(*args)."""
    text = jax.jit(fn).lower(*args).as_text(debug_info=True)
    scopes = dict(re.findall(r'^(#loc\d+) = loc\("([^"]*)"', text, re.M))
    found = []
    for line in text.splitlines():
        if "stablehlo.dot_general" not in line:
            continue
        precision = re.search(r"precision = \[(\w+), \1\]", line)
        types = re.search(r": \(tensor<(?:[\dx]*x)?(\w+)>, tensor<(?:[\dx]*x)?(\w+)>\)", line)
        loc = re.search(r"loc\((#loc\d+)\)\s*$", line)
        found.append((precision.group(1) if precision else "DEFAULT", types.groups(),
                      scopes[loc.group(1)]))
    return found


def loss_dots(gradient: bool = True, **overrides) -> list[tuple[str, tuple[str, str], str]]:
    """dots() of the training loss's gradient (forward and backward), or of the loss alone, of
    deepseek4-smoke in bfloat16 (sliding-window and CSA layers) with both routing losses on."""
    cfg = load_config("deepseek4-smoke", {"max_target_length": 16, "dtype": "bfloat16",
                                          "load_balance_loss_weight": 1e-2,
                                          "router_z_loss_weight": 1e-3, **overrides})
    model = DeepSeekV4(cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    routed = routed_layers(model)
    tokens = jnp.zeros((2, 17), jnp.int32)
    mask, segments = jnp.ones((2, 16), bool), jnp.zeros((2, 16), jnp.int32)

    def loss(params):
        model = nnx.merge(graphdef, params, rest)
        return losses(cfg, model, tokens, mask, segments, routed)[0]

    return dots(jax.grad(loss) if gradient else loss, params)


def test_routing_and_hyper_connection_dots_are_highest_and_bfloat16_ones_default():
    found = loss_dots()
    routing = [d for d in found if ROUTING_SCOPES.search(d[2])]
    # the router (forward, its two backward dots) and every hyper-connection dot are there
    assert {"route/dot_general", "transpose(jvp(route))/dot_general"} <= {
        re.sub(r"^jit\(loss\)/", "", d[2]) for d in routing}
    # the hyper-connections' mixes (forward), their gradient for fn and, in the streams' hand-
    # written backward, their gradient for the streams (a plain matmul); the rest of their maths
    # is broadcast products and sums, no dots
    for spec in ("mhc/jtd,jdk->tk/", "mhc/jtd,tk->jdk/", "transpose(jvp(mhc))/dot_general"):
        assert any(spec in d[2] for d in routing), spec
    wrong = [d for d in routing if d[0] != "HIGHEST" or d[1] != ("f32", "f32")]
    assert not wrong, wrong
    bf16 = [d for d in found if "bf16" in d[1]]
    assert len(bf16) > 50  # the experts', shared experts' and attention's matmuls
    assert all(d[0] == "DEFAULT" for d in bf16), [d for d in bf16 if d[0] != "DEFAULT"]


# the attention's logits and its probabilities times values: sliding window, then CSA's chosen
# entries attended densely (all entries, the others masked) or gathered (attention.DENSE_TOPK)
ATTENTION = {"dense": ("bcqhd,bckd->bhcqk", "bcqhk,bckd->bcqhd", "bshd,bnd->bhsn",
                       "bhsn,bnd->bshd"),
             "gathered": ("bshd,bskd->bhsk", "bhsk,bskd->bshd")}


@pytest.mark.parametrize("csa", ["dense", "gathered"])
def test_attention_dots_take_the_compute_dtype(csa, monkeypatch):
    """The attention's forward dots multiply bfloat16 operands, accumulating in float32 (their
    results feed a float32 softmax), as a TPU computes float32 operands at the default precision
    anyway: no float32 copy of the keys or of CSA's gathered entries is made or kept for the
    backward. (The backward's cotangents are float32, JAX's transpose of a float32 result.)"""
    monkeypatch.setattr(attention, "DENSE_TOPK", 4 if csa == "dense" else 0)
    found = loss_dots(gradient=False)
    for spec in ATTENTION[csa]:
        mine = [d for d in found if f"/{spec}/" in d[2]]
        assert mine and all(d[1] == ("bf16", "bf16") for d in mine), (spec, mine)


def test_a_float32_model_multiplies_in_float32_everywhere():
    """The cause of cached decoding parting from the full pass on a TPU v5e (logits up to 2.95
    apart, greedy tokens from the 4th on; equal to 2e-5 on the CPU): a float32 model's matmuls
    ran at the default precision, one bfloat16 pass, so the two paths' activations, equal to
    float32 rounding, were rounded to 8 bits, and wherever a value sat near a rounding boundary
    the two roundings differed by 2^-8; top-k choices downstream (experts, the indexer's entries)
    flipped. matmul_precision `auto` runs a float32 model's every dot at HIGHEST: the training
    loss and its gradient (the cross-entropy's own backward included), the cached prefill and
    step, and the logits. A bfloat16 model keeps the default (test above)."""
    found = loss_dots(dtype="float32", mtp_num_layers=1)
    assert len(found) > 100
    assert all(d[0] == "HIGHEST" for d in found), [d for d in found if d[0] != "HIGHEST"]
    assert any("loss" in d[2] for d in found)  # the cross-entropy's dots are among them
    cfg = load_config("deepseek4-smoke", {"compress_ratios": [0, 0, 4, 0]})
    model = DeepSeekV4(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((1, 8), jnp.int32)

    def prefill(state):
        return decode.prefill(nnx.merge(graphdef, state), tokens, 5)

    def step(state, cache):
        return decode.step(nnx.merge(graphdef, state), cache, tokens[:, 0])

    _, cache = jax.jit(prefill)(state)  # one program, not ~400 eager operations
    decoding = dots(prefill, state) + dots(step, state, cache)
    assert len(decoding) > 50
    assert all(d[0] == "HIGHEST" for d in decoding), [d for d in decoding if d[0] != "HIGHEST"]
    assert all(d[0] == "DEFAULT" for d in loss_dots(gradient=False, dtype="float32",
                                                      matmul_precision="default")
               if not ROUTING_SCOPES.search(d[2]))
