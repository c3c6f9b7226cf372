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
- `JointLayout`: a joint plan's stages, each a data x model mesh (`MeshStage`): its time per
  microbatch is its compute plus its collectives priced on its placed device groups, the cuts
  move each data replica's shard to the next stage's devices, and L combines them as the joint
  planner does (`hlomap.cost.pipeline.costs.stage_time_latency`).

Compute does not depend on the placement (every device of a cluster is costed like the first), so
the search is over communication only; memory per device does not change either.

A placement is the tuple of devices of the logical positions, in logical order: row-major over
the mesh, or stage by stage. `step_seconds` prices one with the cost model directly; the search
states of `hlomap.tasks.placement.objective` price moves incrementally and agree with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from hlomap.cost.cluster import Cluster
from hlomap.cost.collectives import Collective, collective_permute_time, collective_time
from hlomap.cost.estimate import CommunicationTerm
from hlomap.cost.mapping import AxisMapping
from hlomap.cost.pipeline.costs import stage_time_latency
from hlomap.cost.pipeline.profile import PipelineProfile
from hlomap.cost.pipeline.stages import PipelinePlan, Schedule, Stage
from hlomap.tasks.placement.pipeline_costs import PipelineModel

__all__ = ["JointLayout", "Layout", "MeshLayout", "MeshStage", "PlacementError", "PlacementProblem", "StageLayout",
           "StageTerm", "step_seconds"]


class PlacementError(ValueError):
    """A placement problem or placement that does not fit together (the message says why)."""


def consecutive_ranges(sizes: Sequence[int]) -> tuple[range, ...]:
    """Positions stage by stage: one range per size, each starting where the last ended."""
    starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).tolist()
    return tuple(range(a, b) for a, b in zip(starts[:-1], starts[1:]))


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
        return consecutive_ranges(self.replication)

    def plan(self, devices: Sequence[int]) -> PipelinePlan:
        """The stage plan with device stage s on the devices of its logical positions (and logical
        stage k on those of device stage k mod S)."""
        groups = [tuple(int(devices[p]) for p in positions) for positions in self.stage_positions()]
        stages = tuple(Stage(k, k + 1, groups[k % len(groups)]) for k in range(self.profile.n_layers))
        return PipelinePlan(stages, self.microbatches, self.schedule, self.repeats)


class StageTerm(NamedTuple):
    """A collective a joint stage runs over every device group of its mesh `axes`, priced per
    microbatch as `count * (latency_weight * T(0) + bytes_weight * (T(nbytes) - T(0)))` with T
    the collective's time on the placed groups: a tensor-parallel collective pays its latency
    every microbatch and its bytes over the M microbatches (weights 1 and 1 / M); the gradient
    all-reduce and the updated parameters' all-gather run once per step (1 / M and 1 / M, or 1
    and 1 where the executor syncs every microbatch: `syncs_each_microbatch`)."""

    kind: Collective
    axes: tuple[str, ...]
    nbytes: float
    count: float
    latency_weight: float
    bytes_weight: float


@dataclass(frozen=True)
class MeshStage:
    """One stage of a joint plan: its data x model mesh (positions row-major, `model`
    innermost, as the runner builds it), its seconds per microbatch that placement does not
    change (compute, update, recomputation), its collectives, and the bytes per microbatch of
    the cut it sends to the next stage (0 for the last), one shard per data replica; and its
    forward share of the stage time (the timeline schedules split the passes by it)."""

    axes: tuple[tuple[str, int], ...]
    seconds: float
    terms: tuple[StageTerm, ...]
    send_bytes: float = 0.0
    forward_share: float = 1.0 / 3.0

    @property
    def n_positions(self) -> int:
        return math.prod(size for _, size in self.axes)

    @property
    def data(self) -> int:
        return dict(self.axes).get("data", 1)

    @property
    def model(self) -> int:
        return dict(self.axes).get("model", 1)

    def mapping(self, devices: Sequence[int]) -> AxisMapping:
        return AxisMapping(self.axes, np.asarray(devices, dtype=np.int64).reshape([size for _, size in self.axes]))

    def time(self, cluster: Cluster, devices: Sequence[int]) -> float:
        """Seconds per microbatch with the stage's positions on `devices` (row-major)."""
        mapping = self.mapping(devices)
        total = self.seconds
        for term in self.terms:
            groups = mapping.groups(term.axes)
            if len(groups[0]) < 2:
                continue
            empty = collective_time(term.kind, cluster, groups, 0.0)
            full = collective_time(term.kind, cluster, groups, term.nbytes)
            total += term.count * (term.latency_weight * empty + term.bytes_weight * (full - empty))
        return total

    def send_time(self, cluster: Cluster, devices: Sequence[int], receivers: Sequence[int]) -> float:
        """Moving the cut to the next stage on `receivers`: data replica c's first device sends its
        shard to the receiving stage's c-th device (wrapping), all at once."""
        if self.send_bytes <= 0:
            return 0.0
        shards = self.data
        pairs = [(int(devices[c * self.model]), int(receivers[c % len(receivers)])) for c in range(shards)]
        return collective_permute_time(cluster, pairs, self.send_bytes / shards)


@dataclass(frozen=True, eq=False)
class JointLayout:
    """A joint plan's logical side: its stages (positions stage by stage), the microbatches, the
    schedule and what its executor costs besides the stages (placement does not change it)."""

    stages: tuple[MeshStage, ...]
    microbatches: int
    schedule: Schedule = Schedule.ONE_F_ONE_B
    overhead: float = 0.0

    def __post_init__(self) -> None:
        if not self.stages or self.microbatches < 1:
            raise PlacementError(f"a joint layout needs stages and microbatches >= 1 (got {len(self.stages)} stages, "
                                 f"{self.microbatches} microbatches)")

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def n_positions(self) -> int:
        return sum(stage.n_positions for stage in self.stages)

    def stage_positions(self) -> tuple[range, ...]:
        return consecutive_ranges([stage.n_positions for stage in self.stages])

    def latency(self, times: Sequence[float], transfers: Sequence[float]) -> float:
        """The step from each stage's and cut's seconds per microbatch."""
        return self.latency_and_bottleneck(times, transfers)[0]

    def latency_and_bottleneck(self, times: Sequence[float], transfers: Sequence[float]) -> tuple[float, float]:
        """(the step, the slowest stage or cut per microbatch) from each stage's and cut's seconds."""
        shares = [stage.forward_share for stage in self.stages]
        found, bottleneck = stage_time_latency(list(times), shares, list(transfers), self.schedule, self.microbatches)
        return found + self.overhead, bottleneck

    def times(self, cluster: Cluster, devices: Sequence[int]) -> tuple[list[float], list[float]]:
        """(stage seconds, cut seconds) per microbatch with position i on `devices[i]`."""
        groups = [[int(devices[p]) for p in positions] for positions in self.stage_positions()]
        times = [stage.time(cluster, group) for stage, group in zip(self.stages, groups)]
        cuts = [stage.send_time(cluster, group, nxt) for stage, group, nxt in zip(self.stages, groups, groups[1:])]
        return times, cuts


Layout = MeshLayout | StageLayout | JointLayout


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
                                 f"has only {d} device{'s' if d != 1 else ''}")
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
    if isinstance(layout, JointLayout):
        return layout.latency(*layout.times(problem.cluster, devices))
    return PipelineModel(problem.cluster).plan_cost(layout.profile, layout.plan(devices)).latency
