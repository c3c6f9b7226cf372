"""`hlomap.explore(...)`: capture -> search space -> driver -> `Plan` with its estimate and how it
was found.

    plan = hlomap.explore(cap, task="opp", mesh={"model": 8}, cluster="A", agent="dqn",
                          budget_seconds=60, seed=0, reward="paper")

`explore_detailed` returns the `Exploration` (plan, search result, space, graph, optimum...) that
reports and benchmarks need. With `output=`, the best plan so far is written there (atomically)
every time it improves, so a search stopped with Ctrl-C leaves its best plan on disk; the
search itself also stops cleanly on Ctrl-C and returns that plan.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from os import PathLike
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from hlomap.explore.baselines import greedy_search, random_search
from hlomap.explore.costmodel import estimate_model
from hlomap.explore.dqn_search import DqnSearchConfig, dqn_search
from hlomap.explore.exact import exact_search
from hlomap.explore.objective import CostObjective, Objective, PaperObjective, RewardMode
from hlomap.explore.search import Budget, Driver, Progress, SearchResult
from hlomap.explore.space import SearchSpace, Task, make_space
from hlomap.hlo.capture import Capture
from hlomap.propagation.conflicts import MeshAxes
from hlomap.propagation.graph import FactorGraph

log = logging.getLogger(__name__)

__all__ = ["Exploration", "build_problem", "explore", "explore_detailed", "parse_mesh", "run_driver", "to_plan"]


def parse_mesh(mesh: Mapping[str, int] | int | str, task: Task | str = Task.OPP) -> dict[str, int]:
    """`{"model": 8}`, `8` or `"8"` (one axis, named `model`, or `data` for ADP) or
    `"data=2,model=4"`. Hybrid needs two axes.

    Text goes through `hlomap.cost.estimate.parse_mesh` (the CLI's `--mesh` for `simulate`), so
    `explore` and `simulate` accept and reject the same strings; this adds the task's axis names.
    """
    from hlomap.cost.estimate import parse_mesh as parse_mesh_text  # the cost model is imported lazily

    task = Task(task)
    if isinstance(mesh, str):
        mesh = parse_mesh_text(mesh)
    if isinstance(mesh, int):
        if task is Task.HYBRID:
            raise ValueError(f"the hybrid task needs a data x model mesh such as data=2,model=8, not {mesh}")
        mesh = {"data" if task is Task.ADP else "model": mesh}
    shape = {str(k): int(v) for k, v in dict(mesh).items()}
    if not shape or any(v < 1 for v in shape.values()):
        raise ValueError(f"mesh {shape} needs at least one axis of size >= 1")
    if task is Task.HYBRID and len(shape) < 2:
        raise ValueError(f"the hybrid task needs two mesh axes (data x model), got {shape}")
    return shape


@dataclasses.dataclass(frozen=True, eq=False)
class Problem:
    """Everything a driver needs, built once: graph, axes, space, objective."""

    cap: Capture
    graph: FactorGraph
    axes: MeshAxes
    space: SearchSpace
    objective: Objective
    cluster: Any


def build_problem(cap: Capture, *, task: Task | str = Task.OPP, mesh: Mapping[str, int] | int | str = 8,
                  cluster: Any = "A", reward: RewardMode | str = RewardMode.PAPER, graph: FactorGraph | None = None,
                  replicate_residual: bool | None = None, axis_order: Any = None) -> Problem:
    """Graph, mesh axes, search space and objective for one exploration.

    `replicate_residual` (default: True for the paper reward, False for the cost reward) keeps the
    residual stream replicated, see `hlomap.explore.space.opp_space`.
    """
    task, reward = Task(task), RewardMode(reward)
    graph = graph if graph is not None else FactorGraph.from_capture(cap)
    axes = MeshAxes.from_mesh(parse_mesh(mesh, task))
    if replicate_residual is None:
        replicate_residual = reward is RewardMode.PAPER and task is not Task.ADP
    space = make_space(graph, axes, task, replicate_residual=replicate_residual)
    if reward is RewardMode.PAPER:
        objective: Objective = PaperObjective(space)
    else:
        objective = CostObjective(space, estimate_model(cap, graph, axes, cluster, axis_order=axis_order))
    return Problem(cap, graph, axes, space, objective, cluster)


def run_driver(problem: Problem, driver: Driver | str, budget: Budget, seed: int = 0, *,
               dqn_config: DqnSearchConfig | None = None,
               on_best: Callable[[SearchResult], None] | None = None,
               on_progress: Callable[[Progress], None] | None = None) -> SearchResult:
    driver = Driver(driver)
    kw = dict(on_best=on_best, on_progress=on_progress)
    if driver is Driver.DQN:
        return dqn_search(problem.space, problem.objective, budget, seed, config=dqn_config or DqnSearchConfig(), **kw)
    if driver is Driver.RANDOM:
        mask = (dqn_config or DqnSearchConfig()).mask
        return random_search(problem.space, problem.objective, budget, seed, mask=mask, **kw)
    if driver is Driver.GREEDY:
        return greedy_search(problem.space, problem.objective, budget, seed, **kw)
    return exact_search(problem.space, problem.objective, budget, seed, **kw)


def to_plan(problem: Problem, result: SearchResult, *, with_estimate: bool = True) -> Any:
    """The `Plan` of a search result, carrying how it was found and (with `with_estimate`) the
    cost model's estimate on the problem's cluster."""
    from hlomap.plan import Plan

    plan = Plan.from_groups(problem.cap, problem.graph, result.plan, problem.axes)
    search = {"task": problem.space.task.value, **result.search_json()}
    estimate = None
    if with_estimate and problem.cluster is not None:
        try:
            from hlomap.explore.costmodel import step_estimate

            estimate = step_estimate(problem.cap, problem.graph, result.plan, problem.axes, problem.cluster).to_json()
        except Exception as exc:  # an estimate is a report, not a reason to lose the plan
            log.warning("could not estimate the explored plan: %s", exc)
    return dataclasses.replace(plan, search=search, estimate=estimate)


def _save_atomic(plan: Any, path: str | PathLike[str]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        plan.save(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclasses.dataclass(frozen=True, eq=False)
class Exploration:
    """A finished exploration: the plan and everything about how it was found."""

    plan: Any  # hlomap.plan.Plan
    result: SearchResult
    problem: Problem

    @property
    def space(self) -> SearchSpace:
        return self.problem.space


def explore_detailed(cap: Capture, task: Task | str = "opp", mesh: Mapping[str, int] | int | str = 8,
                     cluster: Any = "A", agent: Driver | str = "dqn", budget_seconds: float | None = 60.0,
                     seed: int = 0, reward: RewardMode | str = "paper", *,
                     budget_evaluations: int | None = None, output: str | PathLike[str] | None = None,
                     graph: FactorGraph | None = None, replicate_residual: bool | None = None,
                     dqn_config: DqnSearchConfig | None = None, with_estimate: bool = True,
                     on_progress: Callable[[Progress], None] | None = None) -> Exploration:
    """`explore` returning the whole `Exploration`."""
    problem = build_problem(cap, task=task, mesh=mesh, cluster=cluster, reward=reward, graph=graph,
                            replicate_residual=replicate_residual)
    budget = Budget(seconds=budget_seconds, evaluations=budget_evaluations)

    def on_best(partial: SearchResult) -> None:
        if output is not None:
            _save_atomic(to_plan(problem, partial, with_estimate=False), output)

    result = run_driver(problem, agent, budget, seed, dqn_config=dqn_config, on_best=on_best,
                        on_progress=on_progress)
    plan = to_plan(problem, result, with_estimate=with_estimate)
    if output is not None:
        _save_atomic(plan, output)
    log.info("explored %s (%s, %s reward) with %s: score %.4g after %d evaluations in %.1f s%s",
             cap.source, problem.space.task, result.reward, result.driver, result.score.value, result.evaluations,
             result.seconds, " (interrupted)" if result.interrupted else "")
    return Exploration(plan, result, problem)


def explore(cap: Capture, task: Task | str = "opp", mesh: Mapping[str, int] | int | str = 8, cluster: Any = "A",
            agent: Driver | str = "dqn", budget_seconds: float | None = 60.0, seed: int = 0,
            reward: RewardMode | str = "paper", **options: Any) -> Any:
    """Search a plan for `cap` and return it as a `hlomap.plan.Plan`.

    task: "opp" (tensor parallelism of the trainable variables), "adp" (data inputs), "hybrid"
    (both, on a data x model mesh). mesh: `{"model": 8}`, `8` or `"data=2,model=8"`. cluster: a
    preset name ("A", "B", "C"), a JSON path or a Cluster (used by the cost reward and for the
    plan's estimate). agent: "dqn", "random", "greedy" or "exact". reward: "paper" or "cost".
    Options: budget_evaluations, output (path saved as the search runs), graph,
    replicate_residual, dqn_config, with_estimate, on_progress.

    task "pipeline" decides stage cuts instead (`hlomap.pipeline.explore.explore_pipeline`):
    agent "dqn", "dqn-infer" or "dp"; mesh and reward do not apply. Options: stages (default:
    one stage per server of the cluster), microbatches, schedule, episodes, finetune_episodes,
    compare_dp, png_path; `output` saves the plan. The plan's parameters stay replicated and its
    `pipeline` section holds the cuts, stage devices and replication.
    """
    if str(task) == "pipeline":
        return _explore_pipeline_plan(cap, cluster, str(agent), budget_seconds, seed, **options)
    return explore_detailed(cap, task, mesh, cluster, agent, budget_seconds, seed, reward, **options).plan


def _explore_pipeline_plan(cap: Capture, cluster: Any, agent: str, budget_seconds: float | None, seed: int,
                           *, stages: int | None = None, output: str | PathLike[str] | None = None,
                           **options: Any) -> Any:
    """`explore(task="pipeline")`: the pipeline explorer's result as a `Plan`."""
    from hlomap.explore.pipeline import pipeline_plan
    from hlomap.pipeline.explore import PipelineAgent, cluster_links, explore_pipeline

    agents = [a.value for a in PipelineAgent]
    if agent not in agents:
        raise ValueError(f"agent {agent!r}: the pipeline task takes {', '.join(agents)}")
    if stages is None:
        links, _ = cluster_links(cluster)
        stages = len(set(links.node_of))
    result = explore_pipeline(cap, stages=stages, cluster=cluster, agent=agent, seed=seed,
                              budget_seconds=budget_seconds, **options)
    plan = pipeline_plan(cap, result, seed=seed)
    if output is not None:
        plan.save(output)
    return plan


def choices_from_plan(problem: Problem, plan: Any) -> np.ndarray:
    """The choice vector of a saved plan in this problem's space."""
    return problem.space.choices_of(plan.group_array(problem.graph, problem.axes))
