"""Trace a train step into what a pipeline runner needs: the marked loss as a flat jaxpr, and the
step around it with the marked call as one equation.

The step is traced with `jax.make_jaxpr` while `hlomap.run.grad.intercept` is active: the one
call of an `hlomap.value_and_grad`-marked function is traced on its own (its jaxpr closes over
whatever of the step it reads, e.g. a batch captured by a lambda) and appears in the step's
jaxpr as a single `hlomap_value_and_grad` equation whose operands are those closed-over values
followed by the call's arguments, and whose results are the loss, the aux leaves and the
gradients, flat. That equation is never lowered: the runner replaces it by its pipeline.

The step must look like `train_step(params, opt_state, batch, *rest) -> (params, opt_state,
*rest_out)`: arguments 0 and 1 are the state the runner keeps per stage (returned with the same
structure), argument 2 is the batch (every leaf split on its leading dim into microbatches);
a leaf of a later argument whose leading dim is the batch's is split the same way (the labels of
`train_step(params, opt_state, x, y)`), and the other later leaves are passed whole to every
microbatch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.extend import core as jcore

from hlomap.run.errors import SplitError
from hlomap.run.grad import GradCall, intercept
from hlomap.run.program import describe_eqn, is_literal

__all__ = ["InputKind", "LossInput", "MARKER", "TracedStep", "microbatch_args", "trace_step"]

STATE_ARGS = 2  # params, opt_state
BATCH_ARG = 2

MARKER = jcore.Primitive("hlomap_value_and_grad")
MARKER.multiple_results = True


def _marker_abstract_eval(*avals: Any, outs: tuple[Any, ...], call: int) -> list[Any]:
    del avals, call
    return list(outs)


MARKER.def_abstract_eval(_marker_abstract_eval)


class InputKind(enum.Enum):
    """Where a loss input comes from, which decides how each stage gets it."""

    PARAM = "param"  # a state leaf the gradient is taken of: lives with the stages reading it
    STATE = "state"  # a state leaf read but not differentiated (batch-norm statistics)
    DATA = "data"  # a leaf of the batch argument, or a later one of the batch's leading dim: split into microbatches
    BROADCAST = "broadcast"  # any other leaf of a later argument: the same for every microbatch
    CONST = "const"  # a constant of the step


@dataclass(frozen=True)
class LossInput:
    """One input of the flat loss jaxpr (its constvars, then its invars)."""

    kind: InputKind
    leaf: int | None  # flat index into the step's arguments; None for constants
    path: str
    value: Any = None  # constants only


@dataclass(frozen=True, eq=False)
class TracedStep:
    """A train step split at its marked `value_and_grad` call.

    step: the whole step, flat arguments -> flat results, the marked call as equation `marker`.
    loss: the marked function, `(*loss constvars, *loss invars) -> (loss, *aux leaves)`.
    loss_inputs: one per loss constvar then invar.
    grads: for each gradient leaf the marked call returns (in order), its loss input index.
    The marked call's results are `[loss, *aux, *grads]` flat.
    """

    step: Any  # ClosedJaxpr
    marker: int
    loss: Any  # ClosedJaxpr
    loss_inputs: tuple[LossInput, ...]
    grads: tuple[int, ...]
    n_aux: int
    arg_tree: Any
    arg_sizes: tuple[int, ...]
    out_tree: Any
    paths: tuple[str, ...]
    batch_size: int

    @property
    def loss_vars(self) -> list[Any]:
        return list(self.loss.jaxpr.constvars) + list(self.loss.jaxpr.invars)

    @property
    def state_leaves(self) -> int:
        """Flat arguments (and results) 0..n-1 are the state: params and opt_state leaves."""
        return sum(self.arg_sizes[:STATE_ARGS])

    def arg_of(self, leaf: int) -> int:
        """Which argument flat argument `leaf` belongs to."""
        return int(np.searchsorted(np.cumsum(self.arg_sizes), leaf, side="right"))


class _Recorder:
    """The `intercept` handler: traces each marked call and binds it as one MARKER equation."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any, Any, int]] = []  # (loss jaxpr, aux tree, grad positions, n consts)

    def __call__(self, call: GradCall) -> Any:
        fun = functools.partial(call.fun, **dict(call.kwargs)) if call.kwargs else call.fun
        flat_args, args_tree = jax.tree_util.tree_flatten(call.args)
        aux_tree: list[Any] = []

        def flat_fun(*flat: Any) -> list[Any]:
            out = fun(*jax.tree_util.tree_unflatten(args_tree, flat))
            value, aux = out if call.has_aux else (out, None)
            leaves = jax.tree_util.tree_leaves(value)
            if len(leaves) != 1:
                raise SplitError(f"the loss of {_name(call.fun)} is a pytree of {len(leaves)} leaves; "
                                 "hlomap.value_and_grad needs one scalar (use has_aux=True for the rest)")
            aux_leaves, tree = jax.tree_util.tree_flatten(aux)
            aux_tree.append(tree)
            return leaves + aux_leaves

        closed = jax.make_jaxpr(flat_fun)(*flat_args)
        loss_aval = closed.out_avals[0]
        if loss_aval.shape != () or not jax.numpy.issubdtype(loss_aval.dtype, jax.numpy.floating):
            raise SplitError(f"the loss of {_name(call.fun)} has shape {loss_aval.shape} and dtype "
                             f"{loss_aval.dtype}; a pipeline needs a scalar float loss (the mean over "
                             "microbatches is taken)")
        out_shape = jax.eval_shape(call.plain)
        flat_out, out_tree = jax.tree_util.tree_flatten(out_shape)
        argnums = (call.argnums,) if isinstance(call.argnums, int) else call.argnums
        sizes = [len(jax.tree_util.tree_leaves(a)) for a in call.args]
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        grad_positions = tuple(int(i) for a in argnums for i in range(starts[a], starts[a + 1]))
        n_aux = len(closed.out_avals) - 1
        if len(flat_out) != 1 + n_aux + len(grad_positions):
            raise SplitError(f"{_name(call.fun)}: value_and_grad returned {len(flat_out)} leaves, expected "
                             f"1 loss + {n_aux} aux + {len(grad_positions)} gradients")
        avals = tuple(jax.core.ShapedArray(o.shape, o.dtype) for o in flat_out)
        index = len(self.calls)
        self.calls.append((closed, aux_tree[0], grad_positions, len(closed.consts)))
        results = MARKER.bind(*closed.consts, *flat_args, outs=avals, call=index)
        return jax.tree_util.tree_unflatten(out_tree, results)


def _name(fun: Any) -> str:
    return getattr(fun, "__name__", type(fun).__name__)


def _unjit(step: Callable[..., Any]) -> Callable[..., Any]:
    """The Python function of a `jax.jit`-wrapped step: its marked call must be traced at the
    top level, not inside a nested jit equation."""
    while hasattr(step, "lower") and hasattr(step, "__wrapped__"):
        step = step.__wrapped__
    return step


def trace_step(step: Callable[..., Any], args: Sequence[Any], paths: Sequence[str] | None = None) -> TracedStep:
    """Trace `step(*args)` (args real or abstract) and split it at its marked gradient.

    `paths` names the flat arguments in messages (e.g. a Capture's parameter paths). Raises
    SplitError saying why when the step cannot be split.
    """
    args = tuple(args)
    if len(args) < STATE_ARGS + 1:
        raise SplitError(f"a pipelined step takes (params, opt_state, batch, ...); {_name(step)} was given "
                         f"{len(args)} arguments")
    flat_args, arg_tree = jax.tree_util.tree_flatten(args)
    if paths is None:
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    paths = tuple(paths)
    arg_sizes = tuple(len(jax.tree_util.tree_leaves(a)) for a in args)
    recorder = _Recorder()
    fn = _unjit(step)

    def fresh(*a: Any) -> Any:
        # A new function object: JAX caches traces by function and argument types, and a cached
        # trace of the step (by jax.jit, hlomap.capture) would skip the marked call's handler.
        return fn(*a)

    with intercept(recorder):
        closed, out_shape = jax.make_jaxpr(fresh, return_shape=True)(*args)
    closed = inline_calls(closed)
    out_tree = jax.tree_util.tree_structure(out_shape)
    _check_state_outputs(step, args, out_shape)
    markers = [i for i, eqn in enumerate(closed.jaxpr.eqns) if eqn.primitive is MARKER]
    if not recorder.calls:
        raise SplitError(f"{_name(step)} takes no gradient with hlomap.value_and_grad: a pipeline needs to know "
                         "which function is the loss; replace jax.value_and_grad by hlomap.value_and_grad "
                         "(a drop-in)")
    if len(recorder.calls) > 1:
        raise SplitError(f"{_name(step)} calls hlomap.value_and_grad {len(recorder.calls)} times; a pipeline "
                         "splits one loss (call it once, or combine the losses into one function)")
    if len(markers) != 1:
        raise SplitError(f"{_name(step)} calls hlomap.value_and_grad inside a nested transformation (jax.jit, "
                         "lax.scan, vmap, ...); call it at the top level of the step")
    marker = markers[0]
    loss, aux_tree, grad_positions, n_consts = recorder.calls[0]
    del aux_tree
    eqn = closed.jaxpr.eqns[marker]
    inputs = _classify(closed, eqn, arg_sizes, paths, n_consts, grad_positions)
    opened = _with_consts_as_vars(loss)
    batch_size = _batch_size(inputs, opened)
    inputs = _per_example_later_leaves(inputs, opened, batch_size)
    grads = tuple(n_consts + g for g in grad_positions)
    return TracedStep(step=closed, marker=marker, loss=opened, loss_inputs=inputs,
                      grads=grads, n_aux=len(loss.out_avals) - 1, arg_tree=arg_tree, arg_sizes=arg_sizes,
                      out_tree=out_tree, paths=paths, batch_size=batch_size)


#: Equations that only call a jaxpr (a `jax.jit`-wrapped function traced inside the step). JAX
#: named the primitive `pjit` before it named it `jit`.
CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call"})


def inline_calls(closed: Any) -> Any:
    """`closed` with every call equation (`CALL_PRIMITIVES`, at any depth) replaced by the
    equations it calls, the same computation. A jitted helper over a whole tree (optax's
    `tree.bias_correction` is `jax.jit(inline=True)`, which current JAX keeps as one equation)
    would otherwise be one equation reading every stage's gradients, which no stage can run
    alone. Returned unchanged when it has no call equation."""
    if not any(eqn.primitive.name in CALL_PRIMITIVES for eqn in closed.jaxpr.eqns):
        return closed
    jaxpr = closed.jaxpr
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in jaxpr.invars]

    def run(*flat: Any) -> list[Any]:
        return _eval_inlined(jaxpr, closed.consts, flat)

    return jax.make_jaxpr(run)(*avals)


def _source_of(eqn: Any) -> Any:
    """A context binding under `eqn`'s source location and name stack, as `jax.core.eval_jaxpr`
    does (JAX-internal; without it the messages lose the user's file:line, nothing else)."""
    try:
        from jax._src import source_info_util
    except ImportError:  # pragma: no cover - a JAX without the module
        return contextlib.nullcontext()
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    return source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack)


def _eval_inlined(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """Evaluate `jaxpr` primitive by primitive (as `jax.core.eval_jaxpr` does), evaluating the
    jaxpr of each call equation in place instead of binding the call."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if is_literal(v) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        operands = [read(v) for v in eqn.invars]
        if eqn.primitive.name in CALL_PRIMITIVES and "jaxpr" in eqn.params:
            inner = eqn.params["jaxpr"]
            if hasattr(inner, "consts"):  # a ClosedJaxpr (jit); closed_call's may be open
                outs = _eval_inlined(inner.jaxpr, inner.consts, operands)
            else:
                outs = _eval_inlined(inner, (), operands)
        else:
            bound = eqn.primitive.get_bind_params(eqn.params)
            # JAX before 0.10 returned (subfuns, params), later the params alone.
            subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
            with _source_of(eqn):  # keeps the user's file:line for describe_eqn's messages
                outs = eqn.primitive.bind(*subfuns, *operands, **params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _with_consts_as_vars(closed: Any) -> Any:
    """The loss with its constants turned into leading invars: the runner binds every loss input
    itself (constants of the loss are operands of the marker equation)."""
    jaxpr = closed.jaxpr
    opened = jcore.Jaxpr([], list(jaxpr.constvars) + list(jaxpr.invars), list(jaxpr.outvars), list(jaxpr.eqns),
                         effects=jaxpr.effects)
    return jcore.ClosedJaxpr(opened, [])


def _check_state_outputs(step: Callable[..., Any], args: tuple[Any, ...], out: Any) -> None:
    if not isinstance(out, (tuple, list)) or len(out) < STATE_ARGS:
        raise SplitError(f"a pipelined step returns (params, opt_state, ...); {_name(step)} returns "
                         f"{type(out).__name__}")
    for k, name in enumerate(("params", "opt_state")):
        given = jax.tree_util.tree_structure(args[k])
        returned = jax.tree_util.tree_structure(out[k])
        if given != returned:
            raise SplitError(f"{_name(step)} returns {name} with another structure than it takes ({returned} "
                             f"vs {given}); the runner keeps them per stage and needs the same leaves back")


def _classify(closed: Any, eqn: Any, arg_sizes: tuple[int, ...], paths: tuple[str, ...], n_consts: int,
              grad_positions: tuple[int, ...]) -> tuple[LossInput, ...]:
    """Where each operand of the marker equation comes from (see `InputKind`)."""
    jaxpr = closed.jaxpr
    arg_of_var = {v: i for i, v in enumerate(jaxpr.invars)}
    const_of_var = dict(zip(jaxpr.constvars, closed.consts))
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    bounds = np.cumsum(arg_sizes)
    differentiated = {n_consts + g for g in grad_positions}
    out = []
    for position, v in enumerate(eqn.invars):
        if is_literal(v):
            out.append(LossInput(InputKind.CONST, None, f"constant {v.val!r}", v.val))
            continue
        if v in const_of_var:
            out.append(LossInput(InputKind.CONST, None, "a constant", const_of_var[v]))
            continue
        if v not in arg_of_var:
            made_by = producer.get(v)
            where = describe_eqn(made_by) if made_by is not None else "the step"
            raise SplitError(f"an argument of the loss is computed in the step before hlomap.value_and_grad "
                             f"(by {where}); the runner gives each stage the step's own arguments, so move that "
                             "computation into the loss function")
        leaf = arg_of_var[v]
        arg = int(np.searchsorted(bounds, leaf, side="right"))
        if position in differentiated:
            if arg >= STATE_ARGS:
                raise SplitError(f"the gradient is taken with respect to {paths[leaf]}, which is not in params or "
                                 "opt_state; a pipeline differentiates the state it keeps per stage")
            kind = InputKind.PARAM
        elif arg < STATE_ARGS:
            kind = InputKind.STATE
        elif arg == BATCH_ARG:
            kind = InputKind.DATA
        else:
            kind = InputKind.BROADCAST
        out.append(LossInput(kind, leaf, paths[leaf]))
    return tuple(out)


def microbatch_args(args: Sequence[Any], size: int, batch_size: int) -> tuple[Any, ...]:
    """Abstract step arguments at one microbatch: every batch leaf cut to `size` examples, the
    batch's and those of later arguments whose leading dim is the batch's (`InputKind.DATA`)."""

    def cut(x: Any) -> Any:
        return jax.ShapeDtypeStruct((size,) + tuple(x.shape[1:]), x.dtype)

    def cut_per_example(x: Any) -> Any:
        return cut(x) if tuple(getattr(x, "shape", ()))[:1] == (batch_size,) else x

    batch = jax.tree.map(cut, args[2])
    return (*args[:2], batch, *(jax.tree.map(cut_per_example, a) for a in args[3:]))


def _per_example_later_leaves(inputs: tuple[LossInput, ...], loss: Any, batch_size: int) -> tuple[LossInput, ...]:
    """`inputs` with every leaf of a later argument whose leading dim is the batch's read as part of
    the batch (split into the same microbatches): per-example inputs passed beside the batch, such
    as labels. Passed whole, they would pair each microbatch with the whole batch's labels, which
    broadcasting can let through unnoticed."""
    out = []
    for item, var in zip(inputs, loss.jaxpr.invars):
        shape = getattr(var.aval, "shape", ())
        if item.kind is InputKind.BROADCAST and shape and int(shape[0]) == batch_size:
            item = dataclasses.replace(item, kind=InputKind.DATA)
        out.append(item)
    return tuple(out)


def _batch_size(inputs: tuple[LossInput, ...], loss: Any) -> int:
    """The leading dim every batch leaf the loss reads shares (they are cut into microbatches)."""
    sizes: dict[str, int] = {}
    for item, var in zip(inputs, loss.jaxpr.invars):
        if item.kind is not InputKind.DATA:
            continue
        shape = var.aval.shape
        if not shape:
            raise SplitError(f"batch leaf {item.path} is a scalar; every leaf of the batch argument is split "
                             "into microbatches on its leading dim (pass scalars as a later argument)")
        sizes[item.path] = int(shape[0])
    if not sizes:
        raise SplitError("the loss reads no leaf of the batch argument (the third argument of the step); "
                         "there is nothing to split into microbatches")
    distinct = sorted(set(sizes.values()))
    if len(distinct) > 1:
        a, b = (next(p for p, s in sizes.items() if s == d) for d in distinct[:2])
        raise SplitError(f"batch leaves {a} ({sizes[a]}) and {b} ({sizes[b]}) have different leading dims; "
                         "every batch leaf is split on its leading dim into the same microbatches")
    return distinct[0]
