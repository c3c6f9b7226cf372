"""Explorers: OPP / ADP / hybrid search spaces and environments (Auto-MAP §3.2-§4.3), the paper
and cost rewards, and search drivers (Rainbow DQN with fine-tuning, random, greedy, exact).

    plan = hlomap.explore.explore(cap, task="opp", mesh={"model": 8}, agent="dqn", reward="paper")

    space = opp_space(graph, axes)            # positions = linkage groups, largest first
    objective = PaperObjective(space)         # or CostObjective(space, estimate_model(...))
    result = dqn_search(space, objective, Budget(seconds=60))

Names are imported lazily: `import hlomap.explore.space` does not import JAX.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_PUBLIC: dict[str, str] = {
    "explore": "hlomap.explore.api",
    "explore_detailed": "hlomap.explore.api",
    "Exploration": "hlomap.explore.api",
    "build_problem": "hlomap.explore.api",
    "run_driver": "hlomap.explore.api",
    "to_plan": "hlomap.explore.api",
    "parse_mesh": "hlomap.explore.api",
    "Task": "hlomap.explore.space",
    "SearchSpace": "hlomap.explore.space",
    "opp_space": "hlomap.explore.space",
    "adp_space": "hlomap.explore.space",
    "hybrid_space": "hlomap.explore.space",
    "make_space": "hlomap.explore.space",
    "RewardMode": "hlomap.explore.objective",
    "Score": "hlomap.explore.objective",
    "PaperObjective": "hlomap.explore.objective",
    "CostObjective": "hlomap.explore.objective",
    "estimate_model": "hlomap.explore.costmodel",
    "PlanEnv": "hlomap.explore.env",
    "EnvConfig": "hlomap.explore.env",
    "Encoding": "hlomap.explore.env",
    "MaskPolicy": "hlomap.explore.env",
    "Budget": "hlomap.explore.search",
    "Driver": "hlomap.explore.search",
    "SearchResult": "hlomap.explore.search",
    "dqn_search": "hlomap.explore.dqn_search",
    "DqnSearchConfig": "hlomap.explore.dqn_search",
    "random_search": "hlomap.explore.baselines",
    "greedy_search": "hlomap.explore.baselines",
    "exact_search": "hlomap.explore.exact",
    "paper_milp": "hlomap.explore.exact",
    "ExactTooLarge": "hlomap.explore.exact",
    "compare_with_megatron": "hlomap.explore.report",
    "format_plan_summary": "hlomap.explore.report",
    "plot_convergence": "hlomap.explore.report",
    "run_plan": "hlomap.explore.run",
    "RunReport": "hlomap.explore.run",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'hlomap.explore' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


class _CallableModule(types.ModuleType):
    """`hlomap.explore` is both this package and, per DESIGN.md, the function
    `hlomap.explore(cap, ...)`: once the package is imported, `hlomap.explore` names the package,
    so the package forwards calls to `api.explore`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return __getattr__("explore")(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
