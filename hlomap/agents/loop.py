"""The training loop: environment <-> agent, statistics, progress reports, checkpoint and resume.

Resuming needs no pickled environment: episode e is reset with a seed derived from (loop seed, e),
and the loop checkpoints the actions taken so far in the current episode. On resume it resets the
environment with that seed and replays those actions (the agent already holds what it learned from
them), so an interrupted run continues exactly where it stopped and ends bit-identical to an
uninterrupted one. Ctrl-C is caught at a step boundary, checkpointed, then re-raised.

The loop draws nothing: it logs, and reports progress to an `on_progress` callback
(`hlomap.report.progress.training_bar` turns that into a progress bar).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from hlomap.agents.base import Agent
from hlomap.agents.environment import Environment, TimeStep

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """How long to train and how to checkpoint and report."""

    num_steps: int  # total environment steps, counting those of a resumed run
    seed: int = 0  # derives every episode's reset seed
    checkpoint_path: str | None = None
    checkpoint_every_steps: int | None = None  # None: only at the end and on Ctrl-C
    resume: bool = True  # continue from checkpoint_path when it exists
    stats_window: int = 100  # episodes in the running mean return
    progress_seconds: float = 0.1  # at most one `on_progress` call per this interval, plus the last


class LoopProgress(NamedTuple):
    """Where a run stands, as reported to `run_loop`'s `on_progress`."""

    step: int  # environment steps so far, counting those of a resumed run
    total: int  # the run's `num_steps`
    episodes: int  # finished episodes
    mean_return: float | None  # over the last `stats_window` episodes; None before the first ends
    best_return: float | None  # None before the first episode ends
    loss: float | None  # of the last learner update; None before the first
    metrics: Mapping[str, float]  # the agent's cheap scalars (`Agent.metrics`: epsilon, entropy...)

    @property
    def epsilon(self) -> float | None:
        """The exploration rate of an epsilon-greedy agent (None for others)."""
        return self.metrics.get("epsilon")


class EpisodeRecord(NamedTuple):
    """One finished episode."""

    index: int
    episode_return: float
    length: int
    end_step: int  # global environment step at which it ended


@dataclasses.dataclass(frozen=True)
class LoopResult:
    """What a run produced; episode arrays cover the resumed part too."""

    num_steps: int
    episode_returns: np.ndarray
    episode_lengths: np.ndarray
    best_return: float  # -inf when no episode finished
    best_episode: int  # -1 when no episode finished
    last_loss: float | None
    stopped_early: bool

    @property
    def num_episodes(self) -> int:
        return int(self.episode_returns.shape[0])

    def mean_return(self, last: int = 100) -> float:
        tail = self.episode_returns[-last:]
        return float(tail.mean()) if tail.size else float("nan")


def episode_seed(seed: int, episode: int) -> int:
    """The reset seed of episode `episode` of a run seeded with `seed`."""
    return int(np.random.SeedSequence([seed, episode]).generate_state(1)[0])


@dataclasses.dataclass
class _LoopState:
    """The loop's own mutable bookkeeping; JSON round-trips through checkpoints."""

    step: int = 0
    episode: int = 0
    in_episode: bool = False
    episode_actions: list[int] = dataclasses.field(default_factory=list)
    episode_return: float = 0.0
    returns: list[float] = dataclasses.field(default_factory=list)
    lengths: list[int] = dataclasses.field(default_factory=list)
    best_return: float | None = None
    best_episode: int = -1
    last_loss: float | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> _LoopState:
        return cls(**data)


def run_loop(env: Environment, agent: Agent, config: LoopConfig, *,
             on_episode: Callable[[EpisodeRecord], bool | None] | None = None,
             on_progress: Callable[[LoopProgress], None] | None = None) -> LoopResult:
    """Trains `agent` on `env` for `config.num_steps` environment steps.

    `on_episode` is called after every episode; returning True stops the run early (at that
    episode boundary, after a checkpoint if one is configured). `on_progress` is called at most
    every `config.progress_seconds` and once when the run ends; it only observes.
    """
    state = _LoopState()
    timestep: TimeStep | None = None
    path = Path(config.checkpoint_path) if config.checkpoint_path else None
    if path is not None and config.resume and path.exists():
        extra = agent.restore(path)
        if not extra or "loop" not in extra:
            raise ValueError(f"{path}: checkpoint holds no training-loop state")
        state = _LoopState.from_json(extra["loop"])
        timestep = _replay_episode(env, config.seed, state)
        log.info("resumed from %s at step %d, episode %d", path, state.step, state.episode)

    def checkpoint() -> None:
        if path is not None:
            agent.save(path, extra={"loop": state.to_json()})

    stopped_early = False
    last_report = -math.inf
    with _deferred_interrupt() as interrupted:
        while state.step < config.num_steps:
            if timestep is None or timestep.last:
                timestep = env.reset(episode_seed(config.seed, state.episode))
                agent.observe_first(timestep)
                state.in_episode, state.episode_actions, state.episode_return = True, [], 0.0
            action = agent.act(timestep)
            timestep = env.step(action)
            agent.observe(action, timestep)
            state.episode_actions.append(int(action))
            state.episode_return += float(timestep.reward)
            state.step += 1
            stats = agent.update()
            if stats is not None:
                state.last_loss = stats.loss
            stop = False
            if timestep.last:
                record = _finish_episode(state)
                stop = bool(on_episode(record)) if on_episode is not None else False
            if on_progress is not None and time.monotonic() - last_report >= config.progress_seconds:
                on_progress(_progress_of(state, agent, config))
                last_report = time.monotonic()
            due = (config.checkpoint_every_steps is not None
                   and state.step % config.checkpoint_every_steps == 0)
            if due or interrupted():
                checkpoint()
            if interrupted():
                raise KeyboardInterrupt(f"training interrupted at step {state.step}"
                                        + (f"; checkpoint in {path}" if path else ""))
            if stop:
                stopped_early = True
                break
        if on_progress is not None:
            on_progress(_progress_of(state, agent, config))
    checkpoint()
    log.info("trained to step %d: %d episodes, best return %s (episode %d)", state.step,
             len(state.returns), state.best_return, state.best_episode)
    return LoopResult(
        num_steps=state.step,
        episode_returns=np.asarray(state.returns, np.float64),
        episode_lengths=np.asarray(state.lengths, np.int64),
        best_return=state.best_return if state.best_return is not None else float("-inf"),
        best_episode=state.best_episode,
        last_loss=state.last_loss,
        stopped_early=stopped_early,
    )


def _finish_episode(state: _LoopState) -> EpisodeRecord:
    record = EpisodeRecord(state.episode, state.episode_return, len(state.episode_actions),
                           state.step)
    state.returns.append(state.episode_return)
    state.lengths.append(len(state.episode_actions))
    if state.best_return is None or state.episode_return > state.best_return:
        state.best_return, state.best_episode = state.episode_return, state.episode
    state.episode += 1
    state.in_episode, state.episode_actions, state.episode_return = False, [], 0.0
    return record


def _replay_episode(env: Environment, seed: int, state: _LoopState) -> TimeStep | None:
    """Brings `env` back to where the checkpointed episode stood; None at an episode boundary."""
    if not state.in_episode:
        return None
    timestep = env.reset(episode_seed(seed, state.episode))
    for action in state.episode_actions:
        timestep = env.step(action)
    return timestep


@contextlib.contextmanager
def _deferred_interrupt() -> Iterator[Callable[[], bool]]:
    """Turns Ctrl-C into a flag the loop checks at step boundaries, so that a checkpoint is never
    taken halfway through a step. Only possible in the main thread; elsewhere, or where SIGINT
    is ignored, Ctrl-C is left alone."""
    flag = threading.Event()
    # A process started in the background (`cmd &`, nohup) has SIGINT ignored: keep it so.
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is signal.SIG_IGN):
        yield flag.is_set
        return

    def handler(signum: int, frame: Any) -> None:
        if flag.is_set():  # a second Ctrl-C: the user does not want to wait for the step
            raise KeyboardInterrupt
        log.warning("interrupt: stopping after this step and checkpointing "
                    "(press Ctrl-C again to stop at once)")
        flag.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield flag.is_set
    finally:
        signal.signal(signal.SIGINT, previous)


def _progress_of(state: _LoopState, agent: Agent, config: LoopConfig) -> LoopProgress:
    window = state.returns[-config.stats_window:]
    return LoopProgress(state.step, config.num_steps, state.episode,
                        float(np.mean(window)) if window else None, state.best_return, state.last_loss,
                        agent.metrics())
