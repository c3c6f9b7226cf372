"""Random search: the equal-budget baseline every learned search has to beat.

Episodes of a uniformly random policy over the same legal actions the agent sees (an epsilon
= 1 agent), each ending at its first conflict as the agent's would, the best plan kept. A task
may draw many episodes at once (`SearchTask.sample`, vectorized); otherwise the driver plays its
environment.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from hlomap.search.task import SearchTask
from hlomap.search.tracker import Budget, Driver, Progress, SearchResult, Tracker

log = logging.getLogger(__name__)

__all__ = ["random_search"]


def random_search(task: SearchTask, budget: Budget, seed: int = 0, *, batch: int = 64,
                  on_best: Callable[[SearchResult], None] | None = None,
                  on_progress: Callable[[Progress], None] | None = None) -> SearchResult:
    """Random episodes until the budget is spent; keeps the best conflict-free plan."""
    budget.require_limit("random")
    tracker = Tracker(task, budget, Driver.RANDOM, seed, on_best=on_best, on_progress=on_progress)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xA11]))
    with tracker.guard():
        start = task.initial()
        if start is not None:
            tracker.record(start, task.score(start))
        env = None
        while not tracker.exhausted():
            left = tracker.remaining_evaluations()
            n = batch if left is None else min(batch, left)
            drawn = task.sample(rng, n)
            if drawn is not None:
                for row, score in zip(drawn, task.score_many(drawn)):
                    tracker.record(row, score)
                tracker.episodes += len(drawn)
            else:
                env = env or task.make_env()
                for _ in range(n):
                    timestep = env.reset(tracker.episodes)
                    while not timestep.last:
                        timestep = env.step(int(rng.choice(np.flatnonzero(timestep.legal))))
                    tracker.episodes += 1
                    outcome = env.last_outcome
                    if outcome is not None:
                        tracker.record(outcome.decisions, outcome.score)
                    if tracker.exhausted():
                        break
            tracker.progress()
    return tracker.result()
