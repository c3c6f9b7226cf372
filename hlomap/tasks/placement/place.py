"""Plans in, placed plans out: the library side of `hlomap place` and of `hlomap simulate` on a
placed pipeline plan.

    problem = problem_from_plan(plan, cluster)        # SPMD: from the plan's saved estimate
    placed, result = place_plan(plan, cluster, "greedy", Budget(60.0))
    result.plan.devices, result.plan.step_seconds     # a `task.PlacedOrder`

The search is any `PLACEMENT_DRIVERS` driver of `hlomap.search` on a `PlacementTask`.

An SPMD plan is placed from its estimate: the collectives it records (kind, mesh axes, bytes,
count) are re-priced on the target cluster for each candidate device order (`MeshLayout`), its
compute time is the estimate's (placement does not change it). A pipeline plan is placed from the
block profile its pipeline section carries (`tasks.pipeline.block_profile`), merged per stage, with
each stage's replicas as its logical positions (`StageLayout`). A joint plan is placed from its
step's module (`hlomap.tasks.joint.layout`): each stage's mesh positions, its collectives re-priced
on the devices it is given and its cut on the devices of both sides (`JointLayout`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

from hlomap.cost.cluster import Cluster
from hlomap.cost.estimate import CollectiveEstimate, StepEstimate, communication_terms
from hlomap.cost.pipeline.costs import lockstep_latency, lockstep_remat, paced_profile
from hlomap.cost.pipeline.profile import PipelineProfile
from hlomap.cost.pipeline.simulator import SimulationResult
from hlomap.hlo.capture import Capture
from hlomap.plan import PipelineKind, Placement, Plan, Recompute
from hlomap.search.drivers import run_driver
from hlomap.search.tracker import Budget, Driver, Progress, SearchResult
from hlomap.tasks.pipeline.block_profile import PlanProfile, ProfileError
from hlomap.tasks.placement.pipeline_costs import PipelineModel
from hlomap.tasks.placement.ppo import PlacementPolicy, load_placement_policy
from hlomap.tasks.placement.problem import (JointLayout, Layout, MeshLayout, PlacementError, PlacementProblem,
                                            StageLayout)
from hlomap.tasks.placement.task import PlacedOrder, PlacementTask

__all__ = ["PLACEMENT_DRIVERS", "PipelineEstimate", "estimate_pipeline_plan", "place_plan", "plan_profile_of", "refuse_chunks",
           "problem_from_plan", "search_placement", "with_placement"]

#: The drivers that search placements (DQN needs an episode per decision vector that placement's
#: permutations of thousands of devices do not have).
PLACEMENT_DRIVERS = (Driver.GREEDY, Driver.PPO, Driver.EXACT, Driver.RANDOM, Driver.IDENTITY)


def _mesh_layout(plan: Plan, estimate: StepEstimate | Mapping[str, Any] | None, where: str) -> MeshLayout:
    if estimate is None:
        raise PlacementError(f"{where}: the plan has no estimate section to take its collectives from; give its "
                             "SOURCE (hlomap place --source) to estimate it")
    if isinstance(estimate, StepEstimate):
        overlap, compute, collectives = estimate.overlap.value, estimate.compute_seconds, list(estimate.collectives)
    else:
        overlap, compute = estimate.get("overlap", "none"), float(estimate.get("compute_seconds", 0.0))
        collectives = [CollectiveEstimate.from_json(c, where=f"{where}: estimate.collectives[{i}]")
                       for i, c in enumerate(estimate.get("collectives", ()))]
    if overlap != "none":
        raise PlacementError(f"{where}: the estimate assumes overlap {overlap!r}; placement prices the step "
                             "without overlap (re-estimate with the default)")
    return MeshLayout(tuple(plan.mesh), communication_terms(collectives), compute)


def plan_profile_of(plan: Plan, where: str = "plan") -> PlanProfile:
    """The block profile a pipeline plan's section carries (`tasks.pipeline.block_profile`)."""
    pipeline = plan.pipeline
    if pipeline is None:
        raise PlacementError(f"{where}: the plan has no pipeline section")
    if pipeline.kind is PipelineKind.JOINT:
        raise PlacementError(f"{where}: a joint plan (hlomap explore --task auto) has no block profile: it is priced "
                             "from its step's module (give its SOURCE)")
    if pipeline.block_profile is None:
        raise PlacementError(f"{where}: the pipeline section has no block_profile (plans explored before placement "
                             "existed lack it); explore the pipeline again")
    try:
        profile = PlanProfile.from_json(pipeline.block_profile, where=f"{where}: pipeline.block_profile")
    except ProfileError as err:
        raise PlacementError(str(err)) from None
    chunks = pipeline.n_stages * pipeline.repeats
    if len(profile.stage_bounds) - 1 != chunks:
        raise PlacementError(f"{where}: pipeline.block_profile has {len(profile.stage_bounds) - 1} stages, the "
                             f"pipeline section {pipeline.n_stages}" + (f" x {pipeline.repeats} chunks"
                                                                        if pipeline.repeats > 1 else ""))
    return profile


def refuse_chunks(plan: Plan, what: str, where: str = "plan") -> None:
    """PlacementError when `plan` runs several model chunks per stage: `what` (re-planning)
    prices one chunk per stage so far; pricing (`hlomap simulate`) and placing the plan take it."""
    if plan.pipeline is not None and plan.pipeline.repeats > 1:
        raise PlacementError(f"{where}: the pipeline runs {plan.pipeline.repeats} model chunks per stage (repeats); "
                             f"{what} takes one chunk per stage so far (hlomap simulate prices this plan)")


def _stage_layout(plan: Plan, where: str) -> StageLayout:
    assert plan.pipeline is not None
    replication = tuple(len(devices) for devices in plan.logical_stage_devices())
    return StageLayout(plan_profile_of(plan, where).stage_profile(), replication, plan.pipeline.microbatches,
                       plan.pipeline.schedule, plan.pipeline.repeats)


def _joint_layout(plan: Plan, cluster: Cluster, cap: Capture | None, where: str) -> JointLayout:
    from hlomap.tasks.joint.layout import joint_layout, staged_model

    if cap is None:
        raise PlacementError(f"{where}: a joint plan is priced from its step's module: give its SOURCE "
                             "(hlomap place --source)")
    assert plan.pipeline is not None
    try:
        return joint_layout(*staged_model(cap, cluster, plan.pipeline))
    except ValueError as err:
        raise PlacementError(f"{where}: {err}") from None


def problem_from_plan(plan: Plan, cluster: Cluster, *, estimate: StepEstimate | None = None,
                      cap: Capture | None = None, where: str = "plan") -> PlacementProblem:
    """The placement problem of `plan` on `cluster`; `estimate` (an SPMD plan's StepEstimate on
    its identity order) replaces the plan's saved one; a joint plan is priced from `cap`, its
    step."""
    layout: Layout
    if plan.pipeline is not None and plan.pipeline.kind is PipelineKind.JOINT:
        layout = _joint_layout(plan, cluster, cap, where)
    elif plan.pipeline is not None:
        layout = _stage_layout(plan, where)
    else:
        if plan.n_positions < 2:
            raise PlacementError(f"{where}: a plan on one device has nothing to place (mesh {plan.mesh_shape})")
        layout = _mesh_layout(plan, estimate if estimate is not None else plan.estimate, where)
    identity = plan.logical_devices()
    if len(identity) > cluster.n_devices:
        raise PlacementError(f"{where}: the plan has {len(identity)} logical positions but cluster {cluster.name!r} "
                             f"has only {cluster.n_devices} device{'s' if cluster.n_devices != 1 else ''}")
    if max(identity, default=0) >= cluster.n_devices:
        raise PlacementError(f"{where}: the plan uses device {max(identity)} but cluster {cluster.name!r} has "
                             f"{cluster.n_devices} devices")
    return PlacementProblem(cluster, layout, identity=identity, name=f"{where} on {cluster.name}")


def search_placement(problem: PlacementProblem, driver: Driver | str = Driver.GREEDY,
                     budget: Budget = Budget(60.0, None), seed: int = 0, *,
                     policy: PlacementPolicy | str | Path | None = None, finetune_seconds: float = 0.0,
                     on_progress: Callable[[Progress], None] | None = None) -> SearchResult:
    """Search a placement of `problem` with one of `PLACEMENT_DRIVERS`; its `plan` is a
    `PlacedOrder`. ppo: `policy` (a loaded one, a file, default the shipped one) and the seconds
    to fine-tune it on this problem."""
    names = [d.value for d in PLACEMENT_DRIVERS]
    if str(driver) not in names:
        raise PlacementError(f"placement driver {str(driver)!r} is not one of {', '.join(names)}")
    driver = Driver(driver)
    agent = None
    if driver is Driver.PPO:
        loaded = policy if isinstance(policy, PlacementPolicy) else load_placement_policy(policy)
        agent = loaded.agent(seed)
    return run_driver(PlacementTask(problem), driver, budget, seed, ppo_agent=agent,
                      finetune_seconds=finetune_seconds, on_progress=on_progress)


def with_placement(plan: Plan, problem: PlacementProblem, result: SearchResult) -> Plan:
    """`plan` with `result` (a placement search's) as its placement section."""
    placed: PlacedOrder = result.plan
    placement = Placement(placed.devices, problem.cluster.name, result.driver.value, placed.step_seconds,
                          placed.identity_seconds)
    return dataclasses.replace(plan, placement=placement)


def place_plan(plan: Plan, cluster: Cluster, driver: Driver | str = Driver.GREEDY,
               budget: Budget = Budget(60.0, None), seed: int = 0, *, estimate: StepEstimate | None = None,
               cap: Capture | None = None, where: str = "plan", **options: Any) -> tuple[Plan, SearchResult]:
    """Place `plan` on `cluster` (a joint plan needs `cap`, its step); returns the placed plan and
    the search's result (`options`: those of `search_placement`)."""
    problem = problem_from_plan(plan, cluster, estimate=estimate, cap=cap, where=where)
    result = search_placement(problem, driver, budget, seed, **options)
    return with_placement(plan, problem, result), result


class PipelineEstimate(NamedTuple):
    """A pipeline plan on a cluster, with its stages on the placed devices and on the identity
    order: the event simulator's batch time and the closed form's."""

    placed: SimulationResult
    identity: SimulationResult
    placed_model_seconds: float
    identity_model_seconds: float


def _priced_layout(plan: Plan, cluster: Cluster, where: str) -> tuple[StageLayout, PipelineProfile]:
    """The plan's stage layout on `cluster`, and its profile at the pace of the devices it keeps busy."""
    problem = problem_from_plan(plan, cluster, where=where)
    layout = problem.layout
    assert isinstance(layout, StageLayout)
    # the profile's times are the cluster's all-busy rate; a plan on fewer devices computes faster
    return layout, paced_profile(layout.profile, cluster, len(set(plan.device_order())))


def lockstep_pipeline_seconds(plan: Plan, cluster: Cluster, *, where: str = "plan") -> float:
    """A pipeline plan's step as the spmd executor runs it, on its placement (`costs.lockstep_latency`):
    it rematerializes stage calls when several microbatches are in flight or a stage asks for it."""
    layout, profile = _priced_layout(plan, cluster, where)
    section = plan.pipeline
    assert section is not None
    remat = lockstep_remat(section.microbatches, any(s.recompute is not Recompute.NONE for s in section.stages))
    return lockstep_latency(profile, cluster, layout.plan(plan.device_order()), remat=remat)


def estimate_pipeline_plan(plan: Plan, cluster: Cluster, *, where: str = "plan") -> PipelineEstimate:
    """Simulate a pipeline plan on `cluster` on its placement (or identity) and on the identity."""
    layout, profile = _priced_layout(plan, cluster, where)
    model = PipelineModel(cluster)
    runs = []
    for devices in (plan.device_order(), plan.logical_devices()):
        if max(devices) >= cluster.n_devices:
            raise PlacementError(f"{where}: the placement uses device {max(devices)} but cluster {cluster.name!r} "
                                 f"has {cluster.n_devices} devices")
        stages = layout.plan(devices)
        runs.append((model.simulate(profile, stages), model.plan_cost(profile, stages).latency))
    (placed, placed_model), (identity, identity_model) = runs
    return PipelineEstimate(placed, identity, placed_model, identity_model)
