"""Benchmark training steps: GPT, BERT, T5, VGG-19, ResNet-50, a Mixture-of-Experts decoder and
a dm-haiku MLP, each with Adam, lowerable abstractly and runnable on small real inputs.

    entry = hlomap.zoo.get("gpt-base")
    params, opt_state, batch = entry.abstract_args()     # ShapeDtypeStructs, nothing allocated
    text = entry.hlo_text()                               # HLO of forward + backward + Adam
    args = hlomap.zoo.get("gpt-tiny").example_args(seed=0)
    f32 = hlomap.zoo.get("gpt-1.3b:float32")            # a bfloat16 entry computing in float32

The transformers (GPT, BERT, T5, MoE) keep float32 parameters and optimizer state and compute in
their entry's `compute_dtype`: bfloat16 for the entries of about 300M parameters and more,
float32 for the smaller ones. `NAME:DTYPE` (`COMPUTE_DTYPES`) picks the other.

See `model.py` for the conventions (params paths, the "batch_stats" key of non-trained state).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Mapping

from hlomap.zoo.model import (
    COMPUTE_DTYPES,
    DEFAULT_MAX_EXAMPLE_BYTES,
    DTYPE_SEPARATOR,
    OTHER_KEY,
    BatchField,
    Family,
    ZooError,
    ZooModel,
    make_train_step,
    tree_paths,
)

__all__ = [
    "COMPUTE_DTYPES",
    "DEFAULT_MAX_EXAMPLE_BYTES",
    "DTYPE_SEPARATOR",
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
    """Every entry name, sorted (without `:DTYPE` variants)."""
    return tuple(sorted(_registry()))


def get(name: str) -> ZooModel:
    """The entry called `name`, or with `NAME:DTYPE` that entry computing in DTYPE (one of
    `COMPUTE_DTYPES`, e.g. `gpt-1.3b:float32`); ZooError (a KeyError) naming the known names or
    dtypes otherwise."""
    entries = _registry()
    base, separator, compute_dtype = name.partition(DTYPE_SEPARATOR)
    if base not in entries:
        raise ZooError(f"unknown zoo model {base!r}; known: {', '.join(sorted(entries))}")
    return entries[base].with_compute_dtype(compute_dtype) if separator else entries[base]
