"""Event simulator of one global batch through a pipeline (GPipe, 1F1B, interleaved 1F1B, ZB-H1).

Model:
- Each device stage (group of devices) is one serial compute resource; its r replicas run in
  lockstep, each on 1/r of every microbatch, so a pass of a logical stage takes the sum of its
  layers' times with the part that grows with the batch over r (a weight's read is every
  replica's: `PipelineProfile.on_replicas`). Under interleaved 1F1B a device stage runs V
  logical stages (chunks).
- Each device stage runs its passes in the fixed order of its schedule (`stages.device_order`); a
  pass starts when the group is free and its input has arrived: the activation from the previous
  logical stage (forward) or the gradient from the next one (backward; the last stage's backward
  only needs its own forward). Under ZB-H1 the backward is split (`pass_times`): B, the input
  gradient, is what the previous stage waits for; W, the weight gradient, only needs its own B.
- Each direction between two device stages is one serial link resource (under interleaving the
  V cuts between them share it). A transfer starts when its producer pass ends and the link is
  free (first come, first served), and takes `hlomap.cost.pipeline.links.transfer_time`: the
  replicas' chunks as one collective-permute on the cluster, cross-server streams sharing the
  servers' NICs. Links and compute run concurrently: communication overlaps with compute.
- After its last pass, a replicated device stage all-reduces its parameter gradients (all its
  chunks') over its devices (`links.allreduce_time`, the all-reduce of `hlomap.cost.collectives`:
  a ring inside a server, hierarchical across servers); the batch ends when the last all-reduce
  or pass ends. On a measured cluster (`costs.syncs_each_microbatch`) each chunk's backward (its
  W under ZB-H1) all-reduces its own gradients instead, every microbatch, as hlomap's executors
  do. These are the prices the closed form (`costs`) and the searches use.
- Memory: a logical stage stashes a microbatch's activations from the start of its forward to the
  end of its backward (under ZB-H1 of its W, which still reads them); the peak, counted along the
  order (`costs.device_memory_bytes`), prices the stash. Devices short of memory are
  reported in `SimulationResult.violations`, logged, and raised by `check()`: never ignored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hlomap.cost.pipeline.costs import (
    CommModel,
    CostOptions,
    MemoryViolation,
    check_plan,
    stage_passes,
    stage_update_seconds,
    device_memory_bytes,
    memory_violations,
    peak_counts,
    syncs_each_microbatch,
)
from hlomap.cost.cluster import Cluster
from hlomap.cost.pipeline.links import allreduce_time, transfer_time
from hlomap.cost.pipeline.profile import PipelineProfile
from hlomap.cost.pipeline.stages import INPUT_GRADIENT_SHARE, PipelinePlan, Schedule
from hlomap.cost.pipeline.timeline import COMPUTE, Span, SpanKind, event_timeline

__all__ = [
    "COMPUTE",
    "PipelineMemoryError",
    "SimulationResult",
    "Span",
    "SpanKind",
    "pass_times",
    "simulate",
]

log = logging.getLogger(__name__)


class PipelineMemoryError(RuntimeError):
    """A plan does not fit in its devices' memory."""


@dataclass(frozen=True)
class SimulationResult:
    """Timeline and memory of one global batch.

    length: L, seconds from the first forward to the end of the last pass or all-reduce.
    stage_memory: bytes needed on each device of each device stage at its peak (its chunks'
      parameters and, at the peak of their sum, their stashed activations).
    peak_in_flight: most microbatches whose activations a logical stage held at once.
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
        """Seconds device stage `stage` spends computing (F, B and W of all its chunks); the rest
        is bubble."""
        groups = self.plan.device_stages
        return sum(
            span.end - span.start
            for span in self.spans
            if span.stage % groups == stage and span.kind in COMPUTE
        )

    def bubble_fraction(self) -> float:
        """Share of the device stages' time over the batch that is not compute: 1 - (sum of busy
        time) / (S L). For S equal stages and free links it is (S - 1) / (V M + S - 1) under
        GPipe, 1F1B and interleaved 1F1B."""
        groups = self.plan.device_stages
        busy = sum(self.busy_time(g) for g in range(groups))
        return 1.0 - busy / (groups * self.length) if self.length > 0 else 0.0


def pass_times(profile: PipelineProfile, plan: PipelinePlan, cluster: Cluster | None = None, *,
               syncs: bool = True) -> tuple[list[float], list[float], list[float]]:
    """(F, B, W) seconds per microbatch of each logical stage (`costs.stage_passes`: its layers'
    times on each of its replicas, on `cluster`'s slowest of them, with the all-reduces its passes
    run over them unless `syncs` is False). Under ZB-H1 the backward
    splits into B = `INPUT_GRADIENT_SHARE` of it and W = the rest; otherwise W is 0 and B the
    whole backward."""
    split = plan.schedule is Schedule.ZERO_BUBBLE
    forward, backward, weight = [], [], []
    for stage in plan.stages:
        f, b = stage_passes(profile, cluster, stage, syncs=syncs)
        forward.append(f)
        backward.append(b * INPUT_GRADIENT_SHARE if split else b)
        weight.append(b - b * INPUT_GRADIENT_SHARE if split else 0.0)
    return forward, backward, weight


def simulate(
    profile: PipelineProfile,
    cluster: Cluster,
    plan: PipelinePlan,
    options: CostOptions = CostOptions(),
) -> SimulationResult:
    """Run one global batch of `plan` on `cluster`; see the module docstring for the model."""
    check_plan(profile, cluster, plan)
    comm = options.comm is CommModel.OVERLAPPED
    n_groups, m, v = plan.device_stages, plan.microbatches, plan.repeats
    forward, backward, weight = pass_times(profile, plan, cluster, syncs=comm)
    params = [float(profile.parameter_bytes[profile.stage_slice(stage.start, stage.stop)].sum())
              for stage in plan.stages]  # per logical stage (chunk)
    buffers = [profile.gradient_buffers_of(profile.stage_slice(stage.start, stage.stop)) for stage in plan.stages]
    each = syncs_each_microbatch(cluster)
    if each and comm:  # each chunk's backward (weight pass under ZB-H1) all-reduces its gradients
        synced = [allreduce_time(cluster, stage.devices, p, n) for stage, p, n in zip(plan.stages, params, buffers)]
        if plan.schedule is Schedule.ZERO_BUBBLE:
            weight = [w + a for w, a in zip(weight, synced)]
        else:
            backward = [b + a for b, a in zip(backward, synced)]
    transfer = [
        transfer_time(cluster, a.devices, b.devices, float(profile.activation_bytes[a.stop - 1]))
        if comm
        else 0.0
        for a, b in zip(plan.stages[:-1], plan.stages[1:])
    ]

    spans, group_free = event_timeline(forward, backward, weight, transfer, plan.schedule, m, v)

    for g in range(n_groups):
        free = group_free[g]
        if not each:  # one all-reduce per device stage after its last pass
            duration = (allreduce_time(cluster, plan.stages[g].devices, sum(params[g::n_groups]),
                                       sum(buffers[g::n_groups])) if comm else 0.0)
            if duration > 0:
                spans.append(Span(SpanKind.ALLREDUCE, g, -1, free, free + duration))
                free += duration
        # then its optimizer update: every replica updates all the stage's parameters, once per step
        update = stage_update_seconds(profile, cluster, plan, g)
        if update > 0:
            spans.append(Span(SpanKind.UPDATE, g, -1, free, free + update))

    peaks = peak_counts(plan)
    memory = device_memory_bytes(profile, plan, options.param_memory_factor)
    violations = memory_violations(cluster, plan, memory)
    for violation in violations:
        log.warning("%s: %s", profile.source, violation)
    spans.sort(key=lambda span: (span.start, span.stage, span.kind.value))
    return SimulationResult(
        plan=plan,
        length=max(span.end for span in spans),
        spans=tuple(spans),
        peak_in_flight=peaks,
        stage_memory=memory,
        violations=violations,
    )
