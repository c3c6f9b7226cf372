"""The schedules' per-device orders, their simulated bubbles against the analytic ones, their
memory, and the closed form's agreement with the simulator."""

from __future__ import annotations

import pytest

from hlomap.cost.cluster import uniform
from hlomap.cost.pipeline.costs import CommModel, CostOptions, evaluate_plan, schedule_latency
from hlomap.cost.pipeline.profile import uniform_profile
from hlomap.cost.pipeline.simulator import SpanKind, simulate
from hlomap.cost.pipeline.stages import (
    Pass,
    PipelinePlan,
    Schedule,
    Stage,
    default_executor,
    device_order,
    in_flight,
    schedule_problem,
)

NO_COMM = CostOptions(comm=CommModel.IGNORED)
SHAPES = [(2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (8, 8)]


def _uniform(schedule: Schedule, n_groups: int, microbatches: int, repeats: int = 1, stash: float = 0.0):
    """S V equal logical stages, each 1 / V of a device stage's forward (1 s) and backward (2 s)."""
    n = n_groups * repeats
    profile = uniform_profile(n, forward_time=1.0 / repeats, backward_time=2.0 / repeats, stash_bytes=stash)
    stages = tuple(Stage(k, k + 1, (k % n_groups,)) for k in range(n))
    plan = PipelinePlan(stages, microbatches, schedule, repeats)
    cluster = uniform(n_groups, "V100-16GB", bandwidth=1e30, latency=0.0)
    return profile, cluster, plan


@pytest.mark.parametrize("n_groups,microbatches", SHAPES)
@pytest.mark.parametrize("schedule,repeats", [(Schedule.GPIPE, 1), (Schedule.ONE_F_ONE_B, 1),
                                              (Schedule.INTERLEAVED, 2), (Schedule.INTERLEAVED, 4)])
def test_simulated_bubble_is_the_analytic_one(schedule, repeats, n_groups, microbatches):
    profile, cluster, plan = _uniform(schedule, n_groups, microbatches, repeats)
    result = simulate(profile, cluster, plan, NO_COMM)
    expected = (n_groups - 1) / (repeats * microbatches + n_groups - 1)
    assert result.bubble_fraction() == pytest.approx(expected, abs=1e-12)
    assert evaluate_plan(profile, cluster, plan, NO_COMM).latency == pytest.approx(result.length, rel=1e-12)


@pytest.mark.parametrize("n_groups,microbatches", SHAPES + [(4, 1), (4, 2), (8, 3)])
def test_zero_bubble_beats_1f1b_with_1f1b_peak_memory(n_groups, microbatches):
    zb = simulate(*_uniform(Schedule.ZERO_BUBBLE, n_groups, microbatches, stash=1e6), NO_COMM)
    one = simulate(*_uniform(Schedule.ONE_F_ONE_B, n_groups, microbatches, stash=1e6), NO_COMM)
    assert zb.bubble_fraction() < one.bubble_fraction()
    # the paper's bound (S - 1)(F + B - W) = (S - 1) F is a floor; the greedy order is near it
    assert zb.length >= 3 * microbatches + (n_groups - 1) - 1e-9
    assert zb.length <= 3 * microbatches + 2 * (n_groups - 1) + 1e-9
    assert max(zb.stage_memory) == pytest.approx(max(one.stage_memory))
    assert max(zb.peak_in_flight) == min(n_groups, microbatches)


def test_zero_bubble_reaches_the_paper_bubble_when_the_pipeline_is_full():
    """S = M = 8: (S - 1)(F + B - W) = 7 F of bubble per stage, a third of 1F1B's."""
    zb = simulate(*_uniform(Schedule.ZERO_BUBBLE, 8, 8), NO_COMM)
    assert zb.length == pytest.approx(3 * 8 + 7)


@pytest.mark.parametrize("schedule,repeats", [(Schedule.GPIPE, 1), (Schedule.ONE_F_ONE_B, 1),
                                              (Schedule.INTERLEAVED, 2), (Schedule.INTERLEAVED, 3),
                                              (Schedule.ZERO_BUBBLE, 1)])
@pytest.mark.parametrize("n_groups,microbatches", [(1, 1), (1, 3), (2, 2), (3, 6), (4, 8)])
def test_each_order_runs_every_pass_once_in_dependency_order(schedule, repeats, n_groups, microbatches):
    if schedule_problem(schedule, n_groups, microbatches, repeats) is not None:
        pytest.skip("not a combination the schedule runs")
    kinds = (Pass.FORWARD, Pass.BACKWARD) + ((Pass.WEIGHT,) if schedule is Schedule.ZERO_BUBBLE else ())
    for g in range(n_groups):
        order = device_order(schedule, g, n_groups, microbatches, repeats)
        assert len(order) == len(set(order))
        assert set(order) == {(kind, c, i) for kind in kinds for c in range(repeats) for i in range(microbatches)}
        seen = {step: n for n, step in enumerate(order)}
        for kind, c, i in order:
            if kind is not Pass.FORWARD:
                assert seen[(Pass.FORWARD, c, i)] < seen[(kind, c, i)]
            if kind is Pass.WEIGHT:
                assert seen[(Pass.BACKWARD, c, i)] < seen[(kind, c, i)]


def test_interleaved_memory_follows_megatron_warmup():
    """Device stage g holds 2 (S - g - 1) + (V - 1) S + 1 chunk-microbatches at its peak (capped
    by M V), each a chunk's stash: the simulator's memory is that many chunk stashes."""
    n_groups, m, v, stash = 4, 8, 2, 1e6
    profile, cluster, plan = _uniform(Schedule.INTERLEAVED, n_groups, m, v, stash=stash)
    result = simulate(profile, cluster, plan, CostOptions(comm=CommModel.IGNORED, param_memory_factor=0.0))
    for g in range(n_groups):
        expected = min(2 * (n_groups - g - 1) + (v - 1) * n_groups + 1, m * v)
        assert result.stage_memory[g] == pytest.approx(expected * stash)
        assert sum(in_flight(Schedule.INTERLEAVED, k, n_groups, m, v) for k in range(g, n_groups * v, n_groups)) \
            >= expected


def test_weight_passes_hold_their_residuals_and_follow_their_input_gradient():
    result = simulate(*_uniform(Schedule.ZERO_BUBBLE, 4, 8), NO_COMM)
    spans = {(span.kind, span.stage, span.microbatch): span for span in result.spans}
    for s in range(4):
        for i in range(8):
            weight, backward = spans[(SpanKind.WEIGHT, s, i)], spans[(SpanKind.BACKWARD, s, i)]
            assert weight.start >= backward.end - 1e-12
            assert weight.end - weight.start == pytest.approx(1.0)  # half of the 2 s backward
            assert backward.end - backward.start == pytest.approx(1.0)


def test_links_shared_by_the_chunks_of_two_device_stages_run_one_transfer_at_a_time():
    n_groups, m, v = 2, 4, 2
    profile = uniform_profile(n_groups * v, forward_time=0.5, backward_time=1.0, activation_bytes=1e9)
    plan = PipelinePlan(tuple(Stage(k, k + 1, (k % n_groups,)) for k in range(n_groups * v)), m,
                        Schedule.INTERLEAVED, v)
    result = simulate(profile, uniform(n_groups, "V100-16GB", bandwidth=1e9, latency=0.0), plan, CostOptions())
    sends = sorted((span.start, span.end) for span in result.spans
                   if span.kind is SpanKind.SEND_ACTIVATION and span.stage % n_groups == 0)
    for (_, end), (start, _) in zip(sends, sends[1:]):
        assert start >= end - 1e-12
    assert result.length == pytest.approx(schedule_latency(
        [0.5] * 4, [1.0] * 4, [1.0] * 3, [0.0, 0.0], m, Schedule.INTERLEAVED, v)[0])


def test_plans_and_schedules_refuse_what_they_cannot_run():
    with pytest.raises(ValueError, match="multiple of 4"):
        _uniform(Schedule.INTERLEAVED, 4, 6, 2)
    with pytest.raises(ValueError, match="needs the interleaved-1f1b schedule"):
        _uniform(Schedule.ZERO_BUBBLE, 2, 4, 2)
    with pytest.raises(ValueError, match="not on those of its device stage"):
        PipelinePlan((Stage(0, 1, (0,)), Stage(1, 2, (1,)), Stage(2, 3, (0,)), Stage(3, 4, (2,))), 2,
                     Schedule.INTERLEAVED, 2)
    with pytest.raises(ValueError, match="3 logical stages"):
        PipelinePlan((Stage(0, 1, (0,)), Stage(1, 2, (1,)), Stage(2, 3, (0,))), 2, Schedule.INTERLEAVED, 2)


@pytest.mark.parametrize("schedule", list(Schedule))
def test_the_mpmd_executor_runs_every_schedule_but_uniform_gpipe(schedule):
    expected = "spmd" if schedule is Schedule.GPIPE else "mpmd"
    assert default_executor(schedule, uniform=True) == expected
    assert default_executor(schedule, uniform=False) == "mpmd"


def test_plan_files_name_the_schedules_and_simulate_prices_them():
    import dataclasses

    from hlomap.api import simulate_plan
    from hlomap.plan import Pipeline, Plan
    from hlomap.plan.errors import PlanError

    section = {"stages": [{"devices": [0]}, {"devices": [1]}], "microbatches": 4, "schedule": "zb-h1", "repeats": 1}
    assert Pipeline.from_json(section).schedule is Schedule.ZERO_BUBBLE
    assert Pipeline.from_json({**section, "schedule": "interleaved-1f1b", "repeats": 2}).repeats == 2
    with pytest.raises(PlanError, match="unknown pipeline schedule 'zb'; expected .*interleaved-1f1b or zb-h1"):
        Pipeline.from_json({**section, "schedule": "zb"})
    plan = Plan.load("tests/data/plans/pipeline_v1.json")
    priced = {}
    for schedule in (Schedule.ONE_F_ONE_B, Schedule.ZERO_BUBBLE):
        variant = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, schedule=schedule))
        simulation = simulate_plan(None, variant, cluster="A")
        assert simulation.executor == "mpmd"
        priced[schedule] = simulation.estimate.placed
    assert priced[Schedule.ZERO_BUBBLE].length < priced[Schedule.ONE_F_ONE_B].length
    assert priced[Schedule.ZERO_BUBBLE].bubble_fraction() < priced[Schedule.ONE_F_ONE_B].bubble_fraction()


@pytest.mark.parametrize("schedule,repeats", [(Schedule.INTERLEAVED, 2), (Schedule.ZERO_BUBBLE, 1)])
def test_gantt_draws_chunks_on_their_device_stage_and_weight_passes(tmp_path, schedule, repeats):
    from hlomap.report.gantt import _row_of, draw_gantt

    result = simulate(*_uniform(schedule, 2, 4, repeats), NO_COMM)
    assert draw_gantt(result, tmp_path / "g.png").stat().st_size > 0
    assert _row_of(SpanKind.FORWARD, 3, 2) == 2 and _row_of(SpanKind.WEIGHT, 2, 2) == 0
    assert _row_of(SpanKind.SEND_ACTIVATION, 1, 2) == 3  # device stage 1 -> 0: the wrap-around link's row
