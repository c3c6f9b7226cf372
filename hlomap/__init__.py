"""hlomap: distributed execution plans for JAX training steps, found on XLA's HLO.

The public names are imported lazily so that `import hlomap` (and the CLI's start-up) does not
pay for importing JAX until something needs it.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_PUBLIC: dict[str, str] = {
    "capture": "hlomap.hlo.capture",
    "Capture": "hlomap.hlo.capture",
    "Role": "hlomap.hlo.capture",
    "parse": "hlomap.hlo.parser",
    "HloParseError": "hlomap.hlo.parser",
    "Plan": "hlomap.plan",
    "PlanConflict": "hlomap.propagation.conflicts",
    "explore": "hlomap.api",
    "estimate": "hlomap.api",
    "with_sharded_state": "hlomap.api",
    "calibrate": "hlomap.api",
    "load_source": "hlomap.api",
    "parse_mesh": "hlomap.api",
    "StepEstimate": "hlomap.cost.estimate",
    "Cluster": "hlomap.cost.cluster",
    "load_cluster": "hlomap.api",
    "cluster_preset": "hlomap.cost.cluster",
    "parallelize": "hlomap.run",
    "value_and_grad": "hlomap.run",
    "auto_shard": "hlomap.autoshard",
    "elastic": "hlomap.elasticity",
}

__all__ = sorted(_PUBLIC) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'hlomap' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    """The public names too (they are imported on first use), so that `dir(hlomap)` and tab
    completion show the API."""
    return sorted(set(globals()) | set(__all__))
