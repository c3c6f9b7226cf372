"""The fidelity benchmark's pure helpers: ranks, Spearman, the picks' slowdowns, the pipelines'
microbatch count and random valid plans (scripts/bench_fidelity.py times the plans; nothing here
runs a step)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hlomap.verify.fidelity import (
    EVERY_SPACE,
    PlanFigures,
    fidelity_report,
    pipeline_microbatches,
    random_conflict_free_choices,
    ranks,
    spearman,
)


def _plan(name: str, predicted: float, measured: float, pick: bool = False) -> PlanFigures:
    return PlanFigures(name, "pick" if pick else "built-in", "spmd", predicted, measured, 0.001, pick)


def test_ranks_start_at_one_for_the_fastest_and_ties_share_the_best_rank():
    assert ranks([0.3, 0.1, 0.2]) == (3, 1, 2)
    assert ranks([0.1, 0.2, 0.1, 0.4]) == (1, 3, 1, 4)
    assert ranks([]) == ()


def test_spearman_is_one_for_the_same_order_and_minus_one_for_the_reverse():
    assert spearman([1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 25.0, 90.0]) == pytest.approx(1.0)
    assert spearman([1.0, 2.0, 3.0, 4.0], [9.0, 5.0, 2.0, 1.0]) == pytest.approx(-1.0)
    # one swap among four: 1 - 6 * (1 + 1) / (4 * 15)
    assert spearman([1.0, 2.0, 3.0, 4.0], [1.0, 3.0, 2.0, 4.0]) == pytest.approx(0.8)


def test_spearman_is_nan_where_it_is_undefined_and_refuses_unequal_lengths():
    assert math.isnan(spearman([1.0], [2.0]))
    assert math.isnan(spearman([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))  # every prediction equal
    assert math.isnan(spearman([1.0, 2.0, 3.0], [5.0, 5.0, 5.0]))
    with pytest.raises(ValueError, match="3 predicted times against 2 measured"):
        spearman([1.0, 2.0, 3.0], [1.0, 2.0])


def test_the_report_ranks_every_plan_and_measures_only_the_picks_against_the_fastest():
    plans = [_plan("data=8", 0.010, 0.040), _plan("megatron", 0.030, 0.020), _plan("opp pick", 0.005, 0.021, True),
             _plan("auto pick", 0.008, 0.030, True)]
    report = fidelity_report(plans)
    assert report.fastest == "megatron"
    assert report.predicted_ranks == (3, 4, 1, 2)
    assert report.measured_ranks == (4, 1, 2, 3)
    assert set(report.slowdowns) == {"opp pick", "auto pick"}
    assert report.slowdowns["opp pick"] == pytest.approx(0.05)
    assert report.slowdowns["auto pick"] == pytest.approx(0.5)
    assert report.spearman == pytest.approx(spearman([0.010, 0.030, 0.005, 0.008], [0.040, 0.020, 0.021, 0.030]))
    data = report.to_json()
    assert [p["measured_rank"] for p in data["plans"]] == [4, 1, 2, 3]
    assert data["fastest"] == "megatron" and data["slowdowns"]["opp pick"] == pytest.approx(0.05)


def test_a_single_mesh_pick_is_also_measured_against_the_fastest_plan_its_own_space_holds():
    def plan(name: str, measured: float, space: str | None, pick: bool = False) -> PlanFigures:
        return PlanFigures(name, "pick" if pick else "built-in", "spmd", 0.01, measured, 0.001, pick, space)

    plans = [plan("dp data=8", 0.020, "data=8"), plan("replicated", 0.014, EVERY_SPACE),
             plan("dp+megatron 2x4", 0.004, "data=2,model=4"), plan("pipeline", 0.003, None),
             plan("adp pick data=8", 0.0147, "data=8", True), plan("hybrid pick 2x4", 0.005, "data=2,model=4", True),
             plan("auto pick", 0.0033, None, True)]
    report = fidelity_report(plans)
    assert report.slowdowns["adp pick data=8"] == pytest.approx(0.0147 / 0.003 - 1)
    # the adp space holds data=8 plans and the replicated one: the replicated plan is its fastest
    assert report.space_slowdowns["adp pick data=8"] == ("replicated", pytest.approx(0.05))
    assert report.space_slowdowns["hybrid pick 2x4"] == ("dp+megatron 2x4", pytest.approx(0.25))
    assert "auto pick" not in report.space_slowdowns  # its space is the whole set
    assert report.to_json()["space_slowdowns"]["adp pick data=8"]["fastest"] == "replicated"


def test_a_pick_that_is_the_fastest_has_no_slowdown_and_an_undefined_spearman_is_null_in_json():
    report = fidelity_report([_plan("only pick", 0.01, 0.02, True)])
    assert report.slowdowns == {"only pick": 0.0}
    assert math.isnan(report.spearman) and report.to_json()["spearman"] is None
    with pytest.raises(ValueError, match="no plan was timed"):
        fidelity_report([])


@pytest.mark.parametrize("batch,stages,expected", [
    (8, 2, 2),  # microbatches of 4 split over 4 devices per stage
    (8, 4, 4),  # microbatches of 2 over 2 devices per stage
    (32, 2, 4),
    (6, 4, 3),
    (3, 2, None),  # no microbatch of 3, 1 splits over 4 devices
])
def test_pipeline_microbatches_leave_each_microbatch_divisible_by_a_stages_devices(batch, stages, expected):
    count = pipeline_microbatches(batch, stages, 8, preferred=4)
    assert count == expected
    if count is not None:
        assert batch % count == 0 and (batch // count) % (8 // stages) == 0


def test_pipeline_microbatches_refuses_impossible_shapes():
    with pytest.raises(ValueError, match="stages 9, devices 8"):
        pipeline_microbatches(8, 9, 8)
    with pytest.raises(ValueError, match="batch 0"):
        pipeline_microbatches(0, 2, 8)


def test_random_plans_are_conflict_free_differ_by_seed_and_shard_something(graph_of, cap_of):
    from hlomap.plan import Plan
    from hlomap.propagation.conflicts import MeshAxes
    from hlomap.tasks.sharding.space import hybrid_space

    graph = graph_of("gpt-tiny")
    space = hybrid_space(graph, MeshAxes.from_mesh({"data": 2, "model": 4}))
    drawn = [random_conflict_free_choices(space, np.random.default_rng(seed)) for seed in range(8)]
    assert all(bool(space.ok(c)[0]) for c in drawn)
    assert len({c.tobytes() for c in drawn}) > 1
    assert any((c >= 0).any() for c in drawn)
    for choices in drawn:  # the checker of Plan.from_groups raises on a conflict
        Plan.from_groups(cap_of("gpt-tiny"), graph, space.plan_of(choices), space.axes)
    again = random_conflict_free_choices(space, np.random.default_rng(3))
    assert np.array_equal(again, drawn[3])
