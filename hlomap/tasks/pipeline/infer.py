"""Online inference of pipeline cuts (Auto-MAP section 3.5): one network for every model.

The network is a DQN trained once on hundreds of thousands of random 128-pivot problems
(`normalize.RandomCutEnv`); a real model is coarsened to 128 pivots (`normalize.coarsen`) and the
greedy policy picks its cuts with no further training. `finetune` continues training on the
model itself when inference alone is not good enough (the paper needed it for CNNs).

A policy file is an `hlomap.agents.checkpoint` archive holding only the online network's
parameters and a header (DQN config, observation layout): about 2 MB, shipped as
`hlomap/pipeline/data/cut_policy.npz` and rebuilt by `scripts/train_pipeline_infer.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from hlomap.agents import checkpoint
from hlomap.agents.dqn import DqnAgent, DqnConfig, DqnFunctions, make_dqn
from hlomap.agents.loop import EpisodeRecord, LoopConfig, LoopProgress, run_loop
from hlomap.cost.pipeline.costs import PlanCost, evaluate_plan
from hlomap.tasks.pipeline.cutenv import FEATURES, MAX_STAGES, CutEnv, CutTask
from hlomap.search.budget import Budget
from hlomap.search.dqn import dqn_search, greedy_episode
from hlomap.tasks.pipeline.task import CutSearchTask
from hlomap.tasks.pipeline.normalize import (CANDIDATES, SLOTS, GeneratorSpec, RandomCutEnv, coarsen,
                                       random_task)
from hlomap.tasks.pipeline.solution import NoFeasiblePlan
from hlomap.tasks.pipeline.space import PipelineObjective
from hlomap.cost.pipeline.stages import PipelinePlan, Stage

__all__ = [
    "DEFAULT_POLICY",
    "InferenceResult",
    "CutPolicy",
    "TrainingConfig",
    "inference_dqn_config",
    "infer_cuts",
    "load_policy",
    "save_policy",
    "train_policy",
]

log = logging.getLogger(__name__)

#: The shipped policy (package data).
DEFAULT_POLICY = Path(__file__).resolve().parent / "data" / "cut_policy.npz"
#: Fraction of a fine-tuning run over which epsilon decays from 0.3 to its floor.
FINETUNE_EXPLORATION = 0.6
#: Bump when the observation layout changes: old policy files are then refused.
LAYOUT_VERSION = 1
_KIND = "pipeline-cut-policy"


def _layout() -> dict[str, Any]:
    return {"version": LAYOUT_VERSION, "features": list(FEATURES), "slots": SLOTS,
            "candidates": CANDIDATES, "max_stages": MAX_STAGES}


def inference_dqn_config(total_steps: int, exploration: float = 0.3) -> DqnConfig:
    """The inference network's DQN settings for a run of `total_steps` environment steps."""
    return DqnConfig(
        hidden=(256, 256),
        discount=1.0,
        n_step=3,
        learning_rate=1e-3,
        replay_capacity=50_000,
        batch_size=64,
        min_replay_size=1_000,
        target_update_period=500,
        update_period=4,
        epsilon_start=1.0,
        epsilon_end=0.02,
        epsilon_decay_steps=max(1, int(exploration * total_steps)),
        importance_anneal_updates=max(1, total_steps // 4),
    )


@dataclass(frozen=True, eq=False)
class CutPolicy:
    """A trained inference network: its DQN config, parameters and where it came from."""

    config: DqnConfig
    params: Any
    observation_size: int
    num_actions: int
    meta: dict[str, Any]
    functions: DqnFunctions | None = dataclasses.field(default=None, repr=False)

    def agent(self, seed: int = 0) -> DqnAgent:
        """A DqnAgent holding these parameters (for greedy actions or fine-tuning); agents of
        one loaded policy share its compiled functions."""
        agent = DqnAgent(self.config, self.observation_size, self.num_actions, seed=seed,
                         functions=self.functions)
        agent.set_params(self.params)
        return agent


def save_policy(path: str | Path, agent: DqnAgent, extra: dict[str, Any] | None = None) -> None:
    """Write an agent's online network as a policy file."""
    arrays = checkpoint.flatten("params", agent.get_params())
    meta = {
        "kind": _KIND,
        "config": checkpoint.config_to_json(agent.config),
        "observation_size": agent.observation_size,
        "num_actions": agent.num_actions,
        "layout": _layout(),
        "extra": extra or {},
    }
    checkpoint.save(path, arrays, meta)


def load_policy(path: str | Path | None = None) -> CutPolicy:
    """Read a policy file (default: the shipped one); refuses one of another layout."""
    path = Path(path) if path is not None else DEFAULT_POLICY
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no pipeline inference policy; build one with "
            "`python scripts/train_pipeline_infer.py --out {path}`"
        )
    arrays, meta = checkpoint.load(path)
    if meta.get("kind") != _KIND:
        raise ValueError(f"{path}: not a pipeline cut policy (kind {meta.get('kind')!r})")
    if meta.get("layout") != _layout():
        raise ValueError(
            f"{path}: policy observation layout {meta.get('layout')} does not match this "
            f"version's {_layout()}; retrain it with scripts/train_pipeline_infer.py"
        )
    config = checkpoint.config_from_json(DqnConfig, meta["config"])
    sizes = int(meta["observation_size"]), int(meta["num_actions"])
    functions = make_dqn(config, *sizes)
    template = DqnAgent(config, *sizes, functions=functions).get_params()
    params = checkpoint.unflatten("params", template, arrays)
    return CutPolicy(config, params, *sizes, meta, functions)


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainingConfig:
    """One training run of the inference network.

    episodes: random environments, one episode each.
    validation: random tasks whose DP optimum the network's greedy plans are compared with every
      `validate_every` episodes; the best network by mean gap is kept.
    """

    episodes: int = 100_000
    seed: int = 0
    validation: int = 64
    validate_every: int = 5_000
    spec: GeneratorSpec = GeneratorSpec()


@dataclass(frozen=True)
class Validation:
    """Greedy plans of a network on the validation tasks against their DP optima."""

    mean_gap: float  # mean of value / optimum - 1 over feasible plans (inf: none)
    within_1pct: float  # fraction of tasks within 1% of the optimum
    infeasible: int  # tasks where the greedy plan ran out of memory


def _validation_tasks(config: TrainingConfig) -> list[tuple[CutTask, float]]:
    """Random tasks (seeded apart from training) with their DP optimum."""
    from hlomap.tasks.pipeline.dp import solve

    rng = np.random.default_rng([config.seed, 0xDA7A])
    tasks = []
    while len(tasks) < config.validation:
        task = random_task(rng, config.spec)
        try:
            CutEnv(task, slots=config.spec.slots, ranked=CANDIDATES).reset(0)
            space = replace(task.space, max_stages=task.n_stages)
            optimum = solve(task.profile, task.cluster, space).value
        except NoFeasiblePlan:
            continue
        tasks.append((task, optimum))
    return tasks


def validate(agent: DqnAgent, tasks: list[tuple[CutTask, float]], slots: int = SLOTS) -> Validation:
    """Greedy plans of `agent` on `tasks` against their optima."""
    gaps, infeasible = [], 0
    for task, optimum in tasks:
        env = CutEnv(task, slots=slots, ranked=CANDIDATES)
        greedy_episode(env, agent)
        outcome = env.outcome
        if outcome is None or not outcome.feasible:
            infeasible += 1
            gaps.append(np.inf)
            continue
        gaps.append(outcome.value / optimum - 1.0)
    array = np.array(gaps)
    finite = array[np.isfinite(array)]
    return Validation(
        mean_gap=float(finite.mean()) if finite.size else float("inf"),
        within_1pct=float(np.mean(array <= 0.01)),
        infeasible=infeasible,
    )


def train_policy(
    config: TrainingConfig = TrainingConfig(),
    *,
    out: str | Path | None = None,
    report: Callable[[int, Validation], None] | None = None,
    on_progress: Callable[[LoopProgress], None] | None = None,
) -> tuple[DqnAgent, Validation]:
    """Train the inference network on random environments; keep the best validated network,
    write it to `out` when given, and return the agent holding it and its validation.
    `report` gets every validation, `on_progress` the training loop's progress (`run_loop`)."""
    env = RandomCutEnv(config.spec)
    total_steps = int(config.episodes * 4.2)  # mean episode length of the default generator
    dqn = inference_dqn_config(total_steps)
    agent = DqnAgent(dqn, env.observation_size, env.num_actions, seed=config.seed)
    tasks = _validation_tasks(config)
    best: list[Any] = [None, Validation(float("inf"), 0.0, len(tasks))]
    start = time.perf_counter()

    def consider(episode: int) -> None:
        score = validate(agent, tasks, config.spec.slots)
        log.info("episode %d (%.0f s): validation mean gap %.4f, within 1%% %.2f, OOM %d",
                 episode, time.perf_counter() - start, score.mean_gap, score.within_1pct,
                 score.infeasible)
        if report is not None:
            report(episode, score)
        if (score.within_1pct, -score.mean_gap) > (best[1].within_1pct, -best[1].mean_gap):
            best[0], best[1] = agent.get_params(), score

    def on_episode(record: EpisodeRecord) -> bool:
        if (record.index + 1) % config.validate_every == 0:
            consider(record.index + 1)
        return record.index + 1 >= config.episodes

    result = run_loop(env, agent, LoopConfig(num_steps=10 * config.episodes, seed=config.seed),
                      on_episode=on_episode, on_progress=on_progress)
    consider(result.num_episodes)
    agent.set_params(best[0])
    if out is not None:
        save_policy(out, agent, extra={
            "episodes": result.num_episodes, "steps": result.num_steps,
            "seconds": time.perf_counter() - start, "seed": config.seed,
            "validation": dataclasses.asdict(best[1]),
        })
    return agent, best[1]


# ---------------------------------------------------------------------------------------------
# Inference
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InferenceResult:
    """Cuts the network chose for one task (on its original profile)."""

    plan: PipelinePlan
    cost: PlanCost
    value: float
    feasible: bool
    inference_value: float  # before fine-tuning (inf: infeasible)
    finetune_episodes: int
    seconds: float
    coarse_pivots: tuple[int, ...]  # the original pivot of each of the 128 (or fewer) points


def _lift(task: CutTask, coarse_plan: PipelinePlan, kept: tuple[int, ...]) -> PipelinePlan:
    """A coarse-profile plan as a plan on the task's own profile (same devices, same costs)."""
    bounds = [0]
    for stage in coarse_plan.stages[:-1]:
        bounds.append(kept[stage.stop - 1] + 1)
    bounds.append(task.profile.n_layers)
    stages = tuple(
        Stage(bounds[s], bounds[s + 1], stage.devices)
        for s, stage in enumerate(coarse_plan.stages)
    )
    return PipelinePlan(stages, coarse_plan.microbatches, coarse_plan.schedule)


def infer_cuts(
    task: CutTask,
    policy: CutPolicy | None = None,
    *,
    finetune: Budget | None = None,
    seed: int = 0,
) -> InferenceResult:
    """Cuts for `task` from the inference network, optionally fine-tuned on the task (with the
    DQN driver, from the network's parameters, for `finetune`'s episodes or seconds)."""
    if task.device_radius != 0:
        raise ValueError("the inference network places device cuts at the center solution only "
                         f"(device_radius 0); got {task.device_radius}")
    policy = policy or load_policy()
    slots = int(policy.meta["layout"]["slots"])
    ranked = int(policy.meta["layout"]["candidates"])
    start = time.perf_counter()
    coarse_profile, kept = coarsen(task.profile, slots)
    coarse = replace(task, profile=coarse_profile)
    agent = policy.agent(seed)
    env = CutEnv(coarse, slots=slots, ranked=ranked)
    greedy_episode(env, agent)
    outcome = env.outcome
    inference_value = (outcome.value if outcome is not None and outcome.feasible
                       else float("inf"))
    best_plan = outcome.plan if outcome is not None else None
    episodes = 0
    if finetune is not None:
        planned = finetune.episodes or finetune.evaluations or 1000
        config = replace(policy.config, epsilon_start=0.3, epsilon_end=0.02,
                         epsilon_decay_steps=max(1, int(FINETUNE_EXPLORATION * planned * (task.n_stages - 1))),
                         min_replay_size=64, update_period=2, batch_size=32)
        search_task = CutSearchTask(coarse, slots=slots, ranked=ranked)
        found = dqn_search(search_task, finetune, seed, agent_config=config, params=policy.params)
        episodes = found.episodes
        tuned = search_task.cut_plan(found.decisions)
        if outcome is None or not outcome.feasible or (tuned.feasible and tuned.value < outcome.value):
            best_plan = tuned.plan
    if best_plan is None:
        raise NoFeasiblePlan(f"{task.profile.source}: the inference network reached a dead end")
    plan = _lift(task, best_plan, kept)
    cost = evaluate_plan(task.profile, task.cluster, plan, task.space.cost)
    value = cost.latency if task.space.objective is PipelineObjective.LATENCY else cost.bottleneck
    return InferenceResult(
        plan=plan,
        cost=cost,
        value=value,
        feasible=cost.feasible or not task.space.check_memory,
        inference_value=inference_value,
        finetune_episodes=episodes,
        seconds=time.perf_counter() - start,
        coarse_pivots=kept,
    )
