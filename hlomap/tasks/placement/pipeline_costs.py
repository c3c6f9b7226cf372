"""The one place where placement and re-planning call the pipeline cost model, simulator and DP.

`PipelineModel(cluster)` is those three, and the stage communication prices of
`hlomap.cost.pipeline.links`, on one `hlomap.cost.Cluster`. Everything else in `tasks.placement`
and `tasks.replan` prices pipeline stages only through this class, so it follows whichever model
the pipeline uses.
"""

from __future__ import annotations

from typing import Sequence

from hlomap.cost.cluster import Cluster
from hlomap.cost.pipeline.costs import CostOptions, PlanCost, evaluate_plan
from hlomap.cost.pipeline.links import allreduce_time, transfer_time
from hlomap.cost.pipeline.profile import PipelineProfile
from hlomap.cost.pipeline.simulator import SimulationResult, simulate
from hlomap.cost.pipeline.stages import PipelinePlan
from hlomap.tasks.pipeline.dp import solve
from hlomap.tasks.pipeline.solution import Solution
from hlomap.tasks.pipeline.space import PipelineSpace

__all__ = ["PipelineModel"]


class PipelineModel:
    """The pipeline cost model, simulator and DP on one cluster."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    def allreduce(self, devices: Sequence[int], nbytes: float, buffers: float = 1.0) -> float:
        """A stage's gradient all-reduce of `nbytes` in `buffers` arrays over its replicas
        `devices`, in that order."""
        return allreduce_time(self.cluster, devices, nbytes, buffers)

    def transfer(self, src: Sequence[int], dst: Sequence[int], nbytes: float) -> float:
        """A tensor of `nbytes` from a stage on `src` to the next stage on `dst`, per direction."""
        return transfer_time(self.cluster, src, dst, nbytes)

    def plan_cost(self, profile: PipelineProfile, plan: PipelinePlan,
                  options: CostOptions = CostOptions()) -> PlanCost:
        """The closed-form latency, bottleneck and memory of `plan` (`costs.evaluate_plan`)."""
        return evaluate_plan(profile, self.cluster, plan, options)

    def simulate(self, profile: PipelineProfile, plan: PipelinePlan,
                 options: CostOptions = CostOptions()) -> SimulationResult:
        """One global batch of `plan` through the event simulator."""
        return simulate(profile, self.cluster, plan, options)

    def solve(self, profile: PipelineProfile, space: PipelineSpace) -> Solution:
        """The DP's optimal plan of `space` on the cluster (linear device order)."""
        return solve(profile, self.cluster, space)
