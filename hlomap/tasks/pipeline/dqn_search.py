"""Online DQN search for pipeline cuts (Auto-MAP section 3.4): train on one model, keep the best.

`dqn_search(task)` trains a Rainbow-style `DqnAgent` (hlomap.agents) on the `CutEnv` of one
task, from scratch or from given parameters (fine-tuning the inference network, section 3.5),
and returns the best plan any episode built, exploring or greedy, as Auto-MAP reports the best
strategy found during exploration. Every `eval_every` episodes the greedy policy builds a plan
too; the search stops at `max_episodes`, at `seconds`, or after `patience` greedy evaluations
that improved nothing. By default the agent acts on the 32 best-estimated legal pivots of each
state (`CutEnv(ranked=32)`, see `ONLINE_CANDIDATES`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from hlomap.agents.dqn import DqnAgent, DqnConfig, DqnFunctions
from hlomap.agents.loop import EpisodeRecord, LoopConfig, run_loop
from hlomap.cost.pipeline.costs import PlanCost
from hlomap.tasks.pipeline.cutenv import MAX_STAGES, CutEnv, CutTask, EpisodeOutcome
from hlomap.cost.pipeline.stages import PipelinePlan

__all__ = [
    "SearchBudget",
    "SearchResult",
    "default_dqn_config",
    "dqn_search",
    "greedy_rollout",
]

log = logging.getLogger(__name__)

#: The online search acts on the 32 legal pivots with the best estimates (`CutEnv(ranked=...)`):
#: on the zoo steps of the acceptance run it reaches the DP optimum in about half the time of
#: acting on every pivot, which missed it by 3% on BERT with 4 stages in 2000 episodes.
ONLINE_CANDIDATES = 32


@dataclass(frozen=True)
class SearchBudget:
    """When a search stops (whichever comes first) and how often it tries the greedy policy.

    max_episodes: training episodes (each builds one plan of S - 1 cuts).
    seconds: wall-clock limit, or None.
    eval_every: episodes between greedy rollouts.
    patience: stop after this many greedy rollouts in a row that did not improve the best plan,
      once `min_episodes` have run; None never stops early.
    exploration: fraction of `max_episodes` over which epsilon decays to its floor.
    """

    max_episodes: int = 3000
    seconds: float | None = None
    eval_every: int = 25
    patience: int | None = None
    min_episodes: int = 0
    exploration: float = 0.6

    def __post_init__(self) -> None:
        if self.max_episodes < 1 or self.eval_every < 1:
            raise ValueError(f"SearchBudget needs max_episodes, eval_every >= 1: {self}")
        if not 0 < self.exploration <= 1:
            raise ValueError(f"SearchBudget.exploration = {self.exploration} must be in (0, 1]")


@dataclass(frozen=True)
class SearchResult:
    """The best plan a search found, and how the search went."""

    plan: PipelinePlan
    cost: PlanCost
    value: float  # L (or the bottleneck) of `plan`
    feasible: bool
    actions: tuple[int, ...]  # the episode's actions that built `plan`
    episodes: int
    steps: int
    seconds: float
    found_at_episode: int
    greedy_value: float  # what the final greedy policy builds (inf if infeasible)
    improvements: tuple[tuple[int, float], ...]  # (episode, best value) whenever it improved


def default_dqn_config(n_cuts: int, max_episodes: int, exploration: float = 0.6) -> DqnConfig:
    """DQN settings for a cut search of `n_cuts` steps per episode: undiscounted (episodes are
    short and rewards potential-shaped), n-step returns over the whole episode, a fast learning
    rate, and epsilon decaying over `exploration` of the planned steps."""
    steps = max(1, n_cuts * max_episodes)
    return DqnConfig(
        hidden=(128, 128),
        discount=1.0,
        n_step=max(1, min(n_cuts, 4)),
        learning_rate=1e-3,
        replay_capacity=20_000,
        batch_size=32,
        min_replay_size=128,
        target_update_period=100,
        update_period=2,
        epsilon_start=1.0,
        epsilon_end=0.02,
        epsilon_decay_steps=max(1, int(exploration * steps)),
        importance_anneal_updates=steps,
    )


def greedy_rollout(env: CutEnv, agent: DqnAgent) -> tuple[EpisodeOutcome | None, tuple[int, ...]]:
    """The plan the agent's greedy policy builds on `env` (None at a dead end)."""
    timestep = env.reset(0)
    actions = []
    while not timestep.last:
        action = agent.greedy_action(timestep.observation, timestep.legal)
        actions.append(int(action))
        timestep = env.step(action)
    return env.outcome, tuple(actions)


@dataclass
class _Tracker:
    """The best outcome so far, and the stopping rule's bookkeeping."""

    best: EpisodeOutcome | None = None
    actions: tuple[int, ...] = ()
    found_at: int = -1
    improvements: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    stale_evaluations: int = 0
    greedy_value: float = float("inf")

    def offer(self, outcome: EpisodeOutcome | None, actions: tuple[int, ...],
              episode: int) -> bool:
        if outcome is None:
            return False
        better = self.best is None or (
            (outcome.feasible, -outcome.value) > (self.best.feasible, -self.best.value)
        )
        if better:
            self.best, self.actions, self.found_at = outcome, actions, episode
            self.improvements.append((episode, outcome.value))
        return better


def dqn_search(
    task: CutTask,
    budget: SearchBudget = SearchBudget(),
    *,
    seed: int = 0,
    config: DqnConfig | None = None,
    params: Any = None,
    slots: int | None = None,
    ranked: int | None = ONLINE_CANDIDATES,
    functions: DqnFunctions | None = None,
) -> SearchResult:
    """Train a DQN on `task` and return the best plan found (module docstring).

    config: the DQN's settings (default: `default_dqn_config`).
    params: initial network parameters (fine-tuning); they must fit `config` and the
      environment's sizes.
    slots, ranked: the environment's pivot slots and ranked candidates (`CutEnv`), as for the
      network `params` came from; `ranked=None` acts on every pivot.
    functions: compiled DQN functions for the same config and sizes, to skip compiling again.
    """
    # A fresh network can be laid out for any stage count; given parameters fix the layout.
    stages = MAX_STAGES if params is not None else max(MAX_STAGES, task.n_stages)
    env = CutEnv(task, slots=slots, ranked=ranked, max_stages=stages)
    evaluation = CutEnv(task, slots=slots, ranked=ranked, max_stages=stages)
    n_cuts = task.n_stages - 1
    config = config or default_dqn_config(n_cuts, budget.max_episodes, budget.exploration)
    agent = DqnAgent(config, env.observation_size, env.num_actions, seed=seed,
                     functions=functions)
    if params is not None:
        agent.set_params(params)
    tracker = _Tracker()
    start = time.perf_counter()

    def on_episode(record: EpisodeRecord) -> bool:
        episode = record.index
        tracker.offer(env.outcome, tuple(env.actions), episode)
        out_of_time = budget.seconds is not None and time.perf_counter() - start > budget.seconds
        if (episode + 1) % budget.eval_every == 0 or out_of_time:
            outcome, actions = greedy_rollout(evaluation, agent)
            tracker.greedy_value = (outcome.value if outcome is not None and outcome.feasible
                                    else float("inf"))
            if tracker.offer(outcome, actions, episode):
                tracker.stale_evaluations = 0
            else:
                tracker.stale_evaluations += 1
            if (budget.patience is not None and episode + 1 >= budget.min_episodes
                    and tracker.stale_evaluations >= budget.patience):
                return True
        return out_of_time

    result = run_loop(env, agent, LoopConfig(num_steps=budget.max_episodes * n_cuts, seed=seed),
                      on_episode=on_episode)
    outcome, actions = greedy_rollout(evaluation, agent)
    tracker.greedy_value = (outcome.value if outcome is not None and outcome.feasible
                            else float("inf"))
    tracker.offer(outcome, actions, result.num_episodes)
    seconds = time.perf_counter() - start
    best = tracker.best
    assert best is not None, "every search runs at least one greedy rollout"
    log.info(
        "%s: DQN search of %d stages: %d episodes in %.1f s, best %.6g at episode %d, "
        "greedy %.6g", task.profile.source, task.n_stages, result.num_episodes, seconds,
        best.value, tracker.found_at, tracker.greedy_value,
    )
    return SearchResult(
        plan=best.plan,
        cost=best.cost,
        value=best.value,
        feasible=best.feasible,
        actions=tracker.actions,
        episodes=result.num_episodes,
        steps=result.num_steps,
        seconds=seconds,
        found_at_episode=tracker.found_at,
        greedy_value=tracker.greedy_value,
        improvements=tuple(tracker.improvements),
    )

