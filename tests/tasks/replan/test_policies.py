"""Policies over traces: the oracle against brute force over plan sequences (8 devices), the
ordering static <= arbiter <= oracle on a bandwidth drop, forced re-plans, the meta network."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from hlomap.cost.cluster import load_cluster
from hlomap.tasks.replan.meta import MetaPolicy, _model, load_network, samples, save_network, train_meta
from hlomap.tasks.replan.options import Option, initial_plan, migration
from hlomap.tasks.replan.policies import ReplanPolicy, Replay, oracle_pool, run_policy
from hlomap.tasks.replan.trace import Event, Trace

from tests.tasks.replan.helpers import small_workload

SERVERS = [(a, b) for a in range(4) for b in range(a + 1, 4)]


def _drop(share: float, at: float) -> Event:
    base = load_cluster("hier:4x2").bandwidth[0, 2]
    return Event(at, tuple((a, b, base * share) for a, b in SERVERS))


def _horizon_iterations(replay: Replay, initial, sequence) -> float:
    """Iterations trained by the horizon holding `sequence[i]` from change i, migration blocking
    (an accounting written apart from the policies' own)."""
    times = [t for t, _ in replay.states] + [replay.trace.horizon]
    total, carry, current = 0.0, 0.0, initial
    for i, plan in enumerate(sequence):
        state = replay.states[i][1]
        step = replay.step_seconds(i, plan)
        if not math.isfinite(step):
            return -math.inf  # a plan on devices that left (or out of memory) cannot be chosen
        blocked = carry + (migration(replay.workload, current, plan, state).seconds if plan != current else 0.0)
        length = times[i + 1] - times[i]
        total += max(length - blocked, 0.0) / step
        carry, current = max(blocked - length, 0.0), plan
    return total


def test_the_oracle_is_the_best_sequence_of_its_plans():
    workload = small_workload()
    trace = Trace("t", load_cluster("hier:4x2"), 4000.0,
                  (_drop(0.05, 1000.0), Event(2000.0, gpus=(2, 0, 2, 2)), Event(3000.0, gpus=(2, 2, 2, 2))))
    replay = Replay(trace, workload)
    initial = initial_plan(workload, replay.states[0][1])
    pool = oracle_pool(replay, initial)
    assert 2 <= len(pool) <= 10
    best = max(_horizon_iterations(replay, initial, seq) for seq in itertools.product(pool, repeat=len(replay.states)))
    oracle = run_policy(replay, initial, ReplanPolicy.ORACLE)
    assert oracle.horizon_iterations == pytest.approx(best, rel=1e-9)
    for policy in (ReplanPolicy.STATIC, ReplanPolicy.RESOLVE, ReplanPolicy.ARBITER):
        assert run_policy(replay, initial, policy).horizon_iterations <= oracle.horizon_iterations * (1 + 1e-9)


def test_replanning_beats_the_static_plan_when_bandwidth_drops():
    # One GPU per server: stage replicas all-reduce over the network, so a slow network calls for
    # another plan.
    cluster = load_cluster("hier:8x1")
    base = cluster.bandwidth[0, 1]
    drop = Event(2000.0, tuple((a, b, 0.02 * base) for a in range(8) for b in range(a + 1, 8)))
    workload = small_workload()
    replay = Replay(Trace("drop", cluster, 20_000.0, (drop,)), workload)
    initial = initial_plan(workload, replay.states[0][1])
    policies = (ReplanPolicy.STATIC, ReplanPolicy.RESOLVE, ReplanPolicy.ARBITER, ReplanPolicy.ORACLE)
    runs = {p: run_policy(replay, initial, p) for p in policies}
    assert runs[ReplanPolicy.STATIC].decisions[1].option is Option.KEEP
    assert runs[ReplanPolicy.ARBITER].decisions[1].option is not Option.KEEP
    assert runs[ReplanPolicy.ARBITER].total_seconds < 0.9 * runs[ReplanPolicy.STATIC].total_seconds
    for policy in (ReplanPolicy.STATIC, ReplanPolicy.RESOLVE, ReplanPolicy.ARBITER):
        assert runs[policy].horizon_iterations <= runs[ReplanPolicy.ORACLE].horizon_iterations * (1 + 1e-9)
    assert runs[ReplanPolicy.STATIC].iterations == runs[ReplanPolicy.ORACLE].iterations  # one workload for all


def test_the_static_plan_replans_only_when_a_server_leaves():
    workload = small_workload()
    trace = Trace("leave", load_cluster("hier:4x2"), 10_000.0,
                  (Event(1000.0, gpus=(2, 2, 0, 2)), Event(5000.0, gpus=(2, 2, 2, 2))))
    replay = Replay(trace, workload)
    initial = initial_plan(workload, replay.states[0][1])
    static = run_policy(replay, initial, ReplanPolicy.STATIC)
    assert [d.option for d in static.decisions] == [Option.KEEP, Option.RESOLVE, Option.KEEP]
    assert static.decisions[1].migration_seconds > 0 and math.isinf(static.decisions[1].keep_seconds)
    assert all(4 not in stage and 5 not in stage for stage in static.decisions[2].plan.devices)  # stays put


def test_re_solve_keeps_a_running_plan_faster_than_the_dp_on_every_device():
    # Slow links inside two server pairs; server 1 leaves, so the re-solved plan avoids the slow
    # pair 0-1. When it returns, the DP's plan over all eight devices must replicate across a slow
    # link and is slower than the running plan: re-solving to it would lose iterations for
    # nothing (its total time to the workload hid this; its iterations by the horizon showed it).
    cluster = load_cluster("hier:4x2")
    slow = 0.05 * cluster.bandwidth[0, 2]
    trace = Trace("return", cluster, 20_000.0, (Event(1000.0, ((0, 1, slow), (2, 3, slow))),
                                                Event(2000.0, gpus=(2, 0, 2, 2)), Event(3000.0, gpus=(2, 2, 2, 2))))
    workload = small_workload()
    replay = Replay(trace, workload)
    initial = initial_plan(workload, replay.states[0][1])
    assert replay.solved(3)[1] > replay.solved(2)[1]  # the DP on every device is the slower plan
    resolve = run_policy(replay, initial, ReplanPolicy.RESOLVE)
    assert [d.option for d in resolve.decisions] == [Option.KEEP, Option.RESOLVE, Option.RESOLVE, Option.KEEP]
    assert all(d.step_seconds <= d.keep_seconds for d in resolve.decisions)
    arbiter = run_policy(replay, initial, ReplanPolicy.ARBITER)
    assert resolve.horizon_iterations >= arbiter.horizon_iterations * (1 - 1e-3)


def test_the_meta_network_trains_saves_and_chooses(tmp_path):
    workload = small_workload()
    trace = Trace("t", load_cluster("hier:4x2"), 8000.0, (_drop(0.05, 1000.0), _drop(1.0, 3000.0),
                                                           Event(5000.0, gpus=(2, 0, 2, 2))))
    initial = initial_plan(workload, trace.states()[0][1])
    data = samples(trace, workload, initial)
    assert len(data) == 4 and data[0].history.shape[0] == 8
    assert all(np.isfinite(s.gains).all() for s in data)
    params, loss = train_meta(data, steps=100)
    assert loss < float(np.mean([np.sum(s.gains[s.present] ** 2) for s in data])) + 1e-12
    save_network(tmp_path / "gain.npz", params)
    model, loaded, meta = load_network(tmp_path / "gain.npz")
    x = np.stack([s.history for s in data])
    np.testing.assert_allclose(np.asarray(model.apply(loaded, x)), np.asarray(_model()[0].apply(params, x)), rtol=1e-6)
    chooser = MetaPolicy(trace.horizon, (model, loaded, meta))
    result = run_policy(Replay(trace, workload), initial, ReplanPolicy.META, chooser=chooser)
    assert len(result.decisions) == 4 and 0.0 <= chooser.agreement <= 1.0


def test_a_pipeline_re_solved_with_its_step_keeps_to_stages_a_microbatch_splits_over() -> None:
    """gpt-tiny's batch of 8 in 8 microbatches leaves one example per microbatch: the runner cannot
    split it over a stage's replicas. With the step known, a re-solve offers none (and so no
    spurious gain on a trace where nothing changes); without it, every replication factor."""
    from hlomap import api
    from hlomap.tasks.replan.replay_plan import replan_plan, workload_of

    cap = api.load_source("zoo:gpt-tiny")
    plan = api.explore(cap, task="pipeline", agent="dp", stages=2, microbatches=8, cluster="hier:4x4")
    assert cap.batch_size == 8 and {len(s) for s in plan.stage_devices()} == {1}
    assert workload_of(plan)[0].replication == (1, 2, 4, 8)
    assert workload_of(plan, batch=cap.batch_size)[0].replication == (1,)
    quiet = Trace("nothing changes", load_cluster("hier:4x4"), 3600.0, ())
    resolve = replan_plan(plan, quiet, cap=cap).runs[ReplanPolicy.RESOLVE]
    assert [d.option for d in resolve.decisions] in ([], [Option.KEEP])
    # without the step, the re-solve takes replicated stages the runner would refuse
    blind = replan_plan(plan, quiet).runs[ReplanPolicy.RESOLVE]
    assert any(len(group) > 1 for d in blind.decisions for group in getattr(d.plan, "devices", ()))
