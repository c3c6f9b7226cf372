"""Joint plans (pipeline stages, each a device group with its own mesh and sharding plan) and
their closed-form cost: what the joint planner's searches minimize.

For stages s = 0..S-1 of layers [i_s, j_s) on devices [d_s, d_s + n_s) with option o_s, and
M microbatches (`costs.StageArrays` are per step, on one device of the stage):
  t_s = (compute + collective bandwidth + gradient all-reduce + update) / M + collective latency
        (+ the stage's forward compute / M again when it recomputes, its non-matmul forward
        compute when it recomputes selectively; a stage that splits its
        optimizer state over its data replicas updates 1 / data of it and all-gathers its
        updated parameters once per step; one whose parameters stay split there too (FSDP)
        updates 1 / data, all-gathers its weights in each pass of each microbatch and
        reduce-scatters its gradients every microbatch instead of all-reducing them; one that
        splits its gradients (ZeRO-2) updates 1 / data, all-gathers its updated parameters once
        per step and reduce-scatters its gradients every microbatch)
  u_s = moving the cut's activations (all data shards) from stage s to s + 1, per microbatch
  L   = sum_s t_s + 2 sum_s u_s + (M - 1) max(t_s, u_s)
by the one pipeline closed form, `hlomap.cost.pipeline.costs.pipeline_latency` (Alpa's; fill
and drain, then M - 1 periods of the slowest stage or link), with the stages priced by the
sharded step; plus, on a measured cluster, the executor's own cost (`executor_overhead`), which
is what makes many microbatches or stages dear on a host-bound machine. Memory per device: 4 x
the stage's parameters (weights, gradients, Adam's moments) + the microbatches in flight
(1F1B: min(S - s, M); GPipe: M) x the stage's stash per microbatch (with the optimizer state
split, the moments count 1 / data; with the gradients split too, gradients and moments count
1 / data; with the parameters split too, weights, gradients and moments count 1 / data, plus one
whole copy of the weights that a pass gathers); a stage that recomputes
(`StageOption.recompute`, `hlomap.plan.Recompute.FULL`) is checkpointed as a whole or group by
group (`JointModel.checkpoint_groups`: the layers of one transformer block), whichever holds less
at its count of microbatches in flight (both run the forward once more): whole, it holds its
input per microbatch in flight instead of its stash, plus one microbatch's stash while it
recomputes it; group by group (Megatron-LM's full recomputation), every group's input per
microbatch in flight, plus the largest stash of one group of one microbatch. One that recomputes
selectively (`Recompute.SELECTIVE`, JAX's `dots_saveable`) holds its forward's matmul outputs per
microbatch besides, runs the rest of its forward again, and holds the rest of one microbatch's
(or one group's) stash while it does. A stage checkpointed group by group lists the cuts between
its groups in the plan file (`"recompute_cuts"`), where the runner checkpoints it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from hlomap.cost.estimate import dispatch_seconds
from hlomap.cost.pipeline.costs import executor_overhead, mean_stage_devices, stage_time_latency, syncs_each_microbatch
from hlomap.cost.pipeline.stages import PipelinePlan, Schedule, Stage, default_executor, in_flight
from hlomap.plan.sections import Recompute
from hlomap.tasks.joint.costs import PARAM_MEMORY_FACTOR, JointModel, PlanKind, StageArrays, StageOption

__all__ = ["JointCost", "JointPlan", "JointStage", "checkpoints_groups", "evaluate", "forward_share", "stage_seconds"]

@dataclass(frozen=True)
class JointStage(Stage):
    """A pipeline stage (layers, devices, a data x model mesh) with the sharding plan it runs
    on its mesh; built from the search's (layers, first device, option) by `of`."""

    kind: PlanKind = PlanKind.EXPERT
    recompute: Recompute = Recompute.NONE
    split_state: bool = False
    shard_parameters: bool = False
    shard_gradients: bool = False

    @classmethod
    def of(cls, start: int, stop: int, first_device: int, option: StageOption) -> JointStage:
        """Layers [start, stop) on devices [first_device, first_device + option.devices)."""
        return cls(int(start), int(stop), tuple(range(first_device, first_device + option.devices)), option.model,
                   option.kind, option.recompute, option.split_state, option.shard_parameters, option.shard_gradients)

    @property
    def first_device(self) -> int:
        return self.devices[0]

    @property
    def option(self) -> StageOption:
        return StageOption(len(self.devices), self.replication, self.model, self.kind, self.recompute,
                           self.split_state, self.shard_parameters, self.shard_gradients)


@dataclass(frozen=True)
class JointPlan(PipelinePlan):
    """A pipeline plan of joint stages (`PipelinePlan`'s checks: contiguous layers from 0,
    disjoint devices)."""

    stages: tuple[JointStage, ...]

    def describe(self, names: Sequence[str] | None = None) -> str:
        lines = []
        for s, st in enumerate(self.stages):
            label = f" {names[st.start]}..{names[st.stop - 1]}" if names else ""
            lines.append(f"stage {s}: layers [{st.start}, {st.stop}){label} on devices "
                         f"{st.first_device}-{st.first_device + st.option.devices - 1}: {st.option}")
        return "\n".join(lines) + f"\n{self.microbatches} microbatches, {self.schedule.value}"


@dataclass(frozen=True)
class JointCost:
    latency: float  # the pipeline's L plus the executor's own cost
    bottleneck: float
    stage_seconds: tuple[float, ...]
    transfer_seconds: tuple[float, ...]
    stage_memory: tuple[float, ...]
    device_memory: tuple[float, ...]
    executor_seconds: float = 0.0

    @property
    def fits(self) -> bool:
        return all(need <= have for need, have in zip(self.stage_memory, self.device_memory))


def stage_seconds(a: StageArrays, i: Any, j: Any, microbatches: int, *, sync_each_microbatch: bool = False) -> Any:
    """Per-microbatch time of layers [i, j) under the option of `a` (scalars or arrays); the
    gradient all-reduce counts once per step, or in full every microbatch with
    `sync_each_microbatch` (`syncs_each_microbatch`); a stage whose parameters stay split (FSDP)
    gathers and reduce-scatters every microbatch."""
    grads = a.grads[j] - a.grads[i]
    extra_buffers = np.maximum(a.buffers[j] - a.buffers[i] - 1, 0)
    if a.shard_parameters:
        params = a.params[j] - a.params[i]
        own = (a.compute[j] - a.compute[i]) + (a.beta[j] - a.beta[i]) + (a.update[j] - a.update[i]) / a.data
        gathers = np.where(params > 0, 2.0 * (a.gather_alpha + a.gather_beta * params), 0.0)  # forward, backward
        scatter = np.where(grads > 0, a.scatter_alpha + a.scatter_beta * grads + a.sync_per_buffer * extra_buffers, 0.0)
        return (own + _recomputed_seconds(a, i, j)) / microbatches + gathers + scatter + (a.alpha[j] - a.alpha[i])
    if a.shard_gradients:  # ZeRO-2: ZeRO-1's update and gather, each microbatch's gradients reduce-scattered
        params = a.params[j] - a.params[i]
        own = (a.compute[j] - a.compute[i]) + (a.beta[j] - a.beta[i]) + (a.update[j] - a.update[i]) / a.data
        gather = np.where(params > 0, a.gather_alpha + a.gather_beta * params + a.sync_per_buffer * extra_buffers, 0.0)
        scatter = np.where(grads > 0, a.scatter_alpha + a.scatter_beta * grads + a.sync_per_buffer * extra_buffers, 0.0)
        return (own + gather + _recomputed_seconds(a, i, j)) / microbatches + scatter + (a.alpha[j] - a.alpha[i])
    sync = np.where(grads > 0, a.sync_alpha + a.sync_beta * grads + a.sync_per_buffer * extra_buffers, 0.0)
    per_step = (a.compute[j] - a.compute[i]) + (a.beta[j] - a.beta[i]) + (a.update[j] - a.update[i])
    if a.split_state:  # each replica updates its slice, then the updated parameters are all-gathered
        params = a.params[j] - a.params[i]
        per_step = per_step - (a.update[j] - a.update[i]) * (1.0 - 1.0 / a.data) + np.where(
            params > 0, a.gather_alpha + a.gather_beta * params + a.sync_per_buffer * extra_buffers, 0.0)
    per_step = per_step + _recomputed_seconds(a, i, j)
    if sync_each_microbatch:
        return per_step / microbatches + sync + (a.alpha[j] - a.alpha[i])
    return (per_step + sync) / microbatches + (a.alpha[j] - a.alpha[i])


def stage_memory(a: StageArrays, i: Any, j: Any, held: int, microbatches: int) -> Any:
    """Bytes per device of layers [i, j) with `held` microbatches in flight: parameters, gradients
    and Adam's moments (split over the data replicas when the stage splits its optimizer state;
    the gradients too when it splits them; all of them, plus the weights a pass gathers whole,
    when it splits its parameters),
    and each held microbatch's stash; a recomputing stage holds what `_recomputed_bytes` says
    of checkpointing it whole or group by group, whichever is less (`checkpoints_groups`)."""
    moments = PARAM_MEMORY_FACTOR - 2.0  # Adam's two moments; the weights and gradients stay whole
    factor = PARAM_MEMORY_FACTOR - moments * (1.0 - 1.0 / a.data) if a.split_state else PARAM_MEMORY_FACTOR
    if a.shard_gradients:  # the weights whole; gradients and moments split
        factor = 1.0 + (PARAM_MEMORY_FACTOR - 1.0) / a.data
    if a.shard_parameters:  # everything split, and the weights a pass gathers whole
        factor = PARAM_MEMORY_FACTOR / a.data + 1.0
    params = factor * (a.params[j] - a.params[i])
    if a.recompute is Recompute.NONE:
        return params + held * (a.stash[j] - a.stash[i]) / microbatches
    whole, grouped = _recomputed_bytes(a, i, j, held)
    return params + np.minimum(whole, grouped) / microbatches


def _recomputed_bytes(a: StageArrays, i: Any, j: Any, held: Any) -> tuple[Any, Any]:
    """The activation bytes (per step, as `stash`) a recomputing stage of layers [i, j) holds at
    its peak with `held` microbatches in flight: checkpointed whole (its input per microbatch,
    selectively with its matmuls' outputs, plus one microbatch's stash but those outputs while
    the backward runs the forward again) and checkpointed group by group (every group's input,
    selectively with the matmuls' outputs, plus the most one group holds while it runs again)."""
    stash = a.stash[j] - a.stash[i]
    saved = a.saved[j] - a.saved[i] if a.recompute is Recompute.SELECTIVE else 0.0
    whole = held * (a.inputs[i] + saved) + (np.maximum(stash - saved, 0.0) if a.recompute is Recompute.SELECTIVE
                                            else stash)
    return whole, held * (a.group_inputs[i, j] + saved) + a.group_peak[i, j]


def checkpoints_groups(a: StageArrays, i: int, j: int, held: int) -> bool:
    """Whether a stage of layers [i, j) recomputing as `a` says, `held` microbatches in flight,
    holds less checkpointed group by group (`JointModel.checkpoint_groups`) than checkpointed
    whole (both run the same forward again, so only memory tells them apart)."""
    if a.recompute is Recompute.NONE:
        return False
    whole, grouped = _recomputed_bytes(a, i, j, held)
    return bool(grouped < whole)


def _recomputed_seconds(a: StageArrays, i: Any, j: Any) -> Any:
    """Forward seconds of layers [i, j) that the option's backward runs again: all of the
    forward (FULL), all but its matmuls (SELECTIVE), none."""
    if a.recompute is Recompute.FULL:
        return a.forward[j] - a.forward[i]
    if a.recompute is Recompute.SELECTIVE:
        return a.redo[j] - a.redo[i]
    return 0.0


def evaluate(model: JointModel, plan: JointPlan, *, timeline: bool = False) -> JointCost:
    """The cost of `plan` (module docstring): the closed form under GPipe and 1F1B, the event
    timeline (`cost.pipeline.timeline`) under other schedules or with `timeline`, each stage's
    time split into its forward and backward by their compute (under ZB-H1 the backward into
    input and weight passes by `INPUT_GRADIENT_SHARE`)."""
    cluster = model.cluster
    m, n = plan.microbatches, plan.n_stages
    times, transfers, memory, capacity, shares = [], [], [], [], []
    for s, stage in enumerate(plan.stages):
        a = model.arrays(stage.option)
        times.append(float(stage_seconds(a, stage.start, stage.stop, m,
                                         sync_each_microbatch=syncs_each_microbatch(cluster))))
        shares.append(forward_share(a, stage.start, stage.stop))
        held = in_flight(plan.schedule, s, n, m)
        memory.append(float(stage_memory(a, stage.start, stage.stop, held, m)))
        capacity.append(model.group_capacity(stage.first_device, len(stage.devices)))
        if s + 1 < n:
            nbytes = float(a.crossing[stage.stop - 1]) * stage.option.data / m
            transfers.append(model.transfer_seconds(stage.option, stage.first_device,
                                                    plan.stages[s + 1].first_device, nbytes))
    latency, bottleneck = stage_time_latency(times, shares, transfers, plan.schedule, m, timeline=timeline)
    overhead = joint_overhead(cluster, plan, model.pass_buffers, model.state_leaves)
    return JointCost(latency + overhead, bottleneck, tuple(times), tuple(transfers), tuple(memory), tuple(capacity),
                     overhead)


def forward_share(a: StageArrays, i: int, j: int) -> float:
    """The forward pass's share of layers [i, j)'s compute under the option of `a` (a
    recomputation counts as backward work)."""
    forward = float(a.forward[j] - a.forward[i])
    compute = float(a.compute[j] - a.compute[i] + _recomputed_seconds(a, i, j))  # the recomputation is backward's
    if compute <= 0:
        return 1.0 / 3.0  # the rule of thumb: a backward is two forwards
    return forward / compute


def choose_schedule(model: JointModel, plan: JointPlan,
                    schedules: Sequence[Schedule] = (Schedule.ONE_F_ONE_B, Schedule.ZERO_BUBBLE, Schedule.GPIPE),
                    ) -> JointPlan:
    """`plan`'s stages under the fastest of `schedules` that fits memory, every schedule priced by
    the event timeline (the closed form is exact for GPipe and 1F1B only, so it cannot compare
    them with ZB-H1); `plan` itself when none fits."""
    import dataclasses

    priced = []
    for schedule in schedules:
        variant = dataclasses.replace(plan, schedule=schedule)
        cost = evaluate(model, variant, timeline=True)
        if cost.fits:
            priced.append((cost.latency, variant))
    return min(priced, key=lambda pair: pair[0])[1] if priced else plan


def runs_as_spmd(plan: JointPlan) -> bool:
    """A plan of one stage, one microbatch, on the cluster's first devices is an ordinary SPMD
    plan (`joint.explore.joint_plan` writes it as one): one program, no pipeline executor; unless
    it recomputes, which the pipeline executors run (an SPMD plan keeps every activation)."""
    return (plan.n_stages == 1 and plan.microbatches == 1 and plan.stages[0].first_device == 0
            and plan.stages[0].recompute is Recompute.NONE)


def joint_overhead(cluster: Any, plan: JointPlan, buffers: float = 0.0, state_leaves: float = 0.0) -> float:
    """What running `plan` costs beyond its stages on a measured cluster: one dispatch for a plan
    that runs as SPMD, else its pipeline executor's cost, the `buffers` its passes move per
    microbatch and the `state_leaves` it hands back per step included (`JointModel.pass_buffers`,
    `JointModel.state_leaves`)."""
    if runs_as_spmd(plan):
        return dispatch_seconds(cluster)
    return executor_overhead(cluster, joint_executor(plan), plan.n_stages, plan.microbatches, plan.schedule,
                             buffers, mean_stage_devices(plan.stages), state_leaves)


def joint_executor(plan: JointPlan) -> str:
    """The executor the runner picks for a joint plan (`hlomap.run.runner.choose_executor`):
    stages alike (one mesh option) or not; a stage that splits its optimizer state or recomputes
    runs on mpmd."""
    if any(stage.split_state or stage.recompute is not Recompute.NONE for stage in plan.stages):
        return "mpmd"
    uniform = len({stage.option for stage in plan.stages}) == 1
    return default_executor(plan.schedule, uniform)
