import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hlomap.cost.measured import MeasuredCosts
from hlomap.cost.pipeline.costs import CommModel, CostOptions, evaluate_plan
from hlomap.cost.pipeline.links import is_node_boundary
from hlomap.cost.pipeline.profile import PipelineProfile, uniform_profile
from hlomap.cost.pipeline.simulator import simulate
from hlomap.cost.pipeline.stages import Schedule
from tests.tasks.oracle import pipeline_brute_force
from hlomap.tasks.pipeline.dp import solve
from hlomap.tasks.pipeline.solution import NoFeasiblePlan
from hlomap.tasks.pipeline.space import PipelineObjective, PipelineSpace
from hlomap.tasks.pipeline.space import inadmissible
from tests.tasks.pipeline.strategies import clusters as random_clusters
from tests.tasks.pipeline.strategies import profiles, spaces, uniform_cluster

NO_COMM = CostOptions(comm=CommModel.IGNORED)


def _outcome(search, profile, cluster, space):
    try:
        return search(profile, cluster, space)
    except NoFeasiblePlan:
        return None


def _dp_and_brute_force(profile, cluster, space):
    """(the DP's solution, the brute force's), after checking that both find a plan or neither
    does and that their objectives agree."""
    expected = _outcome(pipeline_brute_force, profile, cluster, space)
    found = _outcome(solve, profile, cluster, space)
    assert (expected is None) == (found is None)
    if expected is not None:
        assert found.value == pytest.approx(expected.value, rel=1e-9, abs=1e-12)
    return found, expected


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(profile=profiles(), cluster=random_clusters(), space=spaces())
def test_dp_finds_the_brute_force_optimum(profile, cluster, space):
    found, expected = _dp_and_brute_force(profile, cluster, space)
    if expected is None:
        return
    if space.objective is PipelineObjective.BOTTLENECK:  # ties are broken by latency in both
        assert found.cost.latency == pytest.approx(expected.cost.latency, rel=1e-9, abs=1e-12)
    # The DP's plan is itself admissible, and its reported cost is the plan's cost.
    assert inadmissible(profile, cluster, found.plan, space, found.cost) is None
    assert found.cost == evaluate_plan(profile, cluster, found.plan, space.cost)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(profile=profiles(), cluster=random_clusters(), space=spaces())
def test_dp_finds_the_brute_force_optimum_where_every_microbatch_syncs(profile, cluster, space):
    """On a measured cluster a replicated stage pays its gradient all-reduce every microbatch
    (`costs.syncs_each_microbatch`, as hlomap's executors run it): the DP's tables and the plan
    pricing the brute force enumerates follow the same rule, so the optimum still agrees; each
    array of the gradient after the first adds its measured cost to the all-reduce in both."""
    measured = dataclasses.replace(cluster, measured=MeasuredCosts(combined_operand_seconds=0.05))
    found, _ = _dp_and_brute_force(profile, measured, space)
    if found is not None:
        assert found.cost == evaluate_plan(profile, measured, found.plan, space.cost)


def test_latency_needs_a_bottleneck_between_the_extremes():
    """Neither the least-bottleneck plan nor the least-sum plan minimizes L here.

    c = f + b = [10, 3, 10, 7, 7], cut bytes [8, 1, 3, 1] GB at 1 GB/s, M = 4, <= 2 devices:
      one stage:        L = 37 + 3 * 37                 = 148   (least sum of stage/cut terms)
      cut after l2:     L = 23 + 14 + 2 * 3 + 3 * 23    = 112   (least bottleneck, 23)
      cut after l1:     L = 13 + 24 + 2 * 1 + 3 * 24    = 111   (the optimum)
    """
    profile = PipelineProfile(
        names=tuple(f"l{i}" for i in range(5)),
        forward_time=[1.0, 1.0, 5.0, 4.0, 4.0],
        backward_time=[9.0, 2.0, 5.0, 3.0, 3.0],
        activation_bytes=[8e9, 1e9, 3e9, 1e9],
        parameter_bytes=[0.0] * 5,
    )
    cluster = uniform_cluster(2, bandwidth=1e9)
    space = PipelineSpace(microbatches=4, use_all_devices=False, check_memory=False)
    solution = solve(profile, cluster, space)
    assert solution.value == pytest.approx(111.0)
    assert solution.value == pytest.approx(pipeline_brute_force(profile, cluster, space).value)
    assert solution.plan.cuts == (1,)
    bottleneck = solve(profile, cluster, PipelineSpace(
        microbatches=4, use_all_devices=False, check_memory=False,
        objective=PipelineObjective.BOTTLENECK,
    ))
    assert bottleneck.plan.cuts == (2,) and bottleneck.cost.latency == pytest.approx(112.0)


@settings(max_examples=60, deadline=None)
@given(
    compute=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=3, max_size=6),
    cut_gb=st.lists(st.integers(0, 9), min_size=5, max_size=5),
    microbatches=st.integers(2, 5),
    n_devices=st.integers(2, 4),
)
def test_latency_dp_on_communication_heavy_chains(compute, cut_gb, microbatches, n_devices):
    """Slow links make the least-bottleneck and least-sum plans differ from the least-L plan
    often (about a third of these cases), which exercises the threshold search."""
    n = len(compute)
    profile = PipelineProfile(
        names=tuple(f"l{i}" for i in range(n)),
        forward_time=[float(f) for f, _ in compute],
        backward_time=[float(b) for _, b in compute],
        activation_bytes=[g * 1e9 for g in cut_gb[: n - 1]],
        parameter_bytes=[0.0] * n,
    )
    cluster = uniform_cluster(n_devices, bandwidth=1e9)
    space = PipelineSpace(microbatches=microbatches, use_all_devices=False, check_memory=False)
    assert solve(profile, cluster, space).value == pytest.approx(
        pipeline_brute_force(profile, cluster, space).value, rel=1e-12
    )


@pytest.mark.parametrize("n_stages,layers_per_stage", [(2, 3), (4, 2), (3, 5)])
def test_uniform_layers_split_evenly(n_stages, layers_per_stage):
    """Closed form: n = S k equal layers on S devices -> bottleneck k (t_f + t_b)."""
    profile = uniform_profile(n_stages * layers_per_stage, forward_time=1.0, backward_time=2.0)
    cluster = uniform_cluster(n_stages, bandwidth=1e9)
    space = PipelineSpace(objective=PipelineObjective.BOTTLENECK, cost=NO_COMM, microbatches=8)
    solution = solve(profile, cluster, space)
    assert solution.value == pytest.approx(layers_per_stage * 3.0)
    assert [s.stop - s.start for s in solution.plan.stages] == [layers_per_stage] * n_stages
    # and the simulated batch matches the GPipe formula for this balanced plan
    result = simulate(profile, cluster, solution.plan, NO_COMM)
    assert result.length == pytest.approx((8 + n_stages - 1) * layers_per_stage * 3.0)


def test_memory_limit_forces_more_stages_and_1f1b_fits_where_gpipe_does_not():
    # 4 layers of 1 GB stash each; M = 4 microbatches; devices of 9 GB.
    profile = uniform_profile(4, forward_time=1, backward_time=1, stash_bytes=1e9)
    cluster = uniform_cluster(4, bandwidth=1e9, memory_bytes=9e9)
    base = dict(microbatches=4, use_all_devices=False, objective=PipelineObjective.BOTTLENECK, cost=NO_COMM)
    # GPipe stashes 4 microbatches on every stage: at most 2 layers (8 GB) per stage.
    gpipe = solve(profile, cluster, PipelineSpace(**base, schedule=Schedule.GPIPE, max_stages=2))
    assert [s.stop - s.start for s in gpipe.plan.stages] == [2, 2]
    assert gpipe.cost.feasible and max(gpipe.cost.stage_memory) <= 9e9
    with pytest.raises(NoFeasiblePlan, match="no plan of 4 layers on 4 devices"):
        solve(profile, cluster, PipelineSpace(**base, schedule=Schedule.GPIPE, max_stages=1))
    # 1F1B: one stage keeps only min(1, 4) = 1 microbatch: 4 GB fits on one device.
    one_f = solve(profile, cluster, PipelineSpace(**base, schedule=Schedule.ONE_F_ONE_B, max_stages=1))
    assert one_f.plan.n_stages == 1 and one_f.cost.stage_memory == (4e9,)


def test_auto_map_rules_server_boundaries_and_trainable_stages():
    # Two servers of 2 devices; layer 1 is the only heavy one, only layers 0 and 3 train.
    profile = PipelineProfile(
        names=("a", "b", "c", "d"),
        forward_time=[1.0, 8.0, 1.0, 1.0],
        backward_time=[1.0, 8.0, 1.0, 1.0],
        activation_bytes=[0.0, 0.0, 0.0],
        parameter_bytes=[1e6, 0.0, 0.0, 1e6],
    )
    cluster = uniform_cluster(4, bandwidth=1e9, devices_per_node=2)
    free = PipelineSpace(objective=PipelineObjective.BOTTLENECK, cost=NO_COMM, microbatches=4)
    assert solve(profile, cluster, free).plan.n_stages == 4
    ruled = PipelineSpace(
        objective=PipelineObjective.BOTTLENECK, cost=NO_COMM, microbatches=4, replication=(1, 2),
        cut_on_node_boundary=True, require_trainable=True,
    )
    solution = solve(profile, cluster, ruled)
    assert solution.value == pytest.approx(pipeline_brute_force(profile, cluster, ruled).value)
    for s, stage in enumerate(solution.plan.stages):
        assert profile.trainable[stage.start : stage.stop].any()
        if s > 0:
            assert is_node_boundary(cluster, stage.devices[0])
    assert solution.plan.n_stages == 2


def test_replication_trades_compute_against_all_reduce():
    """One layer on 4 devices: replicate when gradients are small, not when they are huge."""
    cluster = uniform_cluster(4, bandwidth=1e9)
    space = PipelineSpace(
        replication=(1, 2, 4), use_all_devices=False, microbatches=1,
        objective=PipelineObjective.LATENCY, check_memory=False,
    )
    small = PipelineProfile(("x",), [1.0], [1.0], [], [1e6])
    large = PipelineProfile(("x",), [1.0], [1.0], [], [1e10])
    # r = 4: 2 / 4 + 2 * 3 / 4 * 1e6 / 1e9 = 0.5015 s; r = 1: 2 s
    assert solve(profile=small, cluster=cluster, space=space).plan.replication == (4,)
    assert solve(small, cluster, space).value == pytest.approx(0.5 + 1.5e-3)
    # r = 2 would pay 1 + 2 * 1 / 2 * 10 = 11 s
    assert solve(large, cluster, space).plan.replication == (1,)


def test_no_feasible_plan_is_an_error_naming_the_source():
    profile = uniform_profile(2, forward_time=1, backward_time=1, parameter_bytes=1e9)
    cluster = uniform_cluster(2, bandwidth=1e9, memory_bytes=1e9)
    with pytest.raises(NoFeasiblePlan, match=r"uniform_profile\(2\)"):
        solve(profile, cluster, PipelineSpace())
    with pytest.raises(NoFeasiblePlan, match="all exceed the 2 devices"):
        solve(profile, cluster, PipelineSpace(replication=(4,)))


@pytest.mark.slow
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    profile=profiles(max_layers=8),
    cluster=random_clusters(max_devices=5),
    space=spaces(),
)
def test_dp_finds_the_brute_force_optimum_larger(profile, cluster, space):
    found, _ = _dp_and_brute_force(profile, cluster, space)
    if found is not None:
        assert math.isfinite(found.cost.latency)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(profile=profiles(), cluster=random_clusters(), space=spaces(),
       per_byte=st.floats(1e-12, 1e-9, allow_nan=False, allow_infinity=False))
def test_dp_finds_the_brute_force_optimum_with_the_optimizer_update(profile, cluster, space, per_byte):
    """With the optimizer update priced (`update_seconds_per_byte`: every replica of a stage
    updates all its parameters once per step), the DP's tables charge what `evaluate_plan` does,
    so the optimum still agrees, and a stage's time grows by its update over M."""
    profile = dataclasses.replace(profile, update_seconds_per_byte=per_byte)
    found, _ = _dp_and_brute_force(profile, cluster, space)
    if found is None:
        return
    assert found.cost == evaluate_plan(profile, cluster, found.plan, space.cost)
    if found.plan.schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B) and found.plan.repeats == 1:
        without = evaluate_plan(dataclasses.replace(profile, update_seconds_per_byte=0.0), cluster, found.plan,
                                space.cost)
        assert found.cost.latency > without.latency or not profile.parameter_bytes.any()
    # with every other device at half speed (a straggler's stage updates at its pace too)
    slowed = dataclasses.replace(cluster, slowdown=tuple(1.0 + d % 2 for d in range(cluster.n_devices)))
    _dp_and_brute_force(profile, slowed, space)
