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


@contextlib.contextmanager
def compile_ahead(workers: int = 3):
    """Yields `ahead(step, *args)`: lower `step` (a jitted step, or make_*_step's, which have
    `.lower`) for these arguments now and compile it in the background. Leaving the block waits
    for every compilation and raises the first error."""
    with concurrent.futures.ThreadPoolExecutor(workers, "compile") as pool:
        pending = []

        def ahead(step, *args):
            pending.append(pool.submit(step.lower(*args).compile))

        yield ahead
        for future in pending:
            future.result()
