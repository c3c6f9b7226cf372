"""Benchmark training steps: GPT, BERT, T5, VGG-19, ResNet-50, a Mixture-of-Experts decoder and
a dm-haiku MLP, each with Adam, lowerable abstractly and runnable on small real inputs.

    entry = hlomap.zoo.get("gpt-base")
    params, opt_state, batch = entry.abstract_args()     # ShapeDtypeStructs, nothing allocated
    text = entry.hlo_text()                               # HLO of forward + backward + Adam
    args = hlomap.zoo.get("gpt-tiny").example_args(seed=0)

See `model.py` for the conventions (params paths, the "batch_stats" key of non-trained state).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Mapping

from hlomap.zoo.model import (
    DEFAULT_MAX_EXAMPLE_BYTES,
    OTHER_KEY,
    BatchField,
    Family,
    ZooError,
    ZooModel,
    make_train_step,
    tree_paths,
)

__all__ = [
    "DEFAULT_MAX_EXAMPLE_BYTES",
    "OTHER_KEY",
    "BatchField",
    "Family",
    "ZooError",
    "ZooModel",
    "get",
    "make_train_step",
    "names",
    "tree_paths",
]


@lru_cache(maxsize=1)
def _registry() -> Mapping[str, ZooModel]:
    # Built once, on first use; the mapping is read-only, so caching it shares no mutable state.
    from hlomap.zoo.registry import registry

    return registry()


def names() -> tuple[str, ...]:
    """Every entry name, sorted."""
    return tuple(sorted(_registry()))


def get(name: str) -> ZooModel:
    """The entry called `name`; ZooError (a KeyError) listing the known names otherwise."""
    entries = _registry()
    if name not in entries:
        raise ZooError(f"unknown zoo model {name!r}; known: {', '.join(sorted(entries))}")
    return entries[name]
