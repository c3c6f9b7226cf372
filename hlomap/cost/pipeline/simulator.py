"""Event simulator of one global batch through a pipeline (GPipe or 1F1B).

Model:
- Each stage is one serial compute resource; its r replicas run in lockstep, each on 1/r of every
  microbatch, so a pass takes (sum of the stage's layer times) / r.
- Each stage runs its passes in the fixed order of its schedule (`stages.stage_order`); a pass
  starts when the stage is free and its input has arrived: the activation from the previous
  stage (forward) or the gradient from the next stage (backward; the last stage's backward only
  needs its own forward).
- Each direction of each cut is one serial link resource. A transfer starts when its producer
  pass ends and the link is free (first come, first served), and takes
  `hlomap.cost.pipeline.links.transfer_time`: the replicas' chunks as one collective-permute on
  the cluster, cross-server streams sharing the servers' NICs. Links and compute run
  concurrently: communication overlaps with compute.
- After its last backward, a replicated stage all-reduces its parameter gradients over its
  devices (`links.allreduce_time`, the all-reduce of `hlomap.cost.collectives`: a ring inside a
  server, hierarchical across servers); the batch ends when the last all-reduce or pass ends.
  These are the prices the closed form (`costs`) and the searches use.
- Memory: a stage stashes a microbatch's activations from the start of its forward to the end of
  its backward; the peak count, from the timeline, prices the stash. Devices short of memory are
  reported in `SimulationResult.violations`, logged, and raised by `check()`: never ignored.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import NamedTuple

from hlomap.cost.pipeline.costs import (
    CommModel,
    CostOptions,
    MemoryViolation,
    check_plan,
    memory_violations,
    stage_memory_bytes,
)
from hlomap.cost.cluster import Cluster
from hlomap.cost.pipeline.links import allreduce_time, transfer_time
from hlomap.cost.pipeline.profile import PipelineProfile
from hlomap.cost.pipeline.stages import Pass, PipelinePlan, stage_order

__all__ = [
    "PipelineMemoryError",
    "SimulationResult",
    "Span",
    "SpanKind",
    "simulate",
]

log = logging.getLogger(__name__)


class SpanKind(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    SEND_ACTIVATION = "send-activation"  # stage s -> s + 1
    SEND_GRADIENT = "send-gradient"  # stage s -> s - 1
    ALLREDUCE = "allreduce"


class Span(NamedTuple):
    """One interval of the timeline. For sends, `stage` is the sending stage; all-reduces have
    microbatch -1."""

    kind: SpanKind
    stage: int
    microbatch: int
    start: float
    end: float


class PipelineMemoryError(RuntimeError):
    """A plan does not fit in its devices' memory."""


@dataclass(frozen=True)
class SimulationResult:
    """Timeline and memory of one global batch.

    length: L, seconds from the first forward to the end of the last pass or all-reduce.
    stage_memory: bytes needed on each device of each stage at its peak.
    peak_in_flight: most microbatches whose activations a stage held at once.
    """

    plan: PipelinePlan
    length: float
    spans: tuple[Span, ...]
    peak_in_flight: tuple[int, ...]
    stage_memory: tuple[float, ...]
    violations: tuple[MemoryViolation, ...]

    @property
    def feasible(self) -> bool:
        return not self.violations

    def check(self) -> SimulationResult:
        """Raise `PipelineMemoryError` naming every device out of memory; else return self."""
        if self.violations:
            raise PipelineMemoryError(
                "pipeline plan does not fit in memory: "
                + "; ".join(str(v) for v in self.violations)
            )
        return self

    def busy_time(self, stage: int) -> float:
        """Seconds stage `stage` spends computing (forward + backward); the rest is bubble."""
        return sum(
            span.end - span.start
            for span in self.spans
            if span.stage == stage and span.kind in (SpanKind.FORWARD, SpanKind.BACKWARD)
        )


def simulate(
    profile: PipelineProfile,
    cluster: Cluster,
    plan: PipelinePlan,
    options: CostOptions = CostOptions(),
) -> SimulationResult:
    """Run one global batch of `plan` on `cluster`; see the module docstring for the model."""
    check_plan(profile, cluster, plan)
    comm = options.comm is CommModel.OVERLAPPED
    n_stages, m = plan.n_stages, plan.microbatches
    forward, backward = [], []
    for stage in plan.stages:
        layers = profile.stage_slice(stage.start, stage.stop)
        forward.append(float(profile.forward_time[layers].sum()) / stage.replication)
        backward.append(float(profile.backward_time[layers].sum()) / stage.replication)
    transfer = [
        transfer_time(cluster, a.devices, b.devices, float(profile.activation_bytes[a.stop - 1]))
        if comm
        else 0.0
        for a, b in zip(plan.stages[:-1], plan.stages[1:])
    ]

    orders = [stage_order(plan.schedule, s, n_stages, m) for s in range(n_stages)]
    forward_end: list[list[float | None]] = [[None] * m for _ in range(n_stages)]
    activation_arrival: list[list[float | None]] = [[None] * m for _ in range(n_stages)]
    gradient_arrival: list[list[float | None]] = [[None] * m for _ in range(n_stages)]
    stage_free = [0.0] * n_stages
    forward_link_free = [0.0] * max(n_stages - 1, 0)
    backward_link_free = [0.0] * max(n_stages - 1, 0)
    position = [0] * n_stages
    # Stashed microbatches per stage, counted in execution order (a forward adds one from its
    # start, a backward frees one at its end); the order, not the clock, decides, so
    # zero-length passes cannot reorder a release before an acquire.
    stashed = [0] * n_stages
    peaks = [0] * n_stages
    spans: list[Span] = []

    def send(kind: SpanKind, sender: int, cut: int, microbatch: int, ready: float) -> float:
        free = forward_link_free if kind is SpanKind.SEND_ACTIVATION else backward_link_free
        start = max(ready, free[cut])
        end = start + transfer[cut]
        free[cut] = end
        if end > start:
            spans.append(Span(kind, sender, microbatch, start, end))
        return end

    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for s in range(n_stages):
            while position[s] < len(orders[s]):
                kind, mb = orders[s][position[s]]
                if kind is Pass.FORWARD:
                    ready = 0.0 if s == 0 else activation_arrival[s][mb]
                elif s == n_stages - 1:
                    ready = forward_end[s][mb]
                else:
                    ready = gradient_arrival[s][mb]
                if ready is None:
                    break  # waits on another stage; come back on the next sweep
                start = max(stage_free[s], ready)
                if kind is Pass.FORWARD:
                    end = start + forward[s]
                    spans.append(Span(SpanKind.FORWARD, s, mb, start, end))
                    forward_end[s][mb] = end
                    stashed[s] += 1
                    peaks[s] = max(peaks[s], stashed[s])
                    if s + 1 < n_stages:
                        arrival = send(SpanKind.SEND_ACTIVATION, s, s, mb, end)
                        activation_arrival[s + 1][mb] = arrival
                else:
                    end = start + backward[s]
                    spans.append(Span(SpanKind.BACKWARD, s, mb, start, end))
                    stashed[s] -= 1
                    if s > 0:
                        arrival = send(SpanKind.SEND_GRADIENT, s, s - 1, mb, end)
                        gradient_arrival[s - 1][mb] = arrival
                stage_free[s] = end
                position[s] += 1
                remaining -= 1
                progressed = True
        if remaining and not progressed:
            stuck = {
                s: orders[s][position[s]] for s in range(n_stages) if position[s] < len(orders[s])
            }
            raise RuntimeError(f"pipeline schedule deadlocked; next passes per stage: {stuck}")

    for s, stage in enumerate(plan.stages):
        layers = profile.stage_slice(stage.start, stage.stop)
        params = float(profile.parameter_bytes[layers].sum())
        duration = allreduce_time(cluster, stage.devices, params) if comm else 0.0
        if duration > 0:
            spans.append(Span(SpanKind.ALLREDUCE, s, -1, stage_free[s], stage_free[s] + duration))

    memory = stage_memory_bytes(profile, plan, tuple(peaks), options.param_memory_factor)
    violations = memory_violations(cluster, plan, memory)
    for violation in violations:
        log.warning("%s: %s", profile.source, violation)
    spans.sort(key=lambda span: (span.start, span.stage, span.kind.value))
    return SimulationResult(
        plan=plan,
        length=max(span.end for span in spans),
        spans=tuple(spans),
        peak_in_flight=tuple(peaks),
        stage_memory=memory,
        violations=violations,
    )
