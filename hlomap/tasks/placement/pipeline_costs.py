"""The one place where placement and re-planning call the pipeline cost model, simulator and DP.

`PipelineModel(cluster)` is those three on one `hlomap.cost.Cluster`. Today the pipeline cost
model (`cost.pipeline`) and the DP (`tasks.pipeline.dp`) take `Links`, the part of a cluster they
need, so the model adapts the cluster once, when it is built, and forwards; when they take a
`Cluster` themselves, `_adapt` below is the one edit to make. Everything else in
`tasks.placement` and `tasks.replan` prices pipeline stages only through this class, so it follows
whichever model the pipeline uses. Build one per cluster and keep it: adapting copies the
cluster's tables.
"""

from __future__ import annotations

from typing import Sequence

from hlomap.cost.cluster import Cluster
from hlomap.cost.pipeline.costs import CostOptions, PlanCost, evaluate_plan
from hlomap.cost.pipeline.links import Links
from hlomap.cost.pipeline.profile import PipelineProfile
from hlomap.cost.pipeline.simulator import SimulationResult, simulate
from hlomap.cost.pipeline.stages import PipelinePlan
from hlomap.tasks.pipeline.dp import solve
from hlomap.tasks.pipeline.solution import Solution
from hlomap.tasks.pipeline.space import SearchSpace

__all__ = ["PipelineModel"]


def _adapt(cluster: Cluster) -> Links:
    """What the pipeline cost model and DP take for a cluster."""
    return Links.from_cluster(cluster)


class PipelineModel:
    """The pipeline cost model, simulator and DP on one cluster."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self._links = _adapt(cluster)

    def allreduce(self, devices: Sequence[int], nbytes: float) -> float:
        """A stage's gradient all-reduce of `nbytes` over its replicas `devices`, in that order."""
        return self._links.allreduce_time(devices, nbytes)

    def transfer(self, src: Sequence[int], dst: Sequence[int], nbytes: float) -> float:
        """A tensor of `nbytes` from a stage on `src` to the next stage on `dst`, per direction."""
        return self._links.transfer_time(src, dst, nbytes)

    def plan_cost(self, profile: PipelineProfile, plan: PipelinePlan,
                  options: CostOptions = CostOptions()) -> PlanCost:
        """The closed-form latency, bottleneck and memory of `plan` (`costs.evaluate_plan`)."""
        return evaluate_plan(profile, self._links, plan, options)

    def simulate(self, profile: PipelineProfile, plan: PipelinePlan,
                 options: CostOptions = CostOptions()) -> SimulationResult:
        """One global batch of `plan` through the event simulator."""
        return simulate(profile, self._links, plan, options)

    def solve(self, profile: PipelineProfile, space: SearchSpace) -> Solution:
        """The DP's optimal plan of `space` on the cluster (linear device order)."""
        return solve(profile, self._links, space)
