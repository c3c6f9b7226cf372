"""Options and their prices: migration by hand, the re-solve against brute force on <= 8 devices."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from hlomap.cost.cluster import load_cluster
from hlomap.cost.pipeline.profile import PipelineProfile
from hlomap.cost.pipeline.costs import gpipe_latency
from hlomap.cost.pipeline.stages import PipelinePlan, Schedule
from tests.tasks.oracle import pipeline_brute_force
from hlomap.tasks.placement.pipeline_costs import PipelineModel
from hlomap.tasks.replan.options import (CHECKPOINT_BANDWIDTH, STATE_FACTOR, Option, RunningPlan, Workload, best_move,
                                         migration, plan_step_seconds, resolve)
from hlomap.tasks.pipeline.solution import NoFeasiblePlan
from hlomap.tasks.replan.policies import Replay
from hlomap.tasks.replan.trace import Event, Trace, device_sets, sub_cluster

from tests.tasks.replan.helpers import small_workload


def _four_blocks() -> Workload:
    profile = PipelineProfile(names=("a", "b", "c", "d"), forward_time=np.full(4, 1e-3), backward_time=np.full(4, 2e-3),
                              activation_bytes=np.full(3, 1e6), parameter_bytes=np.array([1e8, 2e8, 3e8, 4e8]))
    return Workload(profile, microbatches=4, replication=(1, 2), max_stages=2)


def test_migration_by_hand():
    cluster = load_cluster("hier:2x2")  # 0,1 | 2,3: NVLink inside, 25 GbE between
    state = Trace("t", cluster, 10.0, ()).states()[0][1]
    workload = _four_blocks()
    old = RunningPlan((0, 2, 4), ((0, 1), (2, 3)))
    new = RunningPlan((0, 3, 4), ((0, 1), (2, 3)))
    # devices 0 and 1 need block 2 (3e8 parameter bytes): both pull it from device 2 (the first of
    # the equally fast holders), which sends twice in a row.
    one = cluster.latency[2, 0] + STATE_FACTOR * 3e8 / cluster.bandwidth[2, 0]
    moved = migration(workload, old, new, state)
    assert moved.nbytes == 2 * STATE_FACTOR * 3e8
    assert moved.seconds == pytest.approx(2 * one, rel=1e-12)
    assert migration(workload, old, old, state) == (0.0, 0.0)


def test_blocks_whose_holders_left_come_from_the_checkpoint():
    cluster = load_cluster("hier:2x2")
    state = Trace("t", cluster, 10.0, (Event(1.0, gpus=(2, 0)),)).states()[1][1]
    workload = _four_blocks()
    old = RunningPlan((0, 2, 4), ((0, 1), (2, 3)))
    new = RunningPlan((0, 2, 4), ((0,), (1,)))
    moved = migration(workload, old, new, state)
    assert moved.nbytes == STATE_FACTOR * (3e8 + 4e8)
    assert moved.seconds == pytest.approx(STATE_FACTOR * 7e8 / CHECKPOINT_BANDWIDTH, rel=1e-12)
    assert math.isinf(plan_step_seconds(workload, old, state, PipelineModel(state.cluster)))  # devices 2, 3 left


@pytest.mark.parametrize("gpus", [(2, 2, 2, 2), (2, 0, 2, 1), (1, 2, 2, 0)])
def test_resolve_is_the_brute_force_optimum_on_the_available_devices(gpus):
    workload = small_workload()
    trace = Trace("t", load_cluster("hier:4x2"), 10.0, (Event(1.0, ((0, 2, 2e8),), gpus),))
    state = trace.states()[1][1]
    model = PipelineModel(state.cluster)
    plan, step = resolve(workload, state, model)
    optimum = pipeline_brute_force(workload.profile, state.cluster, workload.space())
    assert step == pytest.approx(optimum.value, rel=1e-9)
    assert plan_step_seconds(workload, plan, state, model) == pytest.approx(step, rel=1e-12)
    assert {d for stage in plan.devices for d in stage} <= set(state.devices)


@pytest.mark.parametrize("straggler", [0, 3, 5])  # each on a device of the full-speed plan
def test_resolve_around_a_straggler_is_the_brute_force_optimum(straggler):
    """A device at half speed: the stage holding it computes at its pace (its replicas wait), in
    the closed form, the simulator and the DP alike; the re-solve is the brute-force optimum of the
    slowed cluster's device sets (every device, filled in order; those at full speed; the full
    servers), never slower than the DP on every device, and no slower there than the plan chosen
    at full speed."""
    workload = small_workload()
    cluster = load_cluster("hier:4x2")
    trace = Trace("t", cluster, 10.0, (Event(1.0, speed=((straggler, 0.5),)),))
    (_, full), (_, slowed) = trace.states()
    model = PipelineModel(slowed.cluster)
    plan, step = resolve(workload, slowed, model)
    optima = [pipeline_brute_force(workload.profile, sub_cluster(slowed.cluster, keep), workload.space()).value
              for keep in device_sets(slowed.cluster)]
    assert step == pytest.approx(min(optima), rel=1e-9)
    assert step <= optima[0]  # every device, the DP's own space
    if straggler == 0:  # a plan on every device fills device 0 first: leaving the straggler out is faster
        assert step < optima[0]
    before, _ = resolve(workload, full, PipelineModel(full.cluster))
    assert any(straggler in stage for stage in before.devices)
    kept = plan_step_seconds(workload, before, slowed, model)
    assert kept > plan_step_seconds(workload, before, full, PipelineModel(full.cluster))
    assert step <= kept
    # the event simulator slows the stage holding the straggler: under GPipe it equals the closed
    # form on both clusters
    stages = before.on(slowed).stages
    gpipe = PipelinePlan(stages, workload.microbatches, Schedule.GPIPE)
    lengths = []
    for state in (full, slowed):
        events = PipelineModel(state.cluster).simulate(workload.profile, gpipe)
        assert events.length == pytest.approx(gpipe_latency(workload.profile, state.cluster, gpipe), rel=1e-12)
        lengths.append(events.length)
    assert lengths[1] > lengths[0]


def test_a_resolve_moves_to_the_full_server_when_a_device_leaves_another():
    """Device 1 of hier:2x2 leaves: the DP on every remaining device puts its first stage on device
    0 and its second across the slow link; the re-solve also plans on server 1 alone, which is as
    fast as the plan at full strength (stages of one device each, so that no replica can use a
    third device)."""
    workload = Workload(small_workload().profile, microbatches=8, replication=(1,), max_stages=2)
    trace = Trace("t", load_cluster("hier:2x2"), 10.0, (Event(1.0, gpus=(1, 2)),))
    (_, full), (_, left) = trace.states()
    plan, step = resolve(workload, left, PipelineModel(left.cluster))
    every = PipelineModel(left.cluster).solve(workload.profile, workload.space()).cost.latency
    assert {d for stage in plan.devices for d in stage} <= {2, 3}
    assert step < every
    assert step == pytest.approx(resolve(workload, full, PipelineModel(full.cluster))[1], rel=1e-9)


def test_a_resolve_leaves_devices_idle_rather_than_stop_training():
    """2 of a server's 4 GPUs leave hier:4x4: 14 devices cannot be cut into at most 2 stages of 1,
    2, 4 or 8 replicas, so a re-solve that must use them all has no plan; one that may leave
    devices idle trains on 12 of them (8 + 4), and is the brute-force optimum of that space."""
    workload = Workload(small_workload().profile, microbatches=8, replication=(1, 2, 4, 8), max_stages=2)
    state = Trace("t", load_cluster("hier:4x4"), 10.0, (Event(1.0, gpus=(4, 2, 4, 4)),)).states()[1][1]
    assert len(state.devices) == 14
    model = PipelineModel(state.cluster)
    every = dataclasses.replace(workload.space(), use_all_devices=True)
    with pytest.raises(NoFeasiblePlan):
        model.solve(workload.profile, every)
    found = resolve(workload, state, model)
    assert found is not None
    plan, step = found
    used = [d for stage in plan.devices for d in stage]
    assert math.isfinite(step) and len(used) < 14 and set(used) <= set(state.devices)
    assert plan_step_seconds(workload, plan, state, model) == pytest.approx(step, rel=1e-12)


def test_the_best_move_shifts_one_boundary_and_is_the_fastest_such():
    workload = small_workload()
    trace = Trace("t", load_cluster("hier:4x2"), 10.0, (Event(1.0, ((0, 1, 5e7), (1, 2, 5e7))),))
    state = trace.states()[1][1]
    model = PipelineModel(state.cluster)
    running = RunningPlan((0, 6, 7, 8), ((0, 1, 2, 3), (4, 5), (6, 7)))  # stage 0 all-reduces over the slow link
    moved = best_move(workload, running, state, model)
    keep = plan_step_seconds(workload, running, state, model)
    every = []
    for cut in range(2):
        for b in range(running.bounds[cut] + 1, running.bounds[cut + 2]):
            bounds = list(running.bounds)
            bounds[cut + 1] = b
            if 0 < abs(b - running.bounds[cut + 1]) <= 4:
                every.append(plan_step_seconds(workload, RunningPlan(tuple(bounds), running.devices), state, model))
    assert moved is not None and moved[1] == pytest.approx(min(every)) and moved[1] < keep
    assert sum(a != b for a, b in zip(moved[0].bounds, running.bounds)) == 1
    offered = Replay(trace, workload).candidates(1, running)
    assert [c.option for c in offered][:2] == [Option.KEEP, Option.MOVE]
