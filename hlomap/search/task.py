"""The small protocol every search task offers the drivers (DQN, random, greedy, exact).

A task is a decision problem whose candidate plans are *decision vectors* (small int arrays: the
choice at each linkage group of a sharding space, the pivots and device bounds of a pipeline's
cuts). Episodes of its environment build one decision vector each, step by step, as Auto-MAP's
agents do (sections 3.2-3.5); `score` rates a complete vector. Drivers know nothing else about
the task, which is what lets one DQN driver serve the sharding and the pipeline explorers.
"""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple, Protocol, Sequence, runtime_checkable

import numpy as np

from hlomap.agents.environment import TimeStep
from hlomap.search.score import Score

__all__ = ["EpisodeOutcome", "LocalSearchTask", "Neighbourhood", "SearchTask", "TaskEnv"]


class EpisodeOutcome(NamedTuple):
    """One finished episode: the decisions it took (unreached steps as the task's default),
    where it stopped (the step of a conflict, or the episode length), its undiscounted return
    and its score."""

    decisions: np.ndarray
    stopped_at: int
    episode_return: float
    score: Score

    @property
    def conflict_free(self) -> bool:
        return self.score.conflict_free


class TaskEnv(Protocol):
    """`hlomap.agents.Environment` plus what a search driver needs around an episode."""

    observation_size: int
    num_actions: int

    def reset(self, seed: int = 0) -> TimeStep: ...

    def step(self, action: int) -> TimeStep: ...

    @property
    def position(self) -> int:
        """The step (decision) the next action takes."""
        ...

    @property
    def last_outcome(self) -> EpisodeOutcome | None:
        """The outcome of the episode that just ended (None before one has ended)."""
        ...

    def replay_action(self, decisions: np.ndarray) -> int:
        """The action that follows `decisions` at the current step; when that is no longer
        legal (earlier steps changed), the task's fallback (replicate, the best-estimated
        candidate). Used to replay a neighbour of the best plan so the agent learns from it."""
        ...

    def set_replaying(self, replaying: bool) -> None:
        """Episodes that replay decisions use the strictest legality (no choice that clashes
        with an earlier one), so a replayed neighbour never ends in a conflict."""
        ...


class SearchTask(Protocol):
    """What a driver may ask of a task (module docstring).

    reward: what a score measures, for reports ("paper", "cost", "latency", "bottleneck").
    evaluations: complete plans scored so far (the task counts; the tracker reads it).
    """

    reward: str
    evaluations: int

    def make_env(self) -> TaskEnv: ...

    @property
    def episode_length(self) -> int:
        """Steps of one episode of the environment (decisions per plan)."""
        ...

    def default_dqn_config(self, budget: Any) -> Any:
        """The DQN driver's settings this task searches best with (`search.dqn.DqnSearchConfig`)
        for a budget."""
        ...

    def initial(self) -> np.ndarray | None:
        """A plan to start from (the all-replicated plan; a pipeline's best-estimated cuts), or
        None."""
        ...

    def trivial_plan(self) -> np.ndarray | None:
        """A plan available without any search (the all-replicated plan), which the DQN records
        as the floor of its answer; None when there is none."""
        ...

    def score(self, decisions: np.ndarray) -> Score:
        """Score of one decision vector (counts one evaluation)."""
        ...

    def score_many(self, decisions: np.ndarray) -> list[Score]:
        """Scores of `[N, P]` decision vectors (counts N evaluations)."""
        ...

    def plan_of(self, decisions: np.ndarray) -> Any:
        """The task's own plan for a decision vector (a plan array over linkage groups, a
        `PipelinePlan`)."""
        ...

    def neighbours(self, decisions: np.ndarray) -> np.ndarray:
        """`[K, P]` admissible decision vectors one move away (greedy hill climbing)."""
        ...

    def fine_tune_moves(self, best: np.ndarray, start: int) -> Iterator[tuple[int, np.ndarray]]:
        """(position, decisions) neighbours of `best` for the DQN's fine-tuning sweep, cyclic
        from position `start` (Auto-MAP section 5.2.1); none for tasks without one."""
        ...

    def sample(self, rng: np.random.Generator, num: int) -> np.ndarray | None:
        """`[num, P]` random episodes' decisions at once (a vectorized random policy), or None
        when the driver should play the environment instead."""
        ...

    def known_optimum(self) -> Score | None:
        """The optimum's score when the task can prove it cheaply (a small MILP), else None:
        drivers stop once they reach it."""
        ...

    def plan_count(self) -> int | None:
        """How many distinct conflict-free plans there are, when few enough to count, else
        None: drivers stop once they have scored all of them."""
        ...

    def solve_exactly(self, tracker: Any) -> None:
        """Find the optimum, recording every plan it scores in `tracker` and setting
        `tracker.optimal` when proven (raises when the task is too large to solve exactly)."""
        ...


class Neighbourhood(Protocol):
    """One plan being improved by moves priced incrementally (a move re-prices only what it
    touches), for tasks whose plans are too large to rescore from scratch for every neighbour.

    A sweep proposes groups of alternative moves (for placement: the devices one position may
    swap with); the local-search driver tries every move of a group and applies the best one
    that improves. `try_move` gives the score after the move and a proxy (lower is better) that
    tells apart moves of equal score: on a plateau of a max (a ring as slow as its slowest hop)
    it says which move brings the next improvement closer.
    """

    @property
    def decisions(self) -> np.ndarray:
        """The current plan."""
        ...

    @property
    def score(self) -> Score:
        """The current plan's score."""
        ...

    def sweep(self, rng: np.random.Generator) -> Iterator[Sequence[Any]]:
        """Groups of alternative moves from the current plan, in the order to try them; each
        group is computed when the sweep reaches it, after the moves before it were applied."""
        ...

    def try_move(self, move: Any) -> tuple[Score, float]:
        """The score after `move` and its proxy, without applying it (counts one evaluation)."""
        ...

    def apply(self, move: Any) -> None:
        ...


@runtime_checkable
class LocalSearchTask(Protocol):
    """What a task offers the greedy driver to run iterated local search (Lourenco et al.,
    "Iterated Local Search", 2003) instead of rescoring every neighbour from scratch."""

    def starts(self) -> list[np.ndarray]:
        """Plans to start from (the plan as given, structured and constructed ones); the best
        scoring is where the local search begins."""
        ...

    def neighbourhood(self, decisions: np.ndarray) -> Neighbourhood:
        """An incremental state at `decisions` (counts one evaluation: it prices the plan)."""
        ...

    def perturb(self, decisions: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
        """A random kick away from a local optimum, or None when the task has none to give."""
        ...
