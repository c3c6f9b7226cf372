"""One entry point for every driver: `run_driver(task, "dqn" | "random" | "greedy" | "exact", ...)`."""

from __future__ import annotations

from typing import Any, Callable

from hlomap.search.budget import Budget
from hlomap.search.dqn import DqnSearchConfig, dqn_search
from hlomap.search.exact import exact_search
from hlomap.search.greedy import greedy_search
from hlomap.search.random import random_search
from hlomap.search.task import SearchTask
from hlomap.search.tracker import Driver, Progress, SearchResult

__all__ = ["run_driver"]


def run_driver(task: SearchTask, driver: Driver | str, budget: Budget, seed: int = 0, *,
               dqn_config: DqnSearchConfig | None = None,
               on_best: Callable[[SearchResult], None] | None = None,
               on_progress: Callable[[Progress], None] | None = None, **dqn_options: Any) -> SearchResult:
    """Run `driver` on `task`; `dqn_config` and `dqn_options` (agent_config, params, functions)
    reach the DQN driver only."""
    driver = Driver(driver)
    callbacks: dict[str, Any] = dict(on_best=on_best, on_progress=on_progress)
    if driver is Driver.DQN:
        return dqn_search(task, budget, seed, config=dqn_config, **dqn_options, **callbacks)
    if driver is Driver.RANDOM:
        return random_search(task, budget, seed, **callbacks)
    if driver is Driver.GREEDY:
        return greedy_search(task, budget, seed, **callbacks)
    return exact_search(task, budget, seed, **callbacks)
