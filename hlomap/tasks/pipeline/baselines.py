"""Equal-footing baselines for the learned cut search: what the DQN has to beat.

A DQN over `CutEnv(ranked=K)` chooses among the K legal pivots whose even-split estimates look
best. Two searches on the same candidates tell how much of its result the pruning alone gives:

- `first_candidates`: always take the best-estimated candidate (action 0), no learning at all.
  The last cut's estimate is exact, so this is a greedy heuristic over the estimate.
- `random_candidates`: uniformly random legal candidates for as many episodes as the DQN ran,
  keeping the best plan (random search with the same pruning and the same episode budget).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from hlomap.agents.environment import TimeStep
from hlomap.tasks.pipeline.cutenv import CutEnv, CutTask, EpisodeOutcome
from hlomap.cost.pipeline.stages import PipelinePlan

__all__ = ["BaselineResult", "first_candidates", "random_candidates"]


@dataclass(frozen=True)
class BaselineResult:
    """The best plan a baseline built: its value (inf when none fit in memory), episodes, time."""

    plan: PipelinePlan | None
    value: float
    feasible: bool
    episodes: int
    seconds: float


def _episode(env: CutEnv, choose: Callable[[TimeStep], int]) -> EpisodeOutcome | None:
    """One episode with actions from `choose`; None at a dead end (device radius only)."""
    timestep = env.reset(0)
    while not timestep.last:
        timestep = env.step(choose(timestep))
    return env.outcome


def _better(outcome: EpisodeOutcome | None, best: EpisodeOutcome | None) -> bool:
    if outcome is None:
        return False
    return best is None or (outcome.feasible, -outcome.value) > (best.feasible, -best.value)


def _result(best: EpisodeOutcome | None, episodes: int, seconds: float) -> BaselineResult:
    if best is None:
        return BaselineResult(None, float("inf"), False, episodes, seconds)
    value = best.value if best.feasible else float("inf")
    return BaselineResult(best.plan, value, best.feasible, episodes, seconds)


def first_candidates(task: CutTask, ranked: int) -> BaselineResult:
    """The plan of always choosing the best-estimated candidate (module docstring)."""
    start = time.perf_counter()
    outcome = _episode(CutEnv(task, ranked=ranked), lambda timestep: 0)
    return _result(outcome, 1, time.perf_counter() - start)


def random_candidates(task: CutTask, ranked: int, episodes: int, seed: int = 0
                      ) -> BaselineResult:
    """The best of `episodes` uniformly random episodes over the same candidates."""
    if episodes < 1:
        raise ValueError(f"random_candidates needs episodes >= 1, got {episodes}")
    rng = np.random.default_rng(seed)
    env = CutEnv(task, ranked=ranked)
    start = time.perf_counter()
    best: EpisodeOutcome | None = None
    for _ in range(episodes):
        outcome = _episode(env, lambda timestep: int(rng.choice(np.flatnonzero(timestep.legal))))
        if _better(outcome, best):
            best = outcome
    return _result(best, episodes, time.perf_counter() - start)
