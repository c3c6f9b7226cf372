"""The order the mpmd executor runs forward and backward passes in: the simulator's.

Each stage runs its passes in the order of its schedule (`stage_order`: GPipe or 1F1B); how the
stages' passes interleave is what the event simulator predicts for a pipeline of S stages of
equal cost (backward twice the forward, no transfer time). The executor dispatches the events in
the order of their predicted start, so its per-stage order is the schedule's by construction and
its global order is the simulator's; `recorded` events (what ran when, measured) can then be
compared with the prediction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hlomap.cost.cluster import uniform
from hlomap.cost.pipeline.costs import CommModel, CostOptions
from hlomap.cost.pipeline.profile import uniform_profile
from hlomap.cost.pipeline.simulator import SimulationResult, Span, SpanKind, simulate
from hlomap.cost.pipeline.stages import Pass, PipelinePlan, Schedule, stage_order

__all__ = ["Event", "RecordedEvent", "dispatch_order", "events_from_spans", "fusable_passes", "predicted_schedule",
           "same_order"]

#: Relative cost of a backward pass in the predicted schedule (the usual rule of thumb).
BACKWARD_COST = 2.0


@dataclass(frozen=True)
class Event:
    """One pass of one microbatch on one stage."""

    stage: int
    kind: Pass
    microbatch: int


@dataclass(frozen=True)
class RecordedEvent:
    """An event as it ran: seconds from the start of the step."""

    event: Event
    start: float
    end: float


def predicted_schedule(schedule: Schedule, n_stages: int, microbatches: int) -> SimulationResult:
    """The simulator's timeline of S equal stages (forward 1 s, backward 2 s, free links)."""
    profile = uniform_profile(n_stages, forward_time=1.0, backward_time=BACKWARD_COST)
    plan = PipelinePlan.linear(range(n_stages + 1), (1,) * n_stages, microbatches=microbatches, schedule=schedule)
    cluster = uniform(n_stages, "V100-16GB", bandwidth=1e30, latency=0.0)  # the device kind is not used
    return simulate(profile, cluster, plan, CostOptions(comm=CommModel.IGNORED))


def events_from_spans(spans: Sequence[Span]) -> tuple[Event, ...]:
    """Forward and backward passes of a timeline in start order (ties: by stage)."""
    passes = [span for span in spans if span.kind in (SpanKind.FORWARD, SpanKind.BACKWARD)]
    passes.sort(key=lambda span: (span.start, span.stage))
    return tuple(Event(span.stage, Pass.FORWARD if span.kind is SpanKind.FORWARD else Pass.BACKWARD,
                       span.microbatch) for span in passes)


def dispatch_order(schedule: Schedule, n_stages: int, microbatches: int) -> tuple[Event, ...]:
    """The order the mpmd executor dispatches passes in (module docstring), checked against each
    stage's schedule."""
    events = events_from_spans(predicted_schedule(schedule, n_stages, microbatches).spans)
    for s in range(n_stages):
        own = tuple((e.kind, e.microbatch) for e in events if e.stage == s)
        if own != stage_order(schedule, s, n_stages, microbatches):
            raise AssertionError(f"the simulated order of stage {s} is not its {schedule.value} order")
    return events


def fusable_passes(order: Sequence[Event], n_stages: int) -> frozenset[int]:
    """Microbatches whose forward and backward on the last stage can run as one program: the last
    stage's backward needs nothing from another stage, so when its schedule runs the backward
    of a microbatch right after its forward (always under 1F1B; under GPipe only when M = 1)
    the two fuse, and the forward's residuals never leave the program."""
    last = [e for e in order if e.stage == n_stages - 1]
    return frozenset(a.microbatch for a, b in zip(last, last[1:])
                     if a.kind is Pass.FORWARD and b.kind is Pass.BACKWARD and a.microbatch == b.microbatch)


def same_order(recorded: Sequence[RecordedEvent], predicted: Sequence[Event]) -> bool:
    """Whether every stage ran its passes in the predicted order (sorted by measured start)."""
    stages = {e.stage for e in predicted}
    for s in stages:
        ran = [r.event for r in sorted(recorded, key=lambda r: r.start) if r.event.stage == s]
        if ran != [e for e in predicted if e.stage == s]:
            return False
    return True
