"""The order the mpmd executor runs forward, backward and weight passes in: the simulator's.

Each device stage runs its passes in the order of its schedule (`device_order`: GPipe, 1F1B,
interleaved 1F1B over its V chunks, ZB-H1 with the backward split into B and W); how the device
stages' passes interleave is what the event simulator predicts for a pipeline of S V logical
stages of equal cost (a device stage's forward 1, backward 2, shared by its V chunks; no transfer
time). The executor dispatches the events in the order of their predicted start, so its
per-device order is the schedule's by construction and its global order is the simulator's;
`recorded` events (what ran when, measured) can then be compared with the prediction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hlomap.cost.cluster import uniform
from hlomap.cost.pipeline.costs import CommModel, CostOptions
from hlomap.cost.pipeline.profile import uniform_profile
from hlomap.cost.pipeline.simulator import SimulationResult, Span, SpanKind, simulate
from hlomap.cost.pipeline.stages import Pass, PipelinePlan, Schedule, Stage, device_order
from hlomap.cost.pipeline.timeline import COMPUTE

__all__ = ["Event", "RecordedEvent", "dispatch_order", "events_from_spans", "fusable_passes", "measured_bubble",
           "predicted_schedule", "same_order"]

#: Relative cost of a backward pass in the predicted schedule (the usual rule of thumb).
BACKWARD_COST = 2.0


@dataclass(frozen=True)
class Event:
    """One pass of one microbatch on one logical stage (device stage: stage mod S)."""

    stage: int
    kind: Pass
    microbatch: int


@dataclass(frozen=True)
class RecordedEvent:
    """An event as it ran: seconds from the start of the step."""

    event: Event
    start: float
    end: float


def predicted_schedule(schedule: Schedule, n_stages: int, microbatches: int, repeats: int = 1) -> SimulationResult:
    """The simulator's timeline of S = `n_stages` equal device stages (forward 1 s, backward 2 s,
    each split evenly over the V = `repeats` chunks; free links)."""
    n = n_stages * repeats
    profile = uniform_profile(n, forward_time=1.0 / repeats, backward_time=BACKWARD_COST / repeats)
    stages = tuple(Stage(k, k + 1, (k % n_stages,)) for k in range(n))
    plan = PipelinePlan(stages, microbatches, schedule, repeats)
    cluster = uniform(n_stages, "V100-16GB", bandwidth=1e30, latency=0.0)  # the device kind is not used
    return simulate(profile, cluster, plan, CostOptions(comm=CommModel.IGNORED))


_PASS_OF = {SpanKind.FORWARD: Pass.FORWARD, SpanKind.BACKWARD: Pass.BACKWARD, SpanKind.WEIGHT: Pass.WEIGHT}


def events_from_spans(spans: Sequence[Span]) -> tuple[Event, ...]:
    """Forward, backward and weight passes of a timeline in start order (ties: by stage)."""
    passes = [span for span in spans if span.kind in COMPUTE]
    passes.sort(key=lambda span: (span.start, span.stage))
    return tuple(Event(span.stage, _PASS_OF[span.kind], span.microbatch) for span in passes)


def dispatch_order(schedule: Schedule, n_stages: int, microbatches: int, repeats: int = 1) -> tuple[Event, ...]:
    """The order the mpmd executor dispatches passes in (module docstring), checked against each
    device stage's schedule."""
    events = events_from_spans(predicted_schedule(schedule, n_stages, microbatches, repeats).spans)
    for g in range(n_stages):
        own = tuple((e.kind, e.stage // n_stages, e.microbatch) for e in events if e.stage % n_stages == g)
        if own != device_order(schedule, g, n_stages, microbatches, repeats):
            raise AssertionError(f"the simulated order of device stage {g} is not its {schedule.value} order")
    return events


def fusable_passes(order: Sequence[Event], n_stages: int, n_groups: int | None = None) -> frozenset[int]:
    """Microbatches whose forward and backward on the last (logical) stage can run as one
    program: the last stage's backward needs nothing from another stage, so when its device
    stage runs the backward of a microbatch right after its forward (always under 1F1B; under
    GPipe only when M = 1) the two fuse, and the forward's residuals never leave the program.
    None under ZB-H1: its backward is two passes. `n_groups`: device stages (default
    `n_stages`, no chunks)."""
    groups = n_groups or n_stages
    if any(e.kind is Pass.WEIGHT for e in order):
        return frozenset()
    last = [e for e in order if e.stage % groups == (n_stages - 1) % groups]
    return frozenset(a.microbatch for a, b in zip(last, last[1:])
                     if a.stage == b.stage == n_stages - 1 and a.kind is Pass.FORWARD and b.kind is Pass.BACKWARD
                     and a.microbatch == b.microbatch)


def same_order(recorded: Sequence[RecordedEvent], predicted: Sequence[Event], n_groups: int | None = None) -> bool:
    """Whether every device stage ran its passes in the predicted order (sorted by measured
    start). `n_groups`: device stages (default: every logical stage its own)."""
    stages = {e.stage for e in predicted}
    groups = n_groups or max(stages) + 1
    ranked = sorted(recorded, key=lambda r: r.start)
    for g in range(groups):
        ran = [r.event for r in ranked if r.event.stage % groups == g]
        if ran != [e for e in predicted if e.stage % groups == g]:
            return False
    return True


def measured_bubble(recorded: Sequence[RecordedEvent], n_groups: int) -> float:
    """Bubble fraction of a recorded step, as `SimulationResult.bubble_fraction` defines it:
    1 - (summed pass time of the device stages) / (S x the step, first start to last end)."""
    if not recorded:
        raise ValueError("no recorded events: run the step with record=True")
    start = min(r.start for r in recorded)
    length = max(r.end for r in recorded) - start
    busy = sum(r.end - r.start for r in recorded)
    return 1.0 - busy / (n_groups * length) if length > 0 else 0.0
