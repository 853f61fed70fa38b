"""The steps as chains of programs per model segment (`step_programs: segments`, and `auto` on a
TPU: step.chained), for XLA to compile side by side (ahead.compile_ahead) instead of one program
holding every block kind, forward and backward, in turn: deepseek4-tiny's one training program took
70-72 s to compile on one core of a TPU v5e's host (docs/distributed.md, the step as a chain of
programs).

    training    per micro-batch: embed -> segment 0 .. n-1 forward, each returning its output and
                its backward (jax.vjp's) -> head (outputs, losses and their gradient) -> the
                backwards in reverse; then apply (AdamW and the bias update): `segment_steps`
    evaluation  embed -> segments forward only (`infer`, shared with scoring) -> evaluate
    scoring     embed -> segments (the same programs) -> score: `inference_chain`
    fitting     embed -> segments (the model in its fit mode) -> the fitted biases

A chain is a function chain(call, model, split model, *args) that runs its programs in order
through call(program, *its args): `_chain_step` makes it a step that runs them, binds a model
(split once) or lowers them for their shapes. The gradients and sums are the one program's
(objective.loss_terms, apply_gradients, evaluation_sums), summed in another order.
"""

from __future__ import annotations

import contextlib
import functools
import json
import typing

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moebalance.config import Config
from moebalance.model.layers import precision_scope
from moebalance.model.transformer import run_segment
from moebalance.training.objective import apply_gradients, evaluation_sums, loss_terms


def _split_ints(tree):
    """tree -> (its float arrays, its integer arrays), each with None in place of the others':
    a program's integer outputs (the records' counts and choices) have no gradient, and passing
    float0 cotangents between programs would make each call compile its program again."""
    def is_int(x):
        return not jnp.issubdtype(x.dtype, jnp.inexact)
    return (jax.tree.map(lambda x: None if is_int(x) else x, tree),
            jax.tree.map(lambda x: x if is_int(x) else None, tree))


def _join(floats, ints):
    """The inverse of _split_ints."""
    return jax.tree.map(lambda f, i: i if f is None else f, floats, ints,
                        is_leaf=lambda x: x is None)


def _forward_part(model, segment, carry, tokens, segment_ids):
    """The embedding (segment None) of tokens [B, S+1]'s inputs, or model.segments[segment] on
    the streams `carry` -> its output (run_segment's)."""
    inputs = tokens[:, :-1]
    if segment is None:
        return model.streams(inputs)
    positions, _ = model.defaults(inputs, None, segment_ids)
    return run_segment(model.segments[segment], carry, inputs, positions, segment_ids, None)


def _mesh_set(mesh):
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def _call(program, *args):
    return program(*args)


def _lowering(mesh, emit):
    """A chain's `call` that lowers each program for the shapes of its inputs, the earlier
    programs' outputs, and returns its outputs' shapes. On one device they are that device's
    whole arrays: emit(lowered) compiles each in the background. On several, XLA chooses the
    outputs' layouts as it compiles: each program is compiled before the next is traced."""
    def trace(program, *args):
        with _mesh_set(mesh):
            traced = program.trace(*args)
            lowered = traced.lower()
        if mesh is not None and mesh.size > 1:
            compiled = lowered.compile()
            return jax.tree.map(lambda out, sharding: jax.ShapeDtypeStruct(
                out.shape, out.dtype, sharding=sharding), traced.out_info,
                compiled.output_shardings)
        emit(lowered)
        if mesh is None:
            return traced.out_info
        whole = jax.sharding.NamedSharding(  # as a program's outputs are placed
            mesh, jax.sharding.PartitionSpec(),
            memory_kind=mesh.devices.flat[0].default_memory().kind)
        return jax.tree.map(lambda out: out if out.dtype == jax.dtypes.float0 else (
            jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=whole)), traced.out_info)
    return trace


class _Hashed:
    """A static argument of the chains' programs, hashed once: jax.jit hashes its static
    arguments at every call, and deepseek4-tiny's GraphDef took 0.3 ms a hash on a 2-core CPU
    (most programs of a chain take one)."""

    __slots__ = ("value", "_hash")

    def __init__(self, value):
        self.value, self._hash = value, hash(value)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return isinstance(other, _Hashed) and (self.value is other.value or
                                               self.value == other.value)


def _split(model, *filters):
    """nnx.split(model, *filters) with the GraphDef _Hashed."""
    graphdef, *states = nnx.split(model, *filters)
    return _Hashed(graphdef), *states


def _chain_step(chain, mesh, split=_split):
    """chain(call, model, split(model), *args), which runs its programs in order through
    call(program, *its args) and returns the last one's outputs, as a step: step(model, *args)
    runs them; step.bind(model) is the step with the model split once (bind_model: split's
    states hold the model's own Variables, so what is written to them later, the biases, reaches
    it); step.lower_programs(emit, model, *args) lowers each for ahead.compile_ahead;
    step.programs(call, model, *args) passes each program and its arguments (shapes, for a
    call that traces) to call (compiled.chain_memory's account)."""
    def step(model, *args):
        return bind(model)(*args)

    def bind(model):
        parts = split(model)

        def bound(*args):
            with _mesh_set(mesh):
                return chain(_call, model, parts, *args)
        return bound

    step.bind = bind
    step.programs = lambda call, model, *args: chain(call, model, split(model), *args)
    step.lower_programs = lambda emit, model, *args: step.programs(_lowering(mesh, emit), model,
                                                                   *args)
    return step


@functools.cache
def segment_steps(key: str, routed: tuple[int, ...], mesh):
    """step._train_step's step as a chain of programs (`step_programs: segments`). Per micro-batch,
    the embedding and each entry of model.segments run forward as programs of their own, each
    returning its output and its backward (jax.vjp's, with the residuals); one program computes
    the outputs, the losses and their gradient from the last streams and every segment's record;
    the backward programs run in reverse from there; one last program applies AdamW and the bias
    update (apply_gradients). The same gradients as the one program, which the chain only cuts
    where each segment ends: XLA compiles ~2 programs per segment, side by side
    (ahead.compile_ahead), instead of one program holding every block kind, forward and
    backward, in turn."""
    cfg = Config(**json.loads(key))
    routed = list(routed)

    def parts_of(model):
        """Each program's part (kind, segment, the indices of the parameter states it
        differentiates) and nnx.split's filters of those states (one per part, in order)."""
        last = len(model.segments) + 1
        parts = [("embed", None, (0,))]
        filters = [nnx.All(nnx.Param, lambda path, _: path == ("embed",))]
        for i in range(len(model.segments)):
            parts.append(("segment", i, (i + 1,)))
            filters.append(nnx.All(nnx.Param, lambda path, _, i=i: path[:2] == ("segments", i)))
        # the head's: every parameter outside the segments, and the embedding where MTP reads it
        parts.append(("head", None, (0, last) if cfg.mtp_num_layers > 0 else (last,)))
        filters.append(nnx.All(nnx.Param, lambda path, _: path[0] != "segments"))
        return parts, filters

    def run_part(part, model, carry, batch):
        tokens, mask, segment_ids, values, a = batch
        tokens, mask, segment_ids = tokens[a], mask[a], segment_ids[a]
        kind, i, _ = part
        if kind != "head":
            return _forward_part(model, i, carry, tokens, segment_ids)
        h, records = carry
        positions, _ = model.defaults(tokens[:, :-1], None, segment_ids)
        out = model.outputs(h, records, positions, segment_ids, None,
                            tokens[:, 1:] if cfg.mtp_num_layers > 0 else None)
        return loss_terms(cfg, model, out, tokens, mask, segment_ids, routed, values)

    def differentiable(part, graphdef, states, batch):
        """The part as a function of its parameters (the states it differentiates) and input."""
        def fn(chosen, carry):
            merged = list(states)
            for index, state in zip(part[2], chosen):
                merged[index] = state
            model = nnx.merge(graphdef.value, *merged)
            with precision_scope(model.matmul_precision):
                return run_part(part, model, carry, batch)
        return fn, tuple(states[index] for index in part[2])

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def forward(part, graphdef, states, carry, batch):
        """-> (the part's output, its backward: the cotangent of the output's float arrays (None
        for the integer ones) -> (parameter grads, input grad))."""
        fn, chosen = differentiable(part, graphdef, states, batch)
        floats, backward, ints = jax.vjp(lambda *a: _split_ints(fn(*a)), chosen, carry,
                                         has_aux=True)
        return _join(floats, ints), backward

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def head(part, graphdef, states, carry, batch):
        """-> (loss, aux, its parameters' grads, (grad of the last streams, of each record's
        float arrays))."""
        fn, chosen = differentiable(part, graphdef, states, batch)
        floats, ints = _split_ints(carry)
        loss, backward, aux = jax.vjp(lambda chosen, floats: fn(chosen, _join(floats, ints)),
                                      chosen, floats, has_aux=True)
        return loss, aux, *backward(jnp.ones_like(loss))

    @jax.jit
    def backward(vjp, cotangent):
        return vjp(cotangent)

    @functools.partial(jax.jit, donate_argnums=0)
    def accumulate(total, grads):
        return jax.tree.map(jnp.add, total, grads)

    @nnx.jit(donate_argnums=(0, 1))
    def apply(model, optimizer, grads, loss, aux, values):
        by_path = {}  # every part's gradients, summed where parts share a parameter (embedding)
        for part_grads in grads:
            for state in part_grads:
                for path, value in nnx.to_flat_state(state):
                    by_path[path] = jax.tree.map(jnp.add, by_path[path], value) if (
                        path in by_path) else value
        grads = nnx.from_flat_state(by_path)
        aux = jax.tree.map(lambda *x: jnp.stack(x), *aux)
        return apply_gradients(cfg, routed, model, optimizer, grads, sum(loss), aux, values)

    def split(model):
        return _split(model, *parts_of(model)[1], ...)

    def chain(call, model, split_model, optimizer, tokens, mask, segment_ids, values):
        """The step's programs in order, each through call(program, *args) -> its outputs
        (running it, or tracing it for their shapes)."""
        parts = parts_of(model)[0]
        graphdef, *states = split_model
        states, last = tuple(states), len(parts) - 1
        grads, losses_, auxes = [None] * len(parts), [], []
        for a in range(tokens.shape[0]):
            batch = (tokens, mask, segment_ids, values, np.int32(a))
            carry, backwards, records = None, [], []
            for part in parts[:-1]:
                out, vjp = call(forward, part, graphdef, states, carry, batch)
                backwards.append(vjp)
                carry = out if part[0] == "embed" else out[0]
                if part[0] == "segment":
                    records.append(out[1])
            loss, aux, g_part, (g_h, g_records) = call(
                head, parts[last], graphdef, states, (carry, records), batch)
            losses_.append(loss)
            auxes.append(aux)
            grads[last] = g_part if a == 0 else call(accumulate, grads[last], g_part)
            for j in reversed(range(last)):
                cotangent = g_h if j == 0 else (g_h, g_records[j - 1])
                g_part, g_h = call(backward, backwards[j], cotangent)
                grads[j] = g_part if a == 0 else call(accumulate, grads[j], g_part)
        return call(apply, model, optimizer, grads, losses_, auxes, values)

    return _chain_step(chain, mesh, split)


class InferenceChain(typing.NamedTuple):
    eval_step: typing.Callable  # make_eval_step's step
    score_step: typing.Callable  # (routed, num_experts) -> make_score_step's step
    fit_step: typing.Callable  # routed -> make_fit_step's step (the model in its fit mode)


@functools.cache
def inference_chain(mesh) -> InferenceChain:
    """make_eval_step's and make_score_step's steps as chains of programs (`step_programs:
    segments`, _chain_step): the model's forward cut as segment_steps cuts it, the embedding's
    program then one per segment, shared by both steps, then a small program of each's own (the
    cross-entropy and counts; the top-k blocks' scores). No program holds the whole model."""

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def infer(segment, graphdef, state, carry, tokens, segment_ids):
        """The embedding (segment None) or one segment -> its output."""
        model = nnx.merge(graphdef.value, state)
        with precision_scope(model.matmul_precision):
            return _forward_part(model, segment, carry, tokens, segment_ids)

    @functools.partial(jax.jit, static_argnums=0)
    def evaluate(graphdef, state, h, records, tokens, mask, segment_ids):
        model = nnx.merge(graphdef.value, state)
        positions, _ = model.defaults(tokens[:, :-1], None, segment_ids)
        with precision_scope(model.matmul_precision):
            out = model.outputs(h, records, positions, segment_ids, None, None)
        return evaluation_sums(model, out, tokens, mask)

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def score(routed, num_experts, records):
        scores = jnp.concatenate([record.scores for record in records])[np.asarray(routed)]
        return scores.reshape(len(routed), -1, num_experts).astype(jnp.float32)

    @functools.partial(jax.jit, static_argnums=0)
    def fitted(routed, records):
        return jnp.concatenate([record.bias for record in records])[np.asarray(routed)]

    def trunk(call, model, split_model, tokens, segment_ids):
        """-> (graphdef, state, the last streams, each segment's record)."""
        graphdef, state = split_model
        h = call(infer, None, graphdef, state, None, tokens, segment_ids)
        records = []
        for segment in range(len(model.segments)):
            h, record = call(infer, segment, graphdef, state, h, tokens, segment_ids)
            records.append(record)
        return graphdef, state, h, records

    def evaluation(call, model, split_model, tokens, mask, segment_ids):
        graphdef, state, h, records = trunk(call, model, split_model, tokens, segment_ids)
        return call(evaluate, graphdef, state, h, records, tokens, mask, segment_ids)

    def scoring(routed, num_experts):
        def chain(call, model, split_model, tokens, segment_ids):
            return call(score, routed, num_experts,
                        trunk(call, model, split_model, tokens, segment_ids)[3])
        return _chain_step(chain, mesh)

    def fitting(routed):
        def chain(call, model, split_model, tokens, segment_ids):
            return call(fitted, routed, trunk(call, model, split_model, tokens, segment_ids)[3])
        return _chain_step(chain, mesh)

    return InferenceChain(_chain_step(evaluation, mesh), scoring, fitting)
