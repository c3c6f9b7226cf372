"""The sharding tasks (OPP, ADP, hybrid) end to end: capture -> search space -> driver -> `Plan`
with its estimate and how it was found (`hlomap.api.explore` calls this).

    ex = explore_sharding(cap, "opp", {"model": 8}, "A", "dqn", 60, 0, "paper")

`explore_sharding` returns the `Exploration` (plan, search result, space, graph) that reports
and benchmarks need. With `output=`, the best plan so far is written there (atomically)
every time it improves, so a search stopped with Ctrl-C leaves its best plan on disk; the
search itself also stops cleanly on Ctrl-C and returns that plan.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from os import PathLike
from typing import Any, Callable, Mapping

import numpy as np

from hlomap.hlo.capture import Capture
from hlomap.propagation.conflicts import MeshAxes
from hlomap.propagation.graph import FactorGraph
from hlomap.search import drivers
from hlomap.search.budget import Budget
from hlomap.search.dqn import DqnSearchConfig
from hlomap.search.tracker import Driver, Progress, SearchResult
from hlomap.tasks import Task, sharding_task
from hlomap.tasks.sharding.costmodel import estimate_model
from hlomap.tasks.sharding.objective import CostObjective, PaperObjective, RewardMode, ShardingObjective
from hlomap.tasks.sharding.space import ShardingSpace, make_space, mesh_shape
from hlomap.tasks.sharding.task import ShardingTask

log = logging.getLogger(__name__)

__all__ = ["Exploration", "build_problem", "explore_sharding", "mesh_shape", "search_sharding", "to_plan"]


@dataclasses.dataclass(frozen=True, eq=False)
class Problem:
    """Everything a driver needs, built once: graph, axes, space, objective."""

    cap: Capture
    graph: FactorGraph
    axes: MeshAxes
    space: ShardingSpace
    objective: ShardingObjective
    cluster: Any

    @property
    def task(self) -> ShardingTask:
        return ShardingTask(self.space, self.objective, expert_starts=expert_starts(self.graph, self.axes, self.space))


def expert_starts(graph: FactorGraph, axes: MeshAxes, space: ShardingSpace) -> tuple[np.ndarray, ...]:
    """The choice vectors of the built-in expert plans (dp, Megatron, both) on `axes` that
    `space` holds conflict-free: what the exact search starts from (`ShardingTask.expert_starts`)."""
    from hlomap.plan import PlanError, reference_plan

    starts = []
    for kind in ("megatron", "dp", "dp+megatron"):
        try:
            array, plan_axes = reference_plan(graph, kind, axes.mesh_shape)
        except PlanError:
            continue
        if plan_axes != axes or not space.represents(array):
            continue
        choices = space.choices_of(array)
        if bool(space.ok(choices[None, :])[0]) and not any(np.array_equal(choices, s) for s in starts):
            starts.append(choices)
    return tuple(starts)


def _cluster_for(mesh: Mapping[str, int], cluster: Any) -> Any:
    """`cluster` resolved (`hlomap.cost.cluster.load_cluster`) before any search, whatever the
    reward: the paper reward never prices a step, so a misspelt cluster, or one with fewer
    devices than the mesh, used to surface only as a plan without an estimate."""
    from hlomap.cost.cluster import load_cluster
    from hlomap.cost.mapping import MappingError

    resolved = load_cluster(cluster)
    needed = math.prod(mesh.values())
    if needed > resolved.n_devices:
        raise MappingError(f"mesh {dict(mesh)} needs {needed} devices; cluster {resolved.name!r} has "
                           f"{resolved.n_devices}: explore a mesh of at most {resolved.n_devices} devices")
    return resolved


def build_problem(cap: Capture, *, task: Task | str = Task.OPP, mesh: Mapping[str, int] | int | str = 8,
                  cluster: Any = "A", reward: RewardMode | str = RewardMode.PAPER, graph: FactorGraph | None = None,
                  replicate_residual: bool | None = None, axis_order: Any = None) -> Problem:
    """Graph, mesh axes, search space and objective for one exploration.

    `replicate_residual` (default: True for the paper reward, False for the cost reward) keeps the
    residual stream replicated, see `hlomap.tasks.sharding.space.opp_space`.
    """
    task, reward = sharding_task(task), RewardMode(reward)
    shape = mesh_shape(mesh, task)
    cluster = _cluster_for(shape, cluster)
    graph = graph if graph is not None else FactorGraph.from_capture(cap)
    axes = MeshAxes.from_mesh(shape)
    if replicate_residual is None:
        replicate_residual = reward is RewardMode.PAPER and task is not Task.ADP
    space = make_space(graph, axes, task, replicate_residual=replicate_residual)
    if reward is RewardMode.PAPER:
        objective: ShardingObjective = PaperObjective(space)
    else:
        objective = CostObjective(space, estimate_model(cap, graph, axes, cluster, axis_order=axis_order))
    return Problem(cap, graph, axes, space, objective, cluster)


def search_sharding(problem: Problem, driver: Driver | str, budget: Budget, seed: int = 0, *,
               dqn_config: DqnSearchConfig | None = None,
               on_best: Callable[[SearchResult], None] | None = None,
               on_progress: Callable[[Progress], None] | None = None) -> SearchResult:
    """Search `problem` with `driver` (see `hlomap.search.drivers.run_driver`)."""
    return drivers.run_driver(problem.task, driver, budget, seed, dqn_config=dqn_config, on_best=on_best,
                              on_progress=on_progress)


#: `shard_optimizer_state` and `shard_parameters` modes: never, always (where the plan has data
#: replicas), or only when the plan does not fit in memory otherwise and does with it.
STATE_SHARDING_MODES = ("off", "on", "auto")


def to_plan(problem: Problem, result: SearchResult, *, with_estimate: bool = True,
            shard_optimizer_state: str = "auto", shard_parameters: str = "auto") -> Any:
    """The `Plan` of a search result, carrying how it was found and (with `with_estimate`) the
    cost model's estimate on the problem's cluster. `shard_optimizer_state` (`STATE_SHARDING_MODES`)
    says whether the plan splits its optimizer state over its data axes (ZeRO-1,
    `Plan.with_sharded_state`), `shard_parameters` whether it stores its trainable parameters
    split there too (FSDP / ZeRO-3; "on" splits the state as well). "auto" needs the estimate to
    tell whether the plan fits: each split is taken only where the plan does not fit without it
    and does with it, the state's first, then the parameters' (a plan whose parameters stay whole
    between steps is the one a user's code that reads them expects)."""
    from hlomap.plan import Plan, PlanError

    for name, mode in (("shard_optimizer_state", shard_optimizer_state), ("shard_parameters", shard_parameters)):
        if mode not in STATE_SHARDING_MODES:
            raise ValueError(f"{name} {mode!r}: expected one of {STATE_SHARDING_MODES}")
    plan = Plan.from_groups(problem.cap, problem.graph, result.plan, problem.axes)
    search = {"task": problem.space.task.value, **result.search_json()}
    estimate = _estimate_json(problem, result, plan) if with_estimate and problem.cluster is not None else None
    # (parameters too, forced): the splits to try, in order; the parameters' split implies the state's
    steps: list[tuple[bool, bool]] = []
    if shard_parameters == "on":
        steps.append((True, True))
    elif shard_optimizer_state != "off":
        steps.append((False, shard_optimizer_state == "on"))
        if shard_parameters == "auto":
            steps.append((True, False))
    whole = plan
    for parameters, forced in steps:
        if not forced and (estimate is None or estimate["memory"]["fits"]):
            break
        what = "parameters" if parameters else "optimizer state"
        try:
            sharded = whole.with_sharded_state(problem.graph, parameters=parameters)
        except PlanError as exc:
            log.log(logging.WARNING if forced else logging.INFO, "the %s stays whole: %s", what, exc)
            break
        sharded_estimate = (_estimate_json(problem, result, sharded)
                            if with_estimate and problem.cluster is not None else None)
        if forced or (sharded_estimate is not None and sharded_estimate["memory"]["fits"]):
            plan, estimate = sharded, sharded_estimate
    return dataclasses.replace(plan, search=search, estimate=estimate)


def _estimate_json(problem: Problem, result: SearchResult, plan: Any) -> dict[str, Any] | None:
    try:
        from hlomap.tasks.sharding.costmodel import step_estimate

        return step_estimate(problem.cap, problem.graph, result.plan, problem.axes, problem.cluster,
                             sharded_state=plan.sharded_state()).to_json()
    except Exception as exc:  # an estimate is a report, not a reason to lose the plan
        log.warning("could not estimate the explored plan: %s", exc)
        return None


@dataclasses.dataclass(frozen=True, eq=False)
class Exploration:
    """A finished exploration: the plan and everything about how it was found."""

    plan: Any  # hlomap.plan.Plan
    result: SearchResult
    problem: Problem

    @property
    def space(self) -> ShardingSpace:
        return self.problem.space


def explore_sharding(cap: Capture, task: Task | str = "opp", mesh: Mapping[str, int] | int | str = 8,
                     cluster: Any = "A", agent: Driver | str = "dqn", budget_seconds: float | None = 60.0,
                     seed: int = 0, reward: RewardMode | str = "paper", *,
                     budget_evaluations: int | None = None, output: str | PathLike[str] | None = None,
                     graph: FactorGraph | None = None, replicate_residual: bool | None = None,
                     dqn_config: DqnSearchConfig | None = None, with_estimate: bool = True,
                     on_progress: Callable[[Progress], None] | None = None,
                     shard_optimizer_state: str = "auto", shard_parameters: str = "auto") -> Exploration:
    """Search a sharding plan; the whole `Exploration`. `shard_optimizer_state` and
    `shard_parameters`: "off", "on" or "auto" (`to_plan`)."""
    problem = build_problem(cap, task=task, mesh=mesh, cluster=cluster, reward=reward, graph=graph,
                            replicate_residual=replicate_residual)
    budget = Budget(seconds=budget_seconds, evaluations=budget_evaluations)

    def on_best(partial: SearchResult) -> None:
        if output is not None:
            to_plan(problem, partial, with_estimate=False).save(output)

    result = search_sharding(problem, agent, budget, seed, dqn_config=dqn_config, on_best=on_best,
                        on_progress=on_progress)
    plan = to_plan(problem, result, with_estimate=with_estimate, shard_optimizer_state=shard_optimizer_state,
                   shard_parameters=shard_parameters)
    if output is not None:
        plan.save(output)
    log.info("explored %s (%s, %s reward) with %s: score %.4g after %d evaluations in %.1f s%s",
             cap.source, problem.space.task, result.reward, result.driver, result.score.value, result.evaluations,
             result.seconds, " (interrupted)" if result.interrupted else "")
    return Exploration(plan, result, problem)

