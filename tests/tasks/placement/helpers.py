"""Small placement problems for the tests."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from hlomap.cost.cluster import Cluster, hierarchical, load_cluster
from hlomap.cost.collectives import Collective
from hlomap.cost.estimate import CommunicationTerm
from hlomap.cost.pipeline.profile import PipelineProfile
from hlomap.plan import Plan
from hlomap.tasks.placement.problem import MeshLayout, PlacementProblem, StageLayout


def mesh_layout(shape: tuple[int, int], latency_bound: bool = False) -> MeshLayout:
    """A data x model mesh with tensor-parallel all-reduces, an all-to-all over both axes and a
    gradient all-reduce; small messages make it latency-bound."""
    scale = 1e-3 if latency_bound else 1.0
    terms = (CommunicationTerm(Collective.ALL_REDUCE, ("model",), 3e7 * scale, 24),
             CommunicationTerm(Collective.ALL_TO_ALL, ("data", "model"), 4e6 * scale, 2),
             CommunicationTerm(Collective.ALL_GATHER, ("data",), 1e7 * scale, 3),
             CommunicationTerm(Collective.ALL_REDUCE, ("data",), 2e8 * scale, 1))
    return MeshLayout((("data", shape[0]), ("model", shape[1])), terms, compute_seconds=0.05)


def stage_layout(replication: tuple[int, ...], microbatches: int = 6, seed: int = 0, repeats: int = 1) -> StageLayout:
    """Random stages on `replication` devices each; with `repeats` V > 1, S V chunks run
    interleaved (chunk k on stage k mod S)."""
    rng = np.random.default_rng(seed)
    s = len(replication) * repeats
    profile = PipelineProfile(
        names=tuple(f"s{i}" for i in range(s)),
        forward_time=rng.uniform(0.005, 0.02, s), backward_time=rng.uniform(0.01, 0.04, s),
        activation_bytes=rng.uniform(1e6, 4e7, s - 1), parameter_bytes=rng.uniform(1e7, 4e8, s))
    if repeats > 1:
        from hlomap.cost.pipeline.stages import Schedule

        return StageLayout(profile, replication, microbatches, Schedule.INTERLEAVED, repeats)
    return StageLayout(profile, replication, microbatches)


def problem(topology: str, layout: MeshLayout | StageLayout) -> PlacementProblem:
    return PlacementProblem(load_cluster(topology), layout, name=f"test on {topology}")


def renumbered(cluster: Cluster, order: Sequence[int]) -> Cluster:
    """`cluster` with its device ids permuted: id k is the physical device `order[k]`."""
    p = np.asarray(order)
    return Cluster(f"{cluster.name} scrambled", tuple(cluster.devices[i] for i in p),
                   tuple(int(cluster.node_of[i]) for i in p), np.asarray(cluster.bandwidth)[np.ix_(p, p)],
                   np.asarray(cluster.latency)[np.ix_(p, p)], nics_per_node=cluster.nics_per_node)


#: Two servers of 4 whose ids alternate between them: even ids on one, odd on the other.
ALTERNATING = (0, 4, 1, 5, 2, 6, 3, 7)


#: `placed_joint_plan`'s answers per capture (the session's captures are memoized: `cap_of`).
_PLACED: dict[int, tuple[Any, tuple[Plan, Plan, Any]]] = {}


def placed_joint_plan(cap: Any) -> tuple[Plan, Plan, Any]:
    """`cap`'s joint plan of two data=2 x model=2 stages on hier:2x4 (GPipe, the exact DP), placed
    by exact search on the same servers with alternating ids: (the plan, the placed plan, the
    placement's search result). Kept per capture: the exact search takes seconds."""
    kept = _PLACED.get(id(cap))
    if kept is None or kept[0] is not cap:
        _PLACED[id(cap)] = (cap, _placed_joint_plan(cap))
    return _PLACED[id(cap)][1]


def _placed_joint_plan(cap: Any) -> tuple[Plan, Plan, Any]:
    from hlomap.cost.pipeline.stages import Schedule
    from hlomap.search.tracker import Budget
    from hlomap.tasks.joint.costs import StageOption
    from hlomap.tasks.joint.explore import JointResult, joint_model, joint_plan
    from hlomap.tasks.joint.plans import evaluate
    from hlomap.tasks.joint.solve import JointSpace, solve
    from hlomap.tasks.placement.place import place_plan

    physical = hierarchical(2, 4)
    model = joint_model(cap, physical)
    plan, cost = solve(model, JointSpace((StageOption(4, 2, 2),), (2, 4), Schedule.GPIPE, max_stages=2))
    assert plan.n_stages == 2
    saved = joint_plan(JointResult(model, plan, evaluate(model, plan), (), 0.0, "exact", 1))
    placed, result = place_plan(saved, renumbered(physical, ALTERNATING), "exact", Budget(None, 50_000), cap=cap)
    return saved, placed, result
