"""The reference every search is measured from: the task's trivial plan (the all-replicated
plan, a placement's plan as given), scored under the tracker like any driver's answer."""

from __future__ import annotations

from hlomap.search.task import SearchTask
from hlomap.search.tracker import Budget, Driver, SearchResult, Tracker

__all__ = ["identity_search"]


def identity_search(task: SearchTask, seed: int = 0) -> SearchResult:
    """The trivial plan and its score (one evaluation); raises when the task has none."""
    tracker = Tracker(task, Budget(seconds=None), Driver.IDENTITY, seed)
    plan = task.trivial_plan()
    if plan is None:
        raise ValueError("this task has no trivial plan to report without a search")
    tracker.record(plan, task.score(plan))
    return tracker.result()
