"""The PPO placement environment, policy files, and the PPO driver on a placement task."""

from __future__ import annotations

import numpy as np
import pytest

from hlomap.agents import checkpoint
from hlomap.agents.ppo import PpoAgent
from hlomap.search.ppo import rollout
from hlomap.search.tracker import Budget
from hlomap.tasks.placement.construct import construct
from hlomap.tasks.placement.objective import new_state
from hlomap.tasks.placement.place import search_placement
from hlomap.tasks.placement.ppo import (CANDIDATES, DEFAULT_POLICY, PlacementEnv, load_placement_policy,
                                        placement_ppo_config, save_placement_policy, training_problems)
from hlomap.tasks.placement.problem import step_seconds
from hlomap.tasks.placement.task import PlacementTask

from tests.tasks.placement.helpers import mesh_layout, problem, stage_layout


def test_always_taking_the_cheapest_candidate_is_the_construction():
    for layout in (mesh_layout((2, 4)), stage_layout((2, 3, 3))):
        pb = problem("random:8:2:3", layout)
        env = PlacementEnv(pb)
        timestep = env.reset(0)
        assert timestep.observation.shape == (env.observation_size,)
        assert timestep.legal.sum() == 8 and not timestep.legal[8:].any()  # 8 free devices of 16 slots
        total = 0.0
        while not timestep.last:
            timestep = env.step(0)
            total += timestep.reward
        assert total == pytest.approx(0.0, abs=1e-9)
        order = env.episode.full_order()
        np.testing.assert_array_equal(order, construct(pb))
        assert env.last_value == pytest.approx(step_seconds(pb, order[: pb.n_positions]), rel=1e-12)


def test_a_detour_is_penalized_at_once_and_rewarded_by_the_outcome():
    pb = problem("uniform:8:4", mesh_layout((2, 4)))
    env = PlacementEnv(pb)
    timestep = env.reset(0)
    timestep = env.step(0)
    rewards = []
    while not timestep.last:
        timestep = env.step(int(np.flatnonzero(timestep.legal)[-1]))  # the costliest candidate
        rewards.append(timestep.reward)
    assert all(r <= 0 for r in rewards[:-1]) and any(r < 0 for r in rewards[:-1])
    gain = 1 - env.last_value / env.episode.reference
    assert rewards[-1] <= min(5.0, max(-5.0, 10 * gain)) + 1e-9


def test_training_problems_vary_and_are_seeded():
    a, b = training_problems(1), training_problems(1)
    assert a.name == b.name and a.n_positions == b.n_positions
    assert len({training_problems(s).name for s in range(8)}) > 3


def test_policy_files_round_trip_and_refuse_other_layouts(tmp_path):
    agent = PpoAgent(placement_ppo_config(), PlacementEnv(training_problems).observation_size, CANDIDATES, seed=3)
    save_placement_policy(tmp_path / "p.npz", agent, extra={"note": "test"})
    policy = load_placement_policy(tmp_path / "p.npz")
    assert policy.meta["extra"] == {"note": "test"}
    arrays, meta = checkpoint.load(tmp_path / "p.npz")
    meta["layout"]["candidates"] = 8
    checkpoint.save(tmp_path / "old.npz", arrays, meta)
    with pytest.raises(ValueError, match="layout"):
        load_placement_policy(tmp_path / "old.npz")
    with pytest.raises(FileNotFoundError, match="train_placement_policy"):
        load_placement_policy(tmp_path / "missing.npz")


@pytest.mark.skipif(not DEFAULT_POLICY.is_file(), reason="the shipped placement policy is missing")
def test_ppo_driver_with_the_shipped_policy():
    pb = problem("uniform:12:5", stage_layout((3, 3, 3, 3)))
    policy = load_placement_policy()
    task = PlacementTask(pb)
    env = task.make_env()
    rollout(env, policy.agent(0), greedy=True)
    order, score = env.last_outcome.decisions, env.last_outcome.score
    assert task.evaluations == 1 and score.step_time == pytest.approx(new_state(pb, order).value, rel=1e-12)
    result = search_placement(pb, "ppo", Budget(None, 400), policy=policy)
    placed = result.plan
    assert result.driver.value == "ppo" and result.evaluations <= 400 + 2
    assert placed.step_seconds <= min(score.step_time, placed.identity_seconds) * (1 + 1e-12)
    assert step_seconds(pb, placed.devices) == pytest.approx(placed.step_seconds, rel=1e-12)
