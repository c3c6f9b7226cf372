"""What every search driver shares: budgets, the result record, and the tracker that keeps the
best plan, the convergence curve and the evaluation count while a driver runs.

A driver calls `tracker.record(choices, score)` for every complete plan it scores (an episode,
a greedy candidate, an enumerated plan) and stops when `tracker.exhausted()`. The tracker calls
`on_best` whenever the best plan improves, so the caller can save it as the search runs; a
KeyboardInterrupt inside a driver is caught by `tracker.guard()` and the driver returns what it
has, marked `interrupted`.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple

import numpy as np

from hlomap.tasks.sharding.objective import WORST, Objective, RewardMode, Score
from hlomap.tasks.sharding.space import SearchSpace

log = logging.getLogger(__name__)

__all__ = ["Budget", "Driver", "Improvement", "Progress", "SearchResult", "Tracker"]


class Driver(str, enum.Enum):
    DQN = "dqn"
    RANDOM = "random"
    GREEDY = "greedy"
    EXACT = "exact"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Budget:
    """When a search stops: whichever limit comes first (None: no limit of that kind; with
    neither, only drivers that end by themselves, exact and greedy, accept it)."""

    seconds: float | None = 60.0
    evaluations: int | None = None

    @property
    def unlimited(self) -> bool:
        return self.seconds is None and self.evaluations is None

    def require_limit(self, driver: str) -> None:
        if self.unlimited:
            raise ValueError(f"the {driver} driver needs a budget in seconds or evaluations")


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
    """The outcome of one driver run on one space and objective."""

    driver: Driver
    reward: RewardMode
    seed: int
    choices: np.ndarray  # best choice vector [P]
    plan: np.ndarray  # its plan array over the graph's groups
    score: Score
    evaluations: int
    seconds: float
    curve: np.ndarray  # score of every episode / scored plan, in order
    improvements: tuple[Improvement, ...]
    interrupted: bool = False
    optimal: bool = False  # proven optimal (exact driver)
    notes: tuple[str, ...] = field(default=())

    @property
    def best_curve(self) -> np.ndarray:
        """Running maximum of `curve`."""
        return np.maximum.accumulate(self.curve) if len(self.curve) else self.curve

    def search_json(self) -> dict[str, object]:
        """The `search` record stored in a saved plan."""
        return {"driver": self.driver.value, "reward": self.reward.value, "seed": self.seed,
                "evaluations": self.evaluations, "seconds": round(self.seconds, 3),
                "score": self.score.to_json(), "interrupted": self.interrupted, "optimal": self.optimal,
                **({"notes": list(self.notes)} if self.notes else {})}


class Tracker:
    """Best plan, curve, evaluation count and budget of one driver run."""

    def __init__(self, space: SearchSpace, objective: Objective, budget: Budget, driver: Driver, seed: int, *,
                 on_best: Callable[[SearchResult], None] | None = None,
                 on_progress: Callable[[Progress], None] | None = None) -> None:
        self.space = space
        self.objective = objective
        self.budget = budget
        self.driver = driver
        self.seed = seed
        self.on_best = on_best
        self.on_progress = on_progress
        self.start = time.perf_counter()
        self.start_evaluations = objective.evaluations
        self.best_choices = space.empty_choices()
        self.best = WORST
        self.curve: list[float] = []
        self.improvements: list[Improvement] = []
        self.interrupted = False
        self.optimal = False
        self.notes: list[str] = []

    # -- accounting -----------------------------------------------------------------------------
    @property
    def evaluations(self) -> int:
        return self.objective.evaluations - self.start_evaluations

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def fraction(self) -> float:
        parts = []
        if self.budget.seconds is not None:
            parts.append(self.seconds / max(self.budget.seconds, 1e-9))
        if self.budget.evaluations is not None:
            parts.append(self.evaluations / max(self.budget.evaluations, 1))
        return float(min(1.0, max(parts)))

    def exhausted(self) -> bool:
        if self.interrupted:
            return True
        if self.budget.evaluations is not None and self.evaluations >= self.budget.evaluations:
            return True
        return self.budget.seconds is not None and self.seconds >= self.budget.seconds

    def remaining_evaluations(self) -> int | None:
        if self.budget.evaluations is None:
            return None
        return max(0, self.budget.evaluations - self.evaluations)

    # -- recording ------------------------------------------------------------------------------
    def record(self, choices: np.ndarray, score: Score, *, curve: bool = True) -> bool:
        """Note one scored plan; returns True when it is the new best."""
        if curve:
            self.curve.append(score.value)
        if score.conflict_free and score.key > self.best.key:
            self.best = score
            self.best_choices = np.array(choices, dtype=np.int8, copy=True)
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

    def result(self) -> SearchResult:
        return SearchResult(
            driver=self.driver,
            reward=self.objective.mode,
            seed=self.seed,
            choices=self.best_choices.copy(),
            plan=self.space.plan_of(self.best_choices),
            score=self.best,
            evaluations=self.evaluations,
            seconds=self.seconds,
            curve=np.asarray(self.curve, dtype=np.float64),
            improvements=tuple(self.improvements),
            interrupted=self.interrupted,
            optimal=self.optimal,
            notes=tuple(self.notes),
        )
