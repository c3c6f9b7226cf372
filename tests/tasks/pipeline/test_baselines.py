"""The DQN's baselines on its own ranked candidates, against the exact DP."""

import pytest

from hlomap.cost.pipeline.costs import evaluate_plan
from hlomap.tasks.pipeline.dp import solve
from hlomap.tasks.pipeline.baselines import first_candidates, random_candidates
from tests.tasks.pipeline.strategies import random_cut_task


@pytest.mark.parametrize("seed", range(4))
def test_the_first_candidate_is_optimal_for_one_cut(seed):
    """With two stages the only cut is the last, whose estimate is exact."""
    task = random_cut_task(2, seed)
    result = first_candidates(task, ranked=8)
    optimum = solve(task.profile, task.cluster, task.space)
    assert result.value == pytest.approx(optimum.value, rel=1e-12)
    assert result.plan is not None and result.episodes == 1
    cost = evaluate_plan(task.profile, task.cluster, result.plan, task.space.cost)
    assert cost.latency == result.value


def test_random_search_never_beats_the_optimum_and_finds_it_with_enough_episodes():
    task = random_cut_task(3)
    optimum = solve(task.profile, task.cluster, task.space).value
    few = random_candidates(task, ranked=32, episodes=3, seed=1)
    many = random_candidates(task, ranked=32, episodes=400, seed=1)
    assert few.value >= optimum * (1 - 1e-12) and few.episodes == 3
    assert many.value == pytest.approx(optimum, rel=1e-12)  # 12 pivots: few plans to try
    assert many.value <= few.value


def test_plans_out_of_memory_count_as_infinitely_slow():
    task = random_cut_task(2, memory=1e6)  # less than any stage's parameters
    assert first_candidates(task, ranked=8).value == float("inf")
    result = random_candidates(task, ranked=8, episodes=5)
    assert not result.feasible and result.value == float("inf")
    with pytest.raises(ValueError, match="episodes >= 1"):
        random_candidates(task, ranked=8, episodes=0)
