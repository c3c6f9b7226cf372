"""State kept per stage, as the pipeline executors hold params and opt_state inside a step.

The executors take and return the user's pytrees; inside, `Staged` holds the arrays each stage
keeps: the mpmd executor a leaf on every stage that reads it (a tied embedding, Adam's step count,
once per stage), the spmd executor rows stacked on the `stage` mesh axis. The executors also
accept `Staged` values in place of the two pytrees (the tests and benchmarks feed the rows to the
spmd executor's program directly); users never see them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import jax

from hlomap.run.errors import RunError

__all__ = ["Staged", "outline", "state_leaves"]


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True, eq=False)
class Staged:
    """The arrays an executor keeps for one of the step's state arguments.

    parts: the spmd executor, a dict dtype -> `[S, L]` rows sharded on the `stage` axis; the mpmd executor, a
    tuple with one tuple of leaves per stage, each on its stage's mesh. `layout` (static) says
    which leaf is where.
    """

    parts: Any
    layout: Any

    def tree_flatten(self) -> tuple[tuple[Any], Any]:
        return (self.parts,), self.layout

    @classmethod
    def tree_unflatten(cls, layout: Any, children: Sequence[Any]) -> Staged:
        return cls(children[0], layout)


def state_leaves(tree: Any, expected: int) -> list[Any]:
    """The leaves of one of the user's state pytrees, checked against the `expected` count the
    step was cut for (a clear error instead of a mis-assignment of leaves to stages)."""
    leaves = jax.tree_util.tree_leaves(tree)
    if len(leaves) != expected:
        raise RunError(f"the step was cut for state of {expected} leaves; it was given {outline(tree)} of "
                       f"{len(leaves)} leaves: were params and opt_state given in this order?")
    return leaves


def outline(tree: Any) -> str:
    """A pytree's outermost container in a few words (its whole structure can run to pages)."""
    if isinstance(tree, dict):
        keys = list(tree)
        shown = ", ".join(repr(k) for k in keys[:4]) + (", ..." if len(keys) > 4 else "")
        return f"a dict with keys [{shown}]"
    if isinstance(tree, (tuple, list)):
        return f"a {type(tree).__name__} of {len(tree)} items"
    return f"a {type(tree).__name__}"
