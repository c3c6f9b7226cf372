"""Exhaustive search over every plan of a small space: the one oracle for the stage DPs' tests
(the pipeline task's `dp.solve` and `downsets.solve_downsets`, the joint task's `solve.solve`).

Every plan is a composition of the layer chain into contiguous stages (`compositions`), each
stage given an option (a replication factor for the pipeline task, a data x model mesh for the
joint task) on the next devices of the linear device order. Each plan is priced by the task's
own closed form (`cost.pipeline.costs.evaluate_plan`, `joint.plans.evaluate`, both over
`pipeline_latency`) and filtered by the task's rules; nothing is shared with the DPs' tables,
and the downsets of a DAG are found by testing every subset of its layers. Cost grows like
C(n - 1, S - 1) * |options|^S, so keep n and the device count small.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Iterator, Sequence, TypeVar

from hlomap.cost.cluster import Cluster
from hlomap.cost.pipeline.costs import PlanCost, evaluate_plan
from hlomap.cost.pipeline.links import GroupPrices
from hlomap.cost.pipeline.profile import PipelineProfile
from hlomap.cost.pipeline.stages import PipelinePlan
from hlomap.tasks.joint.costs import JointModel
from hlomap.tasks.joint.plans import JointCost, JointPlan, JointStage, evaluate
from hlomap.tasks.joint.solve import JointSpace, aligned
from hlomap.tasks.pipeline.downsets import LayerDag
from hlomap.tasks.pipeline.solution import NoFeasiblePlan, Solution
from hlomap.tasks.pipeline.space import TIE_RTOL, PipelineObjective, PipelineSpace, inadmissible


def compositions(n_layers: int, most_stages: int) -> Iterator[tuple[int, ...]]:
    """Stage bounds (0, ..., n_layers) of every split of the chain into 1..most_stages
    contiguous non-empty stages."""
    for n_stages in range(1, min(most_stages, n_layers) + 1):
        for cuts in itertools.combinations(range(1, n_layers), n_stages - 1):
            yield (0, *cuts, n_layers)


_Candidate = TypeVar("_Candidate")


def _most_stages(n_layers: int, cluster: Cluster, space: PipelineSpace) -> int:
    most = min(n_layers, cluster.n_devices)
    return most if space.max_stages is None else min(most, space.max_stages)


def _plans(
    bounds: Sequence[int], cluster: Cluster, space: PipelineSpace
) -> Iterator[PipelinePlan]:
    """The plans with these stage bounds, for every tuple of replications that fits."""
    for replication in itertools.product(space.replication, repeat=len(bounds) - 1):
        if sum(replication) <= cluster.n_devices:
            yield PipelinePlan.linear(
                bounds, replication, microbatches=space.microbatches, schedule=space.schedule
            )


def pipeline_plans(
    profile: PipelineProfile, cluster: Cluster, space: PipelineSpace
) -> Iterator[PipelinePlan]:
    """Every linear-order plan with stage count and replications that fit the devices."""
    for bounds in compositions(profile.n_layers, _most_stages(profile.n_layers, cluster, space)):
        yield from _plans(bounds, cluster, space)


def _least(
    admissible: list[tuple[_Candidate, PlanCost]], space: PipelineSpace, source: str, devices: int
) -> tuple[_Candidate, PlanCost]:
    """The candidate with the least objective (BOTTLENECK ties broken by latency)."""
    if not admissible:
        raise NoFeasiblePlan(f"{source}: no plan in {space} fits on {devices} devices")
    if space.objective is PipelineObjective.BOTTLENECK:
        least = min(cost.bottleneck for _, cost in admissible)
        admissible = [(c, cost) for c, cost in admissible
                      if cost.bottleneck <= least * (1 + TIE_RTOL)]
    return min(admissible, key=lambda candidate: candidate[1].latency)


def pipeline_brute_force(profile: PipelineProfile, cluster: Cluster, space: PipelineSpace) -> Solution:
    """The admissible plan with the least objective (BOTTLENECK ties broken by latency)."""
    admissible = []
    prices = GroupPrices(cluster)
    for plan in pipeline_plans(profile, cluster, space):
        cost = evaluate_plan(profile, cluster, plan, space.cost, prices=prices)
        if inadmissible(profile, cluster, plan, space, cost) is None:
            admissible.append((plan, cost))
    plan, cost = _least(admissible, space, profile.source, cluster.n_devices)
    return Solution(plan=plan, cost=cost, objective=space.objective)


def all_downsets(dag: LayerDag) -> list[frozenset[int]]:
    """Every set of layers that holds the producers of each of its members, by testing all
    2^n subsets."""
    n = dag.n_layers
    edges = [(u, v) for u, readers in enumerate(dag.consumers) for v in readers]
    found = []
    for bits in range(2**n):
        chosen = frozenset(i for i in range(n) if bits >> i & 1)
        if all(u in chosen for u, v in edges if v in chosen):
            found.append(chosen)
    return found


def _growing_chains(
    downsets: Sequence[frozenset[int]], full: frozenset[int], most: int
) -> Iterator[list[frozenset[int]]]:
    """Every strictly growing chain of at most `most` + 1 downsets from the empty set to
    `full`."""

    def extend(chain: list[frozenset[int]]) -> Iterator[list[frozenset[int]]]:
        if chain[-1] == full:
            yield chain
            return
        if len(chain) > most:
            return
        for nxt in downsets:
            if chain[-1] < nxt:
                yield from extend([*chain, nxt])

    yield from extend([frozenset()])


def downset_brute_force(
    dag: LayerDag,
    cluster: Cluster,
    space: PipelineSpace,
    downsets: Iterable[frozenset[int]] | None = None,
) -> tuple[Solution, PipelineProfile]:
    """The admissible plan with the least objective whose stages are differences of nested
    `downsets` (default: all of the DAG's), and the profile of the order it cuts: each stage's
    layers in the straight order, stage after stage."""
    n = dag.n_layers
    allowed = all_downsets(dag) if downsets is None else list(downsets)
    admissible = []
    prices = GroupPrices(cluster)
    most = _most_stages(n, cluster, space)
    for chain in _growing_chains(allowed, frozenset(range(n)), most):
        order = [layer for a, b in zip(chain[:-1], chain[1:]) for layer in sorted(b - a)]
        profile = dag.linearize(order)
        for plan in _plans([len(d) for d in chain], cluster, space):
            cost = evaluate_plan(profile, cluster, plan, space.cost, prices=prices)
            if inadmissible(profile, cluster, plan, space, cost) is None:
                admissible.append(((plan, profile), cost))
    (plan, profile), cost = _least(admissible, space, dag.source, cluster.n_devices)
    return Solution(plan=plan, cost=cost, objective=space.objective), profile


def joint_plans(model: JointModel, space: JointSpace) -> Iterator[JointPlan]:
    """Every joint plan of the space: each composition of the layers into stages that each hold
    a parameter, each tuple of stage options that fits the devices (uses every device when the
    space says so), every group a slice of one server or whole servers, and every data replica
    a whole number of samples of each microbatch."""
    cluster = model.cluster
    per_node = max(len(cluster.devices_on(node)) for node in set(cluster.node_of))
    n, devices = model.n_layers, cluster.n_devices
    most = min(n, devices) if space.max_stages is None else min(n, devices, space.max_stages)
    params = model.arrays(space.options[0]).params
    for m in space.microbatches:
        valid = [option for option in space.options if model.batch % (m * option.data) == 0]
        for bounds in compositions(n, most):
            if any(params[b] == params[a] for a, b in zip(bounds, bounds[1:])):
                continue
            for options in itertools.product(valid, repeat=len(bounds) - 1):
                firsts = list(itertools.accumulate((o.devices for o in options), initial=0))
                unused = devices - firsts[-1]
                if unused < 0 or (space.use_all_devices and unused) or not all(
                        aligned(per_node, d, o.devices) for d, o in zip(firsts, options)):
                    continue
                stages = tuple(JointStage.of(a, b, d, o) for a, b, d, o in zip(bounds, bounds[1:], firsts, options))
                yield JointPlan(stages, m, space.schedule)


def joint_brute_force(model: JointModel, space: JointSpace) -> tuple[JointPlan, JointCost]:
    """The least-L joint plan by enumeration, priced by `joint.plans.evaluate`."""
    best: tuple[JointPlan, JointCost] | None = None
    for plan in joint_plans(model, space):
        cost = evaluate(model, plan)
        if space.check_memory and not cost.fits:
            continue
        if best is None or cost.latency < best[1].latency - 1e-15:
            best = (plan, cost)
    if best is None:
        raise NoFeasiblePlan("no plan of the space fits")
    return best
