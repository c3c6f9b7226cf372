"""Run plans with JAX: `parallelize` (SPMD plans with jit + NamedSharding, pipeline plans with
the executors of `hlomap.run.pipeline`) and `value_and_grad`, the marker a pipelined step uses.

`parallelize` is imported lazily: model code imports `hlomap.run.grad` (through this package)
and must not pay for the runner."""

from __future__ import annotations

import importlib
from typing import Any

from hlomap.run.grad import value_and_grad

__all__ = ["parallelize", "value_and_grad"]

_LAZY = {"parallelize": "hlomap.run.runner"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hlomap.run' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
