"""The device mesh and where every array lives on it, through JAX's own sharding (GSPMD).

Mesh axes (MaxText's names):
    data    pure data parallelism: the batch is split, parameters are replicated
    fsdp    fully-sharded data parallelism: the batch is split AND each parameter (and its optimizer
            moments) is split along one axis; XLA gathers it where it is used
    expert  expert parallelism: the batch is split, and so are the routed experts (their E axis);
            tokens reach their experts by all-to-all (model/expert_parallel.py)

The batch [A, B, S(+1)] is split over all three axes on B; every process feeds its own rows
(`global_batch`). Counts, losses and the bias update are computed on global arrays inside one
`jax.jit`, so XLA's all-reduces make them identical to the one-device result (counts exactly).
Router biases, hash tables and scalars stay replicated. Run model code under `jax.set_mesh(mesh)`:
the MoE layers read the mesh from there.
"""

from __future__ import annotations

import math
import os
import threading

import jax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moebalance.config import Config, ConfigError
from moebalance.training.topology import device_grid

AXES = ("data", "fsdp", "expert")
ROUTED_EXPERT_WEIGHTS = ("w1", "w2", "w3")  # [(layers,) E, ...] directly under an MoE `ffn`


# Config keys that say how this process joins a multi-process run: they differ between the
# processes of one run (the process id) and between a run and its resumption.
LAUNCH_KEYS = ("jax_distributed_initialization", "distributed_coordinator",
               "distributed_num_processes", "distributed_process_id")
# The environment variables a launcher may set instead of those keys (one command for all hosts).
LAUNCH_ENV = {"distributed_coordinator": "MOEBALANCE_COORDINATOR",
              "distributed_num_processes": "MOEBALANCE_NUM_PROCESSES",
              "distributed_process_id": "MOEBALANCE_PROCESS_ID"}


def _env_int(environ, key: str) -> int | None:
    """The integer in the environment variable standing for config key `key` (None: unset)."""
    name = LAUNCH_ENV[key]
    if name not in environ:
        return None
    try:
        return int(environ[name])
    except ValueError:
        raise ConfigError(f"environment variable {name}={environ[name]!r} must be an integer "
                          f"(it stands for config key `{key}`)") from None


def distributed_settings(cfg: Config, environ=os.environ) -> dict | None:
    """The arguments of `jax.distributed.initialize`, or None for a single-process run.

    A run is multi-process when `jax_distributed_initialization` is true or the environment sets
    any of MOEBALANCE_COORDINATOR / MOEBALANCE_NUM_PROCESSES / MOEBALANCE_PROCESS_ID. Config keys
    win over the environment; the three go together, and when none is given JAX discovers the
    cluster itself (TPU slices, SLURM, Open MPI, Kubernetes; JAX_COORDINATOR_ADDRESS)."""
    if not (cfg.jax_distributed_initialization or any(v in environ for v in LAUNCH_ENV.values())):
        return None
    coordinator = cfg.distributed_coordinator or environ.get(LAUNCH_ENV["distributed_coordinator"])
    if cfg.distributed_num_processes:
        processes, process_id = cfg.distributed_num_processes, cfg.distributed_process_id
    else:
        processes = _env_int(environ, "distributed_num_processes")
        process_id = _env_int(environ, "distributed_process_id")
    given = dict(zip(LAUNCH_ENV, (coordinator, processes, process_id)))
    missing = [key for key, value in given.items() if value is None]
    if missing and len(missing) < len(given):
        raise ConfigError(f"a multi-process launch gives the coordinator, the process count and "
                          f"this process's id together; missing: "
                          f"{', '.join(f'`{k}` (or {LAUNCH_ENV[k]})' for k in missing)}")
    if processes is not None and not 0 <= process_id < processes:
        raise ConfigError(f"config key `distributed_process_id` (or MOEBALANCE_PROCESS_ID): "
                          f"{process_id} is not in [0, {processes}) for {processes} processes")
    return {"coordinator_address": coordinator, "num_processes": processes,
            "process_id": process_id}


def initialize_distributed(cfg: Config) -> None:
    """`jax.distributed.initialize` for multi-process runs (before any other JAX call; once per
    process, so a second run in the same process reuses the connection)."""
    settings = distributed_settings(cfg)
    if settings is not None and not jax.distributed.is_initialized():
        jax.distributed.initialize(**settings)


def open_devices_early(cfg: Config) -> threading.Thread:
    """initialize_distributed, then JAX's backends started on a thread of their own, for a
    command that will train: opening a TPU takes seconds (a v5e: 9.6 s, 2026-12-07) with Python's
    lock released, so the command's imports and reading go on meanwhile; the first JAX call that
    needs the devices waits for it (JAX starts its backends once, under a lock of its own). An
    error there is raised again by that call, so the thread keeps quiet about it. Not a daemon:
    a command that fails early waits for the opening to finish before the process exits."""
    initialize_distributed(cfg)
    thread = threading.Thread(target=_open_devices, name="open-devices")
    thread.start()
    return thread


def _open_devices() -> None:
    try:
        jax.devices()
    except Exception:  # noqa: BLE001 (the main thread's first JAX call raises it again)
        pass


def sync_processes(name: str) -> None:
    """Wait until every process of a multi-process run got here (no-op for one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def mesh_shape(cfg: Config, num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, expert) sizes; one of them may be -1: all the devices left."""
    keys = ("ici_data_parallelism", "ici_fsdp_parallelism", "ici_expert_parallelism")
    sizes = {k: getattr(cfg, k) for k in keys}
    names = " x ".join(f"`{k}`" for k in keys)
    fill = [k for k, v in sizes.items() if v == -1]
    if len(fill) > 1:
        raise ConfigError(f"config keys {names}: at most one of them may be -1 (fill the "
                          f"remaining devices), got {' and '.join(fill)}")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if fill:
        if num_devices % fixed:
            raise ConfigError(f"config keys {names}: the fixed axes ({fixed} devices) do not "
                              f"divide the {num_devices} devices (`{fill[0]}` = -1 takes the rest)")
        sizes[fill[0]] = num_devices // fixed
    if math.prod(sizes.values()) != num_devices:
        raise ConfigError(f"config keys {names} = {' x '.join(map(str, sizes.values()))} must "
                          f"equal the {num_devices} devices (set one of them to -1 to fill)")
    if cfg.num_experts % sizes["ici_expert_parallelism"]:
        raise ConfigError(f"config keys `num_experts` / `ici_expert_parallelism`: "
                          f"{cfg.num_experts} experts do not split over "
                          f"{sizes['ici_expert_parallelism']} expert-parallel ranks")
    return tuple(sizes.values())


def make_mesh(cfg: Config, devices=None) -> Mesh:
    """The (data, fsdp, expert) mesh of the `ici_*` keys on `devices` (default: all), laid out on
    their interconnect (topology.device_grid: ICI-aware on a TPU, data across slices)."""
    devices = jax.devices() if devices is None else devices
    shape = mesh_shape(cfg, len(devices))
    return Mesh(device_grid(shape, devices), AXES)


def param_spec(path: tuple, shape: tuple, fsdp: int, expert: int = 1) -> P:
    """Routed expert weights: their expert axis over `expert`. Then the largest remaining axis
    divisible by the fsdp size over `fsdp` (not the layer axis of scanned stacks, which the scan
    slices); arrays too small to split stay replicated."""
    names = [getattr(k, "key", k) for k in path]
    first = 1 if "units" in names else 0
    spec = [None] * len(shape)
    if expert > 1 and len(names) >= 2 and names[-2] == "ffn" and names[-1] in ROUTED_EXPERT_WEIGHTS:
        spec[first] = "expert"
    candidates = [a for a in range(first, len(shape))
                  if spec[a] is None and shape[a] % fsdp == 0 and shape[a] >= fsdp]
    if fsdp > 1 and candidates:
        spec[max(candidates, key=lambda a: (shape[a], a))] = "fsdp"
    return P(*spec) if any(spec) else P()


def variable_sharding(path: tuple, variable: nnx.Variable, mesh: Mesh) -> NamedSharding:
    """Parameters and their optimizer moments split over fsdp; everything else (biases, hash
    tables, step counters) replicated."""
    names = [getattr(k, "key", k) for k in path]
    is_param = isinstance(variable, nnx.Param) or "mu" in names or "nu" in names
    if not is_param:
        return NamedSharding(mesh, P())
    return NamedSharding(mesh, param_spec(path, variable.shape, mesh.shape["fsdp"],
                                          mesh.shape["expert"]))


def shard(obj, mesh: Mesh) -> None:
    """Place a model's or optimizer's state on the mesh, in place."""
    def place(path, variable):
        return variable.replace(jax.device_put(variable[...], variable_sharding(path, variable,
                                                                                 mesh)))

    state = jax.tree_util.tree_map_with_path(place, nnx.state(obj),
                                             is_leaf=lambda x: isinstance(x, nnx.Variable))
    nnx.update(obj, state)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """[A, B, ...]: micro-batch axis whole, B split over every mesh axis."""
    return NamedSharding(mesh, P(None, AXES, *[None] * (ndim - 2)))


def global_batch(mesh: Mesh, *local_arrays) -> tuple[jax.Array, ...]:
    """This process's rows [A, B_local, ...] -> global arrays [A, B, ...] on the mesh."""
    return tuple(jax.make_array_from_process_local_data(batch_sharding(mesh, x.ndim), x)
                 for x in local_arrays)
