"""A saved pipeline plan against a trace: the library side of `hlomap replan`.

    report = replan_plan(plan, load_trace("trace.json"))
    report.runs[ReplanPolicy.ARBITER].decisions                 # what the arbiter did at each change

The plan's pipeline section gives the workload (its block profile, microbatches, schedule) and the
running plan (its stages' blocks on their devices, the placement's if it has one). A re-solve may
use the plan's own stage replications and 1, 2, 4, 8, as many stages as the plan has, and leave
devices idle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hlomap.plan import Plan
from hlomap.tasks.placement.place import plan_profile_of, refuse_chunks
from hlomap.tasks.placement.problem import PlacementError
from hlomap.tasks.replan.options import RunningPlan, Workload
from hlomap.tasks.replan.policies import PolicyRun, ReplanPolicy, Replay, run_policy
from hlomap.tasks.replan.trace import Trace

__all__ = ["ReplanReport", "replan_plan", "workload_of"]

#: Replication factors a re-solve may give a stage, besides the plan's own.
REPLICATION = (1, 2, 4, 8)


def workload_of(plan: Plan, where: str = "plan") -> tuple[Workload, RunningPlan]:
    """The workload and running plan of a saved pipeline plan."""
    if plan.pipeline is None:
        raise PlacementError(f"{where}: re-planning needs a pipeline plan (hlomap explore --task pipeline)")
    refuse_chunks(plan, "re-planning", where)
    profile = plan_profile_of(plan, where)
    stages = plan.stage_devices()
    replication = tuple(sorted(set(REPLICATION) | {len(s) for s in stages}))
    workload = Workload(profile.blocks, plan.pipeline.microbatches, plan.pipeline.schedule, replication, len(stages))
    return workload, RunningPlan(profile.stage_bounds, stages)


@dataclass(frozen=True)
class ReplanReport:
    runs: dict[ReplanPolicy, PolicyRun]
    agreement: float | None  # the meta policy's agreement with the exact arbiter


def replan_plan(plan: Plan, trace: Trace, policies: Sequence[ReplanPolicy] = tuple(ReplanPolicy), *,
                network: object | None = None, where: str = "plan") -> ReplanReport:
    """Play every policy of `policies` over `trace` from `plan`; META needs `network` (a loaded
    gain network, `meta.load_network()`) and is skipped without one."""
    workload, running = workload_of(plan, where)
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
            runs[policy] = run_policy(replay, running, policy, chooser=chooser)
            agreement = chooser.agreement
        else:
            runs[policy] = run_policy(replay, running, policy)
    return ReplanReport(runs, agreement)
