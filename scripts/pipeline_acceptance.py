"""Issue #7's acceptance run: the DQN against the exact DP on zoo steps over clusters A, B, C.

For each zoo model and Auto-MAP configuration (2, 3, 4 servers of 8 V100s, so 2, 3, 4 stages
of one server each, data parallel inside it) a `Case` records the DP optimum, the online DQN's
best plan, the inference network's plan without training, their gaps, search times and whether
every device cut falls on a server boundary. `scripts/reproduce_pipeline.py` prints the table;
the tests run a small case by default and the rest as slow tests.

Values are the closed-form L the DP and the DQN both minimize (`costs.evaluate_plan`); the
event simulator's L of the DP's and the DQN's plans is recorded beside them, because it differs
(1F1B exposes transfers, and a stage's all-reduce runs after its last backward instead of being
amortized). So that the DQN is judged against what its pruning alone gives, each case also
records two baselines on the same ranked candidates (`baselines`): always the best-estimated
candidate, and random search with the DQN's episode budget.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from hlomap.tasks.pipeline.cutenv import CutTask
from hlomap.tasks.pipeline.dp import solve
from hlomap.search.budget import Budget
from hlomap.search.dqn import dqn_search
from hlomap.search.random import random_search
from hlomap.tasks.pipeline.task import CutSearchTask
from hlomap.tasks.pipeline.explore import pipeline_task
from hlomap.cost.pipeline.chain import StepChain, PivotOptions, step_chain
from hlomap.cost.cluster import Cluster
from hlomap.cost.pipeline.links import is_node_boundary
from hlomap.cost.pipeline.profile import scale_batch
from hlomap.cost.pipeline.simulator import simulate
from hlomap.cost.pipeline.stages import PipelinePlan, Schedule

__all__ = ["Case", "CONFIG_STAGES", "ACCEPTANCE_MODELS", "model_profile", "run_case"]

log = logging.getLogger(__name__)

#: Auto-MAP configuration -> stages (one 8-GPU server per stage).
CONFIG_STAGES = {"A": 2, "B": 3, "C": 4}
#: Zoo models of moderate size that lower quickly on a CPU.
ACCEPTANCE_MODELS = ("gpt-small", "bert-base", "t5-small")


@dataclass(frozen=True)
class Case:
    """One (model, configuration) row of the acceptance table."""

    model: str
    config: str
    stages: int
    pivots: int
    dp_value: float
    dp_seconds: float
    dqn_value: float
    dqn_seconds: float
    dqn_episodes: int
    dqn_found_at: int  # evaluation (episode or greedy check) of the DQN's best plan
    dqn_plan: PipelinePlan
    dqn_on_server_boundaries: bool
    infer_value: float | None  # inference network alone (None: not run)
    infer_seconds: float | None
    dp_simulated: float  # the event simulator's L of the DP's plan
    dqn_simulated: float  # ... and of the DQN's
    first_value: float  # baseline: always the best-estimated candidate
    random_value: float  # baseline: random candidates, the DQN's episode budget
    random_seconds: float

    @property
    def gap(self) -> float:
        return self.dqn_value / self.dp_value - 1.0

    @property
    def infer_gap(self) -> float | None:
        return None if self.infer_value is None else self.infer_value / self.dp_value - 1.0

    @property
    def first_gap(self) -> float:
        return self.first_value / self.dp_value - 1.0

    @property
    def random_gap(self) -> float:
        return self.random_value / self.dp_value - 1.0


def model_profile(model: str, options: PivotOptions = PivotOptions()) -> StepChain:
    """The pipeline profile of a zoo model's train step on a V100 (clusters A-C's device)."""
    from hlomap.cost.cluster import cluster_preset
    from hlomap.api import load_source

    device = cluster_preset("A").devices[0]
    return step_chain(load_source(f"zoo:{model}"), device, options=options)


def _on_boundaries(cluster: Cluster, plan: PipelinePlan) -> bool:
    return all(is_node_boundary(cluster, stage.devices[0]) for stage in plan.stages[1:])


def run_case(
    model: str,
    config: str,
    *,
    hlo: StepChain | None = None,
    microbatches: int = 8,
    schedule: Schedule = Schedule.ONE_F_ONE_B,
    budget: Budget = Budget(episodes=2000, seconds=None),
    seed: int = 0,
    policy_path: str | Path | None = None,
    infer: bool = True,
) -> Case:
    """DP, online DQN and (optionally) the inference network on one model and configuration."""
    from hlomap.cost.cluster import cluster_preset

    hlo = hlo or model_profile(model)
    cluster = cluster_preset(config)
    stages = CONFIG_STAGES[config.upper()]
    profile = scale_batch(hlo.profile, 1.0 / microbatches)
    task: CutTask = pipeline_task(profile, cluster, stages=stages, microbatches=microbatches,
                                  schedule=schedule)
    start = time.perf_counter()
    optimum = solve(profile, cluster, task.space)
    dp_seconds = time.perf_counter() - start
    search = CutSearchTask(task)
    found = dqn_search(search, budget, seed=seed)
    dqn = search.cut_plan(found.decisions)
    first = search.cut_plan(CutSearchTask(task).initial())
    randomly = random_search(CutSearchTask(task), Budget(episodes=found.episodes, seconds=None), seed=seed)
    random_value = search.cut_plan(randomly.decisions)
    infer_value = infer_seconds = None
    if infer:
        from hlomap.tasks.pipeline.infer import infer_cuts, load_policy

        inferred = infer_cuts(task, load_policy(policy_path), seed=seed)
        infer_value, infer_seconds = inferred.value, inferred.seconds
    case = Case(
        model=model, config=config.upper(), stages=stages, pivots=profile.n_pivots,
        dp_value=optimum.value, dp_seconds=dp_seconds,
        dqn_value=dqn.value, dqn_seconds=found.seconds, dqn_episodes=found.episodes,
        dqn_found_at=found.improvements[-1].evaluation,
        dqn_plan=found.plan, dqn_on_server_boundaries=_on_boundaries(cluster, found.plan),
        infer_value=infer_value, infer_seconds=infer_seconds,
        dp_simulated=simulate(profile, cluster, optimum.plan, task.space.cost).length,
        dqn_simulated=simulate(profile, cluster, found.plan, task.space.cost).length,
        first_value=first.value if first.feasible else float("inf"),
        random_value=random_value.value if random_value.feasible else float("inf"), random_seconds=randomly.seconds,
    )
    log.info("%s on %s: DP %.6g, DQN %.6g (gap %.3f%%)", model, config, case.dp_value,
             case.dqn_value, 100 * case.gap)
    return case
