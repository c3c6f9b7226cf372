"""The answer of a pipeline search (`Solution`) and its failure (`NoFeasiblePlan`)."""

from __future__ import annotations

from dataclasses import dataclass

from hlomap.cost.pipeline.costs import PlanCost
from hlomap.tasks.pipeline.space import PipelineObjective
from hlomap.cost.pipeline.stages import PipelinePlan

__all__ = ["NoFeasiblePlan", "Solution"]


class NoFeasiblePlan(ValueError):
    """No plan of the search space satisfies its constraints (memory, devices, rules)."""


@dataclass(frozen=True)
class Solution:
    """A plan, its closed-form cost, and which objective chose it."""

    plan: PipelinePlan
    cost: PlanCost
    objective: PipelineObjective

    @property
    def value(self) -> float:
        """The minimized quantity: L (LATENCY) or the slowest stage/link per microbatch."""
        return self.cost.latency if self.objective is PipelineObjective.LATENCY else self.cost.bottleneck
