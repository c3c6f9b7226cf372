"""Greedy hill climbing: the other equal-budget baseline, and the local search of the tasks
whose moves are priced incrementally.

A task of the plain protocol: from its starting plan (`SearchTask.initial`), repeatedly apply the
best single move (`SearchTask.neighbours`: any one decision changed, each rescored) until no move
improves the score or the budget runs out. Deterministic; the seed is only recorded.

A `LocalSearchTask` (device placement): iterated local search (Lourenco et al. 2003). Start from
the best of the task's starts; sweep its incremental neighbourhood, applying the best improving
move of each group, until a sweep improves nothing (a local optimum); then kick the best plan
(`perturb`) and descend again, until the budget ends, `PATIENCE` kicks in a row found nothing
better, or (a time budget) the best has not improved for `STALL_SHARE` of it. Without a budget,
one descent to its local optimum. The seed drives the kicks and the
random moves a sweep adds.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import numpy as np

from hlomap.search.score import Score
from hlomap.search.task import LocalSearchTask, Neighbourhood, SearchTask
from hlomap.search.tracker import Budget, Driver, Progress, SearchResult, Tracker

log = logging.getLogger(__name__)

__all__ = ["PATIENCE", "STALL_MIN_SECONDS", "STALL_SHARE", "greedy_search", "hill_climb", "iterated_local_search", "stalled"]

#: Kicks in a row without a better plan after which iterated local search stops early.
PATIENCE = 50
#: A time-limited local search also stops once its best has not improved for this share of its
#: budget (and at least STALL_MIN_SECONDS): at 512 devices one sweep of swaps outlasts a minute,
#: so a start that is already optimal (row-major on a torus) would hold the search to its whole
#: budget without a sweep ever finishing to prove it.
STALL_SHARE = 0.25
STALL_MIN_SECONDS = 5.0
#: Relative difference under which two scores (or tie-breaks) count as equal: incremental
#: pricing and pricing from scratch may differ in the last bits.
RTOL = 1e-12


def greedy_search(task: SearchTask, budget: Budget, seed: int = 0, *,
                  on_best: Callable[[SearchResult], None] | None = None,
                  on_progress: Callable[[Progress], None] | None = None) -> SearchResult:
    """Best-improvement hill climbing over the task's neighbours from its starting plan;
    iterated local search for a `LocalSearchTask` (module docstring)."""
    tracker = Tracker(task, budget, Driver.GREEDY, seed, on_best=on_best, on_progress=on_progress)
    if isinstance(task, LocalSearchTask):
        with tracker.guard():
            iterated_local_search(task, tracker, np.random.default_rng(seed))
        return tracker.result()
    with tracker.guard():
        tracker.notes.append(hill_climb(task, tracker))
    return tracker.result()


def hill_climb(task: SearchTask, tracker: Tracker, start: np.ndarray | None = None) -> str:
    """Best-improvement hill climbing over `task`'s neighbours from `start` (default its starting
    plan), every scored plan recorded in `tracker`, until no single move improves the score or
    the tracker's budget runs out; returns why it stopped. The exact sharding search climbs
    first too, so that a budget which cuts its enumeration short still returns a local optimum."""
    current = task.initial() if start is None else start
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
            return "local optimum: no move is possible"
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
            return "local optimum: no single change improves the score"
        current, best = step_row.copy(), step_best
    return "stopped by the budget before a local optimum"


def _ordered(a: float, b: float) -> int:
    """-1, 0 or 1 as `a` is below, within `RTOL` of, or above `b`."""
    tolerance = RTOL * max(abs(a), abs(b))
    return 0 if abs(a - b) <= tolerance else (1 if a > b else -1)


def _beats(score: Score, proxy: float, than: Score, than_proxy: float) -> bool:
    """Lexicographic: score value, then tie-break (both within `RTOL`), then a proxy lower by
    more than rounding."""
    for ours, theirs in ((score.value, than.value), (score.tiebreak, than.tiebreak)):
        order = _ordered(ours, theirs)
        if order:
            return order > 0
    return proxy < than_proxy - 1e-15


def stalled(tracker: Tracker) -> bool:
    """Whether a time-limited search's best has not improved for STALL_SHARE of its budget."""
    budget = tracker.budget.seconds
    if budget is None:
        return False
    return tracker.seconds - _last(tracker) >= max(STALL_MIN_SECONDS, STALL_SHARE * budget)


def _descend(hood: Neighbourhood, tracker: Tracker, rng: np.random.Generator) -> bool:
    """Sweeps until one applies no move (True: a local optimum) or the budget ends or the search
    stalls (False)."""
    while True:
        improved = False
        for group in hood.sweep(rng):
            best_move, best, best_proxy = None, hood.score, 0.0
            for move in group:
                score, proxy = hood.try_move(move)
                if _beats(score, proxy, best, best_proxy):
                    best_move, best, best_proxy = move, score, proxy
                if tracker.exhausted():
                    break
            if best_move is not None:
                hood.apply(best_move)
                tracker.record(hood.decisions, hood.score)
                improved = True
            if tracker.exhausted():
                return False
            if stalled(tracker):
                tracker.notes.append(f"stopped: no better plan in the last {tracker.seconds - _last(tracker):.1f} s")
                return False
        tracker.progress()
        if not improved:
            return True


def _last(tracker: Tracker) -> float:
    return tracker.improvements[-1].seconds if tracker.improvements else 0.0


def iterated_local_search(task: LocalSearchTask, tracker: Tracker, rng: np.random.Generator, *,
                          starts: Sequence[np.ndarray] | None = None) -> None:
    """Descend from the best of `starts` (default: the task's), then kick and descend again
    (module docstring); every plan it reaches is recorded in `tracker`."""
    candidates = list(task.starts() if starts is None else starts)
    scores = [task.score(start) for start in candidates]  # type: ignore[attr-defined]
    for start, score in zip(candidates, scores):
        tracker.record(start, score)
    first = max(range(len(candidates)), key=lambda i: scores[i].key)
    hood = task.neighbourhood(candidates[first])
    converged = _descend(hood, tracker, rng)
    best, best_score = hood.decisions.copy(), hood.score
    restarts = stale = 0
    while (converged and not tracker.budget.unlimited and not tracker.exhausted() and stale < PATIENCE
           and not stalled(tracker)):
        kicked = task.perturb(best, rng)
        if kicked is None:
            break
        restarts += 1
        stale += 1
        hood = task.neighbourhood(kicked)
        converged = _descend(hood, tracker, rng)
        if _beats(hood.score, 0.0, best_score, 0.0):
            best, best_score, stale = hood.decisions.copy(), hood.score, 0
    tracker.notes.append(f"{restarts} restarts")
