"""What a search maximizes: the paper's dim-counting reward, or the cost model's step-time gain.

Both objectives score a *choice vector* (one choice per position of a `ShardingSpace`, -1 =
replicated) as if an episode took those decisions in decision order, so every driver (DQN,
random, greedy, exact) is measured on the same scale and the DQN's episode return is the score
of the plan it built.

`paper` (Auto-MAP §4.2): +0.4 for each candidate dim partitioned, +0.1 for each replicated, -1
at the first conflict, which ends the episode (later positions earn nothing). A decision counts
every candidate dim its linkage group decides. Ties are frequent (splitting the attention heads
or the head dim of Q/K/V partitions the same number of dims), so scores carry a tie-break: the
number of tensor dims of the whole module the partitioned groups split — bigger groups first,
which is also the paper's decision order.

`cost`: the speedup of the plan over the all-replicated plan under `hlomap.cost`'s estimate,
`T_replicated / T_plan` (> 0). A plan that does not fit in device memory scores
`-1 + capacity / memory` (in (-1, 0): below every plan that fits, and better the less it
overflows, so a search is pulled towards fitting plans); a conflict scores -1, the worst.
"""

from __future__ import annotations

import enum
import logging
from typing import Callable, NamedTuple, Protocol

import numpy as np

from hlomap.search.score import WORST, Score
from hlomap.tasks.sharding.space import ShardingSpace

log = logging.getLogger(__name__)

__all__ = [
    "CONFLICT_REWARD",
    "PAPER_PARTITIONED",
    "PAPER_REPLICATED",
    "CostEval",
    "CostModel",
    "CostObjective",
    "ShardingObjective",
    "PaperObjective",
    "RewardMode",
    "Score",
    "WORST",
]

PAPER_PARTITIONED = 0.4
PAPER_REPLICATED = 0.1
CONFLICT_REWARD = -1.0


class RewardMode(str, enum.Enum):
    PAPER = "paper"
    COST = "cost"

    def __str__(self) -> str:
        return self.value


class ShardingObjective(Protocol):
    """Scores complete choice vectors and gives the environments their per-step rewards."""

    mode: RewardMode
    space: ShardingSpace
    evaluations: int

    def score(self, choices: np.ndarray) -> Score:
        """Score of one choice vector `[P]` (counts one evaluation)."""
        ...

    def score_many(self, choices: np.ndarray) -> list[Score]:
        """Scores of `[N, P]` choice vectors (counts N evaluations)."""
        ...

    def step_reward(self, position: int, choice: int) -> float:
        """Reward for a conflict-free decision in the middle of an episode."""
        ...

    def final_reward(self, choices: np.ndarray) -> float:
        """Extra reward when the last position is decided (the cost mode's whole reward)."""
        ...


# ---------------------------------------------------------------------------------------------
# Paper
# ---------------------------------------------------------------------------------------------


class PaperObjective:
    """Auto-MAP's reward; vectorized over many choice vectors."""

    mode = RewardMode.PAPER

    def __init__(self, space: ShardingSpace) -> None:
        self.space = space
        self.evaluations = 0
        self._partitioned = PAPER_PARTITIONED * space.weights
        self._replicated = PAPER_REPLICATED * space.weights

    def step_reward(self, position: int, choice: int) -> float:
        return float(self._partitioned[position] if choice >= 0 else self._replicated[position])

    def final_reward(self, choices: np.ndarray) -> float:
        return 0.0

    def values(self, choices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(value, tiebreak, conflict_free) arrays for `[N, P]` choice vectors, without counting."""
        choices = np.atleast_2d(np.asarray(choices))
        n, p = choices.shape
        first = self.space.first_conflict(choices)
        before = np.arange(p)[None, :] < first[:, None]
        part = (choices >= 0) & before
        # in tenths, so that the same plan always sums to the same float
        w = self.space.weights[None, :]
        tenths = np.where(part, 4.0 * w, np.where(before, 1.0 * w, 0.0)).sum(axis=1)
        conflict = first < p
        value = tenths / 10.0 + np.where(conflict, CONFLICT_REWARD, 0.0)
        tiebreak = (part * self.space.group_sizes[None, :]).sum(axis=1)
        return value, tiebreak, ~conflict

    def score_many(self, choices: np.ndarray) -> list[Score]:
        value, tiebreak, ok = self.values(choices)
        self.evaluations += len(value)
        return [Score(float(v), float(t), bool(c)) for v, t, c in zip(value, tiebreak, ok)]

    def score(self, choices: np.ndarray) -> Score:
        return self.score_many(np.asarray(choices)[None, :])[0]

    @property
    def upper_bound(self) -> float:
        """Every candidate dim partitioned: no plan scores more."""
        return float(self._partitioned.sum())


# ---------------------------------------------------------------------------------------------
# Cost
# ---------------------------------------------------------------------------------------------


class CostEval(NamedTuple):
    """What the cost model says about one plan array."""

    step_time: float  # seconds
    memory: float  # peak bytes per device
    capacity: float  # bytes per device

    @property
    def fits(self) -> bool:
        return self.memory <= self.capacity


#: plan array over the graph's groups -> estimate. See `hlomap.tasks.sharding.costmodel`.
CostModel = Callable[[np.ndarray], CostEval]


class CostObjective:
    """Speedup over the all-replicated plan under a cost model; caches estimates by plan."""

    mode = RewardMode.COST

    def __init__(self, space: ShardingSpace, model: CostModel) -> None:
        self.space = space
        self.model = model
        self.evaluations = 0  # complete plans scored
        self.model_calls = 0  # cache misses (each one an estimate)
        self._cache: dict[bytes, CostEval] = {}
        self.reference = self.estimate(space.plan_of(space.empty_choices()))

    def estimate(self, plan: np.ndarray) -> CostEval:
        key = np.asarray(plan, dtype=np.int8).tobytes()
        hit = self._cache.get(key)
        if hit is None:
            hit = self.model(np.asarray(plan, dtype=np.int8))
            self._cache[key] = hit
            self.model_calls += 1
        return hit

    def value_of(self, est: CostEval) -> float:
        if not est.fits:
            return -1.0 + est.capacity / max(est.memory, 1.0)
        return self.reference.step_time / max(est.step_time, 1e-30)

    def step_reward(self, position: int, choice: int) -> float:
        return 0.0

    def final_reward(self, choices: np.ndarray) -> float:
        # The env ends a conflict-free episode here; the reward is the plan's value.
        est = self.estimate(self.space.plan_of(choices))
        return self.value_of(est)

    def score_many(self, choices: np.ndarray) -> list[Score]:
        choices = np.atleast_2d(np.asarray(choices))
        ok = self.space.ok(choices)
        out = []
        for row, free in zip(choices, ok):
            self.evaluations += 1
            if not free:
                out.append(Score(CONFLICT_REWARD, float("-inf"), False, False))
                continue
            est = self.estimate(self.space.plan_of(row))
            out.append(Score(self.value_of(est), -est.memory, True, est.fits, est.step_time, est.memory))
        return out

    def score(self, choices: np.ndarray) -> Score:
        return self.score_many(np.asarray(choices)[None, :])[0]

