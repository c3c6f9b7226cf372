"""Reinforcement-learning agents for the explorers: Rainbow-style DQN (as Auto-MAP used it) and
PPO (as DRL-PP used it), an environment protocol with legal-action masks, and a training loop
with checkpoint/resume. Self-contained: nothing here imports the rest of hlomap.

Typical use::

    env = MyEnv()                                   # satisfies agents.Environment
    agent = DqnAgent(DqnConfig(), env.observation_size, env.num_actions, seed=0)
    result = run_loop(env, agent, LoopConfig(num_steps=10_000, checkpoint_path="run.npz"))
    best = agent.greedy_action(observation, legal_mask)

Explorers with their own loop call `observe_first` / `act` / `observe` / `update` directly, and
`act_batch` / `greedy_batch` for many environments at once (one jitted call each).
"""

from hlomap.agents.base import Agent, UpdateStats
from hlomap.agents.dqn import DqnAgent, DqnConfig, DqnFunctions, DqnState, TargetUpdate, make_dqn
from hlomap.agents.environment import (Environment, StepType, TimeStep, restart, termination,
                                       transition, truncation)
from hlomap.agents.loop import (EpisodeRecord, LoopConfig, LoopProgress, LoopResult, episode_seed,
                               run_loop)
from hlomap.agents.ppo import Advantage, PpoAgent, PpoConfig, PpoFunctions, PpoState, make_ppo

__all__ = [
    "Advantage", "Agent", "DqnAgent", "DqnConfig", "DqnFunctions", "DqnState", "Environment",
    "EpisodeRecord", "LoopConfig", "LoopProgress", "LoopResult", "PpoAgent", "PpoConfig",
    "PpoFunctions", "PpoState", "StepType", "TargetUpdate", "TimeStep", "UpdateStats",
    "episode_seed", "make_dqn", "make_ppo", "restart", "run_loop", "termination", "transition",
    "truncation",
]
