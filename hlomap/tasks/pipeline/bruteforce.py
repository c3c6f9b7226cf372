"""Exhaustive search over every plan of a small `PipelineSpace`: the oracle for the DPs' tests.

`brute_force` enumerates every composition of the layer chain into stages and every tuple of
replication factors; `brute_force_downsets` does the same for every chain of nested downsets of
a `LayerDag` (the cuts `downsets.solve_downsets` searches), each laid out stage after stage as
one topological order. Both price each plan with `costs.evaluate_plan` and filter it with
`space.inadmissible`; nothing is shared with the DP's tables, and the downsets are found by
testing every subset of the layers. Cost grows like C(n - 1, S - 1) * |R|^S on a chain and with
the number of chains of downsets on a DAG, so keep n and the device count small (n <= 8 on a
chain, n <= 5 on a DAG, <= 4 devices).
"""

from __future__ import annotations

import itertools
from typing import Iterable, Iterator, Sequence, TypeVar

from hlomap.cost.cluster import Cluster
from hlomap.cost.pipeline.costs import PlanCost, evaluate_plan
from hlomap.cost.pipeline.links import GroupPrices
from hlomap.cost.pipeline.profile import PipelineProfile
from hlomap.cost.pipeline.stages import PipelinePlan
from hlomap.tasks.pipeline.downsets import LayerDag
from hlomap.tasks.pipeline.solution import NoFeasiblePlan, Solution
from hlomap.tasks.pipeline.space import TIE_RTOL, PipelineObjective, PipelineSpace, inadmissible

__all__ = ["all_downsets", "brute_force", "brute_force_downsets", "enumerate_plans"]

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


def enumerate_plans(
    profile: PipelineProfile, cluster: Cluster, space: PipelineSpace
) -> Iterator[PipelinePlan]:
    """Every linear-order plan with stage count and replications that fit the devices."""
    n = profile.n_layers
    for n_stages in range(1, _most_stages(n, cluster, space) + 1):
        for cuts in itertools.combinations(range(1, n), n_stages - 1):
            yield from _plans((0, *cuts, n), cluster, space)


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


def brute_force(profile: PipelineProfile, cluster: Cluster, space: PipelineSpace) -> Solution:
    """The admissible plan with the least objective (BOTTLENECK ties broken by latency)."""
    admissible = []
    prices = GroupPrices(cluster)
    for plan in enumerate_plans(profile, cluster, space):
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


def brute_force_downsets(
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
