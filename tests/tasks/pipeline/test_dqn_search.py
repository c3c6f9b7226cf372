"""The online DQN search against the exact DP on small problems."""

import numpy as np
import pytest

from hlomap.cost.pipeline.costs import evaluate_plan
from hlomap.tasks.pipeline.dp import solve
from hlomap.agents.dqn import make_dqn
from hlomap.tasks.pipeline.cutenv import CutEnv
from hlomap.tasks.pipeline.dqn_search import (
    ONLINE_CANDIDATES,
    SearchBudget,
    default_dqn_config,
    dqn_search,
)
from tests.tasks.pipeline.strategies import random_cut_task

EPISODES = 300


@pytest.fixture(scope="module")
def compiled():
    """One compiled set of DQN functions for every search here (compiling dominates)."""
    task = random_cut_task()
    env = CutEnv(task, ranked=ONLINE_CANDIDATES)
    config = default_dqn_config(task.n_stages - 1, EPISODES)
    return task, config, make_dqn(config, env.observation_size, env.num_actions)


@pytest.fixture(scope="module")
def found(compiled):
    task, config, functions = compiled
    budget = SearchBudget(max_episodes=EPISODES, eval_every=20)
    return task, dqn_search(task, budget, seed=0, config=config, functions=functions)


def test_finds_the_dp_optimum_of_a_small_problem(found):
    task, result = found
    optimum = solve(task.profile, task.cluster, task.space)
    assert optimum.plan.n_stages == task.n_stages
    assert result.value >= optimum.value * (1 - 1e-12)  # nothing beats the optimum
    assert result.value == pytest.approx(optimum.value, rel=1e-9)


def test_reports_the_plan_it_found_with_its_own_cost(found):
    task, result = found
    assert result.cost == evaluate_plan(task.profile, task.cluster, result.plan, task.space.cost)
    assert result.value == result.cost.latency and result.feasible
    assert result.episodes == EPISODES and result.steps == EPISODES * (task.n_stages - 1)
    assert 0 <= result.found_at_episode <= result.episodes
    values = [v for _, v in result.improvements]
    assert values == sorted(values, reverse=True) and values[-1] == result.value
    assert result.plan.replication == (2, 2, 2)
    assert [s.devices[0] for s in result.plan.stages] == [0, 2, 4]


def test_a_time_budget_stops_the_search(compiled):
    task, config, functions = compiled
    result = dqn_search(task, SearchBudget(max_episodes=10_000, seconds=0.0), seed=1,
                        config=config, functions=functions)
    assert result.episodes == 1
    assert np.isfinite(result.value)


def test_dqn_defaults_are_undiscounted_with_whole_episode_returns():
    config = default_dqn_config(n_cuts=3, max_episodes=1000, exploration=0.5)
    assert config.discount == 1.0 and config.n_step == 3
    assert config.epsilon_decay_steps == 1500
