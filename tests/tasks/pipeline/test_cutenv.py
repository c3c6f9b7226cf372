"""The cut environment against the brute force: reachable plans, returns, masks."""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hlomap.cost.cluster import Cluster, cluster_preset
from hlomap.cost.pipeline.costs import evaluate_plan
from hlomap.cost.pipeline.links import with_device_memory
from hlomap.cost.pipeline.profile import uniform_profile
from hlomap.cost.pipeline.stages import Schedule
from hlomap.tasks.pipeline.solution import NoFeasiblePlan
from hlomap.tasks.pipeline.space import PipelineObjective, PipelineSpace
from tests.tasks.oracle import pipeline_plans
from hlomap.tasks.pipeline.cutenv import FEATURES, CutEnv, CutTask, center_device_bounds
from hlomap.tasks.pipeline.space import inadmissible
from tests.tasks.pipeline.strategies import profiles, uniform_cluster


@pytest.mark.parametrize("preset, stages, bounds", [
    ("A", 2, (0, 8, 16)),
    ("B", 3, (0, 8, 16, 24)),
    ("C", 4, (0, 8, 16, 24, 32)),
    ("C", 2, (0, 16, 32)),
    ("C", 3, (0, 8, 24, 32)),  # nearest servers to 10.7 and 21.3
    ("A", 4, (0, 4, 8, 12, 16)),
])
def test_center_device_cuts_sit_on_server_boundaries(preset, stages, bounds):
    assert center_device_bounds(cluster_preset(preset), stages) == bounds


@st.composite
def tasks(draw, *, objective=None):
    profile = draw(profiles(min_layers=3, max_layers=7))
    # sometimes with the optimizer update priced: each replica updates its stage's parameters
    profile = dataclasses.replace(profile, update_seconds_per_byte=draw(st.sampled_from([0.0, 1e-9])))
    stages = draw(st.integers(2, min(4, profile.n_layers)))
    per_node = draw(st.sampled_from([1, 2]))
    d = stages * per_node
    bandwidth = np.array(draw(st.lists(st.floats(1e8, 1e10), min_size=d * d, max_size=d * d)))
    memory = draw(st.sampled_from([math.inf, 3e9]))
    cluster = with_device_memory(Cluster(
        "hypothesis", cluster_preset("A").devices[:1] * d, tuple(i // per_node for i in range(d)),
        bandwidth.reshape(d, d), np.full((d, d), 1e-5)), memory)
    space = PipelineSpace(
        microbatches=draw(st.integers(1, 6)),
        schedule=draw(st.sampled_from([Schedule.GPIPE, Schedule.ONE_F_ONE_B])),  # what the explorers offer
        objective=objective or draw(st.sampled_from(PipelineObjective)),
        replication=(per_node,),
        cut_on_node_boundary=True,
        require_trainable=draw(st.booleans()),
        check_memory=memory < math.inf,
    )
    return CutTask(profile, cluster, space, stages)


def _leaves(env: CutEnv, prefix=()):
    """Every complete episode: (actions, return + the start potential, outcome), by replaying
    prefixes from reset (a shaped return is the final reward - the start state's potential)."""
    timestep = env.reset(0)
    total = env.potential if env.shaping else 0.0
    for action in prefix:
        timestep = env.step(action)
        total += timestep.reward
    if timestep.last:
        yield prefix, total, env.outcome
        return
    for action in np.flatnonzero(timestep.legal):
        yield from _leaves(env, prefix + (int(action),))


def _admissible_plans(task: CutTask):
    """Brute force: S-stage plans on the center device groups that `space` admits."""
    center = task.center
    found = {}
    for plan in pipeline_plans(task.profile, task.cluster, task.space):
        if plan.n_stages != task.n_stages:
            continue
        if tuple(s.devices[0] for s in plan.stages) + (task.cluster.n_devices,) != center:
            continue
        cost = evaluate_plan(task.profile, task.cluster, plan, task.space.cost)
        space = task.space
        ignore_memory = PipelineSpace(**{**space.__dict__, "check_memory": False})
        if inadmissible(task.profile, task.cluster, plan, ignore_memory, cost) is None:
            found[plan.cuts] = cost
    return found


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(task=tasks(), shaping=st.booleans())
def test_episodes_reach_exactly_the_admissible_plans_with_returns_of_one_over_l(task, shaping):
    expected = _admissible_plans(task)
    env = CutEnv(task, shaping=shaping)
    try:
        leaves = list(_leaves(env))
    except NoFeasiblePlan:
        assert not expected
        return
    reached = {}
    for actions, total, outcome in leaves:
        assert outcome is not None, f"dead end after {actions}"
        cost = expected[outcome.plan.cuts]
        value = cost.latency if task.space.objective is PipelineObjective.LATENCY else cost.bottleneck
        assert outcome.value == pytest.approx(value, rel=1e-12)
        feasible = cost.feasible or not task.space.check_memory
        want = (env.reference / value if value > 0 else 1.0) if feasible else -task.oom_penalty
        assert total == pytest.approx(want, rel=1e-9, abs=1e-12)
        reached[outcome.plan.cuts] = outcome
    assert set(reached) == set(expected)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(task=tasks(objective=PipelineObjective.LATENCY))
def test_last_cut_estimate_is_exact_and_ranking_puts_the_best_first(task):
    env = CutEnv(task)
    ranked = CutEnv(task, ranked=1)
    try:
        timestep = env.reset(0)
        ranked_step = ranked.reset(0)
    except NoFeasiblePlan:
        return
    estimate = FEATURES.index("estimate")
    # Follow the ranked env's choices (its single action is the best estimate) to the last cut.
    while True:
        pivot, _ = ranked.decode(0)
        if len(ranked.cuts) == task.n_stages - 2:
            break
        ranked_step = ranked.step(0)
        timestep = env.step(pivot)
        assert not ranked_step.last
    features = timestep.observation[: env.slots * len(FEATURES)].reshape(len(FEATURES), env.slots)
    values = {}
    for action in np.flatnonzero(timestep.legal):
        env_copy = CutEnv(task)
        env_copy.reset(0)
        for cut in env.cuts:
            env_copy.step(cut)
        env_copy.step(int(action))
        values[int(action)] = env_copy.outcome.value
        value = env_copy.outcome.value
        assert features[estimate, action] == pytest.approx(
            env.reference / value if value > 0 else 1.0, rel=1e-6)
    ranked.step(0)
    assert ranked.outcome.value == pytest.approx(min(values.values()), rel=1e-12)


def test_illegal_actions_are_refused_by_name():
    task = CutTask(uniform_profile(6, forward_time=1.0, backward_time=2.0),
                   uniform_cluster(3, bandwidth=1e9), PipelineSpace(microbatches=4), 3)
    env = CutEnv(task)
    env.reset(0)
    with pytest.raises(ValueError, match=r"action 4 \(pivot 4, device offset 0\) is illegal"):
        env.step(4)  # leaves no pivot for the second cut
    env.step(1)
    with pytest.raises(ValueError, match="action 0 .* is illegal"):
        env.step(0)  # before the previous cut
    with pytest.raises(ValueError, match="out of range"):
        env.step(99)


def test_fewer_pivots_than_slots_are_spread_and_repeats_masked():
    task = CutTask(uniform_profile(5, forward_time=1.0, backward_time=1.0),
                   uniform_cluster(2, bandwidth=1e9), PipelineSpace(microbatches=2), 2)
    env = CutEnv(task, slots=16)
    timestep = env.reset(0)
    assert env.num_actions == 16 and timestep.legal.all()
    assert sorted(set(env.slot_pivot.tolist())) == [0, 1, 2, 3]
    ranked = CutEnv(task, slots=16, ranked=8)
    timestep = ranked.reset(0)
    # One candidate per distinct pivot: 4 of the 8 ranked actions are legal.
    assert timestep.legal.sum() == 4
    assert {ranked.decode(a)[0] for a in range(4)} == {0, 1, 2, 3}
    # The balanced cut (2 layers each side... pivot 1 or 2 of 5 equal layers) ranks first.
    assert ranked.decode(0)[0] in (1, 2)


def test_a_device_radius_lets_device_cuts_move():
    cluster = uniform_cluster(4, bandwidth=1e9, devices_per_node=1)
    space = PipelineSpace(microbatches=4, replication=(1, 2, 3))
    profile = uniform_profile(4, forward_time=1.0, backward_time=1.0, parameter_bytes=1e6)
    env = CutEnv(CutTask(profile, cluster, space, 2, device_radius=1))
    timestep = env.reset(0)
    assert env.num_actions == 3 * env.slots
    offsets = {env.decode(a)[1] for a in np.flatnonzero(timestep.legal)}
    assert offsets == {-1, 0, 1}
    env.step(int(np.flatnonzero(timestep.legal)[-1]))
    assert env.outcome.plan.replication == (3, 1)
