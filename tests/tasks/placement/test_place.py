"""Plans in, placed plans out: the mesh objective is the estimate's step time, and a placed plan
is estimated on its placement."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from hlomap.api import estimate
from hlomap.cost.cluster import load_cluster
from hlomap.hlo.capture import capture
from hlomap.plan import Plan, PlanSource, reference_plan
from hlomap.propagation.graph import FactorGraph
from hlomap.search.tracker import Budget
from hlomap.tasks.placement.generate import scrambled, tensor_parallel_layout
from hlomap.tasks.placement.place import estimate_pipeline_plan, place_plan, problem_from_plan, search_placement
from hlomap.tasks.placement.problem import PlacementError, PlacementProblem, step_seconds
from hlomap.tasks.pipeline.block_profile import PlanProfile

from tests.tasks.placement.helpers import ALTERNATING, renumbered, stage_layout


@pytest.fixture(scope="module")
def mlp():
    def step(params, x):
        def loss(ws):
            h = x
            for w in ws:
                h = jnp.tanh(h @ w)
            return jnp.mean(h ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        return [w - 0.1 * g for w, g in zip(params, grads)], value

    params = [jax.ShapeDtypeStruct((64, 64), jnp.float32)] * 4
    cap = capture(step, params, jax.ShapeDtypeStruct((32, 64), jnp.float32), arg_names=("params", "x"))
    graph = FactorGraph.from_capture(cap)
    array, axes = reference_plan(graph, "dp+megatron", {"data": 2, "model": 4})
    return cap, graph, Plan.from_groups(cap, graph, array, axes)


def test_the_mesh_objective_is_the_estimates_step_time(mlp):
    cap, graph, plan = mlp
    cluster = load_cluster("uniform:8:2")
    est = estimate(cap, plan, cluster=cluster, graph=graph)
    saved = dataclasses.replace(plan, estimate=est.to_json())
    problem = problem_from_plan(saved, cluster)
    assert step_seconds(problem, problem.identity) == pytest.approx(est.step_seconds, rel=1e-9)
    placed, result = place_plan(saved, cluster, "greedy", Budget(None, 1500))
    assert result.plan.gain > 0 and placed.placement.devices == result.plan.devices
    # api.estimate prices a placed plan on its placement
    again = estimate(cap, Plan.from_json(placed.to_json()), cluster=cluster, graph=graph)
    assert again.step_seconds == pytest.approx(result.plan.step_seconds, rel=1e-9)
    assert estimate(cap, saved, cluster=cluster, graph=graph).step_seconds == pytest.approx(est.step_seconds)


def pipeline_plan(replication=(2, 2, 2, 2)) -> Plan:
    layout = stage_layout(replication)
    devices = iter(range(sum(replication)))
    stages = [{"layers": [s, s + 1], "devices": [next(devices) for _ in range(r)], "replication": r}
              for s, r in enumerate(replication)]
    return Plan(mesh=(), parameters=(), source=PlanSource("test", ""),
                pipeline={"stages": stages, "microbatches": layout.microbatches, "schedule": "1f1b",
                          "block_profile": PlanProfile(layout.profile, tuple(range(len(replication) + 1))).to_json()})


def test_a_placed_pipeline_plan_is_simulated_on_its_placement():
    plan = pipeline_plan()
    cluster = load_cluster("torus:2x4")
    placed, result = place_plan(plan, cluster, "greedy", Budget(None, 2000))
    est = estimate_pipeline_plan(placed, cluster)
    assert est.placed_model_seconds == pytest.approx(result.plan.step_seconds, rel=1e-12)
    assert est.identity_model_seconds == pytest.approx(result.plan.identity_seconds, rel=1e-12)
    assert [stage.devices for stage in est.placed.plan.stages] == [tuple(d) for d in placed.stage_devices()]


# PPO (17 s on 2 cores: its rollouts before the same local search) only in the slow run
@pytest.mark.parametrize("driver", ["greedy", pytest.param("ppo", marks=pytest.mark.slow)])
def test_placement_unscrambles_a_scrambled_torus(driver):
    """8 tensor-parallel groups of 8 all-reduce at once on torus:8x8 whose device ids are a random
    permutation of its nodes. Physical row-major puts each group on a torus row (no link shared,
    3.5 ms per 100 MB); the scrambled identity shares links 4 ways (14 ms). The placement must
    come within 1% of row-major under the network model: starting from the identity, or nesting
    mesh axes over device ids, greedy stalls 1.2% above it, and the identity is 4x slower."""
    physical = load_cluster("torus:8x8")
    cluster = scrambled(physical, seed=3)
    problem = PlacementProblem(cluster, tensor_parallel_layout(64))
    row_major = step_seconds(PlacementProblem(physical, tensor_parallel_layout(64)), tuple(range(64)))
    result = search_placement(problem, driver, Budget(None, 1500))
    assert result.plan.identity_seconds > 3.5 * row_major  # the scramble matters
    assert result.plan.step_seconds <= 1.01 * row_major
    assert step_seconds(problem, result.plan.devices) == pytest.approx(result.plan.step_seconds, rel=1e-12)


def test_a_local_search_that_stops_improving_stops_before_its_budget():
    """512 devices: one sweep of swaps outlasts the budget, and physical row-major (a start) is
    already optimal on the unscrambled torus, so nothing improves after the starts: the search
    stops once STALL_SHARE of its time budget has passed without a better plan."""
    from hlomap.search.greedy import STALL_MIN_SECONDS, STALL_SHARE

    cluster = load_cluster("torus:8x8x8")
    problem = PlacementProblem(cluster, tensor_parallel_layout(512))
    budget = 20.0
    result = search_placement(problem, "greedy", Budget(budget, None))
    assert result.plan.step_seconds == pytest.approx(step_seconds(problem, tuple(range(512))), rel=1e-12)
    stops = [n for n in result.notes if n.startswith("stopped: no better plan")]
    assert stops, result.notes
    assert float(stops[0].split("last ")[1].split(" s")[0]) >= max(STALL_MIN_SECONDS, STALL_SHARE * budget)


@pytest.mark.slow  # 11 s of exact enumeration; the joint and interleaved cases below keep the fast run's cover
def test_greedy_unscrambles_a_cluster_whose_ids_alternate_between_servers():
    """Two servers of 4 with ids alternating between them: the plan's stage pairs (0, 1), (2, 3) ...
    straddle the network, 42% slower than the physical order. Greedy must find the exact optimum
    (every permutation of 8) to within 1%, which is the unscrambled identity's step: a placer that
    kept the identity, or only nested mesh axes over ids, fails."""
    plan = pipeline_plan()
    physical = load_cluster("hier:2x4")
    cluster = renumbered(physical, ALTERNATING)
    _, exact = place_plan(plan, cluster, "exact", Budget(None, 50_000))
    _, greedy = place_plan(plan, cluster, "greedy", Budget(None, 2000))
    _, unscrambled = place_plan(plan, physical, "identity", Budget(None, 1))
    assert greedy.plan.identity_seconds > 1.3 * exact.plan.step_seconds  # the scramble matters
    assert exact.plan.step_seconds == pytest.approx(unscrambled.plan.step_seconds, rel=1e-9)
    assert greedy.plan.step_seconds <= 1.01 * exact.plan.step_seconds


def test_plans_that_cannot_be_placed_say_why(mlp):
    cap, graph, plan = mlp
    with pytest.raises(PlacementError, match="no estimate section"):
        problem_from_plan(plan, load_cluster("uniform:8"))
    bare = pipeline_plan()
    bare = dataclasses.replace(bare, pipeline=dataclasses.replace(bare.pipeline, block_profile=None))
    with pytest.raises(PlacementError, match="no block_profile"):
        problem_from_plan(bare, load_cluster("torus:2x4"))
    with pytest.raises(PlacementError, match="8 logical positions but cluster 'mesh:2x2' has only 4"):
        problem_from_plan(pipeline_plan(), load_cluster("mesh:2x2"))


def test_place_on_a_torus_too_large_for_dense_tables_is_a_clear_error(tmp_path, capsys) -> None:
    from hlomap.cli import run

    plan = Plan(mesh=(("data", 2),), parameters=(), source=PlanSource("test", ""))
    plan.save(tmp_path / "plan.json")
    assert run(["place", str(tmp_path / "plan.json"), "--cluster", "torus:64x64x64"]) == 2
    err = capsys.readouterr().err
    assert "262144 devices" in err and "at most 8192" in err and "Traceback" not in err


def test_greedy_places_an_interleaved_pipeline_on_servers_with_alternating_ids():
    """Two stages of 4 replicas running two model chunks each (interleaved 1F1B, every trial priced
    whole by the event timeline) on two servers whose ids alternate: the identity splits every
    stage over the network; greedy must come within 1% of the plan on the physical order (each
    stage in a server)."""
    from hlomap.tasks.placement.problem import PlacementProblem

    layout = stage_layout((4, 4), microbatches=8, repeats=2)
    physical = load_cluster("hier:2x4")
    best = step_seconds(PlacementProblem(physical, layout), tuple(range(8)))
    problem = PlacementProblem(renumbered(physical, ALTERNATING), layout)
    result = search_placement(problem, "greedy", Budget(None, 2000))
    assert result.plan.identity_seconds > 1.2 * best  # the scramble matters
    assert result.plan.step_seconds <= 1.01 * best
    assert step_seconds(problem, result.plan.devices) == pytest.approx(result.plan.step_seconds, rel=1e-12)
