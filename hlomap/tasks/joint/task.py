"""The joint planner's outer level as a search task, so the DQN driver (and random and greedy
search) can choose the stages the exact DP chooses (Auto-MAP's pipeline DQN, section 3.4,
extended to per-stage device groups and options).

An episode builds one joint plan: the first action picks the microbatch count, then each action
closes the next stage, picking one of the K best-looking (option, end layer) candidates from
the current layer and device: the option fixes the stage's device group (the next
`option.devices` devices, a slice of a server or whole servers) and its mesh and plan. The
episode ends with the stage that takes the remaining layers: on the last device, or on any
when the space may leave devices idle. As with `tasks.pipeline.cutenv`, ranking the
candidates by an estimate is what lets a small network read any model: output k means "the
k-th best-looking stage".

Decisions: [microbatch index, (option index, end layer) per stage...]. Score: ref / L, with ref
the whole step's compute on one device over the devices (a perfectly parallel, bubble-free step),
and plans out of memory below every plan that fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from hlomap.agents.environment import TimeStep, restart, termination, transition
from hlomap.cost.pipeline.stages import in_flight
from hlomap.search.budget import Budget
from hlomap.search.dqn import DqnSearchConfig
from hlomap.search.score import Score
from hlomap.search.task import EpisodeOutcome
from hlomap.search.tracker import Tracker
from hlomap.tasks.joint.costs import JointModel, StageOption
from hlomap.tasks.joint.plans import JointPlan, JointStage, evaluate
from hlomap.tasks.joint.solve import JointProblem, JointSpace, StageTables, aligned, problem_for, solve

__all__ = ["CANDIDATES", "JointEnv", "JointSearchTask"]

#: Ranked (option, end layer) candidates per step: the network's outputs.
CANDIDATES = 32
#: Exploring steps draw candidate k with weight RANK_DECAY ** k: near the top of the ranking,
#: where the DP's stages sit (the exact plan's ranks on the gpt-tiny cases are 0 to 2), instead
#: of uniformly over 32 candidates, which almost never deviates from the best-looking stage at
#: two steps of one episode. With the driver's fine-tuning (one decision changed at a time), the
#: DQN then reaches the exact optimum on every small gpt-tiny case (scripts/reproduce_joint.py).
RANK_DECAY = 0.8
#: Per-candidate features, in observation order.
FEATURES = ("stage", "transfer", "memory", "estimate", "relative", "layers", "devices", "data", "model", "last")
_CLIP = 10.0
#: Steps the fixed-size observation's step one-hot covers.
_MAX_STEPS = 17


@dataclass(eq=False)
class JointEnv:
    """The `hlomap.agents.Environment` of one joint problem (module docstring)."""

    model: JointModel
    space: JointSpace
    ranked: int = CANDIDATES
    plans_scored: int = 0
    _state: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.devices = self.model.cluster.n_devices
        self.layers = self.model.n_layers
        self.per_node = self.model.cluster.most_per_node
        self.choices = tuple(self.space.microbatches)
        self._one = self.model.arrays(StageOption(1, 1, 1))
        self.unit = max(float(self._one.compute[-1]) / self.devices, 1e-30)  # a perfectly parallel step
        self.num_actions = max(self.ranked, len(self.choices))
        self.observation_size = self.ranked * len(FEATURES) + _GLOBALS
        self._problems: dict[int, tuple[JointProblem, StageTables]] = {}
        self._times: dict[tuple[int, int], float] = {}
        self._fewest = fewest_stages(self.devices, self.per_node, {o.devices for o in self.space.options})
        self._reset()

    # -- protocol -------------------------------------------------------------------------------
    def _reset(self) -> None:
        self._state = {"m": None, "layer": 0, "device": 0, "stages": [], "times": [], "candidates": []}
        self.last_outcome: EpisodeOutcome | None = None
        self.plan: JointPlan | None = None

    @property
    def position(self) -> int:
        return len(self._state["stages"]) + (self._state["m"] is not None)

    def reset(self, seed: int = 0) -> TimeStep:
        del seed
        self._reset()
        legal = np.zeros(self.num_actions, dtype=bool)
        legal[: len(self.choices)] = True
        return restart(self._observe_choice(), legal)

    def step(self, action: int) -> TimeStep:
        state = self._state
        if state["m"] is None:
            if not 0 <= action < len(self.choices):
                raise ValueError(f"action {action}: the first step picks one of {len(self.choices)} microbatch counts")
            state["m"] = int(action)
            return self._next()
        candidates = state["candidates"]
        if not 0 <= action < len(candidates):
            raise ValueError(f"action {action} is illegal: {len(candidates)} candidates at step {self.position}")
        option_index, stop = candidates[action]
        option = self.space.options[option_index]
        state["times"].append(self._times[(option_index, stop)])
        state["stages"].append((option_index, stop))
        state["layer"], state["device"] = stop, state["device"] + option.devices
        if stop == self.layers:  # the last stage
            return self._finish()
        return self._next()

    # -- what a driver needs --------------------------------------------------------------------
    def replay_action(self, decisions: np.ndarray) -> int:
        state = self._state
        if state["m"] is None:
            return int(decisions[0])
        k = len(state["stages"])
        target = (int(decisions[1 + 2 * k]), int(decisions[2 + 2 * k])) if 2 + 2 * k < len(decisions) else None
        return state["candidates"].index(target) if target in state["candidates"] else 0

    def set_replaying(self, replaying: bool) -> None:
        """Legality does not change while replaying."""

    # -- internals ------------------------------------------------------------------------------
    @property
    def microbatches(self) -> int:
        return self.choices[self._state["m"]]

    def _next(self) -> TimeStep:
        observation, legal = self._observe()
        if not legal.any():  # no stage fits from here: a dead end
            self.last_outcome = None
            return termination(observation, -1.0, legal)
        return transition(observation, 0.0, legal)

    def _finish(self) -> TimeStep:
        plan = self.plan_of_state()
        cost = evaluate(self.model, plan)
        self.plans_scored += 1
        score = plan_score(self.unit, plan, cost)
        self.plan = plan
        self.last_outcome = EpisodeOutcome(self.decisions(), self.position, score.value, score)
        return termination(np.zeros(self.observation_size, np.float32), score.value,
                           np.zeros(self.num_actions, dtype=bool))

    def decisions(self) -> np.ndarray:
        state = self._state
        flat = [state["m"]] + [x for stage in state["stages"] for x in stage]
        return np.asarray(flat, dtype=np.int64)

    def plan_of_state(self) -> JointPlan:
        return decode(self.model, self.space, self.decisions())

    def _tables(self) -> tuple[JointProblem, StageTables]:
        """The DP's tables for the episode's microbatch count (built once per count)."""
        m = self.microbatches
        if m not in self._problems:
            problem = problem_for(self.model, self.space, m)
            if problem is None:
                raise ValueError(f"no stage option splits the batch of {self.model.batch} into {m} microbatches")
            self._problems[m] = (problem, problem.tables())
        return self._problems[m]

    def _candidates(self) -> list[tuple[int, int, np.ndarray]]:
        """(option index, end layer, features) of the legal next stages, best estimate first."""
        state, m = self._state, self.microbatches
        i, d = state["layer"], state["device"]
        n, devices = self.layers, self.devices
        problem, tables = self._tables()
        decided = [float(tables_time) for tables_time in state["times"]]
        rest_work = (self._one.compute[-1] - self._one.compute) / m  # one-device compute after layer j
        rows = []
        for k, option in enumerate(problem.options):
            e = d + option.devices
            if e > devices or not aligned(self.per_node, d, option.devices):
                continue
            # leave a layer for each stage the remaining devices need at least; a stage that
            # takes the remaining layers ends the plan, on the last device or, when the space
            # may leave devices idle, on any
            fewest = min(self._fewest[e], n)  # stages the devices from e need at least (n: none fits)
            after = fewest if self.space.use_all_devices or fewest >= n else 1
            ends = np.asarray([n]) if e == devices else np.arange(i + 1, n - int(after) + 1)
            if e < devices and not self.space.use_all_devices:
                ends = np.unique(np.append(ends, n))
            if not len(ends):
                continue
            last = ends == n
            t = tables.stage[k][i, ends]
            stages_after = 0 if e == devices else max(1, (devices - e) // option.devices)
            held_last = in_flight(self.space.schedule, 0, 1, m)
            held = in_flight(self.space.schedule, 0, stages_after + 1, m)
            mem = np.where(last, tables.memory[k][held_last][i, ends], tables.memory[k][held][i, ends])
            mem = mem / problem.capacity(d, option.devices)
            transfers = tables.transfer[k].get(d)
            u = np.zeros(len(ends)) if transfers is None else np.where(last, 0.0, transfers[ends])
            rest = np.where(last, 0.0, rest_work[ends] / max(devices - e, 1))
            worst = np.maximum.reduce([t, u, rest, np.full(len(ends), max(decided, default=0.0))])
            est = sum(decided) + t + np.where(last, 0, stages_after) * rest + 2 * u + (m - 1) * worst
            ok = np.isfinite(t) & (~np.asarray(self.space.check_memory) | (mem <= 1.0))
            ref = self.unit
            for j, tj, uj, mj, ej, lj in zip(ends[ok], t[ok], u[ok], mem[ok], est[ok], last[ok]):
                feats = np.asarray([min(tj / self.unit, _CLIP), min(uj / self.unit, _CLIP), min(mj, 2.0),
                                    min(ref / ej, _CLIP), 0.0, (j - i) / n, option.devices / devices,
                                    option.data / option.devices, option.model / option.devices, float(lj)])
                rows.append((self.space.options.index(option), int(j), feats, float(tj)))
        rows.sort(key=lambda row: -row[2][3])
        self._times = {(k, j): tj for k, j, _, tj in rows[: self.ranked]}
        return [(k, j, f) for k, j, f, _ in rows[: self.ranked]]

    def _observe(self) -> tuple[np.ndarray, np.ndarray]:
        found = self._candidates()
        self._state["candidates"] = [(k, j) for k, j, _ in found]
        features = np.zeros((self.ranked, len(FEATURES)), np.float32)
        for r, (_, _, f) in enumerate(found):
            features[r] = f
        if found:
            best = features[0, FEATURES.index("estimate")]
            features[: len(found), FEATURES.index("relative")] = features[: len(found), FEATURES.index("estimate")] - best
        legal = np.zeros(self.num_actions, dtype=bool)
        legal[: len(found)] = True
        return np.concatenate([features.reshape(-1), self._globals()]).astype(np.float32), legal

    def _observe_choice(self) -> np.ndarray:
        return np.concatenate([np.zeros(self.ranked * len(FEATURES), np.float32), self._globals()])

    def _globals(self) -> np.ndarray:
        state = self._state
        step = np.zeros(_MAX_STEPS, np.float32)
        step[min(self.position, _MAX_STEPS - 1)] = 1.0
        m = 0.0 if state["m"] is None else math.log2(self.microbatches) / 6.0
        return np.concatenate([step, [m, state["device"] / self.devices, state["layer"] / self.layers]]).astype(np.float32)


#: Globals after the candidates' features: the step one-hot, log M, devices and layers used.
_GLOBALS = _MAX_STEPS + 3


def fewest_stages(devices: int, per_node: int, sizes: set[int]) -> list[float]:
    """For each first device e, the fewest stages (aligned groups of `sizes`) that cover devices
    e..devices-1 (inf when none can): a stage is only offered if the rest can still be covered."""
    fewest = [math.inf] * devices + [0.0]
    for e in range(devices - 1, -1, -1):
        for size in sizes:
            if e + size <= devices and aligned(per_node, e, size):
                fewest[e] = min(fewest[e], 1 + fewest[e + size])
    return fewest


def decode(model: JointModel, space: JointSpace, decisions: np.ndarray) -> JointPlan:
    """The plan of a decision vector [microbatch index, (option, end layer)...]."""
    m = space.microbatches[int(decisions[0])]
    stages, start, device = [], 0, 0
    for k in range(1, len(decisions), 2):
        option = space.options[int(decisions[k])]
        stop = int(decisions[k + 1])
        stages.append(JointStage.of(start, stop, device, option))
        start, device = stop, device + option.devices
    return JointPlan(tuple(stages), m, space.schedule)


def encode(space: JointSpace, plan: JointPlan) -> np.ndarray:
    flat = [space.microbatches.index(plan.microbatches)]
    for stage in plan.stages:
        flat += [space.options.index(stage.option), stage.stop]
    return np.asarray(flat, dtype=np.int64)


def _changed(decisions: np.ndarray, position: int, value: int) -> np.ndarray:
    row = decisions.copy()
    row[position] = value
    return row


def plan_score(unit: float, plan: JointPlan, cost: object) -> Score:
    """ref / L for a plan that fits (ref = `unit`: the whole step's one-device compute spread over
    every device, a bubble-free perfectly parallel step; the same for every plan, so scores of
    plans with different microbatch counts compare), in [-1, -0.5] for one that does not (less
    negative the faster it would be)."""
    value = unit / max(cost.latency, 1e-300)  # type: ignore[attr-defined]
    if not cost.fits:  # type: ignore[attr-defined]
        value = -1.0 + 0.5 * min(value, 1.0)
    return Score(value, 0.0, True, cost.fits, cost.latency, max(cost.stage_memory))  # type: ignore[attr-defined]


@dataclass(eq=False)
class JointSearchTask:
    """The joint problem for the search drivers (`hlomap.search`)."""

    model: JointModel
    space: JointSpace
    ranked: int = CANDIDATES
    incumbent: JointPlan | None = None  # a plan found by other means: bounds the exact DP from the start
    _scored: int = 0
    _envs: list[JointEnv] = field(default_factory=list)

    reward = "latency"

    @property
    def evaluations(self) -> int:
        return self._scored + sum(env.plans_scored for env in self._envs)

    @property
    def episode_length(self) -> int:
        return 1 + min(self.model.n_layers, 4)

    def make_env(self) -> JointEnv:
        env = JointEnv(self.model, self.space, self.ranked)
        self._envs.append(env)
        return env

    def default_dqn_config(self, budget: Budget) -> DqnSearchConfig:
        episodes = budget.episodes or budget.evaluations or 1000
        return DqnSearchConfig(hidden=(128, 128), n_step=3, min_replay_size=128, epsilon_end=0.02,
                               epsilon_decay_episodes=None, exploration=0.6,
                               importance_anneal_updates=episodes * self.episode_length,
                               greedy_every=25, rank_decay=RANK_DECAY)

    def trivial_plan(self) -> None:
        return None

    def initial(self) -> np.ndarray:
        """The plan of always taking the best-looking candidate."""
        env = self.make_env()
        timestep = env.reset(0)
        while not timestep.last:
            timestep = env.step(0)
        if env.last_outcome is None:
            raise ValueError("the best-looking stages reach a dead end")
        return env.last_outcome.decisions

    def plan_of(self, decisions: np.ndarray) -> JointPlan:
        return decode(self.model, self.space, decisions)

    def score(self, decisions: np.ndarray) -> Score:
        self._scored += 1
        plan = self.plan_of(decisions)
        unit = self._envs[0].unit if self._envs else self.make_env().unit
        return plan_score(unit, plan, evaluate(self.model, plan))

    def score_many(self, decisions: np.ndarray) -> list[Score]:
        return [self.score(row) for row in decisions]

    def neighbours(self, decisions: np.ndarray) -> np.ndarray:
        """Plans with one cut moved by one layer (options and devices kept)."""
        rows = []
        for k in range(2, len(decisions) - 2, 2):  # every end layer but the last stage's
            for step in (-1, 1):
                row = decisions.copy()
                row[k] += step
                previous = row[k - 2] if k > 2 else 0
                if previous < row[k] < row[k + 2]:
                    rows.append(row)
        return np.asarray(rows, dtype=np.int64).reshape(-1, len(decisions))

    def fine_tune_moves(self, best: np.ndarray, start: int) -> Iterator[tuple[int, np.ndarray]]:
        """The DQN driver's fine-tuning (Auto-MAP section 5.2.1) on the outer level: `best` with one
        decision changed, position by position cyclically from `start`: the microbatch count one
        step up or down (position 0), a stage's option swapped for another of as many devices
        (its mesh shape or plan kind), a stage's end moved by one layer. The agent replays each
        as an episode (a move its ranked candidates do not offer plays their best instead)."""
        options = self.space.options
        moves: list[tuple[int, np.ndarray]] = []
        for step in (-1, 1):
            if 0 <= best[0] + step < len(self.space.microbatches):
                moves.append((0, _changed(best, 0, best[0] + step)))
        for k in range(1, len(best), 2):
            devices = options[int(best[k])].devices
            moves += [(k, _changed(best, k, o)) for o, option in enumerate(options)
                      if o != best[k] and option.devices == devices]
        for row in self.neighbours(best):
            moves.append((int(np.flatnonzero(row != best)[0]), row))
        ordered = [move for move in moves if move[0] >= start] + [move for move in moves if move[0] < start]
        return iter(ordered)

    def sample(self, rng: np.random.Generator, num: int) -> None:
        return None

    def known_optimum(self) -> None:
        return None  # the DQN is measured against the DP, not stopped by it

    def plan_count(self) -> None:
        return None

    def solve_exactly(self, tracker: Tracker) -> None:
        plan, _ = solve(self.model, self.space, self.incumbent)
        decisions = encode(self.space, plan)
        tracker.record(decisions, self.score(decisions))
        tracker.optimal = not tracker.interrupted
        tracker.notes.append("exact two-level dynamic programming")
