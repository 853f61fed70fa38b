"""The device mesh and where every array lives on it, through JAX's own sharding (GSPMD).

Mesh axes (MaxText's names):
    data    pure data parallelism: the batch is split, parameters are replicated
    fsdp    fully-sharded data parallelism: the batch is split AND each parameter (and its optimizer
            moments) is split along one axis; XLA gathers it where it is used
    expert  reserved for expert parallelism (size 1 in this version)

The batch [A, B, S(+1)] is split over (data, fsdp) on B; every process feeds its own rows
(`global_batch`). Counts, losses and the bias update are computed on global arrays inside one
`jax.jit`, so XLA's all-reduces make them identical to the one-device result (counts exactly).
Router biases, hash tables and scalars stay replicated.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moebalance.config import Config, ConfigError

AXES = ("data", "fsdp", "expert")
BATCH_AXES = ("data", "fsdp")


def initialize_distributed(cfg: Config) -> None:
    """`jax.distributed.initialize` for multi-host runs (before any other JAX call). Empty keys
    let JAX discover the cluster itself (TPU pods, SLURM, Open MPI)."""
    if not cfg.jax_distributed_initialization:
        return
    jax.distributed.initialize(
        coordinator_address=cfg.distributed_coordinator or None,
        num_processes=cfg.distributed_num_processes or None,
        process_id=cfg.distributed_process_id if cfg.distributed_num_processes else None)


def mesh_shape(cfg: Config, num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, expert) sizes; one of data / fsdp may be -1: all the devices left."""
    sizes = {"ici_data_parallelism": cfg.ici_data_parallelism,
             "ici_fsdp_parallelism": cfg.ici_fsdp_parallelism}
    fill = [k for k, v in sizes.items() if v == -1]
    if len(fill) > 1:
        raise ConfigError("config keys `ici_data_parallelism` and `ici_fsdp_parallelism`: at most "
                          "one of them may be -1 (fill the remaining devices)")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if fill:
        if num_devices % fixed:
            raise ConfigError(f"config keys `ici_data_parallelism` x `ici_fsdp_parallelism`: the "
                              f"fixed axes ({fixed} devices) do not divide the {num_devices} "
                              f"devices (`{fill[0]}` = -1 takes the rest)")
        sizes[fill[0]] = num_devices // fixed
    if math.prod(sizes.values()) != num_devices:
        raise ConfigError(f"config keys `ici_data_parallelism` x `ici_fsdp_parallelism` = "
                          f"{sizes['ici_data_parallelism']} x {sizes['ici_fsdp_parallelism']} must "
                          f"equal the {num_devices} devices (set one of them to -1 to fill)")
    return sizes["ici_data_parallelism"], sizes["ici_fsdp_parallelism"], 1


def make_mesh(cfg: Config, devices=None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    shape = mesh_shape(cfg, len(devices))
    return Mesh(np.asarray(devices).reshape(shape), AXES)


def param_spec(path: tuple, shape: tuple, fsdp: int) -> P:
    """Split the largest axis divisible by the fsdp size (not the layer axis of scanned stacks,
    which the scan slices); arrays too small to split stay replicated."""
    stacked = any(getattr(k, "key", k) == "units" for k in path)
    candidates = [a for a in range(1 if stacked else 0, len(shape))
                  if shape[a] % fsdp == 0 and shape[a] >= fsdp]
    if fsdp == 1 or not candidates:
        return P()
    axis = max(candidates, key=lambda a: (shape[a], a))
    return P(*[("fsdp" if a == axis else None) for a in range(len(shape))])


def variable_sharding(path: tuple, variable: nnx.Variable, mesh: Mesh) -> NamedSharding:
    """Parameters and their optimizer moments split over fsdp; everything else (biases, hash
    tables, step counters) replicated."""
    names = [getattr(k, "key", k) for k in path]
    is_param = isinstance(variable, nnx.Param) or "mu" in names or "nu" in names
    if not is_param:
        return NamedSharding(mesh, P())
    return NamedSharding(mesh, param_spec(path, variable.shape, mesh.shape["fsdp"]))


def shard(obj, mesh: Mesh) -> None:
    """Place a model's or optimizer's state on the mesh, in place."""
    def place(path, variable):
        return variable.replace(jax.device_put(variable[...], variable_sharding(path, variable,
                                                                                 mesh)))

    state = jax.tree_util.tree_map_with_path(place, nnx.state(obj),
                                             is_leaf=lambda x: isinstance(x, nnx.Variable))
    nnx.update(obj, state)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """[A, B, ...]: micro-batch axis whole, B split over (data, fsdp)."""
    return NamedSharding(mesh, P(None, BATCH_AXES, *[None] * (ndim - 2)))


def global_batch(mesh: Mesh, *local_arrays) -> tuple[jax.Array, ...]:
    """This process's rows [A, B_local, ...] -> global arrays [A, B, ...] on the mesh."""
    return tuple(jax.make_array_from_process_local_data(batch_sharding(mesh, x.ndim), x)
                 for x in local_arrays)
