"""Incremental pricing against the cost model itself, and the affinity proxy's bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest

from hlomap.cost.pipeline.costs import evaluate_plan
from hlomap.tasks.placement.objective import affinity, new_state
from hlomap.tasks.placement.problem import PlacementError, step_seconds

from tests.tasks.placement.helpers import mesh_layout, problem, stage_layout

TOPOLOGIES = ["hier:3x4", "random:12:5", "torus:2x2x3", "mesh:3x4", "uniform:12:1"]


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("kind", ["mesh", "stages", "mesh-on-part", "stages-on-part", "chunks-on-part"])
def test_incremental_pricing_agrees_with_the_cost_model(topology, kind):
    """Chunks: two model chunks per stage (interleaved 1F1B), every trial priced whole."""
    layout = {"mesh": mesh_layout((3, 4)), "stages": stage_layout((4, 2, 3, 3)),
              "mesh-on-part": mesh_layout((2, 4)), "stages-on-part": stage_layout((2, 3, 2)),
              "chunks-on-part": stage_layout((2, 3, 2), microbatches=6, repeats=2)}[kind]
    pb = problem(topology, layout)  # "-on-part": fewer positions than devices, free slots to swap into
    rng = np.random.default_rng(0)
    state = new_state(pb, rng.permutation(pb.n_devices))
    assert state.value == pytest.approx(step_seconds(pb, state.order[: pb.n_positions]), rel=1e-12)
    for _ in range(60):
        a, b = (int(x) for x in rng.choice(pb.n_devices, 2, replace=False))
        before = state.value
        tried = state.try_swap(a, b)
        assert state.value == before  # a try changes nothing
        if rng.random() < 0.5:
            state.swap(a, b)
            assert (state.value, state.tiebreak) == tried
            assert state.value == pytest.approx(step_seconds(pb, state.order[: pb.n_positions]), rel=1e-9)


def test_stage_pricing_is_the_pipeline_cost_models_latency():
    layout = stage_layout((2, 3, 1))
    pb = problem("random:6:2", layout)
    devices = (5, 0, 3, 1, 4, 2)
    plan = layout.plan(devices)
    assert plan.stages[1].devices == (3, 1, 4)
    expected = evaluate_plan(layout.profile, pb.cluster, plan).latency
    assert step_seconds(pb, devices) == pytest.approx(expected, rel=1e-12)
    # with all-reduces inside the stages' passes (batch norm's statistics), on the placed groups
    import dataclasses

    from hlomap.tasks.placement.problem import StageLayout

    synced = dataclasses.replace(layout.profile, forward_syncs=np.array([2.0, 1.0, 3.0]),
                                 backward_syncs=np.array([1.0, 0.0, 2.0]),
                                 forward_sync_bytes=np.array([8e3, 4e3, 1e4]),
                                 backward_sync_bytes=np.array([4e3, 0.0, 8e3]))
    layout = StageLayout(synced, layout.replication, layout.microbatches, layout.schedule)
    pb = problem("random:6:2", layout)
    expected_synced = evaluate_plan(synced, pb.cluster, layout.plan(devices)).latency
    assert expected_synced > expected
    assert new_state(pb, np.array(devices)).value == pytest.approx(expected_synced, rel=1e-12)  # the search's price


def test_affinity_swap_delta_is_the_change_of_the_total():
    for layout in (mesh_layout((3, 4)), stage_layout((4, 2, 3, 3))):
        pb = problem("random:16:3", layout)
        aff = affinity(pb)
        rng = np.random.default_rng(1)
        order = rng.permutation(16)
        for _ in range(30):
            a, b = (int(x) for x in rng.choice(16, 2, replace=False))
            swapped = order.copy()
            swapped[a], swapped[b] = order[b], order[a]
            assert aff.swap_delta(order, a, b) == pytest.approx(aff.total(swapped) - aff.total(order), rel=1e-9,
                                                                abs=1e-15)


def test_placements_that_do_not_fit_are_named():
    with pytest.raises(PlacementError, match="12 logical positions but cluster 'hier:2x4' has only 8"):
        problem("hier:2x4", mesh_layout((3, 4)))
    pb = problem("hier:2x4", mesh_layout((2, 4)))
    with pytest.raises(PlacementError, match="two logical positions on one device"):
        step_seconds(pb, (0, 1, 2, 3, 4, 5, 6, 6))
    with pytest.raises(PlacementError, match=r"device\(s\) \[9\], outside cluster 'hier:2x4'"):
        step_seconds(pb, (0, 1, 2, 3, 4, 5, 6, 9))


def test_on_a_measured_cluster_stage_pricing_syncs_every_microbatch_and_prices_each_gradient_array():
    """Where the executors all-reduce a stage's gradient every microbatch (a measured cluster,
    `costs.syncs_each_microbatch`) and each array of it costs its measured buffer, the placement
    search prices a stage as the pipeline cost model does."""
    import dataclasses

    from hlomap.cost.cluster import load_cluster
    from hlomap.cost.measured import MeasuredCosts
    from hlomap.tasks.placement.problem import PlacementProblem, StageLayout

    base = stage_layout((2, 3, 1))
    profile = dataclasses.replace(base.profile, gradient_buffers=np.array([6.0, 2.0, 9.0]))
    layout = StageLayout(profile, base.replication, base.microbatches, base.schedule)
    cluster = dataclasses.replace(load_cluster("random:6:2"), measured=MeasuredCosts(combined_operand_seconds=1e-4))
    pb = PlacementProblem(cluster, layout, name="measured")
    devices = (5, 0, 3, 1, 4, 2)
    expected = evaluate_plan(profile, cluster, layout.plan(devices)).latency
    unmeasured = evaluate_plan(profile, load_cluster("random:6:2"), layout.plan(devices)).latency
    assert expected > unmeasured
    assert new_state(pb, np.array(devices)).value == pytest.approx(expected, rel=1e-12)
