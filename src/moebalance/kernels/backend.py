"""Which platform a program is traced for, from which every choice by backend is made."""

from __future__ import annotations

import jax


def platform() -> str:
    """The platform the program being traced will run on: that of the devices of the mesh set by
    `jax.set_mesh` (or of a `shard_map`'s mesh) when it has devices, else JAX's default backend.
    A step lowered on the CPU under a TPU topology's mesh thus picks kernels and layouts as the
    chip does, and a Pallas kernel is emitted for it rather than interpreted."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.platform if device is not None else jax.default_backend()
