"""Greedy hill climbing: the other equal-budget baseline.

From the task's starting plan (`SearchTask.initial`), repeatedly apply the best single move
(`SearchTask.neighbours`: any one decision changed) until no move improves the score or the
budget runs out. Deterministic; the seed is only recorded.
"""

from __future__ import annotations

import logging
from typing import Callable

from hlomap.search.task import SearchTask
from hlomap.search.tracker import Budget, Driver, Progress, SearchResult, Tracker

log = logging.getLogger(__name__)

__all__ = ["greedy_search"]


def greedy_search(task: SearchTask, budget: Budget, seed: int = 0, *,
                  on_best: Callable[[SearchResult], None] | None = None,
                  on_progress: Callable[[Progress], None] | None = None) -> SearchResult:
    """Best-improvement hill climbing over the task's neighbours from its starting plan."""
    tracker = Tracker(task, budget, Driver.GREEDY, seed, on_best=on_best, on_progress=on_progress)
    with tracker.guard():
        current = task.initial()
        if current is None:
            raise ValueError("greedy search needs a starting plan; this task has none")
        best = task.score(current)
        tracker.record(current, best)
        while not tracker.exhausted():
            candidates = task.neighbours(current)
            left = tracker.remaining_evaluations()
            if left is not None:
                candidates = candidates[:left]
            if not len(candidates):
                tracker.notes.append("local optimum: no move is possible")
                break
            step_best, step_row = best, None
            for row in candidates:
                score = task.score(row)
                tracker.record(row, score)
                if score.key > step_best.key:
                    step_best, step_row = score, row
                if tracker.exhausted():
                    break
            tracker.progress()
            if step_row is None:
                tracker.notes.append("local optimum: no single change improves the score")
                break
            current, best = step_row.copy(), step_best
    return tracker.result()
