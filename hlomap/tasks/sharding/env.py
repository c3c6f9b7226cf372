"""The OPP / ADP / hybrid environment (Auto-MAP §4.2, §4.3) in `hlomap.agents`' protocol.

An episode is one pass over the positions of a `ShardingSpace` in decision order. At each step the
agent picks action 0 (replicate) or k (shard the position's group on mesh-axis option k-1; on a
1-D mesh action 1 is "partition"). The decision applies to the whole linkage group. A decision
that conflicts with the ones before it earns -1 and ends the episode; otherwise the objective's
step reward (paper: +0.4 / +0.1 per candidate dim) and, after the last position, its final
reward (cost: the plan's speedup).

Observation (`Encoding`): the decision state and a one-hot of the current position.
- DIMS, as in the paper: one entry per candidate dim (trainable dims for OPP).
- GROUPS: one entry per position. Every dim of a group always holds the group's decision, so
  this carries the same information in fewer inputs (a T5-11B has 1,184 trainable dims in 222
  groups); it is the default.
On a 1-D mesh an entry is 1 (partitioned), 0 (replicated) or -1 (undecided), the paper's vector.
On an N-D mesh it is a "decided" flag followed by a one-hot over the axis options.

Masking (`MaskPolicy`): NONE lets the agent pick anything (every conflict is discovered the
paper's way); STATIC (default) masks what is impossible for a group whatever else is decided
(indivisible sizes, need-replication factors, pruned groups); FULL also masks choices that
clash with earlier decisions, so episodes never conflict.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from hlomap.agents.environment import TimeStep, restart, termination, transition
from hlomap.propagation.conflicts import REPLICATED
from hlomap.search.score import Score
from hlomap.search.task import EpisodeOutcome
from hlomap.tasks.sharding.objective import CONFLICT_REWARD, ShardingObjective, RewardMode
from hlomap.tasks.sharding.space import ShardingSpace

__all__ = ["Encoding", "EnvConfig", "MaskPolicy", "PlanEnv", "observation_size"]


class Encoding(str, enum.Enum):
    GROUPS = "groups"
    DIMS = "dims"


class MaskPolicy(str, enum.Enum):
    NONE = "none"
    STATIC = "static"
    FULL = "full"


@dataclass(frozen=True)
class EnvConfig:
    encoding: Encoding = Encoding.GROUPS
    mask: MaskPolicy = MaskPolicy.STATIC
    reward_scale: float = 1.0  # multiplies every reward the agent sees (scores are unscaled)
    # The agent also sees the scores' tie-break: partitioning position p adds
    # TIEBREAK_SHARE * size_p / (sizes of all positions) to its reward, at most TIEBREAK_SHARE per
    # episode in all, less than any difference in the reward itself (0.3 per dim for the paper's).
    # None: on for the paper reward (whose scores break ties that way), off otherwise.
    tiebreak_bonus: bool | None = None


TIEBREAK_SHARE = 0.1


def observation_size(space: ShardingSpace, encoding: Encoding) -> int:
    entries = space.num_positions if encoding is Encoding.GROUPS else len(space.candidates)
    width = 1 if len(space.axes.options) == 1 else len(space.axes.options) + 1
    return entries * width + space.num_positions


class PlanEnv:
    """Environment over a `ShardingSpace`, scored by a `ShardingObjective`. Deterministic: `reset(seed)`
    ignores the seed (the episode depends only on the actions)."""

    def __init__(self, space: ShardingSpace, objective: ShardingObjective, config: EnvConfig = EnvConfig()) -> None:
        self.space = space
        self.objective = objective
        self.config = config
        self._k = len(space.axes.options)
        if config.encoding is Encoding.GROUPS:
            self._entry_position = np.arange(space.num_positions)
        else:
            self._entry_position = np.asarray([c.position for c in space.candidates], dtype=np.int64)
        self._obs_size = observation_size(space, config.encoding)
        sizes = space.group_sizes
        bonus = config.tiebreak_bonus if config.tiebreak_bonus is not None else objective.mode is RewardMode.PAPER
        self._bonus = (TIEBREAK_SHARE * sizes / max(float(sizes.sum()), 1.0) if bonus
                       else np.zeros(space.num_positions))
        #: the masking of the current episode (FULL while replaying decisions)
        self.mask = config.mask
        self._choices = space.empty_choices()
        self._plan = space.plan_of(self._choices)
        self._t = 0
        self._return = 0.0
        self.last_outcome: EpisodeOutcome | None = None

    # -- protocol -------------------------------------------------------------------------------
    @property
    def observation_size(self) -> int:
        return self._obs_size

    @property
    def num_actions(self) -> int:
        return self.space.num_actions

    @property
    def position(self) -> int:
        return self._t

    @property
    def choices(self) -> np.ndarray:
        return self._choices.copy()

    def reset(self, seed: int = 0) -> TimeStep:
        del seed
        self._choices = self.space.empty_choices()
        self._plan = self.space.plan_of(self._choices)
        self._t = 0
        self._return = 0.0
        return restart(self._observe(), self.legal())

    def step(self, action: int) -> TimeStep:
        space = self.space
        p = self._t
        if p >= space.num_positions:
            raise RuntimeError("step() after the episode ended; call reset()")
        choice = int(action) - 1
        if not 0 <= action < self.num_actions:
            raise ValueError(f"action {action} out of range [0, {self.num_actions})")
        scale = self.config.reward_scale
        if space.conflicts(self._plan, p, choice):
            self._return += CONFLICT_REWARD
            self._finish(conflict_at=p)
            return termination(self._observe(), CONFLICT_REWARD * scale, self.legal())
        reward = self.objective.step_reward(p, choice)
        bonus = float(self._bonus[p]) if choice != REPLICATED else 0.0
        self._choices[p] = choice
        if choice != REPLICATED:
            space.set_choice(self._plan, p, choice)
        self._t = p + 1
        if self._t == space.num_positions:
            reward += self.objective.final_reward(self._choices)
            self._return += reward
            self._finish(conflict_at=space.num_positions)
            return termination(self._observe(), (reward + bonus) * scale, self.legal())
        self._return += reward
        return transition(self._observe(), (reward + bonus) * scale, self.legal())

    def replay_action(self, decisions: np.ndarray) -> int:
        """The action of `decisions` at the current position, or replicate (action 0) when it
        clashes with what this episode decided so far."""
        action = int(decisions[self._t]) + 1
        return action if self.space.legal_now(self._plan, self._t)[action] else 0

    def set_replaying(self, replaying: bool) -> None:
        """While replaying, every clash is masked (FULL), so the episode cannot conflict."""
        self.mask = MaskPolicy.FULL if replaying else self.config.mask

    # -- helpers --------------------------------------------------------------------------------
    def legal(self) -> np.ndarray:
        space = self.space
        p = min(self._t, space.num_positions - 1)
        policy = self.mask
        if policy is MaskPolicy.NONE:
            return np.ones(self.num_actions, dtype=bool)
        if policy is MaskPolicy.STATIC:
            return space.legal[p].copy()
        return space.legal_now(self._plan, p)

    def _observe(self) -> np.ndarray:
        decided = np.arange(self.space.num_positions) < self._t
        choice = self._choices[self._entry_position]
        dec = decided[self._entry_position]
        if self._k == 1:
            state = np.where(dec, (choice >= 0).astype(np.float32), -1.0).astype(np.float32)
        else:
            state = np.zeros((len(choice), self._k + 1), dtype=np.float32)
            state[:, 0] = dec
            rows = np.flatnonzero(dec & (choice >= 0))
            state[rows, choice[rows] + 1] = 1.0
            state = state.reshape(-1)
        where = np.zeros(self.space.num_positions, dtype=np.float32)
        if self._t < self.space.num_positions:
            where[self._t] = 1.0
        return np.concatenate([state, where])

    def _finish(self, conflict_at: int) -> None:
        choices = self._choices.copy()
        if conflict_at < self.space.num_positions:
            score = Score(self._return, float("-inf"), False, False)
            self.objective.evaluations += 1
        else:
            score = self.objective.score(choices)
        self.last_outcome = EpisodeOutcome(choices, conflict_at, self._return, score)
        self._t = self.space.num_positions
