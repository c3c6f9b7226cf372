"""The learned driver: Rainbow DQN (`hlomap.agents.dqn`) on any `SearchTask`, with Auto-MAP's
fine-tuning stage (section 5.2.1). The sharding explorers and the pipeline-cut explorer both
search with this one driver.

Training: epsilon-greedy episodes of the task's environment, one learner update per
`update_period` steps; every `greedy_every` episodes the current greedy policy builds one plan
without exploring (scored like any other). The best plan any episode built is the answer, as
Auto-MAP reports the best strategy found during exploration.

Fine-tuning: when the greedy plan has not changed for `stable_after` consecutive greedy checks,
or the best plan for `patience` episodes, the strategy is *stable*. The driver then replays
neighbours of the best plan that the task proposes (`SearchTask.fine_tune_moves`: for the
sharding tasks, the best plan with one more group partitioned), cyclically from where the last
sweep improved; those episodes are played and learned from like any other, so the agent learns
the neighbourhood of its best plan. An improvement restarts the sweep from the new best plan; a
sweep without improvement returns to ordinary training.

Stopping: the budget (seconds, evaluations, learning episodes), or `stale_greedy_limit` greedy
checks in a row that improved nothing once `min_episodes` have run. At least one episode runs.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import numpy as np

from hlomap.agents.dqn import DqnAgent, DqnConfig, DqnFunctions, make_dqn
from hlomap.search.task import EpisodeOutcome, SearchTask, TaskEnv
from hlomap.search.tracker import Budget, Driver, Progress, SearchResult, Tracker

log = logging.getLogger(__name__)

__all__ = ["DqnSearchConfig", "dqn_search", "greedy_episode"]


@dataclasses.dataclass(frozen=True)
class DqnSearchConfig:
    """The agent's hyperparameters and the driver's schedule.

    Exploration: epsilon decays from `epsilon_start` to `epsilon_end` over
    `epsilon_decay_episodes` episodes, or (None) over `exploration` of the episodes the budget
    plans. `epsilon_end` None scales the floor to the episode length: min(0.1,
    `explore_per_episode` / length), so a late episode deviates from the policy at about that
    many steps, not at 10% of them.
    """

    hidden: tuple[int, ...] = (256, 256)
    learning_rate: float = 1e-3
    batch_size: int = 32
    update_period: int = 2  # environment steps per learner update
    min_replay_size: int = 200
    replay_capacity: int = 20_000
    target_update_period: int = 100
    n_step: int = 3
    discount: float = 1.0  # episodes are short and finite; rewards are undiscounted sums
    epsilon_start: float = 1.0
    epsilon_end: float | None = None
    explore_per_episode: float = 2.0
    epsilon_decay_episodes: int | None = 40
    exploration: float = 0.6
    importance_anneal_updates: int | None = None
    distributional: bool = False
    rank_decay: float | None = None  # exploration near the top of ranked candidates (`DqnConfig.rank_decay`)
    greedy_every: int = 5  # episodes between greedy-policy episodes
    fine_tune: bool = True
    stable_after: int = 3  # unchanged greedy plans before fine-tuning ...
    patience: int = 30  # ... or this many episodes without a better plan
    stale_greedy_limit: int | None = None
    min_episodes: int = 0

    def __post_init__(self) -> None:
        if self.greedy_every < 1:
            raise ValueError(f"DqnSearchConfig.greedy_every = {self.greedy_every} must be >= 1")
        if not 0 < self.exploration <= 1:
            raise ValueError(f"DqnSearchConfig.exploration = {self.exploration} must be in (0, 1]")

    def agent_config(self, episode_length: int, planned_episodes: int | None = None) -> DqnConfig:
        """The agent's `DqnConfig` for episodes of `episode_length` steps, when the budget plans
        `planned_episodes` of them (None: unknown)."""
        length = max(episode_length, 1)
        eps_end = (self.epsilon_end if self.epsilon_end is not None
                   else min(0.1, self.explore_per_episode / length))
        if self.epsilon_decay_episodes is not None:
            decay = self.epsilon_decay_episodes * length
        else:
            decay = int(self.exploration * (planned_episodes or 1000) * length)
        anneal = (self.importance_anneal_updates if self.importance_anneal_updates is not None
                  else max(1000, 4 * decay // self.update_period))
        return DqnConfig(
            hidden=self.hidden, learning_rate=self.learning_rate, batch_size=self.batch_size,
            update_period=self.update_period, min_replay_size=self.min_replay_size,
            replay_capacity=self.replay_capacity, target_update_period=self.target_update_period,
            n_step=self.n_step, discount=self.discount, epsilon_start=self.epsilon_start,
            epsilon_end=eps_end, epsilon_decay_steps=max(1, decay),
            distributional=self.distributional, importance_anneal_updates=anneal, rank_decay=self.rank_decay,
        )


def greedy_episode(env: TaskEnv, agent: DqnAgent) -> EpisodeOutcome | None:
    """The plan the agent's greedy policy builds on `env` (None at a dead end); learns nothing."""
    timestep = env.reset(0)
    while not timestep.last:
        timestep = env.step(agent.greedy_action(timestep.observation, timestep.legal))
    return env.last_outcome


class _Episodes:
    """Plays episodes of one env with one agent and reports them to the tracker."""

    def __init__(self, env: TaskEnv, agent: DqnAgent, tracker: Tracker) -> None:
        self.env = env
        self.agent = agent
        self.tracker = tracker
        self.steps = 0

    def play(self, replay: np.ndarray | None = None) -> EpisodeOutcome | None:
        """One learning episode; with `replay`, its actions follow those decisions (the
        strictest legality: later decisions that now clash fall back to the task's default)."""
        env, agent = self.env, self.agent
        env.set_replaying(replay is not None)
        try:
            timestep = env.reset(self.tracker.episodes)
            agent.observe_first(timestep)
            while not timestep.last:
                action = env.replay_action(replay) if replay is not None else agent.act(timestep)
                timestep = env.step(action)
                agent.observe(action, timestep)
                agent.update()
                self.steps += 1
        finally:
            env.set_replaying(False)
        self.tracker.episodes += 1
        return self._record(env.last_outcome)

    def greedy(self) -> EpisodeOutcome | None:
        outcome = self._record(greedy_episode(self.env, self.agent))
        self.tracker.greedy = outcome.score if outcome is not None else None
        return outcome

    def _record(self, outcome: EpisodeOutcome | None) -> EpisodeOutcome | None:
        if outcome is not None:
            self.tracker.record(outcome.decisions, outcome.score)
        return outcome


def _sweep(task: SearchTask, runner: _Episodes, tracker: Tracker) -> None:
    """Replay neighbours of the best plan until a whole sweep improves nothing (module
    docstring); the first improvement restarts from the new best, after the changed position."""
    start, improved = 0, True
    while improved and not tracker.exhausted():
        improved = False
        best_key = tracker.best.key
        for position, neighbour in task.fine_tune_moves(tracker.best_decisions, start):
            runner.play(neighbour)
            tracker.progress()
            if tracker.best.key > best_key:
                improved, start = True, position + 1
                break
            if tracker.exhausted():
                break


def _may_score(tracker: Tracker) -> bool:
    """Whether one more plan may be scored: not interrupted, evaluation budget not spent (a
    greedy check is an evaluation; time and episode limits let it run)."""
    limit = tracker.budget.evaluations
    return not tracker.interrupted and (limit is None or tracker.evaluations < limit)


def dqn_search(task: SearchTask, budget: Budget, seed: int = 0, *, config: DqnSearchConfig | None = None,
               agent_config: DqnConfig | None = None, params: Any = None, functions: DqnFunctions | None = None,
               on_best: Callable[[SearchResult], None] | None = None,
               on_progress: Callable[[Progress], None] | None = None) -> SearchResult:
    """Train a DQN agent on `task` until the budget is spent; returns the best plan seen.

    config: the driver's and agent's settings (default: the task's `default_dqn_config`).
    agent_config: the agent's `DqnConfig` as is (fine-tuning a trained network keeps its own).
    params: initial network parameters (fine-tuning); functions: compiled DQN functions for the
    same config and sizes, to skip compiling again.
    """
    budget.require_limit("dqn")
    tracker = Tracker(task, budget, Driver.DQN, seed, on_best=on_best, on_progress=on_progress)
    env = task.make_env()
    config = config or task.default_dqn_config(budget)
    planned = budget.episodes or budget.evaluations
    agent_config = agent_config or config.agent_config(task.episode_length, planned)
    steps = sweeps = 0
    with tracker.guard():
        agent = DqnAgent(agent_config, env.observation_size, env.num_actions, seed=seed,
                         functions=functions or make_dqn(agent_config, env.observation_size, env.num_actions))
        if params is not None:
            agent.set_params(params)
        runner = _Episodes(env, agent, tracker)
        floor = task.trivial_plan()
        if floor is not None:
            tracker.record(floor, task.score(floor), curve=False)
        last_greedy: bytes | None = None
        stable = stale = 0
        last_improvement = (len(tracker.improvements), 0)
        while tracker.episodes == 0 or not tracker.exhausted():
            runner.play()
            tracker.progress()
            if len(tracker.improvements) != last_improvement[0]:
                last_improvement = (len(tracker.improvements), tracker.episodes)
            if tracker.episodes % config.greedy_every or not _may_score(tracker):
                continue
            before = tracker.best.key
            greedy = runner.greedy()
            stale = 0 if tracker.best.key > before else stale + 1
            if (config.stale_greedy_limit is not None and tracker.episodes >= config.min_episodes
                    and stale >= config.stale_greedy_limit):
                break
            plan = greedy.decisions.tobytes() if greedy is not None else None
            stable = stable + 1 if plan is not None and plan == last_greedy else 0
            last_greedy = plan
            stalled = tracker.episodes - last_improvement[1] >= config.patience
            if tracker.exhausted() or not (config.fine_tune and tracker.best_choices is not None
                                           and (stable >= config.stable_after or stalled)):
                continue
            sweeps += 1
            _sweep(task, runner, tracker)
            stable = 0
            last_improvement = (len(tracker.improvements), tracker.episodes)
        if tracker.greedy is None and _may_score(tracker):
            runner.greedy()
        steps = runner.steps
        tracker.notes.append(f"{tracker.episodes} episodes, {agent.num_updates} learner updates, "
                             f"{sweeps} fine-tuning sweep(s)")
    log.info("DQN search: %d episodes, %d steps in %.1f s; best %.6g", tracker.episodes, steps,
             tracker.seconds, tracker.best.value)
    return tracker.result()
