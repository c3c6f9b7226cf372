"""The candidate plans a measured selection times: after a task's search, its pick plus the best
plan of every family the task considered, each with the cost model's step seconds.

    found = candidates_for_sharding(exploration, cluster)     # the pick, dp, megatron, dp+megatron
    timed = select_candidates(found, count=3)                 # best 3 by prediction + each family's best

Families are what the issue calls the kinds of plan a task weighs: SPMD meshes (one mesh for the
whole step: the sharding tasks' pick and the built-in plans), pipelines (stage cuts over device
groups) and joint plans (stages each with its own mesh). It lives among the tasks because it reads
their search results (an `Exploration`, a joint result) and prices plans with their cost models;
compiling and timing the candidates is `hlomap.run.measure`'s, one layer up.

Candidates are distinct by structure: two plans whose JSON differs only in their estimate, search
record or measurement are one candidate (the first listed, i.e. the pick when it is one of them).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from hlomap.hlo.capture import Capture
from hlomap.plan import Plan, PlanError, reference_plan
from hlomap.propagation.conflicts import PlanConflict
from hlomap.propagation.graph import FactorGraph

log = logging.getLogger(__name__)

__all__ = ["ONE_DEVICE", "PICK", "Candidate", "Family", "candidates_for_joint", "candidates_for_pipeline",
           "candidates_for_sharding", "distinct_candidates", "one_device_candidate", "select_candidates",
           "spmd_reference_candidates", "structure_key"]

#: The name of the explorer's own plan among the candidates.
PICK = "searched"
#: The name of the candidate that runs the whole step on one device (`one_device_candidate`).
ONE_DEVICE = "one device"
#: Plan JSON keys that describe how a plan was found or priced, not what it runs.
NOT_STRUCTURE = ("estimate", "search", "measured")


class Family(enum.Enum):
    """The kinds of plan a task weighs (module docstring)."""

    SPMD = "spmd"
    PIPELINE = "pipeline"
    JOINT = "joint"


@dataclass(frozen=True)
class Candidate:
    """A plan to time: its name in reports ("searched", "dp", "joint 2 stages", ...), family,
    the Plan and the cost model's step seconds (None when it could not be priced)."""

    name: str
    family: Family
    plan: Plan
    predicted_seconds: float | None


# ---------------------------------------------------------------------------------------------
# Distinct and selected: pure functions of the candidate list
# ---------------------------------------------------------------------------------------------


def structure_key(plan: Plan) -> str:
    """What a plan runs, as text: its JSON without `NOT_STRUCTURE`, and without the mesh axes of
    one device (they split nothing: on one device dp, megatron and the search's plan are one
    program, and timing it three times would only cost compiles)."""
    data = {k: v for k, v in plan.to_json().items() if k not in NOT_STRUCTURE}
    return json.dumps(_without_unit_axes(data), sort_keys=True)


def _without_unit_axes(data: dict[str, Any]) -> dict[str, Any]:
    """A plan's JSON with the mesh axes of size 1 taken out of its mesh, specs and groups."""
    axes = data["mesh"]["axes"]
    unit = {axis for axis, size in axes.items() if size == 1}
    if not unit:
        return data

    def entry(value: Any) -> Any:
        names = [value] if isinstance(value, str) else list(value or ())
        kept = [name for name in names if name not in unit]
        return None if not kept else kept[0] if len(kept) == 1 else kept

    parameters = [{**p, "spec": [entry(e) for e in p["spec"]]} for p in data["parameters"]]
    groups = [{**g, "axes": kept} for g in data["groups"] if (kept := [a for a in g["axes"] if a not in unit])]
    return {**data, "mesh": {"axes": {a: n for a, n in axes.items() if a not in unit}}, "parameters": parameters,
            "groups": groups}


def _predicted_order(candidate: Candidate) -> float:
    """Sort key: unpriced candidates last."""
    return math.inf if candidate.predicted_seconds is None else candidate.predicted_seconds


def distinct_candidates(candidates: Iterable[Candidate]) -> list[Candidate]:
    """The first candidate of each structure (`structure_key`), in the given order; names stay unique."""
    seen: set[str] = set()
    names: set[str] = set()
    out = []
    for candidate in candidates:
        key = structure_key(candidate.plan)
        if key in seen or candidate.name in names:
            continue
        seen.add(key)
        names.add(candidate.name)
        out.append(candidate)
    return out


def select_candidates(candidates: Sequence[Candidate], count: int, *, pick: str = PICK) -> list[Candidate]:
    """The candidates to time, fastest predicted first: the explorer's pick (named `pick`) and the
    best predicted of every family always, then the next best predicted up to `count` in all. So
    `count` is raised to the number of families (plus the pick when it is not its family's best)."""
    if count < 1:
        raise ValueError(f"measure = {count!r}: the number of candidates to time must be at least 1")
    ordered = sorted(distinct_candidates(candidates), key=_predicted_order)
    required = {c.name for c in ordered if c.name == pick}
    best_of: dict[Family, str] = {}
    for candidate in ordered:
        best_of.setdefault(candidate.family, candidate.name)
    required |= set(best_of.values())
    chosen = set(required)
    for candidate in ordered:
        if len(chosen) >= count:
            break
        chosen.add(candidate.name)
    return [c for c in ordered if c.name in chosen]


# ---------------------------------------------------------------------------------------------
# The families' candidates
# ---------------------------------------------------------------------------------------------


def _spmd_seconds(cap: Capture, graph: FactorGraph, plan: Plan, cluster: Any) -> tuple[float | None, Any]:
    """The cost model's step seconds of an SPMD plan and its estimate's JSON (None, None when it
    cannot be priced: a candidate is still worth timing)."""
    from hlomap.propagation.conflicts import MeshAxes
    from hlomap.tasks.sharding.costmodel import step_estimate

    try:
        axes = MeshAxes.from_mesh(plan.mesh_shape, extra=[g.axes for g in plan.groups])
        estimate = step_estimate(cap, graph, plan.group_array(graph, axes), axes, cluster)
    except Exception as err:  # noqa: BLE001 - a price is a report; the plan can still be timed
        log.warning("could not price the candidate plan on mesh %s: %s", plan.mesh_shape, err)
        return None, None
    return float(estimate.step_seconds), estimate.to_json()


def _reference_meshes(devices: int, mesh: Mapping[str, int] | None) -> list[tuple[str, dict[str, int]]]:
    """(built-in plan, its mesh) over `devices` devices: dp on one data axis, megatron on one
    model axis, dp+megatron on the task's mesh when it has two axes."""
    out = [("dp", {"data": devices}), ("megatron", {"model": devices})]
    if mesh is not None and len(mesh) == 2:
        out.append(("dp+megatron", dict(mesh)))
    return out


def spmd_reference_candidates(cap: Capture, graph: FactorGraph, devices: int, cluster: Any, *,
                              mesh: Mapping[str, int] | None = None) -> list[Candidate]:
    """The built-in plans over `devices` devices that this step allows (one with a conflict, or
    that the step's roles cannot make, such as dp without data inputs, is left out), priced."""
    out = []
    for name, shape in _reference_meshes(devices, mesh):
        try:
            array, axes = reference_plan(graph, name, shape)
            plan = Plan.from_groups(cap, graph, array, axes)
        except (PlanError, PlanConflict, ValueError) as err:
            log.info("built-in plan %s on %s is no candidate: %s", name, shape, err)
            continue
        seconds, estimate = _spmd_seconds(cap, graph, plan, cluster)
        out.append(Candidate(name, Family.SPMD, dataclasses.replace(plan, estimate=estimate), seconds))
    return out


def _saved_seconds(plan: Plan) -> float | None:
    value = (plan.estimate or {}).get("step_seconds")
    return None if value is None else float(value)


def candidates_for_sharding(exploration: Any, cluster: Any) -> list[Candidate]:
    """The sharding tasks (opp, adp, hybrid): the pick (an `Exploration`'s plan) and the built-in
    plans over the same devices."""
    problem = exploration.problem
    plan = exploration.plan
    seconds = _saved_seconds(plan)
    if seconds is None:
        seconds, _ = _spmd_seconds(problem.cap, problem.graph, plan, cluster)
    devices = math.prod(plan.mesh_shape.values())
    pick = Candidate(PICK, Family.SPMD, plan, seconds)
    return distinct_candidates([pick, *spmd_reference_candidates(problem.cap, problem.graph, devices, cluster,
                                                                 mesh=plan.mesh_shape)])


def candidates_for_pipeline(cap: Capture, plan: Plan, cluster: Any, *, graph: FactorGraph | None = None) -> list[Candidate]:
    """The pipeline task: its pick and the built-in SPMD plans over the same devices."""
    graph = graph if graph is not None else FactorGraph.from_capture(cap)
    pick = Candidate(PICK, Family.PIPELINE, plan, _saved_seconds(plan))
    return distinct_candidates([pick, *spmd_reference_candidates(cap, graph, len(plan.device_order()), cluster)])


#: Megatron grid points the auto task lists (the best priced): the runner-up meshes, so that
#: timing the best few candidates can find a data x model mesh the cost model ranks just behind
#: the pick's (on host CPU devices 4 x 2 and 2 x 4 price within a few percent of each other).
GRID_CANDIDATES = 3


def best_grid_points(grid: Sequence[Any], count: int) -> list[Any]:
    """The `count` least-L feasible points of a joint result's Megatron grid (`GridPoint`)."""
    feasible = [g for g in grid if g.plan is not None and g.cost is not None]
    return sorted(feasible, key=lambda g: float(g.cost.latency))[:count]


def candidates_for_joint(result: Any, *, to_plan: Callable[[Any], Plan],
                         resolve: Callable[[int], Any]) -> list[Candidate]:
    """The auto task: the joint pick, the best joint plan of at most s stages for every stage
    count s below the pick's (`resolve(s)` solves the same model again with `max_stages=s`: the
    DP over a model already built is cheap), Megatron's best grid points (`GRID_CANDIDATES`), the
    built-in SPMD plans over the cluster's devices and the step on one device. A one-stage plan on
    fewer devices than the cluster is priced again with only its devices busy. `to_plan` turns a
    joint result into its Plan."""
    model = result.model
    out = [Candidate(PICK, Family.JOINT, to_plan(result), float(result.cost.latency))]
    for stages in range(1, result.plan.n_stages):
        fewer = resolve(stages)
        if fewer is not None and fewer.cost.fits:
            label = f"joint {fewer.plan.n_stages} stage" + ("s" if fewer.plan.n_stages > 1 else "")
            out.append(Candidate(label, Family.JOINT, to_plan(fewer), float(fewer.cost.latency)))
    for point in best_grid_points(result.grid, GRID_CANDIDATES):
        grid = dataclasses.replace(result, plan=point.plan, cost=point.cost)
        out.append(Candidate(f"megatron grid {point.label}", Family.JOINT, to_plan(grid), float(point.cost.latency)))
    out = [_repriced_if_idle(c, model.cap, model.graph, model.cluster) for c in out]
    out += spmd_reference_candidates(model.cap, model.graph, model.cluster.n_devices, model.cluster)
    if model.cluster.n_devices > 1:
        out.append(one_device_candidate(model.cap, model.graph, model.cluster))
    return distinct_candidates(out)


def _repriced_if_idle(candidate: Candidate, cap: Capture, graph: FactorGraph, cluster: Any) -> Candidate:
    """A joint candidate written as an SPMD plan on fewer devices than the cluster, priced again
    by the SPMD estimate: the joint DP prices every stage with all of the cluster's devices busy
    (a pipeline's stages compute at once), while the devices such a plan leaves idle lend their
    shared hardware to the ones it runs on (`hlomap.cost.cluster.busy_speedup`: 8 host CPU
    devices on 2 cores)."""
    plan = candidate.plan
    if plan.pipeline is not None or math.prod(plan.mesh_shape.values()) >= cluster.n_devices:
        return candidate
    seconds, estimate = _spmd_seconds(cap, graph, plan, cluster)
    if seconds is None:
        return candidate
    return dataclasses.replace(candidate, plan=dataclasses.replace(plan, estimate=estimate), predicted_seconds=seconds)


def one_device_candidate(cap: Capture, graph: FactorGraph, cluster: Any) -> Candidate:
    """The whole step on one device, the others idle: never the fastest on devices of their own,
    but 8 host CPU devices share 2 cores, so one device runs up to 4x faster than each of 8 busy
    ones and pays no collective (gpt-tiny: 8.9 ms, against 14.7 ms for the best 8-device plan)."""
    from hlomap.propagation.conflicts import REPLICATED, MeshAxes

    axes = MeshAxes.from_mesh({"data": 1})
    plan = Plan.from_groups(cap, graph, np.full(graph.num_groups, REPLICATED, dtype=np.int8), axes)
    seconds, estimate = _spmd_seconds(cap, graph, plan, cluster)
    return Candidate(ONE_DEVICE, Family.SPMD, dataclasses.replace(plan, estimate=estimate), seconds)
