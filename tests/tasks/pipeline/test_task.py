"""The pipeline-cut task under the generic drivers: the DQN, random search and greedy hill
climbing against the exact DP on small problems."""

import dataclasses

import numpy as np
import pytest

from hlomap.agents.dqn import make_dqn
from hlomap.cost.pipeline.costs import evaluate_plan
from hlomap.search.budget import Budget
from hlomap.search.dqn import dqn_search
from hlomap.search.exact import exact_search
from hlomap.search.greedy import greedy_search
from hlomap.search.random import random_search
from hlomap.tasks.pipeline.cutenv import decisions_of
from hlomap.tasks.pipeline.dp import solve
from hlomap.tasks.pipeline.task import CutSearchTask, cut_dqn_config
from tests.tasks.pipeline.strategies import random_cut_task

EPISODES = 300


@pytest.fixture(scope="module")
def compiled():
    """One compiled set of DQN functions for every search here (compiling dominates)."""
    task = random_cut_task()
    env = CutSearchTask(task).make_env()
    config = dataclasses.replace(cut_dqn_config(task.n_stages - 1, EPISODES), greedy_every=20)
    agent = config.agent_config(task.n_stages - 1, EPISODES)
    return task, config, make_dqn(agent, env.observation_size, env.num_actions)


@pytest.fixture(scope="module")
def found(compiled):
    task, config, functions = compiled
    budget = Budget(episodes=EPISODES, seconds=None)
    return task, dqn_search(CutSearchTask(task), budget, seed=0, config=config, functions=functions)


def test_finds_the_dp_optimum_of_a_small_problem(found):
    task, result = found
    optimum = solve(task.profile, task.cluster, task.space)
    assert optimum.plan.n_stages == task.n_stages
    value = CutSearchTask(task).cut_plan(result.decisions).value
    assert value >= optimum.value * (1 - 1e-12)  # nothing beats the optimum
    assert value == pytest.approx(optimum.value, rel=1e-9)


def test_reports_the_plan_it_found_with_its_own_cost(found):
    task, result = found
    cost = evaluate_plan(task.profile, task.cluster, result.plan, task.space.cost)
    assert result.score.step_time == cost.latency and result.score.fits
    assert np.array_equal(decisions_of(result.plan), result.decisions)
    assert result.episodes == EPISODES and f"{EPISODES} episodes" in result.notes[0]
    values = [i.value for i in result.improvements]
    assert values == sorted(values) and values[-1] == result.score.value
    assert 0 <= result.improvements[-1].evaluation <= result.evaluations
    assert result.plan.replication == (2, 2, 2)
    assert [s.devices[0] for s in result.plan.stages] == [0, 2, 4]


def test_a_time_budget_stops_the_search(compiled):
    task, config, functions = compiled
    result = dqn_search(CutSearchTask(task), Budget(episodes=10_000, seconds=1e-9), seed=1,
                        config=config, functions=functions)
    assert result.episodes == 1
    assert np.isfinite(result.score.value)


def test_dqn_defaults_are_undiscounted_with_whole_episode_returns():
    config = cut_dqn_config(n_cuts=3, episodes=1000, exploration=0.5).agent_config(3, 1000)
    assert config.discount == 1.0 and config.n_step == 3
    assert config.epsilon_decay_steps == 1500


def test_the_exact_driver_is_the_dp():
    task = random_cut_task(3)
    result = exact_search(CutSearchTask(task))
    assert result.optimal
    optimum = solve(task.profile, task.cluster, task.space).value
    assert CutSearchTask(task).cut_plan(result.decisions).value == pytest.approx(optimum, rel=1e-12)


# -- baselines on the DQN's own ranked candidates ----------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_the_first_candidate_is_optimal_for_one_cut(seed):
    """With two stages the only cut is the last, whose estimate is exact."""
    task = random_cut_task(2, seed)
    search = CutSearchTask(task, ranked=8)
    first = search.cut_plan(search.initial())
    optimum = solve(task.profile, task.cluster, task.space)
    assert first.value == pytest.approx(optimum.value, rel=1e-12)
    cost = evaluate_plan(task.profile, task.cluster, first.plan, task.space.cost)
    assert cost.latency == first.value


def test_random_search_never_beats_the_optimum_and_finds_it_with_enough_episodes():
    task = random_cut_task(3)
    optimum = solve(task.profile, task.cluster, task.space).value
    few = random_search(CutSearchTask(task, ranked=32), Budget(episodes=3, seconds=None), seed=1)
    many = random_search(CutSearchTask(task, ranked=32), Budget(episodes=400, seconds=None), seed=1)
    value = lambda r: CutSearchTask(task).cut_plan(r.decisions).value  # noqa: E731
    assert value(few) >= optimum * (1 - 1e-12) and few.episodes == 3
    assert value(many) == pytest.approx(optimum, rel=1e-12)  # 12 pivots: few plans to try
    assert value(many) <= value(few)


def test_greedy_climbs_from_the_first_candidate_and_never_beats_the_optimum():
    task = random_cut_task(3)
    optimum = solve(task.profile, task.cluster, task.space).value
    result = greedy_search(CutSearchTask(task, ranked=8), Budget(seconds=None, evaluations=500))
    start = result.improvements[0].value
    assert result.score.value >= start
    assert CutSearchTask(task).cut_plan(result.decisions).value >= optimum * (1 - 1e-12)
    assert any("local optimum" in n for n in result.notes)


def test_plans_out_of_memory_score_below_every_plan_that_fits():
    task = random_cut_task(2, memory=1e6)  # less than any stage's parameters
    search = CutSearchTask(task, ranked=8)
    assert not search.score(search.initial()).fits
    result = random_search(search, Budget(episodes=5, seconds=None))
    assert not result.score.fits and result.score.value < 0
    with pytest.raises(ValueError, match="episodes = 0 must be positive"):
        Budget(episodes=0)
