import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moebalance.config import load_config
from moebalance.training.ahead import compile_ahead
from moebalance.training.hooks import Hook
from moebalance.training.loop import train

COMPILED = re.compile(r"Finished XLA compilation of jit\((\w+)\)")


def compilations(caplog, name: str | None = None) -> list[str]:
    """The names of the programs XLA compiled while caplog listened (JAX's own timing lines),
    those called `name` only if given."""
    return [m[1] for r in caplog.records
            if (m := COMPILED.match(r.getMessage())) and m[1] == (name or m[1])]


@pytest.fixture
def compile_log(caplog):
    caplog.set_level(logging.DEBUG, logger="jax._src.dispatch")
    return caplog


def train_noting_compilations(cfg, out, caplog) -> list[str]:
    """Train `cfg` into `out`; -> the programs compiled before its first step (compilations)."""
    before_first = []

    class AtStart(Hook):
        def start(self, first, steps):
            before_first.extend(compilations(caplog))

    train(cfg, out, hooks=[AtStart()])
    return before_first


def test_a_program_compiled_ahead_is_not_compiled_again_by_its_call(compile_log):
    @jax.jit
    def twice_plus_shift(x, shift):
        return 2 * x + shift

    x = jnp.asarray(np.arange(6.0).reshape(2, 3))
    with compile_ahead() as ahead:
        ahead(twice_plus_shift, x, 1.0)
    assert len(compilations(compile_log, "twice_plus_shift")) == 1
    np.testing.assert_array_equal(twice_plus_shift(x, 1.0), 2 * np.arange(6.0).reshape(2, 3) + 1)
    assert len(compilations(compile_log, "twice_plus_shift")) == 1
    twice_plus_shift(x[:1], 1.0)  # another shape is another program
    assert len(compilations(compile_log, "twice_plus_shift")) == 2


def test_an_error_while_lowering_reaches_the_caller():
    @jax.jit
    def broken(x):
        return x @ x  # [3] @ [3] is fine, [2, 3] @ [2, 3] is not

    with pytest.raises(TypeError, match="dot_general"):
        with compile_ahead() as ahead:
            ahead(broken, jnp.ones((2, 3)))


def test_a_run_compiles_its_steps_before_the_first_and_each_once(tmp_path, compile_log):
    # its own seed: a training step no other test compiled; the calibration uses the score
    # step, the refit the fit step
    cfg = load_config("deepseek4-smoke", dict(
        steps=2, max_target_length=16, per_device_batch_size=2, seed=91,
        routed_bias_calibration_batches=1, probe_refit_batches=1))
    before_first = train_noting_compilations(cfg, tmp_path / "run", compile_log)
    assert before_first.count("step") == 1
    compiled = compilations(compile_log)
    assert compiled.count("step") == 1
    for program in ("eval_step", "score_step", "fit_step"):  # earlier tests may compile these
        assert compiled.count(program) <= 1


def test_a_run_on_a_chain_of_programs_compiles_each_before_the_first_step_and_once(
        tmp_path, compile_log):
    # step_programs=segments: deepseek4-smoke's 3 segments make 5 parts (the embedding, the
    # segments, the head with its losses): 4 forward and 4 backward programs, the head's, one
    # accumulation per part (2 micro-batches) and AdamW's; evaluation and scoring share 4
    # forward-only programs (infer) and have one each of their own; the refit's fit mode 4 more
    # (infer, a model of another structure) and its own; traced in turn, compiled side by side
    cfg = load_config("deepseek4-smoke", dict(
        steps=2, max_target_length=16, per_device_batch_size=2, seed=92,
        gradient_accumulation_steps=2, step_programs="segments",
        routed_bias_calibration_batches=1, probe_refit_batches=1))
    before_first = train_noting_compilations(cfg, tmp_path / "run", compile_log)
    expected = {"forward": 4, "backward": 4, "head": 1, "accumulate": 5, "apply": 1, "infer": 8,
                "evaluate": 1, "score": 1, "fitted": 1}
    assert {name: before_first.count(name) for name in expected} == expected
    compiled = compilations(compile_log)
    assert {name: compiled.count(name) for name in expected} == expected
    assert not {"step", "eval_step", "score_step"} & set(compiled)
