"""The environment protocol every agent and loop in `hlomap.agents` speaks.

An environment is anything with `reset(seed)` and `step(action)` returning a `TimeStep`, plus two
sizes. The protocol is deliberately dm_env-like but smaller, and it adds the legal-action mask that
placement problems need (an operator cannot be split along a dimension that does not divide, a
pipeline cut cannot go past the last layer...).

Determinism contract: after `reset(seed)` the environment's trajectory must be a function of the
seed and the actions taken. The training loop relies on it to resume an interrupted episode by
resetting with the same seed and replaying the recorded actions (no environment state is pickled).
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np


class StepType(enum.IntEnum):
    """Where a time step sits in its episode."""

    FIRST = 0
    MID = 1
    LAST = 2


class TimeStep(NamedTuple):
    """What the environment returns from `reset` and `step`.

    `reward` and `discount` describe the transition that led here (0 and 1 on FIRST). A LAST step
    with `discount == 0` is a true termination; with `discount > 0` the episode was truncated (a
    time limit) and learners bootstrap from `observation`.
    `legal` is a boolean mask over actions, legal in the state `observation`; on a terminal step it
    may be anything (it is never used to choose an action there).
    """

    step_type: StepType
    observation: np.ndarray
    reward: float
    discount: float
    legal: np.ndarray

    @property
    def first(self) -> bool:
        return self.step_type == StepType.FIRST

    @property
    def last(self) -> bool:
        return self.step_type == StepType.LAST


@runtime_checkable
class Environment(Protocol):
    """A discrete-action environment with a legal-action mask."""

    @property
    def observation_size(self) -> int:
        """Length of the (flat, float) observation vector."""
        ...

    @property
    def num_actions(self) -> int:
        """Number of discrete actions; `legal` masks have this length."""
        ...

    def reset(self, seed: int) -> TimeStep:
        """Starts an episode; the episode is a function of `seed` and the actions taken."""
        ...

    def step(self, action: int) -> TimeStep:
        """Applies `action` (which must be legal) and returns the next time step."""
        ...


def restart(observation: np.ndarray, legal: np.ndarray) -> TimeStep:
    """The first time step of an episode."""
    return TimeStep(StepType.FIRST, observation, 0.0, 1.0, legal)


def transition(
    observation: np.ndarray, reward: float, legal: np.ndarray, discount: float = 1.0
) -> TimeStep:
    """A time step in the middle of an episode."""
    return TimeStep(StepType.MID, observation, float(reward), float(discount), legal)


def termination(observation: np.ndarray, reward: float, legal: np.ndarray) -> TimeStep:
    """The last time step of an episode that ended (no bootstrapping past it)."""
    return TimeStep(StepType.LAST, observation, float(reward), 0.0, legal)


def truncation(
    observation: np.ndarray, reward: float, legal: np.ndarray, discount: float = 1.0
) -> TimeStep:
    """The last time step of an episode cut short (learners bootstrap from `observation`)."""
    return TimeStep(StepType.LAST, observation, float(reward), float(discount), legal)
