"""What every search driver shares: budgets, the result record, and the tracker that keeps the
best plan, the convergence curve and the evaluation count while a driver runs.

A driver calls `tracker.record(decisions, score)` for every complete plan it scores (an
episode, a greedy candidate, an enumerated plan) and stops when `tracker.exhausted()`. The
tracker calls `on_best` whenever the best plan improves, so the caller can save it as the
search runs; a KeyboardInterrupt inside a driver is caught by `tracker.guard()` and the driver
returns what it has, marked `interrupted`.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

from hlomap.search.budget import Budget
from hlomap.search.score import WORST, Score
from hlomap.search.task import SearchTask

log = logging.getLogger(__name__)

__all__ = ["Budget", "Driver", "Improvement", "Progress", "SearchResult", "Tracker"]


class Driver(str, enum.Enum):
    DQN = "dqn"
    PPO = "ppo"  # a trained policy's rollouts, then the greedy driver's local search (`search.ppo`)
    RANDOM = "random"
    GREEDY = "greedy"
    EXACT = "exact"
    IDENTITY = "identity"  # no search: the task's trivial plan (the plan as given), the reference

    def __str__(self) -> str:
        return self.value


class Improvement(NamedTuple):
    """The best score improved at this point of the search."""

    evaluation: int
    seconds: float
    value: float
    tiebreak: float


class Progress(NamedTuple):
    """What a progress display needs, reported after every episode or scored batch."""

    driver: Driver
    evaluations: int
    seconds: float
    best: float
    last: float
    fraction: float  # of the budget used, in [0, 1]


@dataclass(frozen=True)
class SearchResult:
    """The outcome of one driver run on one task.

    decisions: the best decision vector; plan: the task's plan of it (`SearchTask.plan_of`);
    episodes: learning episodes played (learned drivers; 0 otherwise); greedy: the score of
    what the final greedy policy builds (learned drivers; None otherwise).
    """

    driver: Driver
    reward: str
    seed: int
    decisions: np.ndarray
    plan: Any
    score: Score
    evaluations: int
    seconds: float
    curve: np.ndarray  # score of every episode / scored plan, in order
    improvements: tuple[Improvement, ...]
    interrupted: bool = False
    optimal: bool = False  # proven optimal (exact driver)
    notes: tuple[str, ...] = field(default=())
    episodes: int = 0
    greedy: Score | None = None

    @property
    def choices(self) -> np.ndarray:
        """The decisions under the sharding tasks' name for them (a choice per position)."""
        return self.decisions

    @property
    def best_curve(self) -> np.ndarray:
        """Running maximum of `curve`."""
        return np.maximum.accumulate(self.curve) if len(self.curve) else self.curve

    def search_json(self) -> dict[str, object]:
        """The `search` record stored in a saved plan."""
        return {"driver": self.driver.value, "reward": self.reward, "seed": self.seed,
                "evaluations": self.evaluations, "seconds": round(self.seconds, 3),
                "score": self.score.to_json(), "interrupted": self.interrupted, "optimal": self.optimal,
                **({"notes": list(self.notes)} if self.notes else {})}


class Tracker:
    """Best plan, curve, evaluation count and budget of one driver run."""

    def __init__(self, task: SearchTask, budget: Budget, driver: Driver, seed: int, *,
                 on_best: Callable[[SearchResult], None] | None = None,
                 on_progress: Callable[[Progress], None] | None = None) -> None:
        self.task = task
        self.budget = budget
        self.driver = driver
        self.seed = seed
        self.on_best = on_best
        self.on_progress = on_progress
        self.start = time.perf_counter()
        self.start_evaluations = task.evaluations
        self.best_choices: np.ndarray | None = None
        self.best = WORST
        self.episodes = 0
        self.greedy: Score | None = None
        self.curve: list[float] = []
        self.improvements: list[Improvement] = []
        self.interrupted = False
        self.optimal = False
        self.notes: list[str] = []
        # What the task knows without searching: a proven optimum's score, or how many plans
        # there are at all; a search that reaches either has nothing left to find.
        settles = budget.settle and driver in (Driver.DQN, Driver.RANDOM)
        self.ceiling: Score | None = task.known_optimum() if settles else None
        self.universe: int | None = task.plan_count() if settles else None
        self._seen: set[bytes] = set()

    # -- accounting -----------------------------------------------------------------------------
    @property
    def evaluations(self) -> int:
        return self.task.evaluations - self.start_evaluations

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def fraction(self) -> float:
        parts = []
        if self.budget.seconds is not None:
            parts.append(self.seconds / max(self.budget.seconds, 1e-9))
        if self.budget.evaluations is not None:
            parts.append(self.evaluations / max(self.budget.evaluations, 1))
        if self.budget.episodes is not None:
            parts.append(self.episodes / max(self.budget.episodes, 1))
        return float(min(1.0, max(parts, default=0.0)))

    def exhausted(self) -> bool:
        if self.interrupted or self.optimal:
            return True
        if self.budget.evaluations is not None and self.evaluations >= self.budget.evaluations:
            return True
        if self.budget.episodes is not None and self.episodes >= self.budget.episodes:
            return True
        return self.budget.seconds is not None and self.seconds >= self.budget.seconds

    def remaining_evaluations(self) -> int | None:
        if self.budget.evaluations is None:
            return None
        return max(0, self.budget.evaluations - self.evaluations)

    # -- recording ------------------------------------------------------------------------------
    def record(self, decisions: np.ndarray, score: Score, *, curve: bool = True) -> bool:
        """Note one scored plan; returns True when it is the new best."""
        if curve:
            self.curve.append(score.value)
        if self.universe is not None and score.conflict_free:
            self._seen.add(np.asarray(decisions).tobytes())
        improved = self._improve(decisions, score)
        self._settle()
        return improved

    def _settle(self) -> None:
        """Mark the search optimal (so it stops) once its best is the proven optimum or every
        plan of the space has been scored."""
        if self.optimal or self.best_choices is None:
            return
        if self.ceiling is not None and self.best.key >= self.ceiling.key:
            self.optimal = True
            self.notes.append("stopped at the proven optimum (the exact solver's score)")
        elif self.universe is not None and len(self._seen) >= self.universe:
            self.optimal = True
            self.notes.append(f"stopped after scoring every one of the {self.universe} conflict-free plans")

    def _improve(self, decisions: np.ndarray, score: Score) -> bool:
        if score.conflict_free and score.key > self.best.key:
            self.best = score
            self.best_choices = np.array(decisions, copy=True)
            self.improvements.append(Improvement(self.evaluations, self.seconds, score.value, score.tiebreak))
            log.debug("%s: new best %.4f (tie-break %.1f) after %d evaluations", self.driver, score.value,
                      score.tiebreak, self.evaluations)
            if self.on_best is not None:
                self.on_best(self.result())
            return True
        return False

    def progress(self) -> None:
        if self.on_progress is not None:
            last = self.curve[-1] if self.curve else float("nan")
            self.on_progress(Progress(self.driver, self.evaluations, self.seconds, self.best.value, last,
                                      self.fraction()))

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Turns Ctrl-C into a normal end of the search that keeps the best plan so far."""
        try:
            yield
        except KeyboardInterrupt:
            self.interrupted = True
            log.warning("%s search interrupted after %d evaluations; keeping the best plan so far",
                        self.driver, self.evaluations)

    @property
    def best_decisions(self) -> np.ndarray:
        """The best decision vector so far (raises before any conflict-free plan was scored)."""
        if self.best_choices is None:
            raise RuntimeError(f"{self.driver} search has scored no conflict-free plan yet")
        return self.best_choices

    def result(self) -> SearchResult:
        if self.best_choices is None and self.interrupted:
            raise KeyboardInterrupt  # stopped before any plan: nothing to keep, let the caller stop
        if self.best_choices is None:
            raise RuntimeError(f"{self.driver} search ended without a conflict-free plan "
                               f"after {self.evaluations} evaluations")
        return SearchResult(
            driver=self.driver,
            reward=self.task.reward,
            seed=self.seed,
            decisions=self.best_choices.copy(),
            plan=self.task.plan_of(self.best_choices),
            score=self.best,
            evaluations=self.evaluations,
            seconds=self.seconds,
            curve=np.asarray(self.curve, dtype=np.float64),
            improvements=tuple(self.improvements),
            interrupted=self.interrupted,
            optimal=self.optimal,
            notes=tuple(self.notes),
            episodes=self.episodes,
            greedy=self.greedy,
        )
