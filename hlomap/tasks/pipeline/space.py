"""What a pipeline search may choose and what it minimizes: `PipelineSpace`, `PipelineObjective`.

Plans are contiguous cuts of the layer chain, with a replication factor per stage, on devices
taken in linear order from device 0 (PipeDream / Alpa style): stage s gets the next r_s devices.
`inadmissible` states the rules as plain code; the DP enforces the same rules with masks, and the
brute force filters with this function, so the two can check each other.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from hlomap.cost.pipeline.costs import CostOptions, PlanCost
from hlomap.cost.cluster import Cluster
from hlomap.cost.pipeline.links import is_node_boundary
from hlomap.cost.pipeline.profile import PipelineProfile
from hlomap.cost.pipeline.stages import DEFAULT_SCHEDULE, PipelinePlan, Schedule

__all__ = ["PipelineObjective", "PipelineSpace", "TIE_RTOL", "inadmissible"]

#: Relative tolerance under which two bottlenecks count as equal when breaking ties by latency;
#: the DP and the brute force add the same numbers in different orders.
TIE_RTOL = 1e-9


class PipelineObjective(enum.Enum):
    """LATENCY: L of one global batch (GPipe / Alpa). BOTTLENECK: time per microbatch of the
    slowest stage or link (PipeDream), ties broken by L."""

    LATENCY = "latency"
    BOTTLENECK = "bottleneck"


@dataclass(frozen=True)
class PipelineSpace:
    """The plans a search may return, and what it minimizes.

    microbatches, schedule: of every plan (the schedule decides the memory, not L).
    replication: the replication factors a stage may have.
    use_all_devices: every device of the cluster is used (PipeDream without use_fewer_machines);
      otherwise a prefix of the linear device order.
    max_stages: cap on the number of stages (None: as many as devices allow).
    cut_on_node_boundary: Auto-MAP's rule: a stage boundary in device order falls between two
      servers, so every stage but the last owns whole servers' worth of the order.
    require_trainable: Auto-MAP's rule: every stage owns at least one trainable parameter.
    check_memory: drop plans whose stage memory exceeds a device's memory.
    max_thresholds: for LATENCY, how many bottleneck thresholds the DP may try before it stops
      (logging that the answer is then not proven optimal); None for no limit.
    """

    microbatches: int = 1
    schedule: Schedule = DEFAULT_SCHEDULE
    objective: PipelineObjective = PipelineObjective.LATENCY
    replication: tuple[int, ...] = (1,)
    use_all_devices: bool = True
    max_stages: int | None = None
    cut_on_node_boundary: bool = False
    require_trainable: bool = False
    check_memory: bool = True
    cost: CostOptions = field(default_factory=CostOptions)
    max_thresholds: int | None = 10_000

    def __post_init__(self) -> None:
        if self.microbatches < 1:
            raise ValueError(f"PipelineSpace.microbatches = {self.microbatches} must be >= 1")
        factors = tuple(sorted(set(int(r) for r in self.replication)))
        if not factors or factors[0] < 1:
            raise ValueError(f"PipelineSpace.replication = {self.replication!r} needs factors >= 1")
        object.__setattr__(self, "replication", factors)
        if self.max_stages is not None and self.max_stages < 1:
            raise ValueError(f"PipelineSpace.max_stages = {self.max_stages} must be >= 1")


def inadmissible(
    profile: PipelineProfile,
    cluster: Cluster,
    plan: PipelinePlan,
    space: PipelineSpace,
    cost: PlanCost,
) -> str | None:
    """Why `plan` is outside `space` (a sentence), or None when it is inside."""
    if plan.microbatches != space.microbatches or plan.schedule is not space.schedule:
        return f"plan runs {plan.microbatches} microbatches with {plan.schedule.value}"
    if space.max_stages is not None and plan.n_stages > space.max_stages:
        return f"{plan.n_stages} stages > max_stages {space.max_stages}"
    device = 0
    for s, stage in enumerate(plan.stages):
        if stage.replication not in space.replication:
            return f"stage {s} replication {stage.replication} not in {space.replication}"
        if stage.devices != tuple(range(device, device + stage.replication)):
            return f"stage {s} devices {stage.devices} are not next in linear order"
        if s > 0 and space.cut_on_node_boundary and not is_node_boundary(cluster, device):
            return f"stage {s} starts at device {device}, inside node {cluster.node_of[device]}"
        if space.require_trainable and not profile.trainable[stage.start : stage.stop].any():
            return f"stage {s} (layers [{stage.start}, {stage.stop})) has no trainable layer"
        device += stage.replication
    if device > cluster.n_devices:
        return f"plan needs {device} devices, cluster {cluster.name!r} has {cluster.n_devices}"
    if space.use_all_devices and device != cluster.n_devices:
        return f"plan uses {device} of {cluster.n_devices} devices"
    if space.check_memory and not cost.feasible:
        return "; ".join(str(v) for v in cost.violations)
    return None
