"""A run's programs compiled before their first call, side by side.

Each program is traced and lowered in the calling thread, one after another (tracing holds
Python's lock, and nnx walks the model's graph), and XLA compiles it, or loads it from the
persistent compilation cache, in a thread of its own, which releases that lock: the next
program's tracing and the other compilations go on meanwhile. The first call of each then finds
it compiled (jax.jit keeps what `.lower(...).compile()` made for the same arguments). On a TPU v5e,
deepseek4-tiny's training, evaluation and score steps took 68.5, 17.6 and 12.9 s to compile one
after another (docs/distributed.md, On TPUs).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os


@contextlib.contextmanager
def compile_ahead(workers: int | None = None):
    """Yields `ahead(step, *args)`: lower `step` (a jitted step, or make_*_step's, which have
    `.lower`, or, as a chain of programs, `.lower_programs(emit, *args)`) for these arguments now
    and compile each program in the background as soon as it is lowered. Leaving the block waits
    for every compilation and raises the first error. workers: compilations at once (default:
    one per CPU core)."""
    with concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count(), "compile") as pool:
        pending = []

        def emit(lowered):
            pending.append(pool.submit(lowered.compile))

        yield lambda step, *args: lower(step, emit, *args)
        for future in pending:
            future.result()


def lower(step, emit, *args) -> None:
    """Lower `step` (see compile_ahead) for these arguments, each of its programs passed to
    emit(lowered) as it is lowered."""
    if hasattr(step, "lower_programs"):
        step.lower_programs(emit, *args)
    else:
        emit(step.lower(*args))
