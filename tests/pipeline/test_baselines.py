"""The DQN's baselines on its own ranked candidates, against the exact DP."""

import numpy as np
import pytest

from hlomap.pipeline import Links, PipelineProfile, SearchSpace, evaluate_plan, solve
from hlomap.pipeline.baselines import first_candidates, random_candidates
from hlomap.pipeline.cutenv import CutTask


def _task(stages: int, seed: int = 0, memory: float = float("inf")) -> CutTask:
    rng = np.random.default_rng(seed)
    n = 14
    profile = PipelineProfile(
        names=tuple(f"l{i}" for i in range(n)),
        forward_time=rng.uniform(0.5, 2.0, n),
        backward_time=rng.uniform(1.0, 4.0, n),
        activation_bytes=rng.uniform(1e7, 3e8, n - 1),
        parameter_bytes=rng.uniform(1e6, 5e7, n),
        stash_bytes=rng.uniform(1e6, 1e7, n),
        source=f"random{seed}",
    )
    links = Links.uniform(2 * stages, bandwidth=1e9, latency=1e-5, devices_per_node=2,
                          memory_bytes=memory)
    space = SearchSpace(microbatches=4, replication=(2,), cut_on_node_boundary=True)
    return CutTask(profile, links, space, stages)


@pytest.mark.parametrize("seed", range(4))
def test_the_first_candidate_is_optimal_for_one_cut(seed):
    """With two stages the only cut is the last, whose estimate is exact."""
    task = _task(2, seed)
    result = first_candidates(task, ranked=8)
    optimum = solve(task.profile, task.links, task.space)
    assert result.value == pytest.approx(optimum.value, rel=1e-12)
    assert result.plan is not None and result.episodes == 1
    cost = evaluate_plan(task.profile, task.links, result.plan, task.space.cost)
    assert cost.latency == result.value


def test_random_search_never_beats_the_optimum_and_finds_it_with_enough_episodes():
    task = _task(3)
    optimum = solve(task.profile, task.links, task.space).value
    few = random_candidates(task, ranked=32, episodes=3, seed=1)
    many = random_candidates(task, ranked=32, episodes=400, seed=1)
    assert few.value >= optimum * (1 - 1e-12) and few.episodes == 3
    assert many.value == pytest.approx(optimum, rel=1e-12)  # 12 pivots: few plans to try
    assert many.value <= few.value


def test_plans_out_of_memory_count_as_infinitely_slow():
    task = _task(2, memory=1e6)  # less than any stage's parameters
    assert first_candidates(task, ranked=8).value == float("inf")
    result = random_candidates(task, ranked=8, episodes=5)
    assert not result.feasible and result.value == float("inf")
    with pytest.raises(ValueError, match="episodes >= 1"):
        random_candidates(task, ranked=8, episodes=0)
