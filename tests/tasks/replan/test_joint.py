"""Re-planning joint plans (stages with their own data x model meshes) over traces: prices equal
the joint planner's on full servers, a re-solve is the joint DP's optimum and never stops
training while a device remains, partial servers and stragglers are planned around, migration
by hand, and the policies' ordering (no policy trains more than the oracle)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from hlomap.cost.cluster import hierarchical, load_cluster
from hlomap.cost.pipeline.stages import Schedule
from hlomap.plan import Plan
from hlomap.tasks.joint.costs import StageOption
from hlomap.tasks.joint.explore import JointResult, explore_joint, joint_model, joint_plan
from hlomap.tasks.joint.plans import evaluate
from hlomap.tasks.joint.solve import JointSpace, solve
from hlomap.tasks.placement.problem import PlacementError
from hlomap.tasks.replan.joint import JointReplay, RunningJoint, joint_migration, state_bytes
from hlomap.tasks.replan.trace import device_sets
from hlomap.tasks.replan.options import CHECKPOINT_BANDWIDTH, Option
from hlomap.tasks.replan.policies import ReplanPolicy, run_policy
from hlomap.tasks.replan.replay_plan import replan_plan
from hlomap.tasks.replan.trace import Event, ResourceState, Trace


def _saved(cap: Any, option: StageOption, topology: str = "hier:2x4", stages: int = 2,
           schedule: Schedule = Schedule.ONE_F_ONE_B, microbatches: tuple[int, ...] = (2, 4)) -> Plan:
    """`cap`'s exact joint plan with every stage on `option`, as a plan file holds it."""
    model = joint_model(cap, load_cluster(topology))
    plan, _ = solve(model, JointSpace((option,), microbatches, schedule, max_stages=stages))
    assert plan.n_stages == stages
    return joint_plan(JointResult(model, plan, evaluate(model, plan), (), 0.0, "exact", 1))


def _trace(*events: Event, topology: str = "hier:2x4") -> Trace:
    return Trace("t", load_cluster(topology), 10_000.0, events)


@pytest.fixture(scope="module")
def tensor_parallel(cap_of: Any) -> tuple[Any, Plan]:
    """gpt-tiny cut into 2 stages of data=2 x model=2 on hier:2x4."""
    cap = cap_of("gpt-tiny")
    return cap, _saved(cap, StageOption(4, 2, 2))


def test_a_saved_joint_plan_prices_as_the_planner_priced_it(tensor_parallel: tuple[Any, Plan]) -> None:
    """On the trace's full cluster (equal servers) the replay's step for the saved plan is the
    joint planner's L, and a re-solve is the joint DP's optimum there, priced the same."""
    cap, saved = tensor_parallel
    replay = JointReplay.of_plan(cap, saved, _trace())
    assert replay.initial.plan.stages[0].devices == (0, 1, 2, 3)
    assert replay.step_seconds(0, replay.initial) == pytest.approx(saved.estimate["step_seconds"], rel=1e-9)
    solved = replay.solved(0)
    assert solved is not None
    optimum = explore_joint(cap, load_cluster("hier:2x4"), model=replay.model(0))
    assert solved[1] == pytest.approx(optimum.cost.latency, rel=1e-9)
    assert solved[1] <= replay.step_seconds(0, replay.initial) * (1 + 1e-9)


@pytest.mark.parametrize("option", [StageOption(8, 2, 4), StageOption(8, 4, 2, split_state=True)])
def test_the_spmd_plan_of_task_auto_is_a_one_stage_joint_plan(cap_of: Any, option: StageOption) -> None:
    """`--task auto` writes a one-stage plan as an SPMD plan (no pipeline section); the replay
    reads it back as that stage (its mesh, its state split) at the planner's price."""
    cap = cap_of("gpt-tiny")
    saved = _saved(cap, option, stages=1, microbatches=(1,))
    assert saved.pipeline is None and saved.search["task"] == "auto"  # type: ignore[index]
    assert (saved.state_sharding is not None) == option.split_state
    replay = JointReplay.of_plan(cap, saved, _trace(Event(1.0, gpus=(4, 3))))
    stage, = replay.initial.plan.stages
    assert stage.option == option and replay.initial.plan.microbatches == 1
    assert replay.step_seconds(0, replay.initial) == pytest.approx(saved.estimate["step_seconds"], rel=1e-9)
    assert not math.isfinite(replay.step_seconds(1, replay.initial))
    solved = replay.solved(1)
    assert solved is not None and math.isfinite(solved[1]) and 7 not in solved[0].devices()


@pytest.mark.parametrize("gpus", [(4, 3), (2, 0), (1, 0), (0, 1)])
def test_a_joint_re_solve_trains_while_one_device_remains(tensor_parallel: tuple[Any, Plan],
                                                          gpus: tuple[int, int]) -> None:
    cap, saved = tensor_parallel
    replay = JointReplay.of_plan(cap, saved, _trace(Event(1.0, gpus=gpus)))
    state = replay.states[1][1]
    assert not math.isfinite(replay.step_seconds(1, replay.initial))  # device 7 or 4.. left
    solved = replay.solved(1)
    assert solved is not None and math.isfinite(solved[1])
    assert set(solved[0].devices()) <= set(state.devices)
    assert solved[1] == pytest.approx(replay.step_seconds(1, solved[0]), rel=1e-12)


def test_a_partial_server_is_planned_around(tensor_parallel: tuple[Any, Plan]) -> None:
    """With 2 of server 1's 4 GPUs gone on hier:4x4, the re-solve is at least as fast as the saved
    plan moved whole onto two full servers (the DP on every device alone pairs devices across
    servers); the device sets it plans on include the full servers."""
    cap, _ = tensor_parallel
    saved = _saved(cap, StageOption(4, 2, 2), "hier:4x4")
    replay = JointReplay.of_plan(cap, saved, _trace(Event(1.0, gpus=(4, 2, 4, 4)), topology="hier:4x4"))
    state = replay.states[1][1]
    assert (0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13) in device_sets(state.cluster)  # servers 0, 2, 3
    moved = RunningJoint(replay.initial.plan.__class__(tuple(
        st.__class__(st.start, st.stop, tuple(d + 8 for d in st.devices), st.model, st.kind, st.recompute,
                     st.split_state, st.shard_parameters) for st in replay.initial.plan.stages),
        replay.initial.plan.microbatches, replay.initial.plan.schedule))
    solved = replay.solved(1)
    assert solved is not None
    assert solved[1] <= replay.step_seconds(1, moved) * (1 + 1e-9)
    assert replay.step_seconds(1, moved) == pytest.approx(replay.step_seconds(0, replay.initial), rel=1e-9)


def test_a_straggler_slows_its_stage_and_the_re_solve_leaves_it_out(tensor_parallel: tuple[Any, Plan]) -> None:
    cap, saved = tensor_parallel
    replay = JointReplay.of_plan(cap, saved, _trace(Event(1.0, speed=((1, 0.25),))))
    slow, fast = replay.step_seconds(1, replay.initial), replay.step_seconds(0, replay.initial)
    assert slow > fast
    solved, optimum = replay.solved(1), replay.solved(0)
    assert solved is not None and optimum is not None and solved[1] <= slow
    assert 1 in optimum[0].devices()  # at full speed the optimum uses device 1 ...
    assert 1 not in solved[0].devices()  # ... at a quarter of it the re-solve leaves it out (the DP cannot see it)
    assert solved[1] < replay.step_seconds(1, optimum[0])


def test_joint_migration_by_hand(tensor_parallel: tuple[Any, Plan]) -> None:
    """Swapping the two stages' devices moves every layer's state to every device; swapping the
    two model shards of a data replica moves what the swapped devices hold; a device whose layers'
    holders all left reads them from the checkpoint."""
    cap, saved = tensor_parallel
    replay = JointReplay.of_plan(cap, saved, _trace(Event(1.0, gpus=(4, 2))))
    model, state = replay.model(0), replay.states[0][1]
    plan = replay.initial.plan
    assert model is not None
    a, b = plan.stages
    option = a.option
    assert joint_migration(model, plan, plan, state) == (0.0, 0.0)

    swapped = plan.__class__((a.__class__(a.start, a.stop, b.devices, a.model, a.kind),
                              b.__class__(b.start, b.stop, a.devices, b.model, b.kind)), plan.microbatches, plan.schedule)
    moved = joint_migration(model, plan, swapped, state)
    per_device = [sum(state_bytes(model, st.option, layer) for layer in range(st.start, st.stop)) for st in plan.stages]
    assert moved.nbytes == pytest.approx(4 * sum(per_device), rel=1e-12)

    shards = plan.__class__((a.__class__(a.start, a.stop, (1, 0, 2, 3), a.model, a.kind), b), plan.microbatches,
                            plan.schedule)
    moved = joint_migration(model, plan, shards, state)
    assert moved.nbytes == pytest.approx(2 * per_device[0], rel=1e-12)
    link = state.cluster.p2p_time(0, 1, per_device[0])
    assert moved.seconds == pytest.approx(link, rel=1e-12)  # 1 -> 0 and 0 -> 1 at once

    # stage 1 ran on 4..7; on the next state only 4, 5 are there: device 4 alone keeps stage 1's layers
    later = replay.states[1][1]
    alone = plan.__class__((a, b.__class__(b.start, b.stop, (4,), 1, b.kind)), plan.microbatches, plan.schedule)
    assert option.model == 2
    moved = joint_migration(replay.model(1), plan, alone, later)  # type: ignore[arg-type]
    bytes_4 = sum(state_bytes(replay.model(1), alone.stages[1].option, layer)  # type: ignore[arg-type]
                  for layer in range(b.start, b.stop))
    assert moved.nbytes == pytest.approx(bytes_4, rel=1e-12)  # from device 5, its former model partner

    gone = ResourceState(load_cluster("hier:2x4"), np.full((2, 2), 1e10), (4, 0))
    only_first = plan.__class__((a.__class__(a.start, b.stop, a.devices, a.model, a.kind),), plan.microbatches,
                                plan.schedule)
    moved = joint_migration(model, plan, only_first, gone)
    stage_1 = sum(state_bytes(model, a.option, layer) for layer in range(b.start, b.stop))
    assert moved.seconds == pytest.approx(stage_1 / CHECKPOINT_BANDWIDTH, rel=1e-9)


def test_no_policy_trains_more_than_the_oracle_on_a_joint_plan(tensor_parallel: tuple[Any, Plan]) -> None:
    cap, saved = tensor_parallel
    base = hierarchical(2, 4).bandwidth[0, 4]
    trace = _trace(Event(2000.0, ((0, 1, base * 0.02),)), Event(4000.0, gpus=(4, 1)),
                   Event(6000.0, gpus=(4, 4), speed=((2, 0.5),)), Event(8000.0, speed=((2, 1.0),)))
    report = replan_plan(saved, trace, cap=cap)
    oracle = report.runs[ReplanPolicy.ORACLE].horizon_iterations
    for policy in (ReplanPolicy.STATIC, ReplanPolicy.RESOLVE, ReplanPolicy.ARBITER):
        run = report.runs[policy]
        assert run.horizon_iterations <= oracle * (1 + 1e-9)
        assert all(math.isfinite(d.step_seconds) for d in run.decisions)  # never "cannot run"
    static = report.runs[ReplanPolicy.STATIC]
    assert static.decisions[2].option is Option.RESOLVE  # forced: devices 5..7 left
    assert report.runs[ReplanPolicy.ARBITER].horizon_iterations >= static.horizon_iterations * (1 - 1e-9)
    replay = JointReplay.of_plan(cap, saved, trace)
    assert run_policy(replay, replay.initial, ReplanPolicy.ORACLE).horizon_iterations == pytest.approx(oracle)


def test_a_joint_plan_needs_its_step_and_a_trace_that_holds_it(tensor_parallel: tuple[Any, Plan],
                                                               tmp_path: Any) -> None:
    from hlomap import api

    cap, saved = tensor_parallel
    with pytest.raises(PlacementError, match="give its SOURCE"):
        replan_plan(saved, _trace(), cap=None)
    _trace().save(tmp_path / "trace.json")
    assert api.replans_from_module(saved)
    with pytest.raises(api.InputError, match="give its step as source="):
        api.prepare_replan(saved, tmp_path / "trace.json", use_meta=False)
    job = api.prepare_replan(saved, tmp_path / "trace.json", use_meta=False, source=cap)
    assert job.cap is cap and job.network is None
    with pytest.raises(PlacementError, match="has a cluster of 4 devices"):
        JointReplay.of_plan(cap, saved, _trace(topology="hier:1x4"))
