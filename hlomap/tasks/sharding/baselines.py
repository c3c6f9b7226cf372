"""Equal-budget baselines for the learned search: random episodes and greedy hill climbing.

`random_search` plays the environment with a uniformly random policy over the same legal
actions the agent sees (an epsilon = 1 agent): every position takes a random legal action in
decision order and an episode ends at its first conflict. Episodes are drawn in batches and
scored with the objective's vectorized path.

`greedy_search` starts from the all-replicated plan and repeatedly applies the best
single-position change (any position to any choice) until no change improves the score or the
budget runs out. Conflicting candidates are recognized without the objective's cost model.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from hlomap.tasks.sharding.env import MaskPolicy
from hlomap.tasks.sharding.objective import Objective
from hlomap.search.tracker import Budget, Driver, Progress, SearchResult, Tracker
from hlomap.tasks.sharding.space import SearchSpace

log = logging.getLogger(__name__)

__all__ = ["greedy_search", "random_choices", "random_search"]


def random_choices(space: SearchSpace, num: int, rng: np.random.Generator,
                   mask: MaskPolicy = MaskPolicy.STATIC) -> np.ndarray:
    """`[num, P]` choice vectors of a uniformly random policy under `mask`.

    With NONE or STATIC the positions are independent draws; with FULL, all vectors advance one
    position at a time and each draws among the choices that clash with none of its earlier
    ones, so every vector is conflict-free.
    """
    p, a = space.num_positions, space.num_actions
    allowed = np.ones((p, a), dtype=bool) if mask is MaskPolicy.NONE else space.legal
    if mask is not MaskPolicy.FULL:
        noise = rng.random((num, p, a))
        noise[:, ~allowed] = -1.0
        return (noise.argmax(axis=2) - 1).astype(np.int8)
    choices = space.empty_choices(num)
    plans = space.plan_of(choices).astype(np.int64)
    overlap = space.axes.overlap
    for pos in range(p):
        partners = space.partners[pos]
        ok = np.broadcast_to(allowed[pos], (num, a)).copy()
        if len(partners):
            taken = plans[:, partners] + 1  # [num, deg]
            ok[:, 1:] &= ~overlap[1:, :][:, taken].any(axis=2).T
        noise = np.where(ok, rng.random((num, a)), -1.0)
        pick = noise.argmax(axis=1) - 1
        choices[:, pos] = pick
        hit = np.flatnonzero(pick >= 0)
        plans[np.ix_(hit, space.members[pos])] = pick[hit, None]
    return choices


def random_search(space: SearchSpace, objective: Objective, budget: Budget, seed: int = 0, *,
                  mask: MaskPolicy = MaskPolicy.STATIC, batch: int = 64,
                  on_best: Callable[[SearchResult], None] | None = None,
                  on_progress: Callable[[Progress], None] | None = None) -> SearchResult:
    """Random episodes until the budget is spent; keeps the best conflict-free plan."""
    budget.require_limit("random")
    tracker = Tracker(space, objective, budget, Driver.RANDOM, seed, on_best=on_best, on_progress=on_progress)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xA11]))
    with tracker.guard():
        empty = space.empty_choices()
        tracker.record(empty, objective.score(empty))
        while not tracker.exhausted():
            left = tracker.remaining_evaluations()
            n = batch if left is None else min(batch, left)
            drawn = random_choices(space, n, rng, mask)
            # an episode stops at its first conflict: later positions are never reached
            first = space.first_conflict(drawn)
            drawn[np.arange(space.num_positions)[None, :] > first[:, None]] = -1
            for row, score in zip(drawn, objective.score_many(drawn)):
                tracker.record(row, score)
            tracker.progress()
    return tracker.result()


def _neighbours(space: SearchSpace, current: np.ndarray) -> np.ndarray:
    """Every choice vector one position-change away from `current` (statically legal only)."""
    rows = []
    for p in range(space.num_positions):
        for a in np.flatnonzero(space.legal[p]):
            if a - 1 != current[p]:
                row = current.copy()
                row[p] = a - 1
                rows.append(row)
    return np.asarray(rows, dtype=np.int8).reshape(-1, space.num_positions)


def greedy_search(space: SearchSpace, objective: Objective, budget: Budget, seed: int = 0, *,
                  on_best: Callable[[SearchResult], None] | None = None,
                  on_progress: Callable[[Progress], None] | None = None) -> SearchResult:
    """Best-improvement hill climbing over single-position changes from the all-replicated plan.

    Candidates that conflict are skipped without an evaluation (they can never be the best
    change). Deterministic; `seed` is only recorded.
    """
    tracker = Tracker(space, objective, budget, Driver.GREEDY, seed, on_best=on_best, on_progress=on_progress)
    with tracker.guard():
        current = space.empty_choices()
        best = objective.score(current)
        tracker.record(current, best)
        while not tracker.exhausted():
            cands = _neighbours(space, current)
            cands = cands[space.ok(cands)]
            left = tracker.remaining_evaluations()
            if left is not None:
                cands = cands[:left]
            if not len(cands):
                break
            step_best, step_row = best, None
            for row in cands:
                score = objective.score(row)
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
