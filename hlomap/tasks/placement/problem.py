"""Device placement problems: which physical device takes each logical position of a plan.

A plan fixes a logical layout: the positions of a device mesh whose axes carry collectives (an
SPMD plan), or pipeline stages whose replicas all-reduce their gradients and pass activations to
the next stage. The cluster fixes how fast every pair of physical devices talks. Placement
chooses the bijection between the two that minimizes the estimated step time (Parmesan's
topology-aware device mapping; DRL-PP places pipeline stages the same way):

- `MeshLayout`: step = compute + sum over the estimate's communication terms of
  count x `collective_time` over the device groups of the term's axes, exactly what
  `cost.estimate` charges for an SPMD plan with those devices (`communication_terms`).
- `StageLayout`: step = the pipeline cost model's closed-form latency L of the plan with each
  stage on its placed devices (`PipelineModel.plan_cost`): stage all-reduces, the transfers
  between consecutive stages, and M - 1 periods of the slowest of them.

Compute does not depend on the placement (every device of a cluster is costed like the first), so
the search is over communication only; memory per device does not change either.

A placement is the tuple of devices of the logical positions, in logical order: row-major over
the mesh, or stage by stage. `step_seconds` prices one with the cost model directly; the search
states of `hlomap.tasks.placement.objective` price moves incrementally and agree with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hlomap.cost.cluster import Cluster
from hlomap.cost.collectives import collective_time
from hlomap.cost.estimate import CommunicationTerm
from hlomap.cost.mapping import AxisMapping
from hlomap.cost.pipeline.profile import PipelineProfile
from hlomap.cost.pipeline.stages import PipelinePlan, Schedule, Stage
from hlomap.tasks.placement.pipeline_costs import PipelineModel

__all__ = ["Layout", "MeshLayout", "PlacementError", "PlacementProblem", "StageLayout", "step_seconds"]


class PlacementError(ValueError):
    """A placement problem or placement that does not fit together (the message says why)."""


@dataclass(frozen=True)
class MeshLayout:
    """An SPMD plan's logical side: mesh axes, its communication terms, its compute per step."""

    axes: tuple[tuple[str, int], ...]
    terms: tuple[CommunicationTerm, ...]
    compute_seconds: float = 0.0

    def __post_init__(self) -> None:
        names = [name for name, _ in self.axes]
        for term in self.terms:
            unknown = [a for a in term.axes if a not in names]
            if unknown:
                raise PlacementError(f"communication term over axes {term.axes} names axis {unknown[0]!r}, "
                                     f"not an axis of the mesh {dict(self.axes)}")

    @property
    def n_positions(self) -> int:
        return math.prod(size for _, size in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.axes)

    def mapping(self, devices: Sequence[int]) -> AxisMapping:
        """The mesh with logical position i on `devices[i]` (row-major)."""
        return AxisMapping(self.axes, np.asarray(devices, dtype=np.int64).reshape(self.shape))


@dataclass(frozen=True, eq=False)
class StageLayout:
    """A pipeline plan's logical side: a profile with one layer per logical stage (per
    microbatch), each device stage's replication, the microbatches and the schedule; with
    `repeats` V > 1 (interleaved 1F1B, a circular GPipe) the profile has S V logical stages and
    logical stage k runs on device stage k mod S."""

    profile: PipelineProfile
    replication: tuple[int, ...]
    microbatches: int
    schedule: Schedule = Schedule.ONE_F_ONE_B
    repeats: int = 1

    def __post_init__(self) -> None:
        if self.repeats < 1 or len(self.replication) * self.repeats != self.profile.n_layers:
            raise PlacementError(f"{len(self.replication)} stage replications x {self.repeats} chunks for a stage "
                                 f"profile of {self.profile.n_layers} stages")
        if any(r < 1 for r in self.replication) or self.microbatches < 1:
            raise PlacementError(f"replication {self.replication} and microbatches {self.microbatches} "
                                 "must be >= 1")

    @property
    def n_stages(self) -> int:
        return len(self.replication)

    @property
    def n_positions(self) -> int:
        return sum(self.replication)

    def stage_positions(self) -> tuple[range, ...]:
        starts = np.concatenate([[0], np.cumsum(self.replication)]).tolist()
        return tuple(range(a, b) for a, b in zip(starts[:-1], starts[1:]))

    def plan(self, devices: Sequence[int]) -> PipelinePlan:
        """The stage plan with device stage s on the devices of its logical positions (and logical
        stage k on those of device stage k mod S)."""
        groups = [tuple(int(devices[p]) for p in positions) for positions in self.stage_positions()]
        stages = tuple(Stage(k, k + 1, groups[k % len(groups)]) for k in range(self.profile.n_layers))
        return PipelinePlan(stages, self.microbatches, self.schedule, self.repeats)


Layout = MeshLayout | StageLayout


@dataclass(frozen=True, eq=False)
class PlacementProblem:
    """A logical layout on a cluster. `identity` is the placement the plan has today (the
    logical device ids, linear order: 0..n-1 unless the plan says otherwise)."""

    cluster: Cluster
    layout: Layout
    identity: tuple[int, ...] | None = None
    name: str = ""

    def __post_init__(self) -> None:
        n, d = self.layout.n_positions, self.cluster.n_devices
        if n > d:
            raise PlacementError(f"the plan has {n} logical positions but cluster {self.cluster.name!r} "
                                 f"has only {d} devices")
        identity = tuple(range(n)) if self.identity is None else tuple(int(x) for x in self.identity)
        check_placement(self, identity, what="identity placement")
        object.__setattr__(self, "identity", identity)

    @property
    def n_positions(self) -> int:
        return self.layout.n_positions

    @property
    def n_devices(self) -> int:
        return self.cluster.n_devices

    def full_order(self, devices: Sequence[int]) -> np.ndarray:
        """A permutation of every device of the cluster: `devices` for the logical positions,
        then the unused devices in increasing order (the free slots a search may swap into)."""
        used = [int(d) for d in devices]
        free = sorted(set(range(self.n_devices)) - set(used))
        return np.asarray(used + free, dtype=np.int64)


def check_placement(problem: PlacementProblem, devices: Sequence[int], *, what: str = "placement") -> None:
    n = problem.layout.n_positions
    if len(devices) != n:
        raise PlacementError(f"{what} lists {len(devices)} devices for {n} logical positions")
    bad = [int(d) for d in devices if not 0 <= int(d) < problem.cluster.n_devices]
    if bad:
        raise PlacementError(f"{what} uses device(s) {bad}, outside cluster {problem.cluster.name!r} "
                             f"of {problem.cluster.n_devices} devices")
    if len(set(int(d) for d in devices)) != n:
        raise PlacementError(f"{what} puts two logical positions on one device: {list(devices)}")


def step_seconds(problem: PlacementProblem, devices: Sequence[int]) -> float:
    """The estimated step time with logical position i on `devices[i]`, straight from the cost
    model (no incremental bookkeeping: the reference the search states are checked against)."""
    check_placement(problem, devices)
    layout = problem.layout
    if isinstance(layout, MeshLayout):
        mapping = layout.mapping(devices)
        return layout.compute_seconds + sum(
            term.count * collective_time(term.kind, problem.cluster, mapping.groups(term.axes), term.nbytes)
            for term in layout.terms)
    return PipelineModel(problem.cluster).plan_cost(layout.profile, layout.plan(devices)).latency
