"""The learned driver: Rainbow DQN (`hlomap.agents.dqn`) on a `PlanEnv`, with Auto-MAP's
fine-tuning stage (§5.2.1).

Training: epsilon-greedy episodes, one learner update per `update_period` steps; every
`greedy_every` episodes the current greedy policy plays one episode without exploring (its plan
is scored like any other). Exploration is scaled to the episode length: the final epsilon is at
most `explore_per_episode / P`, so a late episode deviates from the policy at about that many
positions instead of at 10% of them.

Fine-tuning: when the greedy plan has not changed for `stable_after` consecutive greedy checks,
or the best plan for `patience` episodes, the strategy is *stable*. The driver then backtracks the best plan's replicated decisions: one
episode partitions all of them that clash with none of its partitioned groups; then, for each
replicated position (cyclically, going on after the last improvement), an episode replays the
best plan with a partition forced there (each mesh-axis option in turn), later decisions that
now conflict falling back to replicate. Those episodes are played and learned from like any
other, so the agent learns the neighbourhood of its best plan. An improvement restarts the sweep from
the new best plan; a sweep without improvement returns to ordinary training.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Iterator

import numpy as np

from hlomap.agents.dqn import DqnAgent, DqnConfig, make_dqn
from hlomap.tasks.sharding.env import Encoding, EnvConfig, EpisodeOutcome, MaskPolicy, PlanEnv
from hlomap.tasks.sharding.objective import CONFLICT_REWARD, Objective, RewardMode
from hlomap.search.tracker import Budget, Driver, Progress, SearchResult, Tracker
from hlomap.tasks.sharding.space import SearchSpace

log = logging.getLogger(__name__)

__all__ = ["DqnSearchConfig", "dqn_search"]


@dataclasses.dataclass(frozen=True)
class DqnSearchConfig:
    """Search-level settings around the agent's own `DqnConfig`."""

    hidden: tuple[int, ...] = (256, 256)
    learning_rate: float = 1e-3
    batch_size: int = 32
    update_period: int = 2  # environment steps per learner update
    min_replay_size: int = 200
    replay_capacity: int = 20_000
    target_update_period: int = 100
    n_step: int = 3
    discount: float = 1.0  # episodes are short and finite; the paper reward is an undiscounted sum
    epsilon_decay_episodes: int = 40
    explore_per_episode: float = 2.0  # final epsilon = min(0.1, this / P)
    greedy_every: int = 5  # episodes between greedy-policy episodes
    stable_after: int = 3  # unchanged greedy plans before fine-tuning ...
    patience: int = 30  # ... or this many episodes without a better plan
    fine_tune: bool = True
    encoding: Encoding = Encoding.GROUPS
    mask: MaskPolicy = MaskPolicy.STATIC
    distributional: bool = False

    def agent_config(self, num_positions: int) -> DqnConfig:
        eps_end = min(0.1, self.explore_per_episode / max(num_positions, 1))
        return DqnConfig(
            hidden=self.hidden, learning_rate=self.learning_rate, batch_size=self.batch_size,
            update_period=self.update_period, min_replay_size=self.min_replay_size,
            replay_capacity=self.replay_capacity, target_update_period=self.target_update_period,
            n_step=self.n_step, discount=self.discount, epsilon_end=eps_end,
            epsilon_decay_steps=max(1, self.epsilon_decay_episodes * num_positions),
            distributional=self.distributional,
            importance_anneal_updates=max(1000, 4 * self.epsilon_decay_episodes * num_positions // self.update_period),
        )


def reward_scale(space: SearchSpace, objective: Objective) -> float:
    """A uniform scale bringing per-step rewards to at most 1 in magnitude (a uniform scaling of
    every reward leaves the optimal policy unchanged, and keeps the network's targets small)."""
    if objective.mode is RewardMode.PAPER and space.num_positions:
        top = max(abs(objective.step_reward(p, 0)) for p in range(space.num_positions))
        return 1.0 / max(1.0, top, abs(CONFLICT_REWARD))
    return 1.0


class _Episodes:
    """Plays episodes of one env with one agent and reports them to the tracker."""

    def __init__(self, env: PlanEnv, agent: DqnAgent, tracker: Tracker) -> None:
        self.env = env
        self.agent = agent
        self.tracker = tracker
        self.episodes = 0

    def play(self, forced: dict[int, int] | None = None, *, learn: bool = True, greedy: bool = False,
             mask: MaskPolicy | None = None) -> EpisodeOutcome:
        """One episode. `forced` maps positions to actions taken regardless of the policy; `mask`
        overrides the environment's masking for this episode."""
        env, agent = self.env, self.agent
        default = env.mask
        env.mask = mask if mask is not None else default
        try:
            return self._play(forced, learn, greedy)
        finally:
            env.mask = default

    def _play(self, forced: dict[int, int] | None, learn: bool, greedy: bool) -> EpisodeOutcome:
        env, agent = self.env, self.agent
        ts = env.reset(self.episodes)
        if learn:
            agent.observe_first(ts)
        while not ts.last:
            p = env.position
            if forced is not None and p in forced:
                action = forced[p] if ts.legal[forced[p]] else 0
            elif greedy:
                action = agent.greedy_action(ts.observation, ts.legal)
            else:
                action = agent.act(ts)
            ts = env.step(action)
            if learn:
                agent.observe(action, ts)
                agent.update()
        self.episodes += 1
        outcome = env.last_outcome
        assert outcome is not None
        self.tracker.record(outcome.choices, outcome.score)
        return outcome


def _fill(space: SearchSpace, best: np.ndarray) -> dict[int, int] | None:
    """Forced actions partitioning every position `best` replicates whose partition clashes with
    none of `best`'s partitioned groups (in decision order; clashes among the newly partitioned
    ones fall back to replicate). None when there is no such position."""
    plan = space.plan_of(best)
    forced = {q: int(c) + 1 for q, c in enumerate(best)}
    free = False
    for p in np.flatnonzero(best < 0):
        for a in np.flatnonzero(space.legal[p, 1:]):
            if not space.conflicts(plan, int(p), int(a)):
                forced[int(p)] = int(a) + 1
                free = True
                break
    return forced if free else None


def _flips(space: SearchSpace, best: np.ndarray, start: int) -> Iterator[tuple[int, dict[int, int]]]:
    """(position, forced actions) for the fine-tuning sweep: for each position `best` replicates,
    cyclically from `start`, and each legal partition there, `best`'s decisions everywhere else.
    Played with the FULL mask, a later decision that now conflicts falls back to replicate."""
    replicated = [int(p) for p in np.flatnonzero(best < 0)]
    order = [p for p in replicated if p >= start] + [p for p in replicated if p < start]
    for p in order:
        for a in np.flatnonzero(space.legal[p, 1:]) + 1:
            forced = {q: int(c) + 1 for q, c in enumerate(best)}
            forced[p] = int(a)
            yield p, forced


def dqn_search(space: SearchSpace, objective: Objective, budget: Budget, seed: int = 0, *,
               config: DqnSearchConfig = DqnSearchConfig(),
               on_best: Callable[[SearchResult], None] | None = None,
               on_progress: Callable[[Progress], None] | None = None) -> SearchResult:
    """Train a DQN agent on the space until the budget is spent; returns the best plan seen."""
    budget.require_limit("dqn")
    tracker = Tracker(space, objective, budget, Driver.DQN, seed, on_best=on_best, on_progress=on_progress)
    env = PlanEnv(space, objective, EnvConfig(config.encoding, config.mask, reward_scale(space, objective)))
    agent_config = config.agent_config(space.num_positions)
    with tracker.guard():
        agent = DqnAgent(agent_config, env.observation_size, env.num_actions, seed=seed,
                         functions=make_dqn(agent_config, env.observation_size, env.num_actions))
        runner = _Episodes(env, agent, tracker)
        empty = space.empty_choices()
        tracker.record(empty, objective.score(empty), curve=False)
        last_greedy: bytes | None = None
        stable = 0
        sweeps = 0
        last_improvement = (len(tracker.improvements), 0)
        while not tracker.exhausted():
            runner.play()
            tracker.progress()
            if len(tracker.improvements) != last_improvement[0]:
                last_improvement = (len(tracker.improvements), runner.episodes)
            if runner.episodes % config.greedy_every or tracker.exhausted():
                continue
            plan = runner.play(learn=False, greedy=True).choices.tobytes()
            stable = stable + 1 if plan == last_greedy else 0
            last_greedy = plan
            stalled = runner.episodes - last_improvement[1] >= config.patience
            if not (config.fine_tune and (stable >= config.stable_after or stalled)):
                continue
            # the strategy is stable: backtrack the replicated decisions of the best plan
            sweeps += 1
            fill = _fill(space, tracker.best_choices)
            if fill is not None:
                runner.play(fill, mask=MaskPolicy.FULL)
            start, improved = 0, True
            while improved and not tracker.exhausted():
                improved = False
                best_key = tracker.best.key
                for p, forced in _flips(space, tracker.best_choices, start):
                    runner.play(forced, mask=MaskPolicy.FULL)
                    tracker.progress()
                    if tracker.best.key > best_key:
                        improved, start = True, p + 1  # first improvement: go on from there
                        break
                    if tracker.exhausted():
                        break
            stable = 0
            last_improvement = (len(tracker.improvements), runner.episodes)
        tracker.notes.append(f"{runner.episodes} episodes, {agent.num_updates} learner updates, "
                             f"{sweeps} fine-tuning sweep(s)")
    return tracker.result()
