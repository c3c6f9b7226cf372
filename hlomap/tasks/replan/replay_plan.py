"""A saved pipeline plan against a trace: the library side of `hlomap replan`.

    report = replan_plan(plan, load_trace("trace.json"))
    report.runs[ReplanPolicy.ARBITER].decisions                 # what the arbiter did at each change

The plan's pipeline section gives the workload (its block profile, microbatches, schedule) and the
running plan (its stages' blocks on their devices, the placement's if it has one). A re-solve may
use the plan's own stage replications and 1, 2, 4, 8, as many stages as the plan has, and leave
devices idle. A joint plan (`hlomap explore --task auto`, stages with their own data x model
meshes) is re-planned in the joint planner's space from its step's module (`cap`;
`tasks.replan.joint`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hlomap.hlo.capture import Capture
from hlomap.plan import Plan
from hlomap.plan.sections import PipelineKind
from hlomap.tasks.pipeline.explore import runnable_replication
from hlomap.tasks.placement.place import plan_profile_of, refuse_chunks
from hlomap.tasks.placement.problem import PlacementError
from hlomap.tasks.replan.options import RunningPlan, Workload
from hlomap.tasks.replan.policies import PlanReplay, PolicyRun, ReplanPolicy, Replay, run_policy
from hlomap.tasks.replan.trace import Trace

__all__ = ["ReplanReport", "is_joint", "replan_plan", "workload_of"]

#: Replication factors a re-solve may give a stage, besides the plan's own.
REPLICATION = (1, 2, 4, 8)


def is_joint(plan: Plan) -> bool:
    """Whether `plan` is a joint plan (re-planned from its step's module): one with pipeline stages
    of their own meshes, or the one-stage SPMD plan `--task auto` writes."""
    if plan.pipeline is not None:
        return plan.pipeline.kind is PipelineKind.JOINT
    return (plan.search or {}).get("task") == "auto"


def workload_of(plan: Plan, where: str = "plan", batch: int | None = None) -> tuple[Workload, RunningPlan]:
    """The workload and running plan of a saved pipeline plan. With the step's `batch` known, a
    re-solve replicates a stage only over devices a microbatch splits over (`runnable_replication`: what
    the runner can run), besides the plan's own stage widths; without it, over any of
    `REPLICATION`."""
    if plan.pipeline is None:
        raise PlacementError(f"{where}: re-planning needs a pipeline plan (hlomap explore --task pipeline) or a plan "
                             "of hlomap explore --task auto")
    refuse_chunks(plan, "re-planning", where)
    profile = plan_profile_of(plan, where)
    stages = plan.stage_devices()
    widths = {len(s) for s in stages}
    offered = runnable_replication(REPLICATION, batch, plan.pipeline.microbatches)
    replication = tuple(sorted(set(offered) | widths))
    workload = Workload(profile.blocks, plan.pipeline.microbatches, plan.pipeline.schedule, replication, len(stages))
    return workload, RunningPlan(profile.stage_bounds, stages)


@dataclass(frozen=True)
class ReplanReport:
    runs: dict[ReplanPolicy, PolicyRun]
    agreement: float | None  # the meta policy's agreement with the exact arbiter


def replan_plan(plan: Plan, trace: Trace, policies: Sequence[ReplanPolicy] = tuple(ReplanPolicy), *,
                network: object | None = None, where: str = "plan", cap: Capture | None = None) -> ReplanReport:
    """Play every policy of `policies` over `trace` from `plan`; META needs `network` (a loaded
    gain network, `meta.load_network()`) and is skipped without one. A joint plan needs `cap`,
    its step."""
    replay: PlanReplay
    if is_joint(plan):
        from hlomap.tasks.replan.joint import JointReplay

        if cap is None:
            raise PlacementError(f"{where}: a joint plan is re-planned from its step's module: give its SOURCE "
                                 "(hlomap replan --source)")
        replay = JointReplay.of_plan(cap, plan, trace, where=where)
        running: object = replay.initial
    else:
        workload, running = workload_of(plan, where, None if cap is None else cap.batch_size)
        used = max(d for stage in running.devices for d in stage)
        if used >= trace.cluster.n_devices:
            raise PlacementError(f"{where}: the plan uses device {used} but trace {trace.name!r} has a cluster of "
                                 f"{trace.cluster.n_devices} devices ({trace.cluster.name})")
        replay = Replay(trace, workload)
    runs: dict[ReplanPolicy, PolicyRun] = {}
    agreement = None
    for policy in policies:
        if policy is ReplanPolicy.META:
            if network is None:
                continue
            from hlomap.tasks.replan.meta import MetaPolicy

            chooser = MetaPolicy(trace.horizon, network)  # type: ignore[arg-type]
            runs[policy] = run_policy(replay, running, policy, chooser=chooser)  # type: ignore[arg-type]
            agreement = chooser.agreement
        else:
            runs[policy] = run_policy(replay, running, policy)  # type: ignore[arg-type]
    return ReplanReport(runs, agreement)
