"""The agent protocol: what the training loop (and any explorer's own loop) calls.

The split follows acme/dqn_zoo: `observe_first`/`act`/`observe` feed experience in, `update`
runs the learner when it is due. Everything heavier than bookkeeping happens in jitted pure
functions owned by the concrete agent.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from hlomap.agents.environment import TimeStep


class UpdateStats(NamedTuple):
    """What one learner call reports: the mean loss over the updates it ran."""

    loss: float
    num_updates: int  # learner updates run so far, in total


@runtime_checkable
class Agent(Protocol):
    """A discrete-action agent that honours legal-action masks."""

    num_steps: int  # environment steps observed so far

    def observe_first(self, timestep: TimeStep) -> None:
        """Starts an episode at `timestep` (a FIRST step)."""
        ...

    def act(self, timestep: TimeStep) -> int:
        """Chooses a legal action for `timestep` (exploring, as in training)."""
        ...

    def observe(self, action: int, timestep: TimeStep) -> None:
        """Records that `action` led to `timestep`."""
        ...

    def update(self) -> UpdateStats | None:
        """Runs the learner if it is due; None when it was not."""
        ...

    def greedy_action(self, observation: np.ndarray, legal: np.ndarray) -> int:
        """The best legal action by the current policy, without exploration."""
        ...

    def metrics(self) -> dict[str, float]:
        """Cheap scalars worth showing in a progress bar (e.g. epsilon)."""
        ...

    def save(self, path: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> None:
        """Writes a checkpoint; `extra` (JSON data) rides along, e.g. the loop's state."""
        ...

    def restore(self, path: str | os.PathLike[str]) -> dict[str, Any] | None:
        """Loads a checkpoint written by `save` of an agent with the same config; returns extra."""
        ...
