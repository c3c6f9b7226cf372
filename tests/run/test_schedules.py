"""Interleaved 1F1B and ZB-H1 on the mpmd executor, 8 CPU devices: loss and gradients equal the
unsharded step's, and one step's update equals it (S = 2, 4; M = 4, 8; V = 2). One
case per schedule runs by default; the rest of the matrix is marked slow."""

from __future__ import annotations

import pytest

from hlomap.cost.pipeline.stages import Pass, Schedule, device_order
from hlomap.run import parallelize
from hlomap.run.errors import RunError
from hlomap.run.pipeline.dispatch import measured_bubble, same_order
from tests.run.helpers import FAST_COMPILE, assert_ok, check_gradients, check_update, pipeline_plan, pivots_at


def _plan(case, schedule: str, n_stages: int, microbatches: int, repeats: int = 1):
    logical = n_stages * repeats
    pivots = pivots_at(case.chain, [(k + 1) / logical for k in range(logical - 1)])
    return pipeline_plan(case.cap, case.chain, pivots, microbatches=microbatches, schedule=schedule,
                         devices_per_stage=8 // n_stages // 2, repeats=repeats)


def _check(case, plan):
    step = parallelize(case.model.train_step(), plan, example_args=case.args, compiler_options=FAST_COMPILE)
    assert step.describe().executor == "mpmd"
    assert_ok(check_gradients(step, case.args) + check_update(step, case.args))
    return step


def test_interleaved_two_stages_two_chunks(zoo_case) -> None:
    """S = 2 device stages x V = 2 chunks (4 logical stages, stage k on device stage k mod 2), M = 4."""
    case = zoo_case("haiku-mlp")
    step = _check(case, _plan(case, "interleaved-1f1b", 2, 4, repeats=2))
    runner = step._runner
    assert runner.n_stages == 4 and runner.n_groups == 2
    assert [s.devices for s in step.describe().stages] == [(0, 1), (2, 3), (0, 1), (2, 3)]
    # each device stage ran its passes in Megatron's interleaved order, measured on the devices
    params, opt_state = step.place(*case.args[:2])
    runner(params, opt_state, *case.args[2:], record=True)
    events = runner.stats.events
    assert len(events) == 2 * 4 * 4 and same_order(events, runner.order, n_groups=2)
    assert 0.0 <= measured_bubble(events, 2) < 1.0


def test_zero_bubble_two_stages(zoo_case) -> None:
    """ZB-H1, S = 2, M = 4: the backward as an input-gradient and a weight-gradient program."""
    case = zoo_case("haiku-mlp")
    step = _check(case, _plan(case, "zb-h1", 2, 4))
    runner = step._runner
    assert runner.split_backward and not runner.fused
    assert {kind for kind, _ in runner.trace_counts} >= {"forward", "input_gradient", "weight_gradient", "update"}
    params, opt_state = step.place(*case.args[:2])
    runner(params, opt_state, *case.args[2:], record=True)
    events = runner.stats.events
    assert sum(e.event.kind is Pass.WEIGHT for e in events) == 2 * 4
    assert same_order(events, runner.order, n_groups=2)
    # residuals live from the forward to the weight pass: at most 1F1B's peak, min(S, M), per stage
    assert runner.stats.peak_in_flight == [2, 2]
    ordered = [(k.kind, k.chunk, k.microbatch) for k in device_order(Schedule.ZERO_BUBBLE, 0, 2, 4)]
    assert [(e.event.kind, 0, e.event.microbatch) for e in sorted(events, key=lambda e: e.start)
            if e.event.stage == 0] == ordered


@pytest.mark.slow
@pytest.mark.parametrize("schedule, repeats", [("interleaved-1f1b", 2), ("zb-h1", 1)])
@pytest.mark.parametrize("n_stages, microbatches", [(2, 8), (4, 4), (4, 8)])
def test_schedules_equal_the_unsharded_step(zoo_case, schedule: str, repeats: int, n_stages: int,
                                           microbatches: int) -> None:
    case = zoo_case("haiku-mlp")
    _check(case, _plan(case, schedule, n_stages, microbatches, repeats))


def test_schedules_the_executors_cannot_run_are_refused(zoo_case) -> None:
    case = zoo_case("haiku-mlp")
    plan = _plan(case, "interleaved-1f1b", 2, 3, repeats=2)
    with pytest.raises(RunError, match="3 microbatches is not a multiple of 2"):
        parallelize(case.model.train_step(), plan)
    plan = _plan(case, "interleaved-1f1b", 2, 4, repeats=2)
    with pytest.raises(RunError, match="spmd executor runs GPipe only; a plan with schedule interleaved-1f1b needs the mpmd"):
        parallelize(case.model.train_step(), plan, executor="spmd")
    plan = _plan(case, "zb-h1", 2, 4, repeats=2)
    with pytest.raises(RunError, match="runs the gpipe schedule .* or interleaved-1f1b .*, not zb-h1"):
        parallelize(case.model.train_step(), plan)
