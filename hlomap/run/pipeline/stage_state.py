"""State kept per stage, as the pipeline executors hold params and opt_state between steps.

`parallelize(step, pipeline_plan).place(params, opt_state)` returns `Staged` values in place of
the two pytrees: the runner keeps each stage's leaves on that stage's devices, and a leaf read
by several stages (a tied embedding, Adam's step count) once per stage. They are pytrees (of the
arrays the executor holds) that the step takes and returns; `step.gather(params, opt_state)`
rebuilds the user's pytrees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import jax
import numpy as np

__all__ = ["Staged", "put", "to_host"]


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True, eq=False)
class Staged:
    """The arrays an executor keeps for one of the step's state arguments.

    parts: executor A, a dict dtype -> `[S, L]` rows sharded on the `stage` axis; executor B, a
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


def put(value: Any, sharding: Any, *, own: bool = True) -> Any:
    """`jax.device_put`, also when the sharding spans several processes (every process passes the
    same full value and keeps its own shards). With `own`, into buffers of its own: the steps
    donate the state they are given, which must not delete the caller's arrays (`device_put` may
    hand back the caller's buffer as one of the shards, even with `may_alias=False`); arguments
    no step donates (the batch) skip that copy."""
    if own and isinstance(value, jax.Array) and value.is_fully_addressable:
        value = jax.numpy.copy(value)
    if jax.process_count() == 1 or getattr(sharding, "is_fully_addressable", True):
        return jax.device_put(value, sharding)
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def to_host(value: Any) -> np.ndarray:
    """A numpy copy of an array, gathered from every process when it spans several."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(value)
