"""The OPP / ADP / hybrid explorers as a `hlomap.search` task: a `ShardingSpace` scored by an
`ShardingObjective`, searched by any driver (DQN, random, greedy, exact).

Decisions are choice vectors (`int8[P]`, -1 = replicated, k = mesh-axis option k); an episode of
`PlanEnv` builds one position at a time (Auto-MAP sections 4.2, 4.3). What the drivers need
beyond that lives here: the all-replicated starting plan, one-position moves for greedy hill
climbing, the DQN's fine-tuning moves (section 5.2.1: partition what the best plan replicates),
a vectorized random policy, and the exact solvers (`exact.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from hlomap.search.budget import Budget
from hlomap.search.dqn import DqnSearchConfig
from hlomap.search.greedy import hill_climb
from hlomap.search.score import Score
from hlomap.search.tracker import Tracker
from hlomap.tasks.sharding.env import EnvConfig, MaskPolicy, PlanEnv
from hlomap.tasks.sharding.exact import DEFAULT_ENUMERATION_LIMIT, count_conflict_free, paper_milp, solve_exactly
from hlomap.tasks.sharding.objective import CONFLICT_REWARD, PaperObjective, RewardMode, ShardingObjective
from hlomap.tasks.sharding.space import ShardingSpace

__all__ = ["ShardingTask", "random_choices", "reward_scale"]

#: Time the MILP may take to prove the paper optimum a search can stop at.
MILP_SECONDS = 5.0
#: Spaces with at most this many conflict-free plans are counted, so a search that has scored
#: them all stops (an ADP space of a few data inputs has a handful).
COUNT_LIMIT = 512


def reward_scale(space: ShardingSpace, objective: ShardingObjective) -> float:
    """A uniform scale bringing per-step rewards to at most 1 in magnitude (a uniform scaling of
    every reward leaves the optimal policy unchanged, and keeps the network's targets small)."""
    if objective.mode is RewardMode.PAPER and space.num_positions:
        top = max(abs(objective.step_reward(p, 0)) for p in range(space.num_positions))
        return 1.0 / max(1.0, top, abs(CONFLICT_REWARD))
    return 1.0


def random_choices(space: ShardingSpace, num: int, rng: np.random.Generator,
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


def _fill(space: ShardingSpace, best: np.ndarray) -> np.ndarray | None:
    """`best` with every replicated position partitioned whose partition clashes with none of
    `best`'s partitioned groups (in decision order; clashes among the newly partitioned ones
    fall back to replicate when replayed). None when there is no such position."""
    plan = space.plan_of(best)
    filled = best.copy()
    free = False
    for p in np.flatnonzero(best < 0):
        for a in np.flatnonzero(space.legal[p, 1:]):
            if not space.conflicts(plan, int(p), int(a)):
                filled[p] = a
                free = True
                break
    return filled if free else None


@dataclass(eq=False)
class ShardingTask:
    """A sharding space and objective as a search task (module docstring).

    env: the environment's encoding and masking (its reward scale is derived from the
    objective); enumeration_limit: the exact driver refuses spaces with more conflict-free
    plans than this under a reward it must enumerate.
    """

    space: ShardingSpace
    objective: ShardingObjective
    env: EnvConfig = field(default_factory=EnvConfig)
    enumeration_limit: int = DEFAULT_ENUMERATION_LIMIT
    #: choice vectors of expert plans the space holds (Megatron's on a model axis, `expert_starts`):
    #: the exact search scores them and climbs from the best before it enumerates
    expert_starts: tuple[np.ndarray, ...] = ()

    # -- what the drivers read ------------------------------------------------------------------
    @property
    def reward(self) -> str:
        return self.objective.mode.value

    @property
    def evaluations(self) -> int:
        return self.objective.evaluations

    @property
    def episode_length(self) -> int:
        return self.space.num_positions

    def make_env(self) -> PlanEnv:
        config = EnvConfig(self.env.encoding, self.env.mask, reward_scale(self.space, self.objective),
                           self.env.tiebreak_bonus)
        return PlanEnv(self.space, self.objective, config)

    def default_dqn_config(self, budget: Budget) -> DqnSearchConfig:
        return DqnSearchConfig()

    def initial(self) -> np.ndarray:
        return self.space.empty_choices()

    def trivial_plan(self) -> np.ndarray:
        return self.space.empty_choices()

    def score(self, decisions: np.ndarray) -> Score:
        return self.objective.score(decisions)

    def score_many(self, decisions: np.ndarray) -> list[Score]:
        return self.objective.score_many(decisions)

    def plan_of(self, decisions: np.ndarray) -> np.ndarray:
        return self.space.plan_of(decisions)

    # -- moves ----------------------------------------------------------------------------------
    def neighbours(self, decisions: np.ndarray) -> np.ndarray:
        """Every conflict-free choice vector one position-change away (any position, any
        choice); conflicting candidates are dropped without an evaluation (they can never be
        the best change)."""
        space = self.space
        rows = []
        for p in range(space.num_positions):
            for a in np.flatnonzero(space.legal[p]):
                if a - 1 != decisions[p]:
                    row = decisions.copy()
                    row[p] = a - 1
                    rows.append(row)
        out = np.asarray(rows, dtype=np.int8).reshape(-1, space.num_positions)
        return out[space.ok(out)] if len(out) else out

    def fine_tune_moves(self, best: np.ndarray, start: int) -> Iterator[tuple[int, np.ndarray]]:
        """First (at the start of a sweep) `best` with every free replicated position
        partitioned; then, for each position `best` replicates, cyclically from `start`, and
        each legal partition there, `best` with that one position partitioned."""
        space = self.space
        if start == 0:
            filled = _fill(space, best)
            if filled is not None:
                yield -1, filled
        replicated = [int(p) for p in np.flatnonzero(best < 0)]
        order = [p for p in replicated if p >= start] + [p for p in replicated if p < start]
        for p in order:
            for a in np.flatnonzero(space.legal[p, 1:]):
                moved = best.copy()
                moved[p] = a
                yield p, moved

    def sample(self, rng: np.random.Generator, num: int) -> np.ndarray:
        """Random episodes under the environment's masking, each cut off at its first conflict
        (later positions are never reached)."""
        drawn = random_choices(self.space, num, rng, self.env.mask)
        first = self.space.first_conflict(drawn)
        drawn[np.arange(self.space.num_positions)[None, :] > first[:, None]] = -1
        return drawn

    def known_optimum(self) -> Score | None:
        """The paper reward's optimum from the MILP when HiGHS proves it within a few seconds
        (the ADP spaces take milliseconds); None for the cost reward."""
        if not isinstance(self.objective, PaperObjective):
            return None
        choices, proven = paper_milp(self.space, time_limit=MILP_SECONDS)
        if not proven:
            return None
        value, tiebreak, ok = self.objective.values(choices[None, :])
        return Score(float(value[0]), float(tiebreak[0]), bool(ok[0]))

    def plan_count(self) -> int | None:
        count = count_conflict_free(self.space, COUNT_LIMIT)
        return count if count <= COUNT_LIMIT else None

    def solve_exactly(self, tracker: Tracker) -> None:
        solve_exactly(self.space, self.objective, tracker, limit=self.enumeration_limit,
                      warm_start=lambda t: hill_climb(self, t, self._best_start(t)))

    def _best_start(self, tracker: Tracker) -> np.ndarray:
        """The best scored of the replicated plan and the expert starts (each recorded): where a
        budget that cuts the enumeration short cannot leave the search behind Megatron's plan
        (t5-tiny's opp space on 8 CPU devices: a climb from the replicated plan stopped at a
        plan 2x slower than Megatron's, the enumeration reached neither in 20 s)."""
        rows = (self.initial(), *self.expert_starts)
        if len(rows) == 1:
            return rows[0]
        scores = [self.score(row) for row in rows]
        best = max(range(len(rows)), key=lambda k: scores[k].key)
        for k, (row, score) in enumerate(zip(rows, scores)):
            if k != best:  # the climb records its start itself
                tracker.record(row, score)
        return rows[best].copy()
