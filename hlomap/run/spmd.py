"""SPMD plans (operator partitioning, data parallel, hybrid): `jax.jit` with the plan's shardings.

The mesh is the plan's, over the first devices of the device order, with `AxisType.Auto` axes so
that XLA's partitioner propagates the plan from the arguments. Arguments are placed with the
plan's NamedShardings, the state outputs keep the state's shardings (so the next step needs no
resharding) and the state arguments are donated.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hlomap.run.errors import RunError
from hlomap.run.transfer import put, to_host
from hlomap.verify.mesh import plan_mesh

__all__ = ["ReturnedState", "SpmdStep"]

STATE_ARGS = 2


class ReturnedState:
    """The state a step last returned (its params and opt_state containers) and what the caller
    derived from it, so that a call handed that same state back need not flatten it again: a
    train loop passes each step's state to the next, and flattening gpt-small's 303 leaves twice
    per call cost 0.4 ms, 7% of its step on an H200. Holds the containers until the next call
    (their arrays are donated to it). A container changed in place after it was returned (a key
    added to the params dict) is taken as returned: JAX's steps take new pytrees, not edited ones."""

    def __init__(self) -> None:
        self._objects: tuple[Any, ...] | None = None
        self._value: Any = None

    def lookup(self, args: Sequence[Any]) -> Any | None:
        """What was remembered for the state in `args`, if it is the state last returned; else None."""
        objects = self._objects
        if objects is None or len(args) < STATE_ARGS or any(a is not b for a, b in zip(args, objects)):
            return None
        return self._value

    def remember(self, out: Any, value: Any) -> None:
        """`out` is a step's result: remember its state (the first STATE_ARGS items) with `value`."""
        if isinstance(out, tuple) and len(out) >= STATE_ARGS:
            self._objects, self._value = tuple(out[:STATE_ARGS]), value
        else:
            self.forget()

    def forget(self) -> None:
        self._objects = self._value = None


class SpmdStep:
    """A train step jitted with an SPMD plan's shardings (module docstring)."""

    def __init__(self, step: Callable[..., Any], plan: Any, order: Sequence[Any],
                 compiler_options: Mapping[str, Any] | None = None):
        self.mesh = plan_mesh(plan, order)
        self.plan = plan
        self.step = step
        self._specs = {p.index: plan.leaf_spec(p) for p in plan.parameters}
        self._jitted: dict[Any, Any] = {}
        self._options = dict(compiler_options or {})
        self._returned = ReturnedState()  # the state's structures, when it is what the last call returned
        self._placed: tuple[Any, ...] = ()  # the containers `place` last returned: the step's own to donate
        self._direct: Callable[..., Any] | None = None  # what the last call ran, when that is the whole step

    def _shardings(self, flat_start: int, tree: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if self._specs and flat_start + len(leaves) > len(self._specs):
            raise RunError(f"the plan has {len(self._specs)} parameters but the step's arguments have more leaves "
                           f"({flat_start + len(leaves)} at least); was the plan made for this step?")
        shardings = [NamedSharding(self.mesh, self._specs.get(flat_start + i, P())) for i in range(len(leaves))]
        return jax.tree_util.tree_unflatten(treedef, shardings)

    def arg_shardings(self, args: Sequence[Any]) -> tuple[Any, ...]:
        """NamedSharding pytree for every argument (the plan's specs, by flat argument index)."""
        out, start = [], 0
        for arg in args:
            out.append(self._shardings(start, arg))
            start += len(jax.tree_util.tree_leaves(arg))
        if self._specs and start != len(self._specs):
            raise RunError(self._arity_problem(start))
        return tuple(out)

    def _arity_problem(self, leaves: int) -> str:
        """Why arguments of `leaves` leaves in all do not fit the plan's parameters, in words: the
        first parameter nothing was given for, or how many leaves are too many."""
        by_index = {p.index: p for p in self.plan.parameters}
        n = len(self._specs)
        if leaves < n:
            first = by_index.get(leaves)
            named = f" its parameter {first.path!r}" if first is not None and first.path else f" parameter {leaves}"
            more = f" (and {n - leaves - 1} more)" if n - leaves > 1 else ""
            return (f"the step's arguments have {leaves} leaves but the plan has {n} parameters: nothing was given for"
                    f"{named}{more}: was an argument left out?")
        return (f"the step's arguments have {leaves} leaves but the plan has {n} parameters: {leaves - n} more than "
                "it was made for: was an argument added?")

    def direct(self) -> Callable[..., Any] | None:
        """The jitted program the last call ran, when calling it on arguments of the same
        structures is the whole step (one process; the step returns the state as it got it);
        else None. `auto_shard` calls it straight when handed back the state it returned: each
        layer between it and the program cost a few microseconds per call."""
        return self._direct

    def first_misshaped(self, args: Sequence[Any]) -> str | None:
        """The first leaf of `args` (the step's arguments from the first, or a prefix of them)
        shaped unlike the plan's parameter at its flat position, in words; None when every leaf
        matches. What a failing call or `place` explains with: JAX would name only an array."""
        flat, _ = jax.tree_util.tree_flatten_with_path(tuple(args))
        by_index = {p.index: p for p in self.plan.parameters}
        for i, (path, leaf) in enumerate(flat):
            p = by_index.get(i)
            shape = tuple(int(n) for n in getattr(leaf, "shape", ()))
            if p is not None and tuple(p.shape) != shape:
                return (f"argument {jax.tree_util.keystr(path)} is shaped {list(shape)}, but the plan was made for "
                        f"{list(p.shape)} there (its parameter {p.path!r}): was it made for this step and these "
                        "arguments, in this order?")
        return None

    def place(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        problem = self.first_misshaped((params, opt_state))
        if problem is not None:  # else another tree's leaves would take this one's shardings without a word
            raise RunError(f"place: {problem}")
        s_params = self._shardings(0, params)
        s_opt = self._shardings(len(jax.tree_util.tree_leaves(params)), opt_state)
        placed = jax.tree.map(put, params, s_params), jax.tree.map(put, opt_state, s_opt)
        self._placed = placed
        return placed

    def gather(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        return jax.tree.map(to_host, params), jax.tree.map(to_host, opt_state)

    def _is_placed(self, args: Sequence[Any]) -> bool:
        """Whether `args` begins with the very containers `place` last returned."""
        return len(self._placed) == STATE_ARGS and all(a is b for a, b in zip(args, self._placed))

    def _compiled(self, key: tuple[Any, ...], args: Sequence[Any]) -> tuple[Any, Any, bool]:
        """The jitted step for arguments of structure `key` (built once per structure), the
        arguments' shardings, and whether it returns the state in the structure it was given."""
        if key not in self._jitted:
            shardings = self.arg_shardings(args)
            donate = tuple(range(min(STATE_ARGS, len(args))))
            out = jax.eval_shape(self.step, *args)
            # The new state keeps the state's shardings (the next step needs no resharding); the
            # rest (loss, metrics) is left to XLA.
            keeps_state = isinstance(out, tuple) and len(out) >= STATE_ARGS and all(
                jax.tree_util.tree_structure(out[k]) == jax.tree_util.tree_structure(args[k])
                for k in range(STATE_ARGS))
            out_shardings = shardings[:STATE_ARGS] + (None,) * (len(out) - STATE_ARGS) if keeps_state else None
            self._jitted[key] = (jax.jit(self.step, in_shardings=shardings, out_shardings=out_shardings,
                                         donate_argnums=donate, compiler_options=self._options or None),
                                 shardings, keeps_state)
        return self._jitted[key]

    def __call__(self, *args: Any) -> Any:
        rest = tuple(jax.tree_util.tree_structure(a) for a in args[STATE_ARGS:])
        known = self._returned.lookup(args)  # (key, compiled) of the call that returned this state
        if known is not None and known[0][STATE_ARGS:] == rest:
            key, compiled = known
        else:
            key = tuple(jax.tree_util.tree_structure(a) for a in args[:STATE_ARGS]) + rest
            compiled = self._compiled(key, args)
        jitted, shardings, keeps_state = compiled
        single = jax.process_count() == 1
        if not single:  # host values must become global arrays first
            args = jax.tree.map(put, tuple(args), shardings)
        elif known is None and not self._is_placed(args):
            # The step donates its state: arrays of the caller's own (not returned by a step or by
            # `place`) are copied first, as the pipeline executors copy them, instead of deleted.
            args = (*(jax.tree.map(put, args[k], shardings[k]) for k in range(STATE_ARGS)), *args[STATE_ARGS:])
        try:
            out = jitted(*args)
        except (ValueError, TypeError) as err:  # JAX's own words name an array, not the argument
            problem = self.first_misshaped(args)
            if problem is None:
                raise
            raise RunError(problem) from err
        self._direct = jitted if single and keeps_state else None
        if keeps_state:  # the state it returns has the structure it was given
            self._returned.remember(out, (key, compiled))
        else:
            self._returned.forget()
        return out
