"""The PPO placement agent (DRL-PP): a policy that places logical positions one at a time.

Episode. Positions are visited in the constructive order (`construct.placement_order`: most attached
to those already placed first). At each step the `CANDIDATES` free devices that add the least
affinity cost to the position's placed partners are the actions, cheapest first; the policy picks
one. Ranking the actions makes one network read clusters of any size and topology (the same device
count need not even recur): action k means "the k-th cheapest device by the proxy", and the
features say how each candidate really sits: its proxy cost relative to the others, its slowest
bandwidth and largest latency to the placed partners, how many of them share its node, how full
its node is, and its distance to the device placed just before.

Reward. At the end, the relative gain of the placement's estimated step time (the cost model's,
`objective.new_state`) over the greedy construction's (`construct.construct`), times
`REWARD_SCALE`: 0 for matching the heuristic, so returns are comparable across problems of any
scale. Each step also pays what its choice adds to the affinity proxy beyond the cheapest
candidate, as a share of the construction's whole proxy cost (`PROXY_WEIGHT` times it): zero for
the heuristic's choice, so a step is told at once what a detour costs and the terminal reward says
when a detour paid off. Always taking the cheapest candidate is the construction: return 0.

Training: DRL-PP's PPO (clip 0.2, entropy 0.001, Adam 3e-4, gradient-norm clip 1.0, 3 epochs and
4 minibatches per update; `hlomap.agents.ppo`) on generated problems (`generate.random_problem`),
from a policy whose logits fall with the candidates' rank (`RANK_PRIOR`: it starts close to the
heuristic), keeping the network with the best validation gain. It ships as `data/placement_policy.npz`
(rebuilt by `scripts/train_placement_policy.py`), saved and loaded like the pipeline-cut
inference network. At use, the PPO driver (`hlomap.search.ppo`) runs it on a `PlacementTask`:
optionally fine-tune on the problem itself, infer (the greedy rollout, then sampled rollouts for a
share of the budget), then polish the best placement (or the plan's own order, when that is
faster) with the greedy driver's local search for the rest of the budget.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from hlomap.agents import checkpoint
from hlomap.agents.environment import TimeStep, restart, termination, transition
from hlomap.agents.loop import EpisodeRecord, LoopConfig, run_loop
from hlomap.agents.ppo import PpoAgent, PpoConfig, PpoFunctions, make_ppo
from hlomap.search.ppo import rollout
from hlomap.search.task import EpisodeOutcome, SearchTask
from hlomap.tasks.placement.construct import construct, placement_order, scalar_weights
from hlomap.tasks.placement.generate import random_problem
from hlomap.tasks.placement.objective import Affinity, affinity, new_state
from hlomap.tasks.placement.problem import MeshLayout, PlacementProblem

__all__ = ["CANDIDATES", "DEFAULT_POLICY", "PlacementEnv", "PlacementPolicy", "PlacementTrainingConfig",
           "load_placement_policy", "placement_ppo_config", "save_placement_policy", "train_placement_policy"]

log = logging.getLogger(__name__)

#: The shipped policy (package data).
DEFAULT_POLICY = Path(__file__).resolve().parent / "data" / "placement_policy.npz"
#: Candidate devices (actions) per step.
CANDIDATES = 16
#: Per-candidate features, in observation order.
FEATURES = ("proxy_relative", "proxy_ratio", "min_bandwidth", "max_latency", "same_node", "node_free",
            "previous_latency", "rank")
#: Features of the step itself.
GLOBALS = ("progress", "positions_share", "partners_placed", "mesh", "log_devices", "free_share")
#: The terminal reward is this times the relative gain over the greedy construction.
REWARD_SCALE = 10.0
#: Weight of the per-step proxy penalty (a share of the construction's proxy cost).
PROXY_WEIGHT = 1.0
#: The initial policy's logit drop per candidate rank (softmax: about 78% on the cheapest).
RANK_PRIOR = 1.5
#: Bump when the observation layout changes: old policy files are then refused.
LAYOUT_VERSION = 1
_KIND = "placement-policy"


def _layout() -> dict[str, Any]:
    return {"version": LAYOUT_VERSION, "features": list(FEATURES), "globals": list(GLOBALS),
            "candidates": CANDIDATES}


def placement_ppo_config(rollout_length: int = 256) -> PpoConfig:
    """DRL-PP's hyperparameters; an episode's only reward is at its end, so no discount."""
    return PpoConfig(hidden=(128, 128), discount=1.0, clip_epsilon=0.2, entropy_coef=0.001, learning_rate=3e-4,
                     max_grad_norm=1.0, num_epochs=3, num_minibatches=4, rollout_length=rollout_length)


# ---------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------


class _Episode:
    """One problem's constant tables and the construction in progress."""

    def __init__(self, problem: PlacementProblem):
        self.problem = problem
        self.aff: Affinity = affinity(problem)
        self.order = placement_order(problem, self.aff)
        built = construct(problem, self.aff)
        self.reference = new_state(problem, built).value
        self.proxy_scale = max(self.aff.total(built), 1e-30)
        cluster = problem.cluster
        off = ~np.eye(problem.n_devices, dtype=bool)
        self.max_latency = float(cluster.latency[off].max()) if off.any() else 1.0
        self.max_bandwidth = float(cluster.bandwidth[off].max()) if off.any() else 1.0
        self.node_of = np.asarray(cluster.node_of)
        self.node_size = np.bincount(self.node_of)
        self.weights = scalar_weights(problem, self.aff)
        d = problem.n_devices
        self.devices = np.zeros(d, dtype=np.int64)
        self.placed = np.zeros(d, dtype=bool)
        self.free = np.ones(d, dtype=bool)
        self.node_free = self.node_size.astype(np.float64).copy()
        self.step = 0
        self.previous = -1
        self.candidates = np.zeros(0, dtype=np.int64)
        self.candidate_costs = np.zeros(0)

    @property
    def done(self) -> bool:
        return self.step >= self.problem.n_positions

    def observe(self) -> tuple[np.ndarray, np.ndarray]:
        """Observation and legal mask of the current step; sets `candidates`."""
        p = int(self.order[self.step])
        cluster = self.problem.cluster
        cost = np.where(self.free, self.aff.increments(p, self.devices, self.placed), np.inf)
        count = min(CANDIDATES, int(self.free.sum()))
        ranked = np.lexsort((np.arange(len(cost)), cost))[:count]
        self.candidates, self.candidate_costs = ranked, cost[ranked]
        nb = self.aff.neighbors[p]
        mask = self.placed[nb]
        partners, weight = self.devices[nb[mask]], self.weights[p][mask]
        features = np.zeros((CANDIDATES, len(FEATURES)), dtype=np.float32)
        c = cost[ranked]
        spread = float(c.max() - c.min())
        features[:count, 0] = (c - c.min()) / spread if spread > 0 else 0.0
        mean = float(c.mean())
        features[:count, 1] = np.clip(c / mean, 0.0, 10.0) if mean > 0 else 1.0
        if partners.size:
            features[:count, 2] = cluster.bandwidth[np.ix_(ranked, partners)].min(axis=1) / self.max_bandwidth
            features[:count, 3] = cluster.latency[np.ix_(ranked, partners)].max(axis=1) / self.max_latency
            same = self.node_of[ranked][:, None] == self.node_of[partners][None, :]
            total = float(weight.sum())
            features[:count, 4] = (same @ weight) / total if total > 0 else same.mean(axis=1)
        else:
            features[:count, 2] = 1.0
        features[:count, 5] = self.node_free[self.node_of[ranked]] / self.node_size[self.node_of[ranked]]
        if self.previous >= 0:
            features[:count, 6] = cluster.latency[ranked, self.previous] / self.max_latency
        features[:count, 7] = np.arange(count) / CANDIDATES
        n, d = self.problem.n_positions, self.problem.n_devices
        all_weight = float(self.weights[p].sum())
        placed_weight = float(weight.sum())
        step = np.array([self.step / n, n / d, placed_weight / all_weight if all_weight > 0 else 0.0,
                         float(isinstance(self.problem.layout, MeshLayout)), np.log2(d) / 10.0,
                         float(self.free.sum()) / d], dtype=np.float32)
        legal = np.zeros(CANDIDATES, dtype=bool)
        legal[:count] = True
        return np.concatenate([features.reshape(-1), step]), legal

    def place(self, action: int) -> float:
        """Put the current position on candidate `action`; returns the step's proxy penalty."""
        p = int(self.order[self.step])
        penalty = PROXY_WEIGHT * float(self.candidate_costs[action] - self.candidate_costs[0]) / self.proxy_scale
        device = int(self.candidates[action])
        self.devices[p] = device
        self.placed[p] = True
        self.free[device] = False
        self.node_free[self.node_of[device]] -= 1
        self.previous = device
        self.step += 1
        return penalty

    def full_order(self) -> np.ndarray:
        n = self.problem.n_positions
        order = self.devices.copy()
        order[n:] = np.flatnonzero(self.free)
        return order


class PlacementEnv:
    """Places one problem per episode: a fixed one, or `problems(seed)` (a generator). With the
    fixed problem's `task`, a finished episode is scored by it (one evaluation) and is its
    `last_outcome`, as the search drivers read episodes."""

    def __init__(self, problems: PlacementProblem | Callable[[int], PlacementProblem], *,
                 task: SearchTask | None = None):
        self._fixed = problems if isinstance(problems, PlacementProblem) else None
        self._make = problems if not isinstance(problems, PlacementProblem) else None
        self._task = task
        self._cached: _Episode | None = None
        self._return = 0.0
        self.episode: _Episode | None = None
        self.last_value = float("nan")
        self.last_outcome: EpisodeOutcome | None = None

    @property
    def position(self) -> int:
        """The step (position placed) the next action takes."""
        return self.episode.step if self.episode is not None else 0

    @property
    def observation_size(self) -> int:
        return CANDIDATES * len(FEATURES) + len(GLOBALS)

    @property
    def num_actions(self) -> int:
        return CANDIDATES

    def _episode_for(self, seed: int) -> _Episode:
        if self._fixed is None:
            assert self._make is not None
            return _Episode(self._make(seed))
        if self._cached is None:  # a fixed problem's tables are built once
            self._cached = _Episode(self._fixed)
        return _fresh(self._cached)

    def reset(self, seed: int = 0) -> TimeStep:
        self.episode = self._episode_for(seed)
        self._return = 0.0
        observation, legal = self.episode.observe()
        return restart(observation, legal)

    def step(self, action: int) -> TimeStep:
        episode = self.episode
        assert episode is not None and not episode.done
        penalty = episode.place(int(action))
        if episode.done:
            order = episode.full_order()
            if self._task is not None:
                score = self._task.score(order)
                value = float(score.step_time)
            else:
                value = float(new_state(episode.problem, order).value)
            self.last_value = value
            gain = (episode.reference - value) / episode.reference if episode.reference > 0 else 0.0
            reward = float(np.clip(REWARD_SCALE * gain, -5.0, 5.0)) - penalty
            self._return += reward
            if self._task is not None:
                self.last_outcome = EpisodeOutcome(order, episode.step, self._return, score)
            empty = np.zeros(self.observation_size, dtype=np.float32)
            return termination(empty, reward, np.ones(CANDIDATES, dtype=bool))
        observation, legal = episode.observe()
        self._return -= penalty
        return transition(observation, -penalty, legal)


def _fresh(template: _Episode) -> _Episode:
    """A new construction over a problem whose constant tables `template` already holds."""
    episode = _Episode.__new__(_Episode)
    episode.__dict__.update(template.__dict__)
    d = template.problem.n_devices
    episode.devices = np.zeros(d, dtype=np.int64)
    episode.placed = np.zeros(d, dtype=bool)
    episode.free = np.ones(d, dtype=bool)
    episode.node_free = template.node_size.astype(np.float64).copy()
    episode.step, episode.previous = 0, -1
    episode.candidates, episode.candidate_costs = np.zeros(0, dtype=np.int64), np.zeros(0)
    return episode


def training_problems(seed: int) -> PlacementProblem:
    """The training distribution: one random problem per episode seed."""
    return random_problem(np.random.default_rng([seed, 0x91AC]))


# ---------------------------------------------------------------------------------------------
# PlacementPolicy files
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class PlacementPolicy:
    """A trained placement network: its PPO config, parameters and where it came from."""

    config: PpoConfig
    params: Any
    meta: dict[str, Any]
    functions: PpoFunctions | None = dataclasses.field(default=None, repr=False)

    def agent(self, seed: int = 0) -> PpoAgent:
        env_sizes = (CANDIDATES * len(FEATURES) + len(GLOBALS), CANDIDATES)
        agent = PpoAgent(self.config, *env_sizes, seed=seed, functions=self.functions)
        agent.set_params(self.params)
        return agent


def save_placement_policy(path: str | Path, agent: PpoAgent, extra: dict[str, Any] | None = None) -> None:
    """Write an agent's network as a policy file (parameters and a JSON header, no optimizer)."""
    meta = {"kind": _KIND, "config": checkpoint.config_to_json(agent.config), "layout": _layout(),
            "extra": extra or {}}
    checkpoint.save(path, checkpoint.flatten("params", agent.get_params()), meta)


def load_placement_policy(path: str | Path | None = None) -> PlacementPolicy:
    """Read a policy file (default: the shipped one); refuses one of another layout."""
    path = Path(path) if path is not None else DEFAULT_POLICY
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no placement policy; build one with "
                                f"`python scripts/train_placement_policy.py --out {path}`")
    arrays, meta = checkpoint.load(path)
    if meta.get("kind") != _KIND:
        raise ValueError(f"{path}: not a placement policy (kind {meta.get('kind')!r})")
    if meta.get("layout") != _layout():
        raise ValueError(f"{path}: policy observation layout {meta.get('layout')} does not match this version's "
                         f"{_layout()}; retrain it with scripts/train_placement_policy.py")
    config = checkpoint.config_from_json(PpoConfig, meta["config"])
    sizes = (CANDIDATES * len(FEATURES) + len(GLOBALS), CANDIDATES)
    functions = make_ppo(config, *sizes)
    template = PpoAgent(config, *sizes, functions=functions).get_params()
    return PlacementPolicy(config, checkpoint.unflatten("params", template, arrays), meta, functions)


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlacementTrainingConfig:
    """One training run: `episodes` random problems, validated every `validate_every` episodes
    on `validation` fixed ones (greedy rollouts against the greedy construction)."""

    episodes: int = 20_000
    seed: int = 0
    validation: int = 24
    validate_every: int = 1_000
    rollout_length: int = 256
    seconds: float | None = None
    progress: bool = True


@dataclass(frozen=True)
class PlacementValidation:
    mean_gain: float      # mean over the validation problems of 1 - policy / construction
    better: float         # share of problems where the policy's placement is faster
    worse: float          # share where it is slower


def validate_placement_policy(agent: PpoAgent, problems: list[PlacementProblem]) -> PlacementValidation:
    gains = []
    for problem in problems:
        env = PlacementEnv(problem)
        rollout(env, agent, greedy=True)
        assert env.episode is not None
        gains.append(1.0 - env.last_value / env.episode.reference)
    array = np.asarray(gains)
    return PlacementValidation(float(array.mean()), float(np.mean(array > 1e-9)), float(np.mean(array < -1e-9)))


def train_placement_policy(config: PlacementTrainingConfig = PlacementTrainingConfig(), *,
                           out: str | Path | None = None,
                           report: Callable[[int, PlacementValidation], None] | None = None,
                           ) -> tuple[PpoAgent, PlacementValidation]:
    """Train the placement network on random problems, keep the best validated network, write it
    to `out` when given."""
    env = PlacementEnv(training_problems)
    agent = PpoAgent(placement_ppo_config(config.rollout_length), env.observation_size, env.num_actions,
                     seed=config.seed)
    params = agent.get_params()
    # Start near the heuristic: logits fall with the candidate's rank, so the untrained policy
    # mostly takes the cheapest candidates and learns where to deviate.
    params["policy_head"]["bias"] = -RANK_PRIOR * np.arange(CANDIDATES, dtype=np.float32)
    agent.set_params(params)
    rng = np.random.default_rng([config.seed, 0x7A11D])
    problems = [random_problem(rng) for _ in range(config.validation)]
    best: list[Any] = [agent.get_params(), validate_placement_policy(agent, problems)]
    start = time.perf_counter()
    if report is not None:
        report(0, best[1])

    def consider(episode: int) -> None:
        score = validate_placement_policy(agent, problems)
        log.info("episode %d (%.0f s): mean gain over construction %.4f, better %.2f, worse %.2f", episode,
                 time.perf_counter() - start, score.mean_gain, score.better, score.worse)
        if report is not None:
            report(episode, score)
        if score.mean_gain > best[1].mean_gain:
            best[0], best[1] = agent.get_params(), score

    def on_episode(record: EpisodeRecord) -> bool:
        if (record.index + 1) % config.validate_every == 0:
            consider(record.index + 1)
        out_of_time = config.seconds is not None and time.perf_counter() - start > config.seconds
        return record.index + 1 >= config.episodes or out_of_time

    result = run_loop(env, agent, LoopConfig(num_steps=200 * config.episodes, seed=config.seed,
                                             progress=config.progress), on_episode=on_episode)
    consider(result.num_episodes)
    agent.set_params(best[0])
    if out is not None:
        save_placement_policy(out, agent, extra={"episodes": result.num_episodes, "steps": result.num_steps,
                                       "seconds": round(time.perf_counter() - start, 1), "seed": config.seed,
                                       "validation": dataclasses.asdict(best[1])})
    return agent, best[1]
