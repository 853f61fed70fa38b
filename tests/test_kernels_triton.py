"""The Triton grouped-matmul kernels of the blocked expert layout (kernels/triton.py), run here in
Pallas' interpret mode, against loops over blocks in NumPy; and their lowering for GPUs (Triton)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moebalance.kernels.triton as gm
from moebalance.model.moe import MoE, MoEConfig

# (blocks, rows per block, K, N, experts, the sorted expert of each block): an expert without
# blocks (1), blocks of several row chunks (b = 128 > TILE_M), K and N of several tiles
CASES = [
    (5, 32, 192, 96, 4, [0, 0, 2, 2, 3]),
    (3, 128, 64, 256, 3, [0, 2, 2]),
    (4, 16, 48, 40, 5, [1, 1, 1, 4]),
]


def _arrays(nb, b, k, n, e, experts, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(nb, b, k)).astype(dtype), rng.normal(size=(e, k, n)).astype(dtype),
            np.array(experts, np.int32))


def loop_matmul(x, w, experts):
    return np.stack([x[i].astype(np.float64) @ w[e] for i, e in enumerate(experts)])


def loop_weight_grad(x, dy, experts, num_experts):
    dw = np.zeros((num_experts, x.shape[2], dy.shape[2]))
    for i, e in enumerate(experts):
        dw[e] += x[i].astype(np.float64).T @ dy[i]
    return dw


@pytest.mark.parametrize("case", CASES)
def test_block_matmul_equals_a_loop_over_blocks(case):
    x, w, experts = _arrays(*case)
    np.testing.assert_allclose(gm.block_matmul(x, w, experts), loop_matmul(x, w, experts),
                               rtol=1e-5, atol=1e-4)
    w_t = np.ascontiguousarray(w.transpose(0, 2, 1))  # [E, N, K]: y = x @ w_t[e]^T
    np.testing.assert_allclose(gm.block_matmul(x, w_t, experts, transpose_w=True),
                               loop_matmul(x, w, experts), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("case", CASES)
def test_weight_grad_sums_each_experts_blocks(case):
    nb, b, k, n, e, experts = case
    x, _, experts = _arrays(*case)
    dy = np.random.default_rng(1).normal(size=(nb, b, n)).astype(np.float32)
    dw = np.asarray(gm.expert_weight_grad(x, dy, experts, e))
    np.testing.assert_allclose(dw, loop_weight_grad(x, dy, experts, e), rtol=1e-5, atol=1e-4)
    for absent in sorted(set(range(e)) - set(experts.tolist())):
        assert not dw[absent].any()


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_gradients_equal_autodiff_of_picked_weights(dtype, tol):
    nb, b, k, n, e, experts = CASES[0]
    x, w, experts = _arrays(*CASES[0])
    x, w = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
    probe = jax.random.normal(jax.random.key(3), (nb, b, n))

    def loss(matmul):
        return lambda x, w: (matmul(x, w).astype(jnp.float32) * probe).sum()

    kernel = loss(lambda x, w: gm.grouped_matmul(x, w, experts))
    picked = loss(lambda x, w: jnp.einsum("nbk,nkf->nbf", x, w[experts]))
    np.testing.assert_allclose(kernel(x, w), picked(x, w), rtol=tol)
    for got, want in zip(jax.grad(kernel, (0, 1))(x, w), jax.grad(picked, (0, 1))(x, w)):
        assert got.dtype == want.dtype == dtype
        scale = float(jnp.abs(want.astype(jnp.float32)).max())
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32),
                                   atol=tol * scale)


def test_layer_backward_runs_each_kernel_once():
    """Forward: gate, up, down (3 kernels); backward: input and weight gradient of each (6). The
    remat policy keeps the kernels' outputs, so none of the forward's runs again."""
    model = MoE(MoEConfig(emb_dim=16, num_experts=4, num_experts_per_tok=2, moe_mlp_dim=32,
                          block_size=8, kernel="pallas"), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    x = jax.random.normal(jax.random.key(1), (2, 16, 16))
    grad = jax.grad(lambda state: nnx.merge(graphdef, state)(x)[0].sum())
    assert str(jax.make_jaxpr(grad)(state)).count("pallas_call") == 9


def test_kernels_lower_to_triton_for_gpus(monkeypatch):
    """Off a GPU the kernels run interpreted; lowered for one, the forward and backward are three
    Triton kernels (this checks their lowering, not a GPU compile)."""
    monkeypatch.setattr(gm, "_interpret", lambda x: False)
    nb, b, k, n, e, experts = CASES[1]
    x, w, experts = _arrays(*CASES[1], dtype=jnp.bfloat16)
    grad = jax.jit(jax.grad(lambda x, w: gm.grouped_matmul(x, w, experts).astype(
        jnp.float32).sum(), (0, 1)))
    # the GPU lowered for, an H100 (sm_90): JAX 0.11's Triton lowering takes it from the device,
    # real or abstract, and refuses without one (JAX 0.10 assumed sm_90 off a GPU)
    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                       platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=h100)):
        text = grad.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"custom_call @([\w$.]+)", text) == ["__gpu$xla.gpu.triton"] * 3


def test_tiles_too_small_for_a_gpu_are_refused(monkeypatch):
    monkeypatch.setattr(gm, "_interpret", lambda x: False)
    x, w, experts = _arrays(4, 8, 64, 64, 2, [0, 0, 1, 1])
    with pytest.raises(ValueError, match="blocks of 8 rows.*moe_block_size"):
        gm.block_matmul(x, w, experts)


def test_interpreted_kernels_under_shard_map_are_refused_with_the_fix():
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("expert",))
    x, w, experts = _arrays(*CASES[0])
    spec = jax.sharding.PartitionSpec("expert")
    run = jax.shard_map(lambda x: gm.block_matmul(x, w, experts), mesh=mesh, in_specs=spec,
                        out_specs=spec)
    with pytest.raises(NotImplementedError, match="GPUs only.*moe_kernel=xla"):
        run(x)
