"""The learned driver with a trained policy: a PPO policy (`hlomap.agents.ppo`) builds plans step
by step in the task's environment, then the greedy driver's local search polishes the best
(DRL-PP's inference followed by refinement).

Use: optionally fine-tune the policy on the task itself (PPO on its environment, for at most
half a timed budget); the greedy rollout (the most probable action at every step); sampled
rollouts for `INFERENCE_SHARE` of what is left of the budget; then iterated local search
(`search.greedy`) from the best of the best rollout, the task's trivial plan and its starts
(`LocalSearchTask.starts`) for the rest. Every episode
the environment finishes, fine-tuning included, is a scored plan the tracker records.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from hlomap.agents.loop import EpisodeRecord, LoopConfig, run_loop
from hlomap.agents.ppo import PpoAgent
from hlomap.search.greedy import iterated_local_search
from hlomap.search.task import LocalSearchTask, SearchTask, TaskEnv
from hlomap.search.tracker import Budget, Driver, Progress, SearchResult, Tracker

__all__ = ["INFERENCE_SHARE", "ppo_search", "rollout"]

#: Share of the budget left after fine-tuning that sampled rollouts get before the local search.
INFERENCE_SHARE = 0.3


def rollout(env: TaskEnv, agent: PpoAgent, *, greedy: bool, seed: int = 0) -> None:
    """One episode without learning: the most probable action at each step (`greedy`) or a
    sample. Its outcome is `env.last_outcome`."""
    timestep = env.reset(seed)
    while not timestep.last:
        observation, legal = timestep.observation[None], timestep.legal[None]
        action = agent.greedy_batch(observation, legal)[0] if greedy else agent.sample_batch(observation, legal)[0]
        timestep = env.step(int(action))


def _record_outcome(env: TaskEnv, tracker: Tracker) -> None:
    outcome = env.last_outcome
    if outcome is not None:
        tracker.record(outcome.decisions, outcome.score)
    tracker.episodes += 1


def _finetune(agent: PpoAgent, env: TaskEnv, tracker: Tracker, seconds: float, seed: int) -> int:
    """PPO on the task's environment for `seconds` (or until the budget ends); returns the
    episodes it ran."""
    start = time.perf_counter()

    def on_episode(record: EpisodeRecord) -> bool:
        _record_outcome(env, tracker)
        return time.perf_counter() - start >= seconds or tracker.exhausted()

    return run_loop(env, agent, LoopConfig(num_steps=10**9, seed=seed, progress=False),
                    on_episode=on_episode).num_episodes


def _sampling_done(tracker: Tracker, until_seconds: float | None, until_evaluations: int | None) -> bool:
    if tracker.exhausted() or (until_seconds is None and until_evaluations is None):
        return True
    if until_seconds is not None and tracker.seconds >= until_seconds:
        return True
    return until_evaluations is not None and tracker.evaluations >= until_evaluations


def ppo_search(task: SearchTask, budget: Budget, seed: int = 0, *, agent: PpoAgent, finetune_seconds: float = 0.0,
               on_best: Callable[[SearchResult], None] | None = None,
               on_progress: Callable[[Progress], None] | None = None) -> SearchResult:
    """Fine-tune (optionally), infer, polish (module docstring) within `budget`. The task must
    offer the local-search protocol (`LocalSearchTask`) for the polish."""
    if not isinstance(task, LocalSearchTask):
        raise TypeError(f"the ppo driver polishes with local search, which {type(task).__name__} does not offer")
    tracker = Tracker(task, budget, Driver.PPO, seed, on_best=on_best, on_progress=on_progress)
    env = task.make_env()
    with tracker.guard():
        if finetune_seconds > 0:
            limit = finetune_seconds if budget.seconds is None else min(finetune_seconds, budget.seconds / 2)
            tracker.notes.append(f"{_finetune(agent, env, tracker, limit, seed)} fine-tuning episodes")
        rollout(env, agent, greedy=True)
        _record_outcome(env, tracker)
        rollouts = 1
        until_seconds = (None if budget.seconds is None
                         else tracker.seconds + INFERENCE_SHARE * (budget.seconds - tracker.seconds))
        until_evaluations = (None if budget.evaluations is None
                             else tracker.evaluations + int(INFERENCE_SHARE * tracker.remaining_evaluations()))
        while not _sampling_done(tracker, until_seconds, until_evaluations):
            rollout(env, agent, greedy=False, seed=seed + rollouts)
            _record_outcome(env, tracker)
            rollouts += 1
        tracker.progress()
        tracker.notes.append(f"{rollouts} rollouts")
        trivial = task.trivial_plan()
        if tracker.exhausted():  # nothing left to polish with: the rollouts' best, or the plan as given
            if trivial is not None:
                tracker.record(trivial, task.score(trivial))
        else:
            # the task's structured starts too: a polish from the best rollout alone could end
            # worse than a start built in microseconds (a walk over a scrambled torus)
            starts = [tracker.best_decisions] + ([trivial] if trivial is not None else []) + list(task.starts())
            iterated_local_search(task, tracker, np.random.default_rng(seed), starts=starts)
    return tracker.result()
