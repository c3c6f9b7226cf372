"""The event timeline of one batch through a pipeline, from its passes' and transfers' times.

The one event model of the cost layer (`simulator.simulate` prices a plan on a cluster with it;
`costs.schedule_latency` prices stage times with it where no closed form is exact): each device
stage runs its passes in its schedule's order (`stages.device_order`); a pass starts when its
group is free and its input has arrived; each direction between two device stages is one serial
link (first come, first served).
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Sequence

from hlomap.cost.pipeline.stages import Pass, Schedule, device_order

__all__ = ["COMPUTE", "Span", "SpanKind", "event_timeline"]


class SpanKind(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"  # under ZB-H1 the input gradient only
    WEIGHT = "weight"  # ZB-H1's weight gradient
    SEND_ACTIVATION = "send-activation"  # stage s -> s + 1
    SEND_GRADIENT = "send-gradient"  # stage s -> s - 1
    ALLREDUCE = "allreduce"
    UPDATE = "update"  # the optimizer update of a device stage's parameters, once per step


class Span(NamedTuple):
    """One interval of the timeline. `stage` is the logical stage (for sends the sending one);
    all-reduces have the device stage and microbatch -1."""

    kind: SpanKind
    stage: int
    microbatch: int
    start: float
    end: float


#: The span kinds that occupy a device stage's compute.
COMPUTE = frozenset({SpanKind.FORWARD, SpanKind.BACKWARD, SpanKind.WEIGHT})


def event_timeline(forward: Sequence[float], backward: Sequence[float], weight: Sequence[float],
                   transfer: Sequence[float], schedule: Schedule, microbatches: int,
                   repeats: int = 1) -> tuple[list[Span], list[float]]:
    """(compute and send spans, when each device stage ends its last pass) of S V logical stages
    with these per-microbatch pass times (`weight` all 0 unless the schedule splits the
    backward) and per-cut transfer times (S V - 1). Raises RuntimeError when the orders deadlock,
    which a schedule of `stages` never does."""
    n_logical, m, v = len(forward), microbatches, repeats
    n_groups = n_logical // v
    orders = [device_order(schedule, g, n_groups, m, v) for g in range(n_groups)]
    forward_end: list[list[float | None]] = [[None] * m for _ in range(n_logical)]
    backward_end: list[list[float | None]] = [[None] * m for _ in range(n_logical)]
    activation_arrival: list[list[float | None]] = [[None] * m for _ in range(n_logical)]
    gradient_arrival: list[list[float | None]] = [[None] * m for _ in range(n_logical)]
    group_free = [0.0] * n_groups
    # one serial link per (sending group, receiving group) and direction: under interleaving the V
    # cuts between two groups share it
    link_free: dict[tuple[SpanKind, int, int], float] = {}
    position = [0] * n_groups
    spans: list[Span] = []

    def send(kind: SpanKind, sender: int, cut: int, microbatch: int, ready: float) -> float:
        receiver = sender + 1 if kind is SpanKind.SEND_ACTIVATION else sender - 1
        link = (kind, sender % n_groups, receiver % n_groups)
        start = max(ready, link_free.get(link, 0.0))
        end = start + transfer[cut]
        link_free[link] = end
        if end > start:
            spans.append(Span(kind, sender, microbatch, start, end))
        return end

    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for g in range(n_groups):
            while position[g] < len(orders[g]):
                kind, chunk, mb = orders[g][position[g]]
                k = chunk * n_groups + g
                if kind is Pass.FORWARD:
                    ready: float | None = 0.0 if k == 0 else activation_arrival[k][mb]
                elif kind is Pass.WEIGHT:
                    ready = backward_end[k][mb]
                elif k == n_logical - 1:
                    ready = forward_end[k][mb]
                else:
                    ready = gradient_arrival[k][mb]
                if ready is None:
                    break  # waits on another group; come back on the next sweep
                start = max(group_free[g], ready)
                if kind is Pass.FORWARD:
                    end = start + forward[k]
                    spans.append(Span(SpanKind.FORWARD, k, mb, start, end))
                    forward_end[k][mb] = end
                    if k + 1 < n_logical:
                        activation_arrival[k + 1][mb] = send(SpanKind.SEND_ACTIVATION, k, k, mb, end)
                elif kind is Pass.WEIGHT:
                    end = start + weight[k]
                    spans.append(Span(SpanKind.WEIGHT, k, mb, start, end))
                else:
                    end = start + backward[k]
                    spans.append(Span(SpanKind.BACKWARD, k, mb, start, end))
                    backward_end[k][mb] = end
                    if k > 0:
                        gradient_arrival[k - 1][mb] = send(SpanKind.SEND_GRADIENT, k, k - 1, mb, end)
                group_free[g] = end
                position[g] += 1
                remaining -= 1
                progressed = True
        if remaining and not progressed:
            stuck = {
                g: orders[g][position[g]] for g in range(n_groups) if position[g] < len(orders[g])
            }
            raise RuntimeError(f"pipeline schedule deadlocked; next passes per device stage: {stuck}")

    return spans, group_free
