"""The exact driver: the task's own exact method (a MILP, an enumeration, a dynamic program)
under the tracker, so its answer is reported like every other driver's and can be compared
with them at equal footing."""

from __future__ import annotations

from typing import Callable

from hlomap.search.task import SearchTask
from hlomap.search.tracker import Budget, Driver, Progress, SearchResult, Tracker

__all__ = ["exact_search"]


def exact_search(task: SearchTask, budget: Budget | None = None, seed: int = 0, *,
                 on_best: Callable[[SearchResult], None] | None = None,
                 on_progress: Callable[[Progress], None] | None = None) -> SearchResult:
    """The optimum; `optimal` is False when the budget cut the task's method short."""
    budget = budget or Budget(seconds=None, evaluations=None)
    tracker = Tracker(task, budget, Driver.EXACT, seed, on_best=on_best, on_progress=on_progress)
    with tracker.guard():
        task.solve_exactly(tracker)
    return tracker.result()
