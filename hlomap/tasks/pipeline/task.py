"""The pipeline-cut explorer as a `hlomap.search` task (Auto-MAP sections 3.4, 3.5), searched by
the same drivers as the sharding explorers: the DQN on `CutEnv` episodes, random episodes over
the same ranked candidates, greedy hill climbing over single-cut moves, and the exact DP.

Decisions are the pivots of the S - 1 cuts followed by the first device of stages 1..S-1
(`cutenv.decisions_of`). Scores are `CutEnv.plan_score`: ref / L (or / the bottleneck) for a plan
that fits in memory, below all of those for one that does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator

import numpy as np

from hlomap.cost.pipeline.costs import evaluate_plan
from hlomap.cost.pipeline.stages import PipelinePlan, Stage
from hlomap.search.budget import Budget
from hlomap.search.dqn import DqnSearchConfig
from hlomap.search.score import Score
from hlomap.search.tracker import Tracker
from hlomap.tasks.pipeline.cutenv import MAX_STAGES, CutEnv, CutPlan, CutTask, decisions_of
from hlomap.tasks.pipeline.dp import solve
from hlomap.tasks.pipeline.space import PipelineObjective

__all__ = ["ONLINE_CANDIDATES", "CutSearchTask", "cut_dqn_config"]

#: The online search acts on the 32 legal pivots with the best estimates (`CutEnv(ranked=...)`):
#: on the zoo steps of the acceptance run it reaches the DP optimum in about half the time of
#: acting on every pivot, which missed it by 3% on BERT with 4 stages in 2000 episodes.
ONLINE_CANDIDATES = 32


def cut_dqn_config(n_cuts: int, episodes: int, exploration: float = 0.6) -> DqnSearchConfig:
    """DQN settings for a cut search of `n_cuts` steps per episode over `episodes` episodes:
    undiscounted (episodes are short and rewards potential-shaped), n-step returns over the
    whole episode, a fast learning rate, epsilon decaying to 0.02 over `exploration` of the
    planned steps, a greedy check every 25 episodes and no fine-tuning sweep."""
    steps = max(1, n_cuts * episodes)
    return DqnSearchConfig(
        hidden=(128, 128), learning_rate=1e-3, batch_size=32, update_period=2, min_replay_size=128,
        replay_capacity=20_000, target_update_period=100, n_step=max(1, min(n_cuts, 4)), discount=1.0,
        epsilon_start=1.0, epsilon_end=0.02, epsilon_decay_episodes=None, exploration=exploration,
        importance_anneal_updates=steps, greedy_every=25, fine_tune=False,
    )


@dataclass(eq=False)
class CutSearchTask:
    """A `CutTask` as a search task (module docstring).

    slots, ranked, max_stages: the environment's layout (`CutEnv`); the inference network
    fixes them, an online search acts on `ONLINE_CANDIDATES` ranked pivots by default.
    """

    task: CutTask
    slots: int | None = None
    ranked: int | None = ONLINE_CANDIDATES
    max_stages: int = MAX_STAGES
    _scored: int = 0
    _envs: list[CutEnv] = field(default_factory=list)

    # -- what the drivers read ------------------------------------------------------------------
    @property
    def reward(self) -> str:
        return self.task.space.objective.value

    @property
    def evaluations(self) -> int:
        return self._scored + sum(env.plans_scored for env in self._envs)

    @property
    def episode_length(self) -> int:
        return self.task.n_stages - 1

    def make_env(self) -> CutEnv:
        env = CutEnv(self.task, slots=self.slots, ranked=self.ranked,
                     max_stages=max(self.max_stages, self.task.n_stages))
        self._envs.append(env)
        return env

    def default_dqn_config(self, budget: Budget) -> DqnSearchConfig:
        return cut_dqn_config(self.episode_length, budget.episodes or budget.evaluations or 2000)

    def trivial_plan(self) -> None:
        """A pipeline has no plan free of search: the DQN's best is what its episodes built."""
        return None

    def initial(self) -> np.ndarray:
        """The plan of always taking the best-estimated cut (action 0 of the ranked candidates):
        the even-split estimate's greedy answer, where hill climbing starts."""
        env = self.make_env()
        timestep = env.reset(0)
        while not timestep.last:
            timestep = env.step(0 if self.ranked is not None else int(np.flatnonzero(timestep.legal)[0]))
        if env.outcome is None:
            raise ValueError(f"{self.task.profile.source}: the best-estimated cuts reach a dead end")
        return decisions_of(env.outcome.plan, self.task.cluster.n_devices)

    def plan_of(self, decisions: np.ndarray) -> PipelinePlan:
        k = len(decisions) // 2
        cuts, starts = [int(c) for c in decisions[:k]], [int(b) for b in decisions[k:2 * k]]
        end = int(decisions[2 * k]) if len(decisions) > 2 * k else self.task.cluster.n_devices
        layers = [0, *(c + 1 for c in cuts), self.task.profile.n_layers]
        bounds = [0, *starts, end]
        stages = tuple(Stage(layers[s], layers[s + 1], tuple(range(bounds[s], bounds[s + 1])))
                       for s in range(len(layers) - 1))
        space = self.task.space
        return PipelinePlan(stages=stages, microbatches=space.microbatches, schedule=space.schedule)

    def cut_plan(self, decisions: np.ndarray) -> CutPlan:
        """The plan of `decisions` with its closed-form cost."""
        task = self.task
        plan = self.plan_of(decisions)
        cost = evaluate_plan(task.profile, task.cluster, plan, task.space.cost)
        value = cost.latency if task.space.objective is PipelineObjective.LATENCY else cost.bottleneck
        return CutPlan(plan, cost, value, cost.feasible or not task.space.check_memory)

    def score(self, decisions: np.ndarray) -> Score:
        self._scored += 1
        return self._scorer().plan_score(self.cut_plan(decisions))

    def score_many(self, decisions: np.ndarray) -> list[Score]:
        return [self.score(row) for row in decisions]

    def _scorer(self) -> CutEnv:
        return self._envs[0] if self._envs else self.make_env()

    # -- moves ----------------------------------------------------------------------------------
    def neighbours(self, decisions: np.ndarray) -> np.ndarray:
        """Every plan with one cut moved to another pivot between its neighbours (device bounds
        kept), where each stage keeps a trainable layer when the space requires it."""
        profile, space = self.task.profile, self.task.space
        k = len(decisions) // 2
        trainable = np.concatenate([[0.0], np.cumsum(profile.trainable)])
        rows = []
        for i in range(k):
            low = int(decisions[i - 1]) + 1 if i > 0 else 0
            high = int(decisions[i + 1]) if i + 1 < k else profile.n_pivots
            for pivot in range(low, high):
                if pivot == decisions[i]:
                    continue
                row = decisions.copy()
                row[i] = pivot
                if space.require_trainable and not _every_stage_trains(row[:k], trainable, profile.n_layers):
                    continue
                rows.append(row)
        return np.asarray(rows, dtype=np.int64).reshape(-1, len(decisions))

    def fine_tune_moves(self, best: np.ndarray, start: int) -> Iterator[tuple[int, np.ndarray]]:
        return iter(())

    def sample(self, rng: np.random.Generator, num: int) -> None:
        return None

    def known_optimum(self) -> None:
        """None on purpose: the DP is cheap, but a DQN stopped at the DP's answer would no longer
        be measured against it."""
        return None

    def plan_count(self) -> None:
        return None

    def solve_exactly(self, tracker: Tracker) -> None:
        """The exact DP over the same space, restricted to this task's stage count."""
        task = self.task
        space = replace(task.space, max_stages=task.n_stages)
        solution = solve(task.profile, task.cluster, space)
        decisions = decisions_of(solution.plan, task.cluster.n_devices)
        tracker.record(decisions, self.score(decisions))
        tracker.optimal = not tracker.interrupted
        tracker.notes.append(f"dynamic programming over {task.profile.n_pivots} pivots")


def _every_stage_trains(cuts: np.ndarray, trainable: np.ndarray, n_layers: int) -> bool:
    bounds = [0, *(int(c) + 1 for c in cuts), n_layers]
    return all(trainable[b] - trainable[a] > 0.5 for a, b in zip(bounds[:-1], bounds[1:]))

