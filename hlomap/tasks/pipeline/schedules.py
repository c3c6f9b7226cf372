"""The pipeline task's choice of schedule and V for a stage plan (`schedule="auto"`).

The cut search optimizes the closed form, which is the same for GPipe and 1F1B and does not
decompose for interleaved 1F1B or ZB-H1 (`hlomap.cost.pipeline.costs.schedule_latency`). So the
schedule is chosen after the cuts: the found stages are priced under every schedule the runner
runs (`SCHEDULE_CHOICES`), plus interleaved 1F1B with V = 2 model chunks per device stage when
the stages are alike (the layers cut again into S V pieces of equal compute, chunk k on device
stage k mod S), and the fastest that fits memory wins. Each price is the step as the executor
that runs the schedule runs it (`executor_step_seconds`): the event simulator's L
(`hlomap.cost.pipeline.simulator.simulate`: one model for every schedule; the closed form the cut
search uses is exact only for equal stages) on the mpmd executor, the lockstep ticks
(`costs.lockstep_latency`) for GPipe over alike stages on the spmd executor, plus the executor's
own cost on a measured cluster (`executor_overhead`; ZB-H1 launches a third program, the weight
pass, per stage and microbatch), so on hosts where dispatch dominates the chooser keeps fewer
programs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hlomap.cost.cluster import Cluster
from hlomap.cost.pipeline.costs import CostOptions, executor_overhead, lockstep_latency, lockstep_remat, mean_stage_devices
from hlomap.cost.pipeline.profile import PipelineProfile
from hlomap.cost.pipeline.simulator import SimulationResult, simulate
from hlomap.cost.pipeline.stages import PipelinePlan, Schedule, Stage, default_executor, schedule_problem

__all__ = ["AUTO_SCHEDULE", "INTERLEAVED_CHUNKS", "SCHEDULE_CHOICES", "ScheduleOption",
           "choose_schedule", "executor_step_seconds", "interleaved_variant", "schedule_options"]

#: The value of `schedule` that asks the explorer to choose.
AUTO_SCHEDULE = "auto"
#: Schedules tried on the same stages, in order of preference when their prices tie.
SCHEDULE_CHOICES = (Schedule.ONE_F_ONE_B, Schedule.ZERO_BUBBLE, Schedule.GPIPE)
#: Model chunks per device stage tried for interleaved 1F1B.
INTERLEAVED_CHUNKS = (2,)


@dataclass(frozen=True)
class ScheduleOption:
    """One schedule priced on the found stages: the plan, its simulation, the executor that runs
    it and one step as that executor runs it (`executor_step_seconds`), what the chooser compares."""

    plan: PipelinePlan
    simulation: SimulationResult
    executor: str
    seconds: float

    @property
    def label(self) -> str:
        return self.plan.schedule.value + (f" V={self.plan.repeats}" if self.plan.repeats > 1 else "")


def interleaved_variant(profile: PipelineProfile, plan: PipelinePlan, repeats: int) -> PipelinePlan | None:
    """`plan`'s device stages running interleaved 1F1B with `repeats` chunks each: the layers cut
    into S V contiguous pieces of as equal compute as the layer boundaries allow, piece k on the
    devices of stage k mod S. None when the stages differ in devices per stage (pieces of equal
    compute would not take equal time), the microbatches are no multiple of S, or there are
    fewer layers than pieces."""
    groups = plan.stages[:plan.device_stages]
    pieces = len(groups) * repeats
    if (plan.repeats != 1 or len(groups) < 2 or len({(len(s.devices), s.model) for s in groups}) != 1
            or profile.n_layers < pieces
            or schedule_problem(Schedule.INTERLEAVED, len(groups), plan.microbatches, repeats) is not None):
        return None
    bounds = _balanced_bounds(profile.compute_time, pieces)
    if bounds is None:
        return None
    stages = tuple(Stage(bounds[k], bounds[k + 1], groups[k % len(groups)].devices, groups[k % len(groups)].model)
                   for k in range(pieces))
    return PipelinePlan(stages, plan.microbatches, Schedule.INTERLEAVED, repeats)


def _balanced_bounds(times: np.ndarray, pieces: int) -> list[int] | None:
    """Layer bounds [0, ..., n] of `pieces` non-empty contiguous pieces, each ending at the layer
    boundary nearest its equal share of the total time."""
    n = len(times)
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(times, dtype=float))])
    bounds = [0]
    for k in range(1, pieces):
        target = prefix[-1] * k / pieces
        cut = int(np.clip(np.argmin(np.abs(prefix - target)), bounds[-1] + 1, n - (pieces - k)))
        bounds.append(cut)
    bounds.append(n)
    return bounds if all(a < b for a, b in zip(bounds, bounds[1:])) else None


def _with_schedule(plan: PipelinePlan, schedule: Schedule) -> PipelinePlan | None:
    if schedule_problem(schedule, plan.device_stages, plan.microbatches, plan.repeats) is not None:
        return None
    return PipelinePlan(plan.stages, plan.microbatches, schedule, plan.repeats)


def executor_step_seconds(profile: PipelineProfile, cluster: Cluster, plan: PipelinePlan,
                          simulation: SimulationResult) -> tuple[str, float]:
    """(the executor `hlomap run` runs `plan` on by default, one step as it runs it): the spmd
    executor's lockstep ticks (`costs.lockstep_latency`, stage calls rematerialized when several
    microbatches are in flight, as the runner does) or the mpmd executor's schedule (the event
    simulator's `simulation` of `plan`), plus the executor's own cost on a measured cluster
    (`costs.executor_overhead`, ZB-H1's third program included). `hlomap simulate` prices a
    saved plan the same way."""
    groups = plan.stages[:plan.device_stages]
    uniform = len({(len(s.devices), s.model) for s in groups}) == 1
    executor = default_executor(plan.schedule, uniform, plan.repeats)
    if executor == "spmd":
        # a pipeline-task plan never asks a stage to recompute
        length = lockstep_latency(profile, cluster, plan, remat=lockstep_remat(plan.microbatches, False))
    else:
        length = simulation.length
    return executor, float(length) + executor_overhead(cluster, executor, plan.n_stages, plan.microbatches,
                                                       plan.schedule, profile.pass_buffers,
                                                       mean_stage_devices(groups), profile.state_leaves)


def schedule_options(profile: PipelineProfile, cluster: Cluster, plan: PipelinePlan,
                     options: CostOptions = CostOptions(),
                     schedules: Sequence[Schedule] = SCHEDULE_CHOICES,
                     chunks: Sequence[int] = INTERLEAVED_CHUNKS) -> list[ScheduleOption]:
    """`plan`'s stages priced under each of `schedules` and as interleaved 1F1B with each V in
    `chunks` (where `interleaved_variant` can build it), in that order."""
    variants = [_with_schedule(plan, s) for s in schedules]
    variants += [interleaved_variant(profile, plan, v) for v in chunks]
    out = []
    for variant in variants:
        if variant is not None:
            simulation = simulate(profile, cluster, variant, options)
            out.append(ScheduleOption(variant, simulation, *executor_step_seconds(profile, cluster, variant, simulation)))
    return out


def choose_schedule(profile: PipelineProfile, cluster: Cluster, plan: PipelinePlan,
                    options: CostOptions = CostOptions(), *,
                    chunks: Sequence[int] = INTERLEAVED_CHUNKS) -> ScheduleOption:
    """The fastest of `schedule_options` that fits memory (the first listed on a tie); when none
    fits, the one that needs the least memory beyond the devices', so the caller reports it."""
    found = schedule_options(profile, cluster, plan, options, chunks=chunks)
    fitting = [o for o in found if o.simulation.feasible]
    if fitting:
        return min(fitting, key=lambda o: o.seconds)
    return min(found, key=lambda o: max(v.need_bytes - v.have_bytes for v in o.simulation.violations))
