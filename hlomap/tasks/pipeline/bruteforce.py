"""Exhaustive search over every plan of a small `SearchSpace`: the oracle for the DP's tests.

It enumerates every composition of the layer chain into stages and every tuple of replication
factors, prices each plan with `costs.evaluate_plan` and filters it with
`space.inadmissible`; nothing is shared with the DP's tables. Cost grows like
C(n - 1, S - 1) * |R|^S, so keep n and the device count small (n <= 8, <= 4 devices).
"""

from __future__ import annotations

import itertools
from typing import Iterator

from hlomap.cost.pipeline.costs import evaluate_plan
from hlomap.cost.cluster import Cluster
from hlomap.cost.pipeline.links import GroupPrices
from hlomap.cost.pipeline.profile import PipelineProfile
from hlomap.tasks.pipeline.space import TIE_RTOL, Objective, SearchSpace, inadmissible
from hlomap.cost.pipeline.stages import PipelinePlan
from hlomap.tasks.pipeline.solution import NoFeasiblePlan, Solution

__all__ = ["brute_force", "enumerate_plans"]


def enumerate_plans(
    profile: PipelineProfile, cluster: Cluster, space: SearchSpace
) -> Iterator[PipelinePlan]:
    """Every linear-order plan with stage count and replications that fit the devices."""
    n = profile.n_layers
    most = min(n, cluster.n_devices) if space.max_stages is None else min(n, space.max_stages)
    for n_stages in range(1, most + 1):
        for cuts in itertools.combinations(range(1, n), n_stages - 1):
            bounds = (0, *cuts, n)
            for replication in itertools.product(space.replication, repeat=n_stages):
                if sum(replication) > cluster.n_devices:
                    continue
                yield PipelinePlan.linear(
                    bounds, replication, microbatches=space.microbatches, schedule=space.schedule
                )


def brute_force(profile: PipelineProfile, cluster: Cluster, space: SearchSpace) -> Solution:
    """The admissible plan with the least objective (BOTTLENECK ties broken by latency)."""
    admissible = []
    prices = GroupPrices(cluster)
    for plan in enumerate_plans(profile, cluster, space):
        cost = evaluate_plan(profile, cluster, plan, space.cost, prices=prices)
        if inadmissible(profile, cluster, plan, space, cost) is None:
            admissible.append((plan, cost))
    if not admissible:
        raise NoFeasiblePlan(
            f"{profile.source}: no plan in {space} fits on {cluster.n_devices} devices"
        )
    if space.objective is Objective.BOTTLENECK:
        least = min(cost.bottleneck for _, cost in admissible)
        admissible = [(p, c) for p, c in admissible if c.bottleneck <= least * (1 + TIE_RTOL)]
    plan, cost = min(admissible, key=lambda pc: pc[1].latency)
    return Solution(plan=plan, cost=cost, objective=space.objective)
