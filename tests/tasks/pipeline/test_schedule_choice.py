"""The pipeline task's `schedule="auto"`: the found stages priced under every schedule the runner
runs (and interleaved 1F1B with two chunks per stage), the fastest that fits memory kept; the
plan it writes runs with the unsharded step's loss."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from hlomap.cost.cluster import uniform
from hlomap.cost.devices import device_preset
from hlomap.cost.pipeline.costs import CommModel, CostOptions
from hlomap.cost.pipeline.profile import uniform_profile
from hlomap.cost.pipeline.stages import PipelinePlan, Schedule
from hlomap.tasks.pipeline.schedules import choose_schedule, interleaved_variant, schedule_options

FREE = CostOptions(comm=CommModel.IGNORED)


def _plan(layers: int = 8, stages: int = 4, microbatches: int = 8) -> PipelinePlan:
    bounds = [layers * s // stages for s in range(stages + 1)]
    return PipelinePlan.linear(bounds, (1,) * stages, microbatches=microbatches, schedule=Schedule.ONE_F_ONE_B)


def test_interleaving_cuts_equal_compute_and_shrinks_the_bubble() -> None:
    profile = uniform_profile(8, forward_time=1.0, backward_time=2.0)
    cluster = uniform(4, "V100-16GB", bandwidth=1e30, latency=0.0)
    plan = _plan()
    chunked = interleaved_variant(profile, plan, 2)
    assert chunked is not None and chunked.repeats == 2 and chunked.schedule is Schedule.INTERLEAVED
    assert [(s.start, s.stop) for s in chunked.stages] == [(k, k + 1) for k in range(8)]
    assert [s.devices for s in chunked.stages] == [plan.stages[k % 4].devices for k in range(8)]
    seconds = {o.label: o.seconds for o in schedule_options(profile, cluster, plan, FREE)}
    # equal stages, free links: (M + S - 1) passes of a 6 s stage under 1F1B, (V M + S - 1) of a 3 s
    # chunk under interleaving
    assert seconds["1f1b"] == pytest.approx((8 + 3) * 6.0)
    assert seconds["interleaved-1f1b V=2"] == pytest.approx((2 * 8 + 3) * 3.0)
    assert seconds["zb-h1"] < seconds["1f1b"]
    assert choose_schedule(profile, cluster, plan, FREE).label == "interleaved-1f1b V=2"


def test_gpipe_over_alike_stages_is_priced_as_the_spmd_executor_runs_it() -> None:
    """GPipe over alike stages runs on the spmd executor, whose lockstep ticks run every stage in
    every tick and the forward again in a backward tick: the chooser compares that, not the
    schedule's overlapping L, so it keeps 1F1B (the mpmd executor) where the two schedules' L tie."""
    from hlomap.cost.pipeline.costs import lockstep_latency

    profile = uniform_profile(8, forward_time=1.0, backward_time=2.0)
    cluster = uniform(4, "V100-16GB", bandwidth=1e30, latency=0.0)
    options = {o.label: o for o in schedule_options(profile, cluster, _plan(), FREE)}
    gpipe, one_f_one_b = options["gpipe"], options["1f1b"]
    assert gpipe.executor == "spmd" and one_f_one_b.executor == "mpmd"
    assert gpipe.simulation.length == pytest.approx(one_f_one_b.simulation.length)
    assert gpipe.seconds == pytest.approx(lockstep_latency(profile, cluster, gpipe.plan, remat=True))
    assert gpipe.seconds > one_f_one_b.seconds == pytest.approx(one_f_one_b.simulation.length)
    assert choose_schedule(profile, cluster, _plan(), FREE).plan.schedule is not Schedule.GPIPE


def test_no_interleaving_where_it_cannot_run() -> None:
    profile = uniform_profile(8, forward_time=1.0, backward_time=2.0)
    assert interleaved_variant(profile, _plan(microbatches=6), 2) is None  # M is no multiple of S
    assert interleaved_variant(uniform_profile(6, forward_time=1.0, backward_time=2.0), _plan(layers=6, stages=4), 2) is None
    wide = PipelinePlan.linear([0, 4, 8], (1, 2), microbatches=8)
    assert interleaved_variant(profile, wide, 2) is None  # stages of different widths


def test_a_schedule_that_does_not_fit_is_not_chosen() -> None:
    """GPipe holds all M microbatches on every stage, 1F1B at most S - s: with room for four
    stashes, GPipe (eight) is out even where it would be as fast."""
    profile = dataclasses.replace(uniform_profile(8, forward_time=1.0, backward_time=2.0),
                                  stash_bytes=np.full(8, 2.0**30))
    device = dataclasses.replace(device_preset("V100-16GB"), memory_bytes=int(4.5 * 2**31))
    cluster = uniform(4, device, bandwidth=1e30, latency=0.0)
    options = {o.label: o for o in schedule_options(profile, cluster, _plan(), FREE)}
    assert not options["gpipe"].simulation.feasible and options["1f1b"].simulation.feasible
    assert choose_schedule(profile, cluster, _plan(), FREE).plan.schedule is not Schedule.GPIPE


@pytest.mark.slow  # the fast suite runs an explored interleaved plan below
def test_explore_with_schedule_auto_runs_with_the_unsharded_loss() -> None:
    import jax

    import hlomap
    from hlomap import zoo

    model = zoo.get("gpt-tiny")
    step, args = model.train_step(), model.example_args(0)
    cap = hlomap.capture(step, *args, arg_names=model.arg_names)
    plan = hlomap.explore(cap, task="pipeline", stages=2, microbatches=4, schedule="auto", cluster="hier:2x4",
                          agent="dp")
    assert plan.pipeline.schedule.value in {"1f1b", "gpipe", "zb-h1", "interleaved-1f1b"}
    parallel = hlomap.parallelize(step, plan)
    params, opt_state = parallel.place(args[0], args[1])
    _, _, loss = parallel(params, opt_state, *args[2:])
    _, _, want = jax.jit(step)(*args)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)


@pytest.mark.slow  # 30-45 s; interleaved plans run in the fast set: tests/run/test_schedules.py
def test_an_interleaved_choice_is_written_as_a_plan_the_runner_runs(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Where the chooser keeps interleaved 1F1B, the plan lists the S device stages, the S V - 1
    cuts and `repeats` V, and runs with the unsharded step's loss (gpt-tiny's layers are too few
    and uneven for the cost model to choose it, so the choice is forced here)."""
    import jax

    import hlomap
    from hlomap import zoo
    from hlomap.tasks.pipeline import explore as explore_module

    def interleaved(profile, cluster, plan, options, **kwargs):  # type: ignore[no-untyped-def]
        return next(o for o in schedule_options(profile, cluster, plan, options) if o.plan.repeats == 2)

    monkeypatch.setattr(explore_module, "choose_schedule", interleaved)
    model = zoo.get("gpt-tiny")
    step, args = model.train_step(), model.example_args(0)
    cap = hlomap.capture(step, *args, arg_names=model.arg_names)
    plan = hlomap.explore(cap, task="pipeline", stages=2, microbatches=4, schedule="auto", cluster="hier:2x4",
                          agent="dp")
    section = plan.pipeline
    assert section.schedule is Schedule.INTERLEAVED and section.repeats == 2
    assert len(section.stages) == 2 and len(section.cuts) == 3
    # priced again from the plan file's block profile (its 4 chunks on the 2 stages' devices) as
    # the explorer priced it; placed with its chunks (the plan priced whole per trial) and priced
    # on its placement; re-planning it is refused by name
    from hlomap.api import simulate_plan

    priced = simulate_plan(None, plan, cluster="hier:2x4")
    assert priced.executor == "mpmd" and priced.estimate.placed.plan.repeats == 2
    assert priced.step_seconds == pytest.approx(plan.estimate["step_seconds"], rel=1e-9)
    from hlomap.cli import run

    path = tmp_path / "interleaved.json"
    plan.save(path)
    assert run(["simulate", "zoo:gpt-tiny", "--plan", str(path), "--cluster", "hier:2x4"]) == 0
    out = capsys.readouterr().out
    assert "2 stages x 2 model chunks" in out and "stage 2:" not in out  # busy per device stage
    assert run(["place", str(path), "--cluster", "random:8:1", "--agent", "exact", "--budget-evaluations", "50000",
                "--json", "-q"]) == 0
    placed = json.loads(capsys.readouterr().out)
    again = simulate_plan(None, hlomap.Plan.load(tmp_path / "interleaved.placed.json"), cluster="random:8:1")
    assert again.estimate.placed_model_seconds == pytest.approx(placed["step_seconds"], rel=1e-9)
    assert placed["step_seconds"] <= placed["identity_step_seconds"]
    from hlomap.tasks.placement.problem import PlacementError
    from hlomap.tasks.replan.replay_plan import workload_of

    with pytest.raises(PlacementError, match="2 model chunks per stage .*re-planning takes one chunk"):
        workload_of(plan)
    parallel = hlomap.parallelize(step, plan)
    params, opt_state = parallel.place(args[0], args[1])
    _, _, loss = parallel(params, opt_state, *args[2:])
    _, _, want = jax.jit(step)(*args)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
