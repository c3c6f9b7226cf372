"""Closed-form cost of a pipeline plan: what the DP minimizes and the brute force enumerates.

This is written as a plain loop over stages, on purpose independent of the vectorized tables and
recursion of `hlomap.tasks.pipeline.dp`, so that brute force over this function is a real oracle
for the DP. Only the price of a device group is shared, on purpose: there is one model.

For a plan with stages s = 0..S-1 (replication r_s, devices g_s) and M microbatches:
  c_s   = F_s + (C_s - F_s) / r_s       per microbatch, with C_s the forward + backward time of the
          stage's layers and F_s its part a batch split does not shrink (`PipelineProfile.forward_fixed`)
  a_s   = all-reduce of the stage's parameter bytes over g_s               once per batch
  t_s   = c_s + a_s / M          stage time per microbatch, all-reduce amortized over the batch
  u_k   = transfer of activation_bytes[cut k] from g_k to g_{k+1}           per microbatch, each
          way (activations forward, gradients back; links are full duplex)
  tau   = max(max_s t_s, max_k u_k)                    steady-state period (slowest resource)
  L     = sum_s t_s + 2 sum_k u_k + (M - 1) tau        latency of one global batch
a_s and u_k are the one communication model of `hlomap.cost.pipeline.links` on the cluster's
topology: the all-reduce of `hlomap.cost.collectives` (a ring inside a server, hierarchical
across servers), and the transfer a collective-permute of the replicas' k = max(r_k, r_{k+1})
chunks, whose cross-server streams share the servers' NICs.

L is Alpa's formula (fill and drain through every stage and link, then M - 1 periods of the
bottleneck); tau is PipeDream's objective (time per microbatch of the slowest stage, with its
communication when asked). How L relates to the event simulator (the ground truth):
- uniform stages, no communication: L = (M + S - 1)(t_f + t_b) exactly, for GPipe and 1F1B.
- GPipe in general: the simulator's L is `gpipe_latency` below, exactly: the forward and the
  backward phase are each a flow shop of M identical jobs over stages and links, so it charges
  (M - 1)(max forward + max backward) where this L charges (M - 1) max(forward + backward).
- 1F1B keeps only S - s microbatches in flight on stage s, so a slow link is not always hidden;
  its simulated L can be above or below this one.
The DP minimizes this L because it decomposes over stages; check a plan with the simulator.

Memory per device of stage s: param_memory_factor * W_s + in_flight(s) * stash_s / r_s, where
in_flight is M for GPipe and min(S - s, M) for 1F1B, and every replica holds the full parameters
but only its 1/r_s share of each microbatch's activations. Under interleaved 1F1B a device stage
holds its V chunks' parameters and, at the peak of their sum along its order, their stashes
(`device_memory_bytes`); under ZB-H1 a microbatch is held until its weight pass.

Interleaved 1F1B and ZB-H1 have no closed form that is exact for stages that differ: `evaluate_plan`
prices them with the simulator's event timeline (`schedule_latency`), so the searches and the
simulator charge the same for them. For S equal stages without communication that gives
L = (M + (S - 1) / V)(t_f + t_b) for interleaved 1F1B, and less than 1F1B's for ZB-H1.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from hlomap.cost.cluster import Cluster, busy_speedup, compute_slowdown
from hlomap.cost.pipeline.links import GroupPrices, allreduce_cost, allreduce_time, gradient_buffer_seconds, transfer_time
from hlomap.cost.pipeline.profile import PipelineProfile, faster_profile
from hlomap.cost.pipeline.stages import (INPUT_GRADIENT_SHARE, Pass, PipelinePlan, Schedule, Stage, device_order,
                                         held_counts)
from hlomap.cost.pipeline.timeline import event_timeline

__all__ = [
    "PROGRAM_SHARE",
    "executor_overhead",
    "CommModel",
    "CostOptions",
    "MemoryViolation",
    "PlanCost",
    "device_memory_bytes",
    "evaluate_plan",
    "gpipe_latency",
    "peak_counts",
    "pipeline_latency",
    "schedule_latency",
    "stage_time_latency",
]


class CommModel(enum.Enum):
    """Whether point-to-point transfers and all-reduces take time.

    IGNORED is PipeDream's optimizer for straight pipelines without `activation_compression_ratio`
    (stage time = forward + backward compute only).
    """

    OVERLAPPED = "overlapped"
    IGNORED = "ignored"


@dataclass(frozen=True)
class CostOptions:
    """Knobs of the cost model shared by the simulator, the DP and the brute force.

    param_memory_factor: bytes kept per parameter byte: weights, gradients and two Adam moments
      make 4; use 1 to count weights only.
    """

    comm: CommModel = CommModel.OVERLAPPED
    param_memory_factor: float = 4.0


@dataclass(frozen=True)
class MemoryViolation:
    """A device that needs more memory than it has."""

    stage: int
    device: int
    need_bytes: float
    have_bytes: float

    def __str__(self) -> str:
        return (
            f"stage {self.stage} needs {self.need_bytes / 2**30:.3f} GiB on device {self.device}, "
            f"which has {self.have_bytes / 2**30:.3f} GiB"
        )


@dataclass(frozen=True)
class PlanCost:
    """The closed-form costs of one plan (seconds and bytes)."""

    latency: float
    bottleneck: float
    stage_compute: tuple[float, ...]
    stage_allreduce: tuple[float, ...]
    cut_transfer: tuple[float, ...]
    stage_memory: tuple[float, ...]
    in_flight: tuple[int, ...]
    violations: tuple[MemoryViolation, ...]

    @property
    def feasible(self) -> bool:
        return not self.violations


def pipeline_latency(stage_seconds: Sequence[float], transfer_seconds: Sequence[float],
                     microbatches: int) -> tuple[float, float]:
    """(L, tau) of a pipeline from its stages' times t_s and its cuts' transfer times u_k per
    microbatch: tau = max(t, u), L = sum t + 2 sum u + (M - 1) tau (module docstring). The one
    closed form: every plan kind prices its stages its own way and combines them here."""
    bottleneck = max([*stage_seconds, *transfer_seconds])
    return sum(stage_seconds) + 2 * sum(transfer_seconds) + (microbatches - 1) * bottleneck, bottleneck


#: Schedules the closed form `pipeline_latency` prices exactly; the others take the event timeline.
CLOSED_FORM_SCHEDULES = (Schedule.GPIPE, Schedule.ONE_F_ONE_B)


def latency_method(schedule: Schedule, repeats: int = 1) -> str:
    """How the model's L of a pipeline under `schedule` (V = `repeats`) is priced, in a report's
    words: "closed form" (GPipe, 1F1B) or "event timeline" (ZB-H1, interleaved 1F1B)."""
    return "closed form" if schedule in CLOSED_FORM_SCHEDULES and repeats == 1 else "event timeline"


def stage_time_latency(stage_seconds: Sequence[float], forward_share: Sequence[float],
                       transfer_seconds: Sequence[float], schedule: Schedule, microbatches: int, *,
                       timeline: bool = False) -> tuple[float, float]:
    """(L, tau) of a pipeline of one chunk per stage from each stage's whole time per microbatch
    (its gradient sync included) and the forward's share of it: the closed form under GPipe and
    1F1B, else (or with `timeline`) the event timeline with each stage's time split into its
    forward and backward by `forward_share` (under ZB-H1 the backward into input and weight
    passes by `INPUT_GRADIENT_SHARE`). The joint planner and the placement of its plans price
    stages this way."""
    if schedule in CLOSED_FORM_SCHEDULES and not timeline:
        return pipeline_latency(stage_seconds, transfer_seconds, microbatches)
    forward = [t * f for t, f in zip(stage_seconds, forward_share)]
    backward = [t - f for t, f in zip(stage_seconds, forward)]
    split = schedule is Schedule.ZERO_BUBBLE
    inputs = [b * INPUT_GRADIENT_SHARE for b in backward] if split else backward
    weights = [b - i for b, i in zip(backward, inputs)] if split else [0.0] * len(backward)
    spans, group_free = event_timeline(forward, inputs, weights, transfer_seconds, schedule, microbatches)
    return max([*group_free, *(span.end for span in spans)]), max([*stage_seconds, *transfer_seconds])


def schedule_latency(forward: Sequence[float], backward: Sequence[float], transfer: Sequence[float],
                     allreduce: Sequence[float], microbatches: int, schedule: Schedule = Schedule.ONE_F_ONE_B,
                     repeats: int = 1, *, sync_each_microbatch: bool = False) -> tuple[float, float]:
    """(L, tau) of a pipeline under `schedule` from per-microbatch forward and backward seconds of
    its S V logical stages, the transfer seconds of its S V - 1 cuts and the all-reduce seconds
    of its S device stages: what `evaluate_plan` charges, for an explorer that chooses schedule,
    V and M over a stage plan. GPipe and 1F1B: the closed form `pipeline_latency` (Alpa's, the
    all-reduce amortized over M). Interleaved 1F1B and ZB-H1: no closed form is exact for
    stages that differ, so the event timeline of the simulator (`timeline.event_timeline`,
    the backward split by `INPUT_GRADIENT_SHARE` under ZB-H1), plus each device stage's
    all-reduce after its last pass; tau is then the busiest device stage's compute per
    microbatch. For S equal stages and free links both give (V M + S - 1) / V per-stage times,
    ZB-H1 less. With `sync_each_microbatch` (`syncs_each_microbatch`) the all-reduce is part of
    every microbatch's backward (its weight pass under ZB-H1), split evenly over a device stage's
    V chunks, and nothing is left for the end."""
    n_logical = len(forward)
    groups = n_logical // repeats
    if (len(backward), len(transfer), len(allreduce)) != (n_logical, n_logical - 1, groups):
        raise ValueError(f"{n_logical} logical stages with repeats {repeats} need as many backward times, "
                         f"{n_logical - 1} transfers and {groups} all-reduces; got {len(backward)}, "
                         f"{len(transfer)} and {len(allreduce)}")
    if schedule in CLOSED_FORM_SCHEDULES and repeats == 1:
        share = 1 if sync_each_microbatch else microbatches
        times = [f + b + a / share for f, b, a in zip(forward, backward, allreduce)]
        return pipeline_latency(times, transfer, microbatches)
    split = schedule is Schedule.ZERO_BUBBLE
    inputs = [b * INPUT_GRADIENT_SHARE if split else b for b in backward]
    weights = [b - i for b, i in zip(backward, inputs)]
    if sync_each_microbatch:
        synced = [allreduce[k % groups] / repeats for k in range(n_logical)]
        if split:
            weights = [w + a for w, a in zip(weights, synced)]
        else:
            inputs = [i + a for i, a in zip(inputs, synced)]
        backward = [b + a for b, a in zip(backward, synced)]
        allreduce = [0.0] * groups
    spans, group_free = event_timeline(forward, inputs, weights, transfer, schedule, microbatches, repeats)
    end = max([free + a for free, a in zip(group_free, allreduce)] + [span.end for span in spans])
    busy = [sum(forward[k] + backward[k] for k in range(g, n_logical, groups)) for g in range(groups)]
    return end, max([*busy, *transfer])


def paced_profile(profile: PipelineProfile, cluster: Cluster, busy_devices: int) -> PipelineProfile:
    """`profile` (the cluster's all-busy rate) at the pace of a plan that keeps `busy_devices` of
    the cluster's devices busy: faster on devices that share hardware (`busy_speedup`). The
    pipeline explorer and `hlomap simulate` (placement's pricing of a saved plan) both price a
    plan so, and so agree."""
    return faster_profile(profile, busy_speedup(cluster, busy_devices))


def syncs_each_microbatch(cluster: Cluster) -> bool:
    """Whether a stage's gradient all-reduce is priced in every microbatch rather than once per
    step. hlomap's executors all-reduce a stage's gradients in every microbatch's backward (the
    gradient leaves each backward program replicated over the stage's data replicas); a measured
    cluster prices the executors that ran on it (as `executor_overhead` does), a datasheet cluster
    an ideal executor that syncs once per step, as Megatron-LM's does. Every pipeline and joint
    price follows this one rule."""
    return cluster.measured is not None


def allreduce_share(cluster: Cluster, seconds: Any, microbatches: int) -> Any:
    """The part of a stage's gradient all-reduce (`seconds` per sync, a float or an array of
    them) charged to each microbatch: all of it where the all-reduce runs every microbatch
    (`syncs_each_microbatch`), else 1 / M."""
    return seconds if syncs_each_microbatch(cluster) else seconds / microbatches


#: Programs the mpmd executor launches per stage and microbatch, relative to F and B: ZB-H1 adds W.
PROGRAM_SHARE = {Schedule.ZERO_BUBBLE: 1.5}


def mean_stage_devices(stages: Sequence[Any]) -> float:
    """The devices per stage, on average, of stages that each name their `devices` (the
    executor's cost per buffer grows with them: `executor_overhead`)."""
    return sum(len(stage.devices) for stage in stages) / len(stages)


def executor_overhead(cluster: Cluster, executor: str, stages: int, microbatches: int,
                      schedule: Schedule | None = None, buffers: float = 0.0, stage_devices: float = 1.0,
                      state_leaves: float = 0.0) -> float:
    """Seconds per step the pipeline executor itself costs (dispatches, its loop, device_puts,
    the buffers its programs take and return: `buffers` per microbatch,
    `hlomap.cost.estimate.pass_buffers`, and the `state_leaves` the spmd executor slices out
    after each step, `hlomap.cost.estimate.state_leaves`, on stages of `stage_devices` devices
    on average, `mean_stage_devices`) on a cluster that measured it (`Cluster.measured`,
    `hlomap.cost.measured`), for a plan run under `schedule` (ZB-H1 launches a third program per
    stage and microbatch: `PROGRAM_SHARE`); 0 on a datasheet cluster. Added to L: on a host that
    runs the executor and the devices on the same cores, the executor's work does not hide behind
    the stages'."""
    if cluster.measured is None:
        return 0.0
    share = PROGRAM_SHARE.get(schedule, 1.0) if schedule is not None else 1.0
    return cluster.measured.executor_seconds(executor, stages, microbatches, buffers, stage_devices,
                                             state_leaves) * share


def stage_passes(profile: PipelineProfile, cluster: Cluster | None, stage: Stage, *,
                 syncs: bool = True) -> tuple[float, float]:
    """(forward, backward) seconds of one microbatch through a logical stage on each of its
    replicas (`PipelineProfile.on_replicas`), at its slowest device's pace on `cluster`
    (`compute_slowdown`; None: every device at full speed), with the all-reduces the passes run
    over its replicas (`stage_sync_seconds`; `syncs` False or no cluster: none)."""
    slowdown = 1.0 if cluster is None else compute_slowdown(cluster, stage.devices)
    layers = profile.stage_slice(stage.start, stage.stop)
    forward, backward = profile.on_replicas(layers, stage.replication)
    if not syncs or cluster is None:
        return forward * slowdown, backward * slowdown
    forward_syncs, backward_syncs = stage_sync_seconds(profile, cluster, stage)
    return forward * slowdown + forward_syncs, backward * slowdown + backward_syncs


def sync_seconds(allreduce: Any, count: Any, nbytes: Any) -> Any:
    """Seconds of `count` all-reduces of `nbytes` in all, each priced by `allreduce` (seconds of
    one as a function of its bytes, `links.allreduce_cost`), floats or arrays: the bytes shared
    evenly, which is exact for an affine price."""
    count = np.asarray(count, dtype=np.float64)
    each = np.asarray(nbytes, dtype=np.float64) / np.maximum(count, 1.0)
    out = np.where(count > 0, count * allreduce(each), 0.0)
    return float(out) if out.ndim == 0 else out


def stage_sync_seconds(profile: PipelineProfile, cluster: Cluster, stage: Stage) -> tuple[float, float]:
    """(forward, backward) seconds per microbatch of what a stage's passes add on more than one
    data replica: the all-reduces they run over them (`PipelineProfile.forward_syncs`: batch
    norm's statistics), and the weight gradients' transposes after the gradient all-reduce
    (`PipelineProfile.replica_transposes`, at the stage's slowest device's pace); none on one
    replica. A replica group is every `model`-th device of the stage."""
    layers = profile.stage_slice(stage.start, stage.stop)
    (forward_count, forward_bytes), (backward_count, backward_bytes) = profile.syncs_on(layers)
    if stage.replication <= 1:
        return 0.0, 0.0
    transposes = profile.replica_transposes_of(layers)
    if transposes:
        transposes *= compute_slowdown(cluster, stage.devices)
    if forward_count + backward_count == 0:
        return 0.0, transposes  # and no group to price (most profiles have no syncs)
    price = allreduce_cost(cluster, stage.devices[::stage.model])
    return (sync_seconds(price, forward_count, forward_bytes),
            sync_seconds(price, backward_count, backward_bytes) + transposes)


def device_stage_parameter_bytes(profile: PipelineProfile, plan: PipelinePlan, group: int) -> float:
    """Parameter bytes device stage `group` holds: those of all its chunks (logical stages)."""
    return sum(float(profile.parameter_bytes[profile.stage_slice(stage.start, stage.stop)].sum())
               for stage in plan.stages[group::plan.device_stages])


def stage_update_seconds(profile: PipelineProfile, cluster: Cluster, plan: PipelinePlan, group: int) -> float:
    """Seconds of device stage `group`'s optimizer update, once per step: its chunks' parameter
    bytes times `PipelineProfile.update_seconds_per_byte`, at its slowest device's pace (every
    replica updates all of the stage's parameters)."""
    if not profile.update_seconds_per_byte:
        return 0.0
    return (device_stage_parameter_bytes(profile, plan, group) * profile.update_seconds_per_byte
            * compute_slowdown(cluster, plan.stages[group].devices))


def check_plan(profile: PipelineProfile, cluster: Cluster, plan: PipelinePlan) -> None:
    """Raise ValueError unless `plan` covers the profile's layers on devices the cluster has."""
    if plan.n_layers != profile.n_layers:
        raise ValueError(
            f"plan covers {plan.n_layers} layers but {profile.source} has {profile.n_layers}"
        )
    for s, stage in enumerate(plan.stages):
        for d in stage.devices:
            if not 0 <= d < cluster.n_devices:
                raise ValueError(
                    f"stage {s} uses device {d}; cluster {cluster.name!r} has "
                    f"{cluster.n_devices} devices"
                )


def memory_violations(
    cluster: Cluster, plan: PipelinePlan, stage_memory: tuple[float, ...]
) -> tuple[MemoryViolation, ...]:
    """Every (stage, device) whose need exceeds the device's memory."""
    return tuple(
        MemoryViolation(s, d, need, float(cluster.devices[d].memory_bytes))
        for s, (stage, need) in enumerate(zip(plan.stages, stage_memory))
        for d in stage.devices
        if need > cluster.devices[d].memory_bytes
    )


def stage_memory_bytes(
    profile: PipelineProfile, plan: PipelinePlan, peak_in_flight: tuple[int, ...], factor: float
) -> tuple[float, ...]:
    """Bytes per device of each stage, given how many microbatches each stage stashes at peak."""
    out = []
    for stage, count in zip(plan.stages, peak_in_flight):
        layers = profile.stage_slice(stage.start, stage.stop)
        params = float(profile.parameter_bytes[layers].sum())
        stash = 0.0 if profile.stash_bytes is None else float(profile.stash_bytes[layers].sum())
        out.append(factor * params + count * stash / stage.replication)
    return tuple(out)


def peak_counts(plan: PipelinePlan) -> tuple[int, ...]:
    """Most microbatches each logical stage stashes at once under the plan's schedule, counted
    along its device stage's order (`stages.held_counts`)."""
    groups = plan.device_stages
    per_group = [held_counts(device_order(plan.schedule, g, groups, plan.microbatches, plan.repeats), plan.repeats)
                 for g in range(groups)]
    return tuple(per_group[k % groups][k // groups] for k in range(plan.n_stages))


def device_memory_bytes(profile: PipelineProfile, plan: PipelinePlan, factor: float) -> tuple[float, ...]:
    """Bytes per device of each device stage: `factor` times its chunks' parameter bytes, plus
    the most stashed activation bytes (its share of each microbatch) its chunks hold at once
    along its order. Without chunks this is `stage_memory_bytes` of `peak_counts`."""
    groups = plan.device_stages
    out = []
    for g in range(groups):
        chunks = plan.stages[g::groups]
        params, stash = [], []
        for stage in chunks:
            layers = profile.stage_slice(stage.start, stage.stop)
            params.append(float(profile.parameter_bytes[layers].sum()))
            stash.append(0.0 if profile.stash_bytes is None else float(profile.stash_bytes[layers].sum()))
        order = device_order(plan.schedule, g, groups, plan.microbatches, plan.repeats)
        frees = Pass.WEIGHT if plan.schedule is Schedule.ZERO_BUBBLE else Pass.BACKWARD
        held, peak = 0.0, 0.0
        for step in order:  # counted in execution order, as `held_counts` does
            if step.kind is Pass.FORWARD:
                held += stash[step.chunk]
                peak = max(peak, held)
            elif step.kind is frees:
                held -= stash[step.chunk]
        out.append(factor * sum(params) + peak / plan.stages[g].replication)
    return tuple(out)


def evaluate_plan(
    profile: PipelineProfile,
    cluster: Cluster,
    plan: PipelinePlan,
    options: CostOptions = CostOptions(),
    *,
    prices: GroupPrices | None = None,
) -> PlanCost:
    """The closed-form latency, bottleneck and memory of `plan` (see the module docstring).

    prices: a memo of `cluster`'s group prices, for callers that evaluate many plans; the result
      is the same with or without it.
    """
    check_plan(profile, cluster, plan)
    if prices is None:
        prices = GroupPrices(cluster)
    elif prices.cluster is not cluster and prices.cluster != cluster:
        raise ValueError(f"prices of cluster {prices.cluster.name!r} cannot price a plan on "
                         f"cluster {cluster.name!r}")
    comm = options.comm is CommModel.OVERLAPPED
    m, groups = plan.microbatches, plan.device_stages
    compute, forward, backward, params, buffers = [], [], [], [], []
    for stage in plan.stages:
        f, b = stage_passes(profile, cluster, stage, syncs=comm)
        compute.append(f + b)
        forward.append(f)
        backward.append(b)
        layers = profile.stage_slice(stage.start, stage.stop)
        params.append(float(profile.parameter_bytes[layers].sum()))
        buffers.append(profile.gradient_buffers_of(layers))
    # one all-reduce per device stage, of all its chunks' gradients
    allreduce = [float(prices.allreduce(plan.stages[g].devices)(sum(params[g::groups])))
                 + gradient_buffer_seconds(cluster, len(plan.stages[g].devices), sum(buffers[g::groups]))
                 if comm else 0.0
                 for g in range(groups)]
    transfers = []
    for a, b in zip(plan.stages[:-1], plan.stages[1:]):
        nbytes = float(profile.activation_bytes[a.stop - 1])
        transfers.append(float(prices.transfer(a.devices, b.devices)(nbytes)) if comm else 0.0)
    update = [stage_update_seconds(profile, cluster, plan, g) for g in range(groups)]
    if plan.repeats == 1 and plan.schedule in CLOSED_FORM_SCHEDULES:
        # the closed form over t_s = c_s + a_s / M, or + a_s on a cluster whose executors sync
        # every microbatch (compute is the profile's, as the DP's tables), + the stage's
        # optimizer update / M (once per step, amortized as the joint planner does)
        stage_times = [c + allreduce_share(cluster, ar, m) + u / m for c, ar, u in zip(compute, allreduce, update)]
        latency, bottleneck = pipeline_latency(stage_times, transfers, m)
    else:
        latency, bottleneck = schedule_latency(forward, backward, transfers, allreduce, m, plan.schedule,
                                               plan.repeats, sync_each_microbatch=syncs_each_microbatch(cluster))
        latency += max(update, default=0.0)  # the updates run after the last passes (at most the largest)
    counts = peak_counts(plan)
    memory = device_memory_bytes(profile, plan, options.param_memory_factor)
    return PlanCost(
        latency=latency,
        bottleneck=bottleneck,
        stage_compute=tuple(compute),
        stage_allreduce=tuple(allreduce),
        cut_transfer=tuple(transfers),
        stage_memory=memory,
        in_flight=counts,
        violations=memory_violations(cluster, plan, memory),
    )


def _flow_shop_finish(times: list[float], jobs: int) -> list[float]:
    """When the last of `jobs` identical jobs leaves each machine of a serial line (FIFO,
    unbounded buffers): sum of times so far + (jobs - 1) * the slowest machine so far."""
    out, total, slowest = [], 0.0, 0.0
    for t in times:
        total += t
        slowest = max(slowest, t)
        out.append(total + (jobs - 1) * slowest)
    return out


def gpipe_latency(
    profile: PipelineProfile,
    cluster: Cluster,
    plan: PipelinePlan,
    options: CostOptions = CostOptions(),
) -> float:
    """Closed-form L of a GPipe schedule, equal to what `simulate` computes for it.

    Forward: machines f_0, u_0, f_1, ..., f_{S-1} (stages and the forward direction of links)
    process M identical microbatches, so the last forward ends at
    T_F = sum + (M - 1) * max. Backward: b_{S-1}, u_{S-2}, b_{S-2}, ..., b_0 from T_F on, and
    stage s starts its all-reduce when its last backward ends, then its optimizer update (p_s,
    `stage_update_seconds`). L = max_s (end_s + a_s + p_s).
    """
    check_plan(profile, cluster, plan)
    comm = options.comm is CommModel.OVERLAPPED
    m, n_stages = plan.microbatches, plan.n_stages
    forward, backward, allreduce = [], [], []
    for stage in plan.stages:
        f, b = stage_passes(profile, cluster, stage, syncs=comm)
        forward.append(f)
        backward.append(b)
        layers = profile.stage_slice(stage.start, stage.stop)
        params = float(profile.parameter_bytes[layers].sum())
        allreduce.append(allreduce_time(cluster, stage.devices, params, profile.gradient_buffers_of(layers))
                         if comm else 0.0)
    if syncs_each_microbatch(cluster):  # every microbatch's backward ends with its all-reduce
        backward = [b + a for b, a in zip(backward, allreduce)]
        allreduce = [0.0] * n_stages
    cuts = [
        transfer_time(cluster, a.devices, b.devices, float(profile.activation_bytes[a.stop - 1]))
        if comm
        else 0.0
        for a, b in zip(plan.stages[:-1], plan.stages[1:])
    ]
    line = [forward[0]]
    for s in range(1, n_stages):
        line += [cuts[s - 1], forward[s]]
    forward_end = _flow_shop_finish(line, m)[-1]
    line = [backward[-1]]
    for s in range(n_stages - 2, -1, -1):
        line += [cuts[s], backward[s]]
    finish = _flow_shop_finish(line, m)
    # Machine 2k of the backward line is stage S - 1 - k; then its all-reduce and optimizer update.
    return max(
        forward_end + finish[2 * (n_stages - 1 - s)] + allreduce[s] + stage_update_seconds(profile, cluster, plan, s)
        for s in range(n_stages)
    )


#: Row-sized memory passes per backward tick of the spmd executor: the stage's gradient is
#: assembled into its padded parameter row (a concatenation: one row written) and added to the
#: row accumulated over the ticks (two rows read, one written).
ROW_PASSES = 4


def lockstep_remat(microbatches: int, recompute: bool) -> bool:
    """Whether the spmd executor rematerializes its stage calls (`jax.checkpoint`, nothing saved):
    when several microbatches are in flight, where it saves a stage all but its inputs, or when a
    stage asks to recompute; with one microbatch it would recompute the forward for nothing. The
    executor, its price (`lockstep_latency`) and placement's price of it read this one rule."""
    return microbatches > 1 or recompute


def lockstep_latency(profile: PipelineProfile, cluster: Cluster, plan: PipelinePlan, *, remat: bool) -> float:
    """L of a pipeline as the spmd executor runs it (`hlomap.run.pipeline.spmd_executor`): one
    program whose loop moves every device stage in lockstep, one tick per microbatch and stage of
    fill, T = M V + S - 1 ticks forward and T backward, each ending in the `ppermute` that hands
    every stage's output on. Per tick:

    - every device stage computes, the fill and drain ticks too (on garbage the loss masks out):
      its pass of one chunk, in a backward tick the forward again when the executor
      rematerializes stage calls (`remat`), and `ROW_PASSES` passes over its parameter row,
      padded to the longest stage's: the per-tick gradient of the rows;
    - a tick lasts as long as the slowest device's work, or, on devices sharing hardware (host
      CPU devices, `busy_speedup`), as long as all devices' work takes the shared hardware when
      that is longer: the devices that finish early lend the others their cores;
    - then its collectives, as long as the slowest stage's: in a backward tick the gradient
      all-reduce over the stage's replicas (XLA's partitioner puts it where each tick's gradient
      is made: one all-reduce combining every gradient array of the stage, each priced,
      `links.allreduce_time`), in every tick the send to the next stage.

    Then each device stage updates its parameters (`stage_update_seconds`), all in parallel."""
    check_plan(profile, cluster, plan)
    groups = plan.device_stages
    ticks = plan.microbatches * plan.repeats + groups - 1
    row = max(device_stage_parameter_bytes(profile, plan, g) for g in range(groups))
    forward = [0.0] * groups  # per device stage: the costliest chunk's work in one tick
    backward = [0.0] * groups
    forward_comm = backward_comm = 0.0
    for k, stage in enumerate(plan.stages):
        g = k % groups
        f, b = stage_passes(profile, cluster, stage)
        slowdown = compute_slowdown(cluster, stage.devices)
        rows = ROW_PASSES * row / cluster.devices[stage.devices[0]].hbm_bandwidth * slowdown
        forward[g] = max(forward[g], f)
        backward[g] = max(backward[g], b + (f if remat else 0.0) + rows)
        send = 0.0
        if k + 1 < len(plan.stages):
            send = transfer_time(cluster, stage.devices, plan.stages[k + 1].devices,
                                 float(profile.activation_bytes[stage.stop - 1]))
        layers = profile.stage_slice(stage.start, stage.stop)
        params = float(profile.parameter_bytes[layers].sum())
        forward_comm = max(forward_comm, send)
        backward_comm = max(backward_comm,
                            allreduce_time(cluster, stage.devices, params, profile.gradient_buffers_of(layers)) + send)
    widths = [len(plan.stages[g].devices) for g in range(groups)]
    shared = busy_speedup(cluster, 1)

    def tick(work: list[float]) -> float:
        spread = sum(w * n for w, n in zip(work, widths)) / sum(widths)  # the mean device's work
        return max(max(work) / shared, spread) if shared > 1.0 else max(work)

    update = max(stage_update_seconds(profile, cluster, plan, g) for g in range(groups))
    return ticks * (tick(forward) + forward_comm + tick(backward) + backward_comm) + update
