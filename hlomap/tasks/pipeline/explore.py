"""`explore_pipeline`: the library side of `hlomap explore SOURCE --task pipeline`.

One call goes from a captured train step (or a profile) to a pipeline plan and its report:
profile the step (`chain`), scale it to a microbatch, build the cut problem on the
cluster's center device groups (`cutenv`), search it with the chosen agent, then price the plan
in closed form and with the event simulator (memory per stage, timeline).

Agents:
  dqn        online DQN training on this model (section 3.4), best plan found
  dqn-infer  the shipped inference network (section 3.5), optionally fine-tuned
  dp         the exact DP (`dp.solve`) over the same space: the optimum. On a captured step whose
             layer graph branches (ResNet's shortcuts, T5's encoder and decoder), asked to, it also runs the
             downset DP (`step_dag.solve_step_downsets`, at most `downset_states` cut states,
             else the downsets within a lookahead, logged) and keeps its plan when that is
             cheaper; such a plan's cuts list the chain instructions before them
             (`CutDescription.downset`), which the runner follows.

Units. A Capture or StepChain describes the step's whole batch; with M microbatches every
microbatch is 1/M of it (`profile.scale_batch`). A bare PipelineProfile is already per
microbatch (PipeDream's profiles are per minibatch).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from hlomap.cost.pipeline.costs import PlanCost, evaluate_plan, paced_profile
from hlomap.plan import Pipeline
from hlomap.tasks.pipeline.cutenv import CutTask, center_device_bounds
from hlomap.tasks.pipeline.dp import solve
from hlomap.search.budget import Budget
from hlomap.search.drivers import run_driver
from hlomap.search.tracker import Driver, Progress, SearchResult
from hlomap.tasks.pipeline.solution import NoFeasiblePlan
from hlomap.tasks.pipeline.schedules import AUTO_SCHEDULE, INTERLEAVED_CHUNKS, choose_schedule, executor_step_seconds
from hlomap.tasks.pipeline.task import CutSearchTask
from hlomap.cost.pipeline.chain import StepChain, PivotOptions, step_chain
from hlomap.cost.cluster import Cluster, load_cluster
from hlomap.cost.pipeline.links import group_memory, is_node_boundary
from hlomap.cost.pipeline.profile import PipelineProfile, scale_batch
from hlomap.cost.pipeline.simulator import SimulationResult, simulate
from hlomap.tasks.pipeline.space import TIE_RTOL, PipelineObjective, PipelineSpace
from hlomap.tasks.pipeline.step_dag import chain_runs, solve_step_downsets, step_dag
from hlomap.cost.pipeline.stages import DEFAULT_SCHEDULE, PipelinePlan, Schedule, splits_batch

__all__ = [
    "CutDescription",
    "PipelineAgent",
    "PipelineResult",
    "explore_pipeline",
    "explore_pipeline_plan",
    "pipeline_plan",
    "pipeline_task",
]

if TYPE_CHECKING:
    from hlomap.hlo.capture import Capture
    from hlomap.plan import Plan

log = logging.getLogger(__name__)


class PipelineAgent(enum.Enum):
    """How the cuts are found: the DQN driver trained online on this model (section 3.4), the
    shipped inference network, optionally fine-tuned (section 3.5), or the exact DP."""

    DQN = "dqn"
    INFER = "dqn-infer"
    DP = "dp"


@dataclass(frozen=True)
class CutDescription:
    """One layer cut: the profile pivot, the HLO instruction before it, its layer name from
    metadata, the nearest layer scope (`chain.Pivot.scope`: the op's own, or `after X`
    for an op traced outside any scope), its source line when known, and the bytes crossing.
    downset: for a cut at a downset that is not a prefix of the chain, the runs [first, last]
    of chain instructions before it (`plan.PipelineCut.downset`); empty for a prefix."""

    pivot: int
    instruction: str
    layer: str
    crossing_bytes: float
    scope: str = ""
    source: str | None = None
    downset: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, eq=False)
class PipelineResult:
    """A pipeline plan for one step, how it was found and what it costs.

    latency: L of one global batch from the event simulator; model_latency: the closed form the
    searches minimize; stage_memory: bytes per device of each stage at its simulated peak.
    order: for a plan cut at downsets, the step profile's layers in the plan's order (what
    `profile` and the plan's layer ranges index); None for the chain's own order.
    straight_value: the chain order's optimum when the downset DP ran beside it (else None);
    downset_states: the cut states that DP searched (0: it did not run).
    executor: the executor `hlomap run` runs the plan on (`stages.default_executor`);
    step_seconds: one step as that executor runs it (`executor_step_seconds`), what `hlomap run`
    measures and the plan file's estimate records.
    """

    source: str
    agent: PipelineAgent
    profile: PipelineProfile  # per microbatch
    plan: PipelinePlan
    cost: PlanCost
    simulation: SimulationResult
    cuts: tuple[CutDescription, ...]
    device_cuts: tuple[int, ...]
    replication: tuple[int, ...]
    device_memory: tuple[float, ...]  # capacity of each stage's smallest device
    on_node_boundaries: bool | None  # None on one server, where every cut is within it
    search_seconds: float
    episodes: int
    optimum: float | None  # the DP's L (or bottleneck) when compared, else None
    objective: PipelineObjective
    interrupted: bool = False  # Ctrl-C ended the search; the plan is the best found so far
    order: tuple[int, ...] | None = None
    straight_value: float | None = None
    downset_states: int = 0
    executor: str = "mpmd"
    step_seconds: float = math.nan
    cluster: str = ""  # the name of the cluster it was priced on

    @property
    def latency(self) -> float:
        return self.simulation.length

    @property
    def model_latency(self) -> float:
        return self.cost.latency

    @property
    def value(self) -> float:
        """What the search minimized: closed-form L, or the bottleneck."""
        return self.cost.latency if self.objective is PipelineObjective.LATENCY else self.cost.bottleneck

    @property
    def gap(self) -> float | None:
        """value / optimum - 1 when compared with the DP."""
        return None if self.optimum is None else self.value / self.optimum - 1.0

    @property
    def stage_memory(self) -> tuple[float, ...]:
        return self.simulation.stage_memory

    @property
    def feasible(self) -> bool:
        """Every stage fits its devices' memory (else `simulation.violations` says where not)."""
        return self.simulation.feasible

    def to_json(self) -> dict[str, Any]:
        """Plain data for `--json` output."""
        return {
            "source": self.source,
            "agent": self.agent.value,
            "objective": self.objective.value,
            "microbatches": self.plan.microbatches,
            "schedule": self.plan.schedule.value,
            "stages": [
                {"layers": [s.start, s.stop], "devices": list(s.devices),
                 "replication": s.replication, "memory_bytes": mem, "device_memory_bytes": cap}
                for s, mem, cap in zip(self.plan.stages, self.stage_memory, self.device_memory)
            ],
            "cuts": [{"pivot": c.pivot, "instruction": c.instruction, "layer": c.layer,
                      "scope": c.scope, "source": c.source, "crossing_bytes": c.crossing_bytes}
                     | ({"downset": [list(run) for run in c.downset]} if c.downset else {})
                     for c in self.cuts],
            "device_cuts": list(self.device_cuts),
            "on_node_boundaries": self.on_node_boundaries,
            "latency_seconds": self.latency,
            "model_latency_seconds": self.model_latency,
            "executor": self.executor,
            "executor_step_seconds": self.step_seconds,
            "bottleneck_seconds": self.cost.bottleneck,
            "feasible": self.feasible,
            "memory_violations": [str(v) for v in self.simulation.violations],
            "search_seconds": self.search_seconds,
            "episodes": self.episodes,
            "interrupted": self.interrupted,
            "optimum": self.optimum,
            "order": None if self.order is None else list(self.order),
            "straight_value": self.straight_value,
            "downset_states": self.downset_states,
        }


def runnable_replication(sizes: tuple[int, ...], batch: int | None, microbatches: int) -> tuple[int, ...]:
    """The replication factors of `sizes` a microbatch of `batch` splits over (`splits_batch`);
    all of them when the batch is not known (a bare profile)."""
    if batch is None:
        return sizes
    return tuple(r for r in sizes if splits_batch(batch, microbatches, r))


def pipeline_task(
    profile: PipelineProfile,
    cluster: Cluster,
    *,
    stages: int,
    microbatches: int,
    schedule: Schedule = DEFAULT_SCHEDULE,
    objective: PipelineObjective = PipelineObjective.LATENCY,
    device_radius: int = 0,
    require_trainable: bool = True,
    check_memory: bool = True,
    batch: int | None = None,
) -> CutTask:
    """The cut problem of `stages` stages on the center device groups of `cluster`; the DP gets
    the same space (replication factors of the center groups, every device used, stage
    boundaries on servers when there are at least as many servers as stages).

    With the step's `batch` known, a stage only replicates over devices a microbatch splits
    over, as the runner requires. When a center group is too large for that, the space is
    every replication factor up to the largest group that splits a microbatch, on a prefix of
    the devices (the rest stay idle), and the center groups are equal groups of the widest
    factor that fits (`CutTask.center`)."""
    bounds = center_device_bounds(cluster, stages)
    sizes = tuple(sorted({b - a for a, b in zip(bounds[:-1], bounds[1:])}))
    if device_radius > 0:
        sizes = tuple(range(1, cluster.n_devices + 1))
    replication = runnable_replication(sizes, batch, microbatches)
    every_device = replication == sizes
    if not every_device:
        replication = runnable_replication(tuple(range(1, max(sizes) + 1)), batch, microbatches)
    if not replication:
        raise NoFeasiblePlan(f"{profile.source}: the batch of {batch} examples does not split into {microbatches} "
                             "equal microbatches; choose microbatches that divide it")
    space = PipelineSpace(
        microbatches=microbatches,
        schedule=schedule,
        objective=objective,
        replication=replication,
        use_all_devices=every_device,
        max_stages=stages,
        cut_on_node_boundary=every_device and stages <= cluster.n_nodes,
        require_trainable=require_trainable,
        check_memory=check_memory,
    )
    return CutTask(profile, cluster, space, stages, device_radius=device_radius)


def _describe(hlo: StepChain | None, profile: PipelineProfile, plan: PipelinePlan,
              order: tuple[int, ...] | None = None) -> tuple[CutDescription, ...]:
    out = []
    for pivot in plan.cuts:
        if hlo is not None and order is not None:
            out.append(_describe_downset(hlo, profile, plan, order, pivot))
        elif hlo is not None:
            p = hlo.pivots[pivot]
            out.append(CutDescription(pivot, p.instruction, p.layer, p.crossing_bytes,
                                      p.scope, p.source))
        else:
            name = profile.names[pivot]
            out.append(CutDescription(pivot, name, name, float(profile.activation_bytes[pivot]),
                                      name))
    return tuple(out)


def _describe_downset(hlo: StepChain, profile: PipelineProfile, plan: PipelinePlan, order: tuple[int, ...],
                      pivot: int) -> CutDescription:
    """The cut after position `pivot` of a downset plan's layer order: after the last chain
    instruction of the layer there, with the runs of chain instructions before it."""
    layer = order[pivot]
    if layer >= len(hlo.pivots):
        raise ValueError(f"{hlo.source}: a downset plan puts the last layer (the loss) before a cut")
    p = hlo.pivots[layer]
    runs = chain_runs(hlo, order[:pivot + 1])
    prefix = runs == ((hlo.chain.profile.names[0], p.instruction),)
    # `pivot` names the chain's pivot (as in a plan of the chain's order), not the plan's position.
    return CutDescription(layer, p.instruction, p.layer, float(profile.activation_bytes[pivot]) * plan.microbatches,
                          p.scope, p.source, () if prefix else runs)


def _plan_value(profile: PipelineProfile, cluster: Cluster, plan: PipelinePlan, space: PipelineSpace) -> float:
    cost = evaluate_plan(profile, cluster, plan, space.cost)
    return cost.latency if space.objective is PipelineObjective.LATENCY else cost.bottleneck


def explore_pipeline(
    source: Any,
    *,
    stages: int,
    microbatches: int = 8,
    schedule: Schedule | str = DEFAULT_SCHEDULE,
    cluster: str | Path | Cluster = "A",
    agent: PipelineAgent | str = PipelineAgent.DQN,
    seed: int = 0,
    budget_seconds: float | None = None,
    episodes: int = 2000,
    finetune_episodes: int = 0,
    device_radius: int = 0,
    objective: PipelineObjective | str = PipelineObjective.LATENCY,
    require_trainable: bool = True,
    pivot_options: PivotOptions = PivotOptions(),
    policy_path: str | Path | None = None,
    compare_dp: bool = False,
    downset_states: int = 0,
    name: str | None = None,
    on_best: Callable[[PipelineResult], None] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> PipelineResult:
    """Find a pipeline plan of `stages` stages for `source` (module docstring).

    source: a `hlomap.hlo.capture.Capture`, an `StepChain`, or a per-microbatch
      `PipelineProfile`.
    cluster: a preset ("A", "B", "C"), a cluster JSON path, or a `hlomap.cost.Cluster`; its
      devices' spec profiles an HLO source, its topology prices the communication.
    budget_seconds: wall-clock limit of the DQN (training or fine-tuning); episodes: its episode
      limit; finetune_episodes: for dqn-infer, 0 for inference alone.
    compare_dp: also run the DP and report the gap to its optimum.
    downset_states: for agent "dp" on a captured step whose layer graph branches, the most cut
      states of the downset DP (module docstring; `step_dag.EXPLORER_MAX_STATES` searches the
      zoo's steps in seconds); 0 (default) cuts the chain's order only.
    name: how to call the source in reports (default: its profile's source).
    on_best: called with the result of every better plan the search finds (to save it as the
    search runs);
    on_progress: the driver's progress reports. Ctrl-C ends a search with its best plan so far
    (`PipelineResult.interrupted`).
    """
    agent = PipelineAgent(agent)
    choose = schedule == AUTO_SCHEDULE
    # the cuts are searched under 1F1B, then every schedule is priced on them (`schedules`)
    schedule = DEFAULT_SCHEDULE if choose else Schedule(schedule)
    objective = PipelineObjective(objective)
    if stages < 1 or microbatches < 1:
        raise ValueError(f"explore_pipeline: stages = {stages} and microbatches = "
                         f"{microbatches} must be >= 1")
    if downset_states < 0:
        raise ValueError(f"explore_pipeline: downset_states = {downset_states} must be >= 0 (0: no downset DP)")
    cluster = load_cluster(cluster)
    device = cluster.devices[0]
    hlo: StepChain | None
    batch = None
    if isinstance(source, StepChain):
        hlo, profile = source, scale_batch(source.profile, 1.0 / microbatches)
    elif isinstance(source, PipelineProfile):
        hlo, profile = None, source
    elif hasattr(source, "module") and hasattr(source, "parameters"):
        hlo = step_chain(source, device, options=pivot_options)
        profile = scale_batch(hlo.profile, 1.0 / microbatches)
        batch = source.batch_size
    else:
        raise TypeError(f"explore_pipeline: cannot read a pipeline profile from {type(source)!r}")
    task = pipeline_task(
        profile, cluster, stages=stages, microbatches=microbatches, schedule=schedule,
        objective=objective, device_radius=device_radius, require_trainable=require_trainable, batch=batch,
    ) if stages > 1 else None
    start = time.perf_counter()
    single = runnable_replication(tuple(range(1, cluster.n_devices + 1)), batch, microbatches)
    space = task.space if task is not None else PipelineSpace(
        microbatches=microbatches, schedule=schedule, objective=objective,
        replication=(max(single, default=cluster.n_devices),), max_stages=1)
    label = name or (hlo.source if hlo is not None else profile.source)

    def result_of(plan: PipelinePlan, episodes_run: int = 0, interrupted: bool = False,
                  optimum: float | None = None, downsets: _DownsetChoice | None = None) -> PipelineResult:
        device_cuts = tuple(stage.devices[0] for stage in plan.stages[1:])
        used = downsets.profile if downsets is not None and downsets.order is not None else profile
        order = None if downsets is None else downsets.order
        priced = paced_profile(used, cluster, busy_devices(plan))
        simulation = simulate(priced, cluster, plan, space.cost)
        executor, step = executor_step_seconds(priced, cluster, plan, simulation)
        return PipelineResult(
            source=label, agent=agent, profile=used, plan=plan,
            cost=evaluate_plan(priced, cluster, plan, space.cost),
            simulation=simulation, executor=executor, step_seconds=step, cluster=cluster.name,
            cuts=_describe(hlo, used, plan, order), device_cuts=device_cuts, replication=plan.replication,
            device_memory=tuple(group_memory(cluster, stage.devices) for stage in plan.stages),
            on_node_boundaries=None if cluster.n_nodes == 1 else all(is_node_boundary(cluster, d) for d in device_cuts),
            search_seconds=time.perf_counter() - start, episodes=episodes_run, optimum=optimum,
            objective=objective, interrupted=interrupted, order=order,
            straight_value=None if downsets is None else downsets.straight_value,
            downset_states=0 if downsets is None else downsets.states,
        )

    def report_best(found: SearchResult) -> None:
        if on_best is not None:
            on_best(result_of(found.plan, found.episodes))

    episodes_run, interrupted = 0, False
    if task is None:  # one stage: data parallel over every device, nothing to search
        plan = PipelinePlan.linear((0, profile.n_layers), space.replication,
                                   microbatches=microbatches, schedule=schedule)
    elif agent is PipelineAgent.INFER:
        from hlomap.tasks.pipeline.infer import infer_cuts, load_policy

        budget = (Budget(episodes=finetune_episodes, seconds=budget_seconds)
                  if finetune_episodes > 0 else None)
        inferred = infer_cuts(task, load_policy(policy_path), finetune=budget, seed=seed)
        plan, episodes_run = inferred.plan, inferred.finetune_episodes
    else:
        driver = Driver.EXACT if agent is PipelineAgent.DP else Driver.DQN
        found = run_driver(CutSearchTask(task), driver, Budget(episodes=episodes, seconds=budget_seconds),
                           seed, on_best=report_best, on_progress=on_progress)
        plan, episodes_run, interrupted = found.plan, found.episodes, found.interrupted
    optimum = solve(profile, cluster, space).value if compare_dp else None
    downsets = None
    if agent is PipelineAgent.DP and task is not None and hlo is not None and downset_states > 0 and not interrupted:
        downsets = _try_downsets(hlo, profile, cluster, space, plan, microbatches, downset_states)
        if downsets.plan is not None:
            plan = downsets.plan
            optimum = None if optimum is None else min(optimum, downsets.value)
    if choose:
        # on a downset plan (its profile in another order) only the schedule changes, not the cuts
        cut_profile = downsets.profile if downsets is not None and downsets.plan is not None else profile
        chunks = INTERLEAVED_CHUNKS if cut_profile is profile else ()
        paced = paced_profile(cut_profile, cluster, busy_devices(plan))
        plan = choose_schedule(paced, cluster, plan, space.cost, chunks=chunks).plan
    return result_of(plan, episodes_run, interrupted, optimum, downsets)


def busy_devices(plan: PipelinePlan) -> int:
    """The devices `plan`'s stages keep busy (`costs.paced_profile` prices it at their pace)."""
    return len({device for stage in plan.stages for device in stage.devices})


@dataclass(frozen=True)
class _DownsetChoice:
    """What the downset DP beside the exact agent found: its plan on `profile` in `order` when
    that beats the chain order's (else order None), the chain order's value, the states searched."""

    straight_value: float
    states: int
    value: float
    order: tuple[int, ...] | None = None
    profile: PipelineProfile | None = None
    plan: PipelinePlan | None = None


def _try_downsets(hlo: StepChain, profile: PipelineProfile, cluster: Cluster, space: PipelineSpace,
                  straight: PipelinePlan, microbatches: int, max_states: int) -> _DownsetChoice:
    """Run the downset DP on the step's layer DAG and keep its plan when it is cheaper than the
    chain order's `straight` plan by more than ties (module docstring)."""
    straight_value = _plan_value(profile, cluster, straight, space)
    dag = step_dag(hlo, 1.0 / microbatches)
    if dag.is_chain:
        log.info("%s: the layer graph is a chain; its order's cuts are every downset", hlo.source)
        return _DownsetChoice(straight_value, 0, straight_value)
    try:
        found = solve_step_downsets(dag, cluster, space, max_states=max_states)
    except NoFeasiblePlan:
        log.info("%s: the downset DP found no plan around the latest order; keeping the chain order's", hlo.source)
        return _DownsetChoice(straight_value, 0, straight_value)
    states = found.found.states
    log.info("%s: downset DP over %d cut states (%s): %.6g against %.6g cutting the chain order", hlo.source, states,
             "every downset" if found.found.complete else f"those within lookahead {found.found.lookahead}",
             found.value, straight_value)
    if not found.value < straight_value * (1 - TIE_RTOL):
        return _DownsetChoice(straight_value, states, found.value)
    return _DownsetChoice(straight_value, states, found.value, found.order, found.found.profile,
                          found.found.solution.plan)


# ---------------------------------------------------------------------------------------------
# As a Plan
# ---------------------------------------------------------------------------------------------


def _pipeline_section(result: PipelineResult) -> Pipeline:
    from hlomap.tasks.pipeline.block_profile import plan_profile

    data = result.to_json()
    section = {key: data[key] for key in ("stages", "microbatches", "schedule", "cuts", "device_cuts",
                                          "on_node_boundaries")}
    if result.plan.repeats > 1:
        # interleaved: the section lists the S device stages (each runs V chunks, which the S V - 1
        # cuts delimit), so no stage has one layer range
        section["repeats"] = result.plan.repeats
        section["stages"] = [{k: v for k, v in stage.items() if k != "layers"}
                             for stage in data["stages"][:result.plan.device_stages]]
        section["device_cuts"] = data["device_cuts"][:result.plan.device_stages - 1]
    # What re-pricing the plan on other devices or clusters needs (hlomap place, hlomap replan).
    section["block_profile"] = plan_profile(result.profile, result.plan).to_json()
    return Pipeline.from_json(section)


def _estimate_section(result: PipelineResult) -> dict[str, Any]:
    memory = [float(m) for m in result.stage_memory]
    fits = all(m <= c for m, c in zip(memory, result.device_memory))
    return {
        "step_seconds": float(result.step_seconds),
        "executor": result.executor,
        "schedule_step_seconds": float(result.latency),
        "model_step_seconds": float(result.model_latency),
        "bottleneck_seconds": float(result.cost.bottleneck),
        "memory": {"per_stage": memory, "total": max(memory, default=0.0), "fits": fits},
        "memory_violations": [str(v) for v in result.simulation.violations],
        **({"cluster": result.cluster} if result.cluster else {}),
    }


def unsplittable_stages(cap: Capture, result: PipelineResult) -> list[str]:
    """Why the runner would refuse `result`'s plan for `cap`: each stage replicates over its
    devices (data parallelism), so a microbatch must split evenly among them (`splits_batch`).
    The explorer offers only such plans for a captured step; a plan found for a bare profile
    may break the rule."""
    batch = cap.batch_size
    if batch is None:
        return []  # no batch dimension to check (or several candidates)
    m = result.plan.microbatches
    problems = []
    for s, stage in enumerate(result.plan.stages):
        devices = len(stage.devices)
        if not splits_batch(batch, m, devices):
            problems.append(f"stage {s} replicates over {devices} devices, but a microbatch of the batch of {batch} "
                            f"examples in {m} microbatches does not split among them: `hlomap run` refuses this "
                            f"plan; explore with --microbatches M such that {batch} / M is a multiple of {devices}")
    return problems


def pipeline_plan(cap: Capture, result: PipelineResult, *, seed: int = 0) -> Plan:
    """The `Plan` of a pipeline result found for `cap`."""
    from hlomap.plan import ParameterSpec, Plan, PlanSource

    parameters = tuple(ParameterSpec(p.index, p.path, tuple(p.shape.dims), (None,) * len(p.shape.dims))
                       for p in cap.parameters)
    search = {"task": "pipeline", "driver": result.agent.value, "reward": result.objective.value,
              "episodes": result.episodes, "evaluations": result.episodes,
              "seconds": round(result.search_seconds, 3), "seed": seed, "interrupted": result.interrupted}
    if result.optimum is not None:
        search["optimum"] = result.optimum
    if result.downset_states:
        search["downset_states"] = result.downset_states
        search["straight_optimum"] = result.straight_value
    plan = Plan(mesh=(), parameters=parameters, source=PlanSource.of(cap))
    return dataclasses.replace(plan, pipeline=_pipeline_section(result), estimate=_estimate_section(result),
                               search=search)


def explore_pipeline_plan(cap: Any, *, cluster: Any = "A", agent: str = "dqn", budget_seconds: float | None = None,
                          seed: int = 0, stages: int | None = None, output: str | Path | None = None,
                          **options: Any) -> Plan:
    """`hlomap.explore(cap, task="pipeline")`: the pipeline explorer's result as a `Plan`, every
    parameter replicated inside its stage and the `pipeline` section holding the stages,
    microbatches and schedule. Default stages: one per server of the cluster. With `output`,
    the best plan so far is saved there as the search improves it (Ctrl-C keeps it)."""
    agents = [a.value for a in PipelineAgent]
    if agent not in agents:
        raise ValueError(f"agent {agent!r}: the pipeline task takes {', '.join(agents)}")
    if stages is None:
        stages = load_cluster(cluster).n_nodes
    user_on_best = options.pop("on_best", None)

    def on_best(partial: PipelineResult) -> None:
        if output is not None:
            pipeline_plan(cap, partial, seed=seed).save(output)
        if user_on_best is not None:
            user_on_best(partial)

    result = explore_pipeline(cap, stages=stages, cluster=cluster, agent=agent, seed=seed,
                              budget_seconds=budget_seconds, on_best=on_best, **options)
    plan = pipeline_plan(cap, result, seed=seed)
    if output is not None:
        plan.save(output)
    return plan
