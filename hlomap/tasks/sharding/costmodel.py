"""The cost reward's model: `hlomap.cost.estimate` applied to plan arrays, with the per-module
state (cluster, device mapping, computation-cost cache, donated parameters) built once.

    model = estimate_model(cap, graph, axes, cluster="A")
    model(plan_array)  # -> CostEval(step_time, memory, capacity)

One call is one full estimate (compute, collectives, memory simulation): about 0.1 s for the
tiny zoo models and about a second for T5-base on this machine, which is what bounds the number
of evaluations a cost-mode search gets in its budget.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from hlomap.tasks.sharding.objective import CostEval, CostModel
from hlomap.hlo.capture import Capture
from hlomap.propagation.conflicts import MeshAxes
from hlomap.propagation.graph import FactorGraph

log = logging.getLogger(__name__)

__all__ = ["estimate_model", "step_estimate"]


def estimate_model(cap: Capture, graph: FactorGraph, axes: MeshAxes, cluster: Any = "A", *,
                   axis_order: Sequence[str] | None = None, overlap: Any = None) -> CostModel:
    """A `CostModel` for `cap` on `cluster` (a preset name, JSON path or Cluster), with the mesh
    axes mapped to devices in `axis_order` (default the mesh's order: the last axis innermost,
    inside a node)."""
    from hlomap.cost.cluster import load_cluster
    from hlomap.cost.estimate import Overlap, estimate_sharded
    from hlomap.cost.mapping import axis_devices
    from hlomap.cost.memory import donated_parameters
    from hlomap.cost.sharding import ShardedGraph

    clus = load_cluster(cluster)
    mapping = axis_devices(clus, axes.mesh_shape, order=axis_order)
    donated = donated_parameters(cap)
    cache: dict[Any, Any] = {}
    how = overlap if overlap is not None else Overlap.NONE

    def model(plan: np.ndarray) -> CostEval:
        sg = ShardedGraph.build(graph, plan, axes)
        est = estimate_sharded(sg, clus, mapping, overlap=how, donated=donated, cache=cache)
        return CostEval(float(est.step_seconds), float(est.memory.total), float(est.memory.capacity))

    return model


def step_estimate(cap: Capture, graph: FactorGraph, plan: np.ndarray, axes: MeshAxes, cluster: Any = "A", *,
                  axis_order: Sequence[str] | None = None, sharded_state: Any = None) -> Any:
    """The full `StepEstimate` of one plan array (for the plan's saved estimate and reports);
    `sharded_state`: the optimizer state the plan splits over its data axes (`Plan.sharded_state`)."""
    from hlomap.cost.estimate import estimate

    return estimate(cap, np.asarray(plan), axes, cluster=cluster, graph=graph, axis_order=axis_order,
                    sharded_state=sharded_state)
