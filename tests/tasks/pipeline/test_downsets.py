"""The downset DP against brute force over every chain of downsets, the linear DP on chains, the
best straight order, and a residual block worked by hand."""

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from hlomap.cost.pipeline.costs import CommModel, CostOptions, evaluate_plan
from tests.tasks.oracle import all_downsets, downset_brute_force
from hlomap.tasks.pipeline.dp import solve, solve_states
from hlomap.tasks.pipeline.downsets import (
    LayerDag,
    downset_family,
    downset_states,
    solve_downsets,
)
from hlomap.tasks.pipeline.pipedream import parse_graph, to_dag
from hlomap.tasks.pipeline.solution import NoFeasiblePlan
from hlomap.tasks.pipeline.space import PipelineObjective, PipelineSpace, inadmissible
from tests.tasks.pipeline.strategies import clusters, layer_dags, spaces, uniform_cluster

COMPUTE_ONLY = PipelineSpace(
    objective=PipelineObjective.BOTTLENECK, cost=CostOptions(comm=CommModel.IGNORED), check_memory=False
)


def _edges(dag):
    return [(u, v) for u, readers in enumerate(dag.consumers) for v in readers]


def _lookahead(downset, n):
    """How far past the first layer it leaves out the downset reaches, in the straight order."""
    missing = min(set(range(n)) - downset, default=n)
    return max(max(downset, default=-1) - missing, 0)


def _layer_bytes_crossing(dag, before):
    """Outputs of layers in `before` read by a layer outside it, each once (by hand)."""
    return sum(dag.output_bytes[u] for u in before if any(v not in before for v in dag.consumers[u]))


def _expected(dag, cluster, space, downsets=None):
    """The brute-force optimum over chains of downsets, or None when no plan is admissible."""
    try:
        solution, _ = downset_brute_force(dag, cluster, space, downsets)
    except NoFeasiblePlan:
        return None
    return solution


def _outcome(dag, cluster, space, **kwargs):
    try:
        return solve_downsets(dag, cluster, space, **kwargs)
    except NoFeasiblePlan:
        return None


def _check_plan(dag, cluster, space, found):
    """The plan runs a topological order, stage by stage, priced as `evaluate_plan` prices it."""
    order = found.order
    assert sorted(order) == list(range(dag.n_layers))
    position = {layer: p for p, layer in enumerate(order)}
    assert all(position[u] < position[v] for u, v in _edges(dag))
    plan, cost = found.solution.plan, found.solution.cost
    assert found.profile.names == tuple(dag.names[i] for i in order)
    assert cost == evaluate_plan(found.profile, cluster, plan, space.cost)
    assert inadmissible(found.profile, cluster, plan, space, cost) is None
    for stage in plan.stages[:-1]:
        before = set(order[: stage.stop])
        assert found.profile.activation_bytes[stage.stop - 1] == pytest.approx(
            _layer_bytes_crossing(dag, before), rel=1e-12)


# -- the tests -----------------------------------------------------------------------------------

@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dag=layer_dags(), cluster=clusters(), space=spaces())
def test_downset_dp_finds_the_brute_force_optimum(dag, cluster, space):
    expected = _expected(dag, cluster, space)
    found = _outcome(dag, cluster, space)
    assert (expected is None) == (found is None)
    if expected is None:
        return
    assert found.complete
    assert found.value == pytest.approx(expected.value, rel=1e-9, abs=1e-12)
    # BOTTLENECK ties are broken by latency in both (for LATENCY this is the value again).
    assert found.solution.cost.latency == pytest.approx(expected.cost.latency, rel=1e-9,
                                                        abs=1e-12)
    _check_plan(dag, cluster, space, found)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dag=layer_dags(min_layers=3), cluster=clusters(), space=spaces())
def test_a_bounded_family_is_exact_over_its_downsets(dag, cluster, space):
    """With fewer states allowed than the DAG has downsets, the DP is the brute force over the
    downsets within the family's lookahead, which always holds the straight order's prefixes."""
    n = dag.n_layers
    every = all_downsets(dag)
    cap = (n + 1 + len(every)) // 2
    family = downset_family(dag, max_states=cap)
    kept = {frozenset(np.flatnonzero(row).tolist()) for row in family.members}
    assert len(kept) == len(family.members) <= max(cap, n + 1)
    assert kept == {d for d in every if _lookahead(d, n) <= family.lookahead}
    assert {frozenset(range(p)) for p in range(n + 1)} <= kept
    assert family.complete == (len(kept) == len(every))
    if not family.complete:  # the largest lookahead that fits
        assert sum(_lookahead(d, n) <= family.lookahead + 1 for d in every) > cap
    expected = _expected(dag, cluster, space, kept)
    found = _outcome(dag, cluster, space, max_states=cap)
    assert (expected is None) == (found is None)
    if expected is not None:
        assert found.value == pytest.approx(expected.value, rel=1e-9, abs=1e-12)
        assert (found.states, found.lookahead, found.complete) == (
            len(kept) if not dag.is_chain else n + 1,
            family.lookahead if not dag.is_chain else 0,
            family.complete or dag.is_chain,
        )
        _check_plan(dag, cluster, space, found)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dag=layer_dags(max_layers=7, chain=True), cluster=clusters(), space=spaces())
def test_on_a_chain_the_downset_dp_is_the_linear_dp_exactly(dag, cluster, space):
    """A chain (skip edges allowed) has only its prefixes as downsets: the DP over them, built
    as for any DAG, makes the very same tables, so values and plans are equal, not close."""
    family = downset_family(dag)
    assert family.complete and family.members.shape == (dag.n_layers + 1, dag.n_layers)
    assert (family.members == np.tri(dag.n_layers + 1, dag.n_layers, k=-1, dtype=bool)).all()
    try:
        linear = solve(dag.straight, cluster, space)
    except NoFeasiblePlan:
        with pytest.raises(NoFeasiblePlan):
            solve_states(downset_states(dag, family), lambda chain: (dag.straight, chain),
                         cluster, space)
        return
    general = solve_states(downset_states(dag, family), lambda chain: (dag.straight, chain),
                           cluster, space)
    assert general.solution == linear
    fast = solve_downsets(dag, cluster, space)
    assert fast.solution == linear and fast.complete and fast.order == tuple(range(dag.n_layers))


def test_the_downset_optimum_is_the_best_straight_order():
    """A second oracle: every plan on downsets cuts some topological order, so the downset
    optimum is the least linear-DP optimum over all topological orders."""
    rng = np.random.default_rng(7)
    cluster = uniform_cluster(4, bandwidth=1e9, latency=1e-5, devices_per_node=2)
    for trial in range(12):
        n = int(rng.integers(3, 7))
        dag = LayerDag(
            names=tuple(f"v{i}" for i in range(n)),
            forward_time=rng.uniform(0.5, 2.0, n),
            backward_time=rng.uniform(1.0, 4.0, n),
            parameter_bytes=rng.uniform(0, 1e8, n),
            stash_bytes=rng.uniform(0, 1e8, n),
            output_bytes=rng.uniform(1e7, 3e9, n),
            consumers=tuple(tuple(j for j in range(i + 1, n) if rng.random() < 0.4)
                            for i in range(n)),
            source=f"random{trial}",
        )
        objective = (PipelineObjective.LATENCY, PipelineObjective.BOTTLENECK)[trial % 2]
        space = PipelineSpace(microbatches=4, objective=objective, replication=(1, 2),
                            use_all_devices=False, check_memory=False)
        edges = _edges(dag)
        orders = [order for order in itertools.permutations(range(n))
                  if all(order.index(u) < order.index(v) for u, v in edges)]
        best_order = min(solve(dag.linearize(order), cluster, space).value for order in orders)
        assert solve_downsets(dag, cluster, space).value == pytest.approx(best_order, rel=1e-9)
        assert solve(dag.straight, cluster, space).value >= best_order * (1 - 1e-12)


def _residual_block() -> LayerDag:
    """a -> b1 -> b2 -> d and a -> c -> d, numbered in that order (PipeDream's file format)."""
    def node(i, desc, ms, act):
        return (f"node{i} -- {desc} -- forward_compute_time={ms / 3:.6f}, backward_compute_time="
                f"{2 * ms / 3:.6f}, activation_size={act:.1f}, parameter_size=0.000")
    text = "\n".join([
        node(1, "Conv2d(a)", 1.0, 10.0), node(2, "Conv2d(b1)", 3.0, 20.0),
        node(3, "Conv2d(b2)", 3.0, 40.0), node(4, "Conv2d(c)", 2.0, 80.0),
        node(5, "Add(d)", 3.0, 160.0),
        "\tnode1 -- node2", "\tnode2 -- node3", "\tnode3 -- node5", "\tnode1 -- node4",
        "\tnode4 -- node5",
    ])
    return to_dag(parse_graph(text, "block.txt"))


def test_a_residual_block_cuts_between_its_branches():
    """Compute a = 1, b1 = 3, b2 = 3, c = 2, d = 3 ms (12 in all), two stages.
    The straight order a b1 b2 c d splits at best 7 | 5 (after b2). The downset {a, b1, c} splits
    6 | 6: it runs the short branch c in the first stage and b2 in the second. The cut then
    carries b1's output to b2 and c's to d: 20 + 80 bytes."""
    dag = _residual_block()
    cluster = uniform_cluster(2, bandwidth=1e9)
    assert solve(dag.straight, cluster, COMPUTE_ONLY).value == pytest.approx(7e-3)
    found = solve_downsets(dag, cluster, COMPUTE_ONLY)
    assert found.value == pytest.approx(6e-3) and found.complete
    assert [set(n.split(":")[0] for n in stage) for stage in found.stage_layers()] == [
        {"node1", "node2", "node4"}, {"node3", "node5"}]
    assert found.profile.activation_bytes[2] == 100.0
    assert found.states == len(all_downsets(dag))


def test_a_bound_below_the_prefixes_keeps_the_straight_order():
    dag = _residual_block()
    family = downset_family(dag, max_states=1)
    assert family.lookahead == 0 and not family.complete and len(family.members) == 6
    cluster = uniform_cluster(2, bandwidth=1e9)
    found = solve_downsets(dag, cluster, COMPUTE_ONLY, max_states=1)
    assert found.value == solve(dag.straight, cluster, COMPUTE_ONLY).value
    assert not found.complete and found.states == 6


def test_layer_dags_refuse_edges_against_the_order_and_orders_against_the_edges():
    base = dict(names=("x", "y"), forward_time=[1.0, 1.0], backward_time=[1.0, 1.0],
                parameter_bytes=[0.0, 0.0], stash_bytes=None, output_bytes=[1.0, 1.0],
                source="g.txt")
    with pytest.raises(ValueError, match=r"g.txt: layer 1 \(y\) feeds \[0\]"):
        LayerDag(**base, consumers=((), (0,)))
    with pytest.raises(ValueError, match="output_bytes needs 2 finite values"):
        LayerDag(**{**base, "output_bytes": [1.0, math.nan]}, consumers=((1,), ()))
    dag = LayerDag(**base, consumers=((1,), ()))
    with pytest.raises(ValueError, match="puts y before its input x"):
        dag.linearize([1, 0])
    with pytest.raises(ValueError, match="each of the 2 layers once"):
        dag.linearize([0, 0])


@pytest.mark.parametrize("name,lower", [("resnet18", (0.03, 0.06)), ("resnet50", (0.03, 0.06))])
def test_on_resnets_downsets_lower_the_8_stage_bottleneck(corpus_dir, name, lower):
    """PipeDream's optimizer, which cuts at antichains, finds 8-stage compute-only bottlenecks
    3-6% below the straight order's optimum on residual networks; so does the downset DP, over
    every downset (these graphs have a few hundred)."""
    from hlomap.tasks.pipeline.pipedream import load_pipedream_dag, pipedream_cluster

    dag = load_pipedream_dag(corpus_dir / "pipedream" / f"{name}.txt")
    cluster = pipedream_cluster(8)
    straight = solve(dag.straight, cluster, COMPUTE_ONLY).value
    found = solve_downsets(dag, cluster, COMPUTE_ONLY)
    assert found.complete and found.solution.plan.n_stages == 8
    assert lower[0] <= 1 - found.value / straight <= lower[1]


@pytest.mark.slow
def test_every_corpus_graph_gains_or_keeps_its_optimum(corpus_dir):
    """The family always holds the straight prefixes: never worse than the straight optimum."""
    from hlomap.tasks.pipeline.pipedream import load_pipedream_dag, pipedream_cluster

    for path in sorted((corpus_dir / "pipedream").glob("*.txt")):
        dag = load_pipedream_dag(path)
        for n_stages in (4, 8):
            cluster = pipedream_cluster(n_stages)
            space = PipelineSpace(objective=PipelineObjective.BOTTLENECK, microbatches=16,
                                check_memory=False)
            straight = solve(dag.straight, cluster, space)
            found = solve_downsets(dag, cluster, space, max_states=1024)
            assert found.value <= straight.value * (1 + 1e-12), (path.name, n_stages)
            assert found.solution.cost == evaluate_plan(found.profile, cluster,
                                                        found.solution.plan, space.cost)
