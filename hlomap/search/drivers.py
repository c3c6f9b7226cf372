"""One entry point for every driver: `run_driver(task, "dqn" | "ppo" | "random" | "greedy" | "exact" |
"identity", ...)`."""

from __future__ import annotations

from typing import Any, Callable

from hlomap.agents.ppo import PpoAgent
from hlomap.search.budget import Budget
from hlomap.search.dqn import DqnSearchConfig, dqn_search
from hlomap.search.exact import exact_search
from hlomap.search.greedy import greedy_search
from hlomap.search.identity import identity_search
from hlomap.search.ppo import ppo_search
from hlomap.search.random import random_search
from hlomap.search.task import SearchTask
from hlomap.search.tracker import Driver, Progress, SearchResult

__all__ = ["run_driver"]


def run_driver(task: SearchTask, driver: Driver | str, budget: Budget, seed: int = 0, *,
               dqn_config: DqnSearchConfig | None = None, ppo_agent: PpoAgent | None = None,
               finetune_seconds: float = 0.0,
               on_best: Callable[[SearchResult], None] | None = None,
               on_progress: Callable[[Progress], None] | None = None, **dqn_options: Any) -> SearchResult:
    """Run `driver` on `task`; `dqn_config` and `dqn_options` (agent_config, params, functions)
    reach the DQN driver only, `ppo_agent` (the trained policy, required) and
    `finetune_seconds` the PPO driver only."""
    driver = Driver(driver)
    callbacks: dict[str, Any] = dict(on_best=on_best, on_progress=on_progress)
    if driver is Driver.DQN:
        return dqn_search(task, budget, seed, config=dqn_config, **dqn_options, **callbacks)
    if driver is Driver.PPO:
        if ppo_agent is None:
            raise ValueError("the ppo driver needs a trained policy (ppo_agent)")
        return ppo_search(task, budget, seed, agent=ppo_agent, finetune_seconds=finetune_seconds, **callbacks)
    if driver is Driver.IDENTITY:
        return identity_search(task, seed)
    if driver is Driver.RANDOM:
        return random_search(task, budget, seed, **callbacks)
    if driver is Driver.GREEDY:
        return greedy_search(task, budget, seed, **callbacks)
    return exact_search(task, budget, seed, **callbacks)
