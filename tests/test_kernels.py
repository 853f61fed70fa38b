"""The kernels' face (kernels/ops.py): each implementation of the grouped matmul against the plain
XLA path, forward and gradients, the Pallas kernels in interpret mode on the CPU; how `auto` and
the config key choose. The Triton kernels' own tests: test_kernels_triton.py."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moebalance import kernels
from moebalance.config import EXPERT_KERNELS
from moebalance.kernels import megablox
from moebalance.model.moe import MoE, MoEConfig


def _operands(rows_shape, k, n, groups, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(*rows_shape, k)), dtype)
    w = jnp.asarray(rng.normal(size=(groups, k, n)), dtype)
    probe = jnp.asarray(rng.normal(size=(*rows_shape, n)), jnp.float32)
    return x, w, probe


def _value_and_grads(matmul, x, w, probe):
    """(y, dx, dw) of loss = sum(matmul(x, w) * probe), jitted as one program."""
    def loss(x, w):
        y = matmul(x, w)
        return (y.astype(jnp.float32) * probe).sum(), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(x, w)
    return (y, *grads)


def _assert_close(got, want, tol):
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, atol=tol * np.abs(b).max())


# (rows M, group sizes, row tile, K, N, dtype, tolerance): an empty group, rows past the sum, M
# not a whole number of row tiles (megablox pads); then every row in a group, M two whole row
# tiles and a group across their boundary; K and N not whole 128 lanes (megablox pads them too)
RAGGED = [(40, [10, 0, 20, 5], 128, 128, 256, jnp.float32, 1e-5),
          (40, [10, 0, 20, 5], 128, 128, 256, jnp.bfloat16, 1e-2),
          (256, [0, 100, 156], 128, 128, 256, jnp.float32, 1e-5),
          (40, [10, 0, 20, 5], 128, 40, 72, jnp.float32, 1e-5)]


@pytest.mark.parametrize("rows,sizes,row_tile,k,n,dtype,tol", RAGGED)
def test_megablox_on_ragged_rows_equals_ragged_dot(rows, sizes, row_tile, k, n, dtype, tol):
    x, w, probe = _operands((rows,), k, n, len(sizes), dtype)
    sizes = jnp.asarray(sizes, jnp.int32)
    got = _value_and_grads(
        lambda x, w: kernels.grouped_matmul(x, w, sizes, kernel="megablox", row_tile=row_tile),
        x, w, probe)
    want = _value_and_grads(lambda x, w: jax.lax.ragged_dot(x, w, sizes), x, w, probe)
    _assert_close(got, want, tol)
    past = int(sizes.sum())  # rows in no group: zeros, and so is their input gradient
    assert not np.asarray(got[0][past:], np.float32).any()
    assert not np.asarray(got[1][past:], np.float32).any()


@pytest.mark.parametrize("kernel", ["xla", "megablox"])
def test_blocked_rows_equal_gathered_weights(kernel):
    """Blocks of 8 rows, group 1 without blocks; against autodiff of an einsum over each block's
    weights gathered by indexing (neither a one-hot pick nor a kernel)."""
    block_group = jnp.asarray([0, 0, 2, 2, 3], jnp.int32)
    x, w, probe = _operands((5, 8), 128, 256, 4, jnp.float32)
    got = _value_and_grads(lambda x, w: kernels.grouped_matmul(x, w, block_group, kernel=kernel),
                           x, w, probe)
    want = _value_and_grads(lambda x, w: jnp.einsum("nbk,nkf->nbf", x, w[block_group]),
                            x, w, probe)
    _assert_close(got, want, 1e-5)
    assert not np.asarray(got[2][1]).any()  # no rows, no gradient


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
def test_auto_is_the_xla_path_on_every_backend(monkeypatch, backend):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert kernels.resolve("auto") == "xla"
    for kernel in kernels.KERNELS:
        assert kernels.resolve(kernel) == kernel
    with pytest.raises(ValueError, match="unknown kernel 'triton'"):
        kernels.resolve("triton")


def test_config_key_names_every_kernel():
    assert EXPERT_KERNELS == ("auto", *kernels.KERNELS)


def test_megablox_inside_shard_map_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("expert",))
    spec = jax.sharding.PartitionSpec("expert")
    sizes = jnp.asarray([3, 5], jnp.int32)
    x, w, _ = _operands((8,), 128, 128, 2, jnp.float32)

    def run(fn):
        return jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec)(x)

    np.testing.assert_allclose(run(lambda x: kernels.grouped_matmul(x, w, sizes)),
                               jax.lax.ragged_dot(x, w, sizes), rtol=1e-6)  # auto: ragged_dot
    with pytest.raises(NotImplementedError, match="inside shard_map.*moe_kernel=xla"):
        run(lambda x: kernels.grouped_matmul(x, w, sizes, kernel="megablox"))


def test_triton_kernels_refuse_ragged_rows_with_the_fix():
    x, w, _ = _operands((8,), 16, 16, 2, jnp.float32)
    with pytest.raises(ValueError, match="blocked rows only.*moe_dispatch=blocked"):
        kernels.grouped_matmul(x, w, jnp.asarray([3, 5], jnp.int32), kernel="pallas")


@pytest.mark.parametrize("kernel", ["auto", "megablox"])
def test_layer_lowered_for_a_tpu_runs_the_kernel_asked_for(monkeypatch, kernel):
    """The layer as a TPU runs it (lowered here, not compiled): ragged rows, by default through
    ragged_dot; with moe_kernel=megablox through megablox's kernels (Mosaic) and no ragged_dot.
    The loss is linear in the down projection, whose forward is then dropped: gmm for gate and
    up, gmm with the weights transposed for the three input gradients, tgmm for the three weight
    gradients."""
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    model = MoE(MoEConfig(emb_dim=128, num_experts=8, num_experts_per_tok=2, moe_mlp_dim=128,
                          block_size=128, dtype="bfloat16", kernel=kernel), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    x = jax.ShapeDtypeStruct((2, 256, 128), jnp.bfloat16)
    grad = jax.jit(jax.grad(lambda state, x: nnx.merge(graphdef, state)(x)[0].astype(
        jnp.float32).sum(), (0, 1)))
    text = grad.trace(state, x).lower(lowering_platforms=("tpu",)).as_text()
    calls = collections.Counter(re.findall(r"call @(t?gmm)", text))
    if kernel == "auto":
        assert "ragged_dot" in text and "tpu_custom_call" not in text and not calls
    else:
        assert "tpu_custom_call" in text and "ragged_dot" not in text
        assert calls == {"gmm": 5, "tgmm": 3}


def test_megablox_lowered_for_a_tpu_pads_widths_to_whole_lanes(monkeypatch):
    """K = 16 and N = 12, the MoE tests' widths: the TPU's Pallas lowering refuses tiles that are
    not whole 128 lanes (on the v5e, 2026-12-06: "block shape (128, 12), array shape (128, 16)"),
    so megablox pads both; lowered here for a TPU, forward and backward."""
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    x, w, probe = _operands((40,), 16, 12, 4, jnp.bfloat16)
    sizes = jnp.asarray([10, 0, 20, 5], jnp.int32)
    grad = jax.jit(jax.grad(lambda x, w: (kernels.grouped_matmul(
        x, w, sizes, kernel="megablox", row_tile=128).astype(jnp.float32) * probe).sum(), (0, 1)))
    text = grad.trace(x, w).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text and "ragged_dot" not in text
