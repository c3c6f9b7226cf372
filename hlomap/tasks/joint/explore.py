"""From a captured train step to a joint plan: layers, options, the outer search, the expert grid
beside it, and the `Plan` that `hlomap.parallelize` runs.

    result = explore_joint(cap, cluster)                 # exact DP outer level, expert plans inside
    result.plan.describe(result.model.layer_names)
    result.best_grid                                     # what Megatron-LM's grid gives, same model
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hlomap.cost.cluster import Cluster, with_busy_devices
from hlomap.cost.pipeline.stages import DEFAULT_SCHEDULE, Schedule, in_flight
from hlomap.hlo.capture import Capture
from hlomap.hlo.source_info import nearest_scopes
from hlomap.plan import Pipeline, Recompute
from hlomap.plan.sections import spec_to_json
from hlomap.propagation.graph import FactorGraph
from hlomap.tasks.joint.costs import JointModel, PlanKind, StageOption, block_ends, stage_options
from hlomap.tasks.joint.grid import GridPoint, expert_grid, uniform_split_ends
from hlomap.search.budget import Budget
from hlomap.search.drivers import run_driver
from hlomap.search.tracker import Driver, Progress, SearchResult
from hlomap.tasks.joint.plans import (
    JointCost,
    JointPlan,
    JointStage,
    checkpoints_groups,
    choose_schedule,
    evaluate,
    runs_as_spmd,
)
from hlomap.tasks.pipeline.schedules import AUTO_SCHEDULE
from hlomap.tasks.joint.solve import JointSpace, microbatch_choices
from hlomap.tasks.pipeline.solution import NoFeasiblePlan
from hlomap.tasks.joint.task import JointSearchTask
from hlomap.cost.pipeline.chain import PivotOptions, step_chain

log = logging.getLogger(__name__)

__all__ = ["JointResult", "explore_joint", "joint_model", "reprice_joint_plan"]

#: Cut points the joint search considers (on top of the block ends of every uniform split); the
#: pipeline explorer's 256 would make the DP's tables large for little gain between two blocks.
JOINT_PIVOTS = 32


def joint_model(cap: Capture, cluster: Cluster, *, max_pivots: int = JOINT_PIVOTS,
                graph: FactorGraph | None = None) -> JointModel:
    """The step cut into layers: the pipeline explorer's candidate pivots (fewest crossing bytes)
    plus the block ends where a uniform split into any stage count dividing the devices cuts,
    so that Megatron's uniform splits are plans too."""
    probe = JointModel.build(cap, cluster, (), graph=graph)
    chain = step_chain(cap, cluster.devices[0], options=PivotOptions(max_pivots=max_pivots),
                       attribution=probe.attribution, graph=probe.graph)
    last = probe.attribution.length - 1
    ends = uniform_split_ends(block_ends(probe), cluster.n_devices)
    pivots = sorted({p.position for p in chain.pivots} | {e for e in ends if e < last})
    scopes = nearest_scopes(chain.chain.layers)
    bounds = [0, *(p + 1 for p in pivots), probe.attribution.length]
    names = tuple(scopes[b - 1] or f"layer{k}" for k, b in enumerate(bounds[1:]))
    return dataclasses.replace(probe, pivots=tuple(pivots), layer_names=names, _arrays={})


@dataclass(frozen=True, eq=False)
class JointResult:
    model: JointModel
    plan: JointPlan
    cost: JointCost
    grid: tuple[GridPoint, ...]
    seconds: float
    driver: str
    options: int
    search: SearchResult | None = None

    @property
    def best_grid(self) -> GridPoint | None:
        feasible = [g for g in self.grid if g.cost is not None]
        return min(feasible, key=lambda g: g.cost.latency) if feasible else None  # type: ignore[union-attr]


def explore_joint(cap: Capture, cluster: Cluster, *, schedule: Schedule | str = DEFAULT_SCHEDULE,
                  microbatches: Sequence[int] | None = None, max_stages: int | None = None,
                  kinds: Sequence[PlanKind] = (PlanKind.EXPERT,), agent: str = "exact",
                  recompute: bool = True, split_state: bool = True, shard_parameters: bool | None = None,
                  budget: Budget | None = None, seed: int = 0, with_grid: bool = True,
                  graph: FactorGraph | None = None, model: JointModel | None = None,
                  on_best: Callable[[SearchResult], None] | None = None,
                  on_progress: Callable[[Progress], None] | None = None) -> JointResult:
    """The least-L joint plan of `cap` on `cluster`. agent: "exact" (the two-level DP, the
    default: optimal for the model and fast), or a search driver over the outer level ("dqn",
    "random", "greedy"; `budget` bounds it) with the same inner level. recompute: stages may also
    recompute their forward pass, selectively (all but the matmuls) or in full
    (`StageOption.recompute`), which only a stage short of memory takes (`solve.problem_for` drops
    the option where the stage fits with less recomputation). split_state:
    stages with data replicas may also split their optimizer state over them
    (`StageOption.split_state`, ZeRO-1), kept only where it fits what would not or is faster.
    shard_parameters: stages with their optimizer state split may also split their parameters
    (`StageOption.shard_parameters`, FSDP) or only their gradients (`StageOption.shard_gradients`,
    ZeRO-2): True searches those options too, False never; None (auto, the default) searches them
    only when no plan fits without them, as `--shard-parameters auto` does for SPMD plans (they
    add collectives to every microbatch, so they win only where memory binds, and more options
    slow the largest searches).
    With `with_grid`, Megatron-LM's grid is priced first and its best configuration (also with the
    optimizer state split) bounds the exact DP, which then skips whatever cannot beat it."""
    if shard_parameters is None and split_state:
        model = model or joint_model(cap, cluster, graph=graph)  # one model (and its memo) for both searches
        settings = dict(schedule=schedule, microbatches=microbatches, max_stages=max_stages, kinds=kinds,
                        agent=agent, recompute=recompute, budget=budget, seed=seed, with_grid=with_grid,
                        graph=graph, model=model, on_best=on_best, on_progress=on_progress)
        try:
            found = explore_joint(cap, cluster, split_state=True, shard_parameters=False, **settings)  # type: ignore[arg-type]
            if found.cost.fits:
                return found
        except NoFeasiblePlan:
            pass
        return explore_joint(cap, cluster, split_state=True, shard_parameters=True, **settings)  # type: ignore[arg-type]
    start = time.perf_counter()
    choose = schedule == AUTO_SCHEDULE
    # the DP needs the closed form: it plans under 1F1B, then every schedule is priced on its plan
    schedule = DEFAULT_SCHEDULE if choose else Schedule(schedule)
    model = model or joint_model(cap, cluster, graph=graph)
    options = stage_options(cluster, kinds=kinds, recompute=tuple(Recompute) if recompute else (Recompute.NONE,),
                            split_state=(False, True) if split_state else (False,),
                            shard_parameters=(False, True) if split_state and shard_parameters else (False,))
    space = JointSpace(options, tuple(microbatches) if microbatches else microbatch_choices(model.batch),
                       schedule, max_stages)
    # The grid first: its best configuration bounds the exact DP from the start (`solve.solve`),
    # and a tight bound is what lets the DP leave out most stages on a large cluster. The grid's
    # configurations with the optimizer state split (when the space allows it) only serve as
    # that bound: the grid reported stays Megatron's own.
    bounded = split_state and Driver(agent) is Driver.EXACT
    uniform = expert_grid(model, schedule=schedule, microbatches=space.microbatches,
                          split_state=(False, True) if bounded else (False,), max_stages=max_stages) if with_grid else []
    grid = tuple(g for g in uniform if not g.split_state)
    feasible = [g for g in uniform if g.plan is not None and g.cost is not None]
    incumbent = min(feasible, key=lambda g: g.cost.latency).plan if feasible else None  # type: ignore[union-attr]
    task = JointSearchTask(model, space, incumbent=incumbent)
    found = run_driver(task, Driver(agent), budget or Budget(seconds=60.0), seed, on_best=on_best,
                       on_progress=on_progress)
    plan = choose_schedule(model, found.plan) if choose else found.plan
    cost = paced_cost(cap, model, plan)
    log.info("joint plan of %s on %s: %d stages, L %.4g s (%.1f s)", cap.source, cluster.name, plan.n_stages,
             cost.latency, time.perf_counter() - start)
    return JointResult(model, plan, cost, grid, time.perf_counter() - start, found.driver.value, len(options), found)


def option_of(plan: JointPlan, stage: int) -> StageOption:
    return plan.stages[stage].option


def describe_grid(grid: Sequence[GridPoint]) -> list[dict[str, Any]]:
    return [{"config": g.label, "latency": None if g.cost is None else g.cost.latency, "note": g.note,
             "microbatches": None if g.plan is None else g.plan.microbatches} for g in grid]


# ---------------------------------------------------------------------------------------------
# As a Plan
# ---------------------------------------------------------------------------------------------


def _cut(model: JointModel, layer: int) -> dict[str, Any]:
    """The cut before joint layer `layer`: the HLO instruction it follows, its layer name and
    source line from metadata (the pipeline plans' cut record, which the runner maps back)."""
    from hlomap.hlo.source_info import layer_name, source_location, source_tables

    position = model.pivots[layer - 1]
    inst = model.attribution.chain[position]
    return {"pivot": position, "instruction": inst.name, "layer": layer_name(inst.metadata, inst.opcode),
            "scope": model.layer_names[layer - 1],
            "source": source_location(inst, source_tables(model.cap.module))}


def joint_plan(result: JointResult) -> Any:
    """The `Plan` of a joint result: no global mesh; a `pipeline` section whose stages carry
    their devices, mesh and the PartitionSpec of every parameter inside the stage, plus the
    microbatches and schedule; the estimate (L, memory per stage) and how it was found. A result
    of one stage and one microbatch on the first devices (`runs_as_spmd`) is an ordinary SPMD
    plan on the stage's mesh instead: one program, without a pipeline executor's cost."""
    from hlomap.plan import Plan, PlanSource

    model, plan, cost = result.model, result.plan, result.cost
    if runs_as_spmd(plan):
        return _spmd_plan(result)
    stages = []
    for s, stage in enumerate(plan.stages):
        inner = _inner_plan(model, stage.option)
        state = inner.state_sharding
        held = in_flight(plan.schedule, s, plan.n_stages, plan.microbatches)
        grouped = checkpoints_groups(model.arrays(stage.option), stage.start, stage.stop, held)
        inner_cuts = [_cut(model, k) for k in model.checkpoint_starts(stage.start, stage.stop)] if grouped else []
        stages.append({
            "layers": [stage.start, stage.stop], "devices": list(stage.devices),
            "replication": stage.option.data, "mesh": stage.option.mesh, "plan": stage.option.kind.value,
            **({"recompute": stage.recompute.value} if stage.recompute is not Recompute.NONE else {}),
            **({"recompute_cuts": inner_cuts} if inner_cuts else {}),
            **({"state_axes": list(state.axes)} if state is not None else {}),
            **({"shard_parameters": True} if stage.shard_parameters else {}),
            **({"shard_gradients": True} if stage.shard_gradients else {}),
            "specs": [spec_to_json(state.spec_of(p) if state is not None else p.spec) for p in inner.parameters],
            **({"gradient_specs": _gradient_specs(model, stage.option)} if stage.shard_gradients else {}),
            "seconds_per_microbatch": cost.stage_seconds[s], "memory_bytes": cost.stage_memory[s],
            "device_memory_bytes": cost.device_memory[s],
        })
    first = [st.first_device for st in plan.stages[1:]]
    per_node = model.cluster.most_per_node
    pipeline = {
        "kind": "joint", "stages": stages, "microbatches": plan.microbatches, "schedule": plan.schedule.value,
        "cuts": [_cut(model, st.start) for st in plan.stages[1:]], "device_cuts": first,
        "on_node_boundaries": all(d % per_node == 0 for d in first),
        "layer_names": list(model.layer_names),
    }
    best = result.best_grid
    estimate = {
        "step_seconds": cost.latency, "bottleneck_seconds": cost.bottleneck,
        "transfer_seconds": list(cost.transfer_seconds),
        "memory": {"per_stage": list(cost.stage_memory), "total": max(cost.stage_memory), "fits": cost.fits},
        "cluster": model.cluster.name,
    }
    search = {"task": "auto", "driver": result.driver, "seconds": round(result.seconds, 3),
              "options": result.options, "layers": model.n_layers,
              "expert_grid_best": None if best is None else {"config": best.label,
                                                               "step_seconds": best.cost.latency,
                                                               "microbatches": best.plan.microbatches}}
    parameters = Plan.from_groups(model.cap, model.graph, model.plan_for(plan.stages[0].option)[0],
                                  model.plan_for(plan.stages[0].option)[1], check=False).parameters
    replicated = tuple(dataclasses.replace(p, spec=(None,) * len(p.shape)) for p in parameters)
    base = Plan(mesh=(), parameters=replicated, source=PlanSource.of(model.cap))
    return dataclasses.replace(base, pipeline=Pipeline.from_json(pipeline), estimate=estimate, search=search)


def _inner_plan(model: JointModel, option: StageOption) -> Any:
    """The SPMD plan a stage of `option` runs on its mesh (its optimizer state split over `data`
    when the option says so: `Plan.with_sharded_state`)."""
    from hlomap.plan import Plan

    array, axes = model.plan_for(option)
    inner = Plan.from_groups(model.cap, model.graph, array, axes, check=False)
    return inner.with_sharded_state(model.graph, parameters=option.shard_parameters) if option.split_state else inner


def _gradient_specs(model: JointModel, option: StageOption) -> list[Any]:
    """The specs of a ZeRO-2 stage's gradients, one per plan parameter: each trainable
    parameter's as FSDP would store it (split over `data`), every other leaf's as the stage's."""
    fsdp = _inner_plan(model, dataclasses.replace(option, shard_gradients=False, shard_parameters=True))
    return [spec_to_json(fsdp.state_sharding.spec_of(p)) for p in fsdp.parameters]


def _spmd_plan(result: JointResult) -> Any:
    """The one-stage joint result as an SPMD plan (`joint_plan`), with its estimate and search."""
    model, plan, cost = result.model, result.plan, result.cost
    spmd = _inner_plan(model, plan.stages[0].option)
    best = result.best_grid
    estimate = {"step_seconds": cost.latency, "memory": {"per_stage": list(cost.stage_memory),
                                                         "total": max(cost.stage_memory), "fits": cost.fits},
                "cluster": model.cluster.name}
    search = {"task": "auto", "driver": result.driver, "seconds": round(result.seconds, 3),
              "options": result.options, "layers": model.n_layers, "stages": 1,
              "expert_grid_best": None if best is None else {"config": best.label,
                                                               "step_seconds": best.cost.latency,
                                                               "microbatches": best.plan.microbatches}}
    return dataclasses.replace(spmd, estimate=estimate, search=search)


def saved_joint_plan(section: Pipeline) -> JointPlan:
    """The JointPlan a saved plan's pipeline section (kind JOINT) describes. Raises ValueError
    naming the stage and what it lacks."""
    stages = []
    for s, st in enumerate(section.stages):
        mesh = dict(st.mesh)
        if st.layers is None or "data" not in mesh or "model" not in mesh:
            raise ValueError(f"stage {s} of the joint plan's pipeline section needs its layers and a data x model "
                             f"mesh (it has layers {st.layers}, mesh {mesh})")
        try:
            kind = PlanKind(st.inner_plan or PlanKind.EXPERT.value)
        except ValueError:
            raise ValueError(f"stage {s} of the joint plan's pipeline section: unknown plan {st.inner_plan!r}; "
                             f"expected {' or '.join(k.value for k in PlanKind)}") from None
        option = StageOption(len(st.devices), mesh["data"], mesh["model"], kind, st.recompute, bool(st.state_axes),
                             st.shard_parameters, st.shard_gradients)
        stages.append(JointStage.of(st.layers[0], st.layers[1], st.devices[0], option))
    return JointPlan(tuple(stages), section.microbatches, section.schedule)


def paced_cost(cap: Capture, model: JointModel, plan: JointPlan) -> Any:
    """`plan`'s cost at the pace of the devices it keeps busy, as `reprice_joint_plan` (what
    `hlomap simulate` shows) prices it: on a measured cluster whose devices share hardware, a plan
    leaving some idle computes faster than the all-busy rate the DP compares plans at. The DP's
    own model where nothing changes (all devices busy, devices of their own, or another cut)."""
    busy = len({d for stage in plan.stages for d in stage.devices})
    cluster = with_busy_devices(model.cluster, busy)
    if cluster is model.cluster:
        return evaluate(model, plan)
    paced = joint_model(cap, cluster, graph=model.graph)
    return evaluate(paced if paced.layer_names == model.layer_names else model, plan)


def reprice_joint_plan(cap: Capture, cluster: Cluster, section: Pipeline, *,
                       graph: FactorGraph | None = None) -> JointResult:
    """A saved joint plan priced again by the cost model on `cluster` (no search): what `hlomap
    simulate` shows. On the cluster it was made for, the step is cut into that cluster's layers
    (the planner cuts where the cluster's uniform splits cut); elsewhere into one layer per stage
    (`layout.staged_model`: the same stage prices, since a stage costs the sum over its chain
    positions)."""
    from hlomap.tasks.joint.layout import staged_model

    start = time.perf_counter()
    # priced at the rate of the devices the plan keeps busy (faster when it leaves some idle and
    # the measured cluster's devices share hardware)
    busy = len({d for stage in section.stages for d in stage.devices})
    highest = max(d for stage in section.stages for d in stage.devices)
    if highest >= cluster.n_devices:
        raise ValueError(f"the plan's stages use device {highest}, but {cluster.name} has {cluster.n_devices} devices "
                         f"(0-{cluster.n_devices - 1})")
    model = joint_model(cap, with_busy_devices(cluster, busy), graph=graph)
    saved = section.layer_names
    if saved and saved != model.layer_names:  # cut for another cluster
        model, plan = staged_model(cap, cluster, section, graph=model.graph)
        return JointResult(model, plan, evaluate(model, plan), (), time.perf_counter() - start, "saved", 0)
    plan = saved_joint_plan(section)
    if plan.stages[-1].stop != model.n_layers or plan.stages[-1].first_device + plan.stages[-1].option.devices > \
            cluster.n_devices:
        raise ValueError(f"the plan's stages need {plan.stages[-1].first_device + plan.stages[-1].option.devices} "
                         f"devices and {plan.stages[-1].stop} layers; {cluster.name} gives {cluster.n_devices} "
                         f"devices and {model.n_layers} layers")
    return JointResult(model, plan, evaluate(model, plan), (), time.perf_counter() - start, "saved", 0)
