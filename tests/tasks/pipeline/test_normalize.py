"""Coarsening to 128 points and the random problem generator."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hlomap.cost.pipeline.costs import evaluate_plan
from hlomap.cost.pipeline.links import transfer_cost
from hlomap.cost.pipeline.stages import PipelinePlan
from hlomap.tasks.pipeline.cutenv import CutEnv
from hlomap.tasks.pipeline.normalize import (
    CANDIDATES,
    SLOTS,
    GeneratorSpec,
    RandomCutEnv,
    coarsen,
    random_profile,
    random_task,
)
from tests.tasks.pipeline.strategies import profiles, uniform_cluster


@settings(max_examples=40, deadline=None)
@given(profile=profiles(min_layers=2, max_layers=12), slots=st.integers(1, 8), data=st.data())
def test_coarse_plans_cost_the_same_on_the_original(profile, slots, data):
    coarse, kept = coarsen(profile, slots)
    assert coarse.n_pivots == len(kept) <= max(slots, 0)
    assert list(coarse.activation_bytes) == [profile.activation_bytes[k] for k in kept]
    if coarse.n_pivots == 0:
        return
    cut = data.draw(st.integers(0, coarse.n_pivots - 1))
    cluster = uniform_cluster(2, bandwidth=1e9, latency=1e-5)
    on_coarse = PipelinePlan.linear((0, cut + 1, coarse.n_layers), (1, 1), microbatches=3)
    on_original = PipelinePlan.linear((0, kept[cut] + 1, profile.n_layers), (1, 1),
                                      microbatches=3)
    a = evaluate_plan(coarse, cluster, on_coarse)
    b = evaluate_plan(profile, cluster, on_original)
    assert a.latency == pytest.approx(b.latency, rel=1e-12, abs=1e-15)
    assert a.stage_memory == pytest.approx(b.stage_memory, rel=1e-12, abs=1e-6)


def test_small_profiles_are_not_coarsened():
    profile = random_profile(np.random.default_rng(0), 20)
    coarse, kept = coarsen(profile, SLOTS)
    assert coarse is profile and kept == tuple(range(19))


def test_random_tasks_are_valid_and_varied():
    spec = GeneratorSpec()
    stages, objectives, memory, sizes = set(), set(), set(), set()
    for seed in range(60):
        task = random_task(np.random.default_rng(seed), spec)
        assert task.profile.n_pivots <= spec.slots
        assert spec.min_stages <= task.n_stages <= spec.max_stages
        assert task.profile.compute_time.sum() == pytest.approx(1.0)
        per_node = task.space.replication[0]
        assert task.cluster.n_devices == per_node * task.n_stages
        assert task.center == tuple(range(0, task.cluster.n_devices + 1, per_node))
        stages.add(task.n_stages)
        objectives.add(task.space.objective)
        memory.add(task.space.check_memory)
        sizes.add(task.profile.n_pivots == spec.slots)
        # Communication is scaled against compute: the median cut between two servers takes
        # 10^[-3, 0.5] balanced stage times.
        unit = 1.0 / task.cluster.n_devices
        median = float(np.median(task.profile.activation_bytes))
        t = float(transfer_cost(task.cluster, range(per_node), range(per_node, 2 * per_node))(median))
        assert 10 ** -3.01 <= t / unit <= 10 ** 0.51
    assert len(stages) >= 5 and len(objectives) == 2 and memory == {True, False}
    assert sizes == {True, False}


def test_random_environments_follow_their_seed():
    env = RandomCutEnv()
    assert env.num_actions == CANDIDATES
    first = env.reset(7).observation
    other = env.reset(8).observation
    again = env.reset(7).observation
    assert first.shape == (env.observation_size,)
    assert np.array_equal(first, again) and not np.array_equal(first, other)
    timestep = env.reset(7)
    while not timestep.last:
        timestep = env.step(int(np.flatnonzero(timestep.legal)[0]))
    assert env.env.outcome is not None


def test_observation_layout_is_the_same_for_every_task():
    sizes = {CutEnv(random_task(np.random.default_rng(s)), slots=SLOTS,
                    ranked=CANDIDATES).observation_size for s in range(10)}
    assert len(sizes) == 1
