"""Abstract arguments of zoo entries, computed once per test session, with what computing them
allocated: tracing a big entry's initialiser takes up to a second, and several tests look at
the same abstract arguments."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

import jax

import hlomap.zoo as zoo


class Abstract(NamedTuple):
    args: tuple[Any, Any, Any]
    new_live_bytes: int  # bytes of device arrays that appeared while abstract_args() ran


@lru_cache(maxsize=None)
def abstract_with_allocation(name: str) -> Abstract:
    """The entry's abstract_args() (callers must not mutate them) and the bytes of live arrays
    that computing them left behind, measured on the first call, whichever test makes it."""
    before = {id(array) for array in jax.live_arrays()}
    args = zoo.get(name).abstract_args()
    new = sum(array.nbytes for array in jax.live_arrays() if id(array) not in before)
    return Abstract(args, new)
