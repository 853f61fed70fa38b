"""Kernels: one function per operation, each choosing its implementation by the config
(`moe_kernel`), tested against the operation's plain XLA path.

    ops.py        the face: grouped_matmul (the MoE layer's experts), KERNELS, resolve; the
                  plain XLA path of each operation
    backend.py    platform(): the platform a program is traced for (its mesh's devices')
    megablox.py   grouped matmul on ragged rows for TPUs (JAX's megablox gmm / tgmm)
    triton.py     grouped matmul on blocked rows for NVIDIA GPUs (Pallas lowered to Triton)
"""

from moebalance.kernels.backend import platform
from moebalance.kernels.ops import KERNELS, grouped_matmul, resolve

__all__ = ["KERNELS", "grouped_matmul", "platform", "resolve"]
