"""Re-planning policies over a resource trace, and the training they achieve (AutoPipe).

At each change of the trace a policy chooses among the options of `options.candidates`:
- static: PipeDream's plan, made once; it changes only when it cannot run (a device left), and
  then re-solves;
- re-solve: the fastest plan at every change, whatever the migration costs: the DP's optimum,
  unless the running plan is faster (the DP plans over every available device, and a plan on
  fewer of them can be faster: one that left a server behind a slow link out when the server
  returns);
- arbiter: AutoPipe's switch arbiter with the cost model's exact prices: the option that trains the
  most iterations over the rest of the trace's horizon if the current resources last, i.e. the
  largest (remaining - migration) / step time;
- meta: the same choice made with the gains a learned network predicts (`meta`);
- oracle: knows the whole trace: dynamic programming over the changes and the plans any option
  produced at any change, maximizing the iterations trained by the horizon.

`run_policy` plays a policy over a trace: between changes the plan trains at its step time; a migration
stops training while it lasts (a long one runs on into the next interval). The workload is the
number of iterations the initial plan trains, on the trace's first resources, in `WORKLOAD_SHARE`
of the horizon; a policy's total training time is when it completes them (if that is after the
horizon, the last resources last).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hlomap.tasks.replan.options import (Candidate, Migration, Option, ReplannedPlan, RunningPlan, Workload,
                                        best_move, migration, plan_step_seconds, resolve)
from hlomap.tasks.replan.trace import ResourceState, Trace

__all__ = ["Decision", "PlanReplay", "PolicyRun", "Replay", "ReplanPolicy", "Segment", "arbiter_choice", "oracle_pool",
           "play", "run_policy"]


#: The workload: the iterations the initial plan trains in this share of the horizon, unchanged.
WORKLOAD_SHARE = 0.5


class ReplanPolicy(str, enum.Enum):
    STATIC = "static"
    RESOLVE = "re-solve"
    ARBITER = "arbiter"
    META = "meta"
    ORACLE = "oracle"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Decision:
    """What a policy chose at a change, and why."""

    time: float
    option: Option
    plan: ReplannedPlan
    step_seconds: float
    migration_seconds: float
    moved_bytes: float
    keep_seconds: float  # the running plan's step time on the new resources (inf: cannot run)


@dataclass(frozen=True)
class Segment:
    """[start, end): training at `step_seconds` per iteration (inf: stalled) after `blocked`
    seconds of migration at its start."""

    start: float
    end: float
    step_seconds: float
    blocked: float


@dataclass(frozen=True)
class PolicyRun:
    policy: ReplanPolicy
    decisions: tuple[Decision, ...]
    segments: tuple[Segment, ...]
    iterations: float           # the workload
    total_seconds: float        # when the workload is done
    horizon_iterations: float   # trained by the trace's horizon

    @property
    def throughput(self) -> float:
        """Iterations per second over the whole run."""
        return self.iterations / self.total_seconds if self.total_seconds > 0 else 0.0

    @property
    def migration_seconds(self) -> float:
        return sum(d.migration_seconds for d in self.decisions)


Chooser = Callable[[int, float, ResourceState, Sequence[Candidate]], Candidate]


def arbiter_choice(now: float, horizon: float, options: Sequence[Candidate]) -> Candidate:
    """The option training the most iterations until the horizon if the resources last; ties go
    to the cheaper migration (keep first)."""
    remaining = max(horizon - now, 0.0)

    def trained(c: Candidate) -> float:
        return max(remaining - c.migration_seconds, 0.0) / c.step_seconds if math.isfinite(c.step_seconds) else -1.0

    return max(options, key=lambda c: (trained(c), -c.migration_seconds))


def _runnable(options: Sequence[Candidate]) -> list[Candidate]:
    return [c for c in options if math.isfinite(c.step_seconds)]


def _static(index: int, now: float, state: ResourceState, options: Sequence[Candidate]) -> Candidate:
    keep = options[0]
    if math.isfinite(keep.step_seconds):
        return keep
    solved = [c for c in options if c.option is Option.RESOLVE]
    return solved[0] if solved else keep


def _resolve(index: int, now: float, state: ResourceState, options: Sequence[Candidate]) -> Candidate:
    keep = options[0]
    solved = [c for c in options if c.option is Option.RESOLVE]  # absent: the running plan is the optimum
    return solved[0] if solved and solved[0].step_seconds < keep.step_seconds else keep


class PlanReplay:
    """A trace's states and what every policy asks of a plan space at change i: the re-solved
    plan (computed once), a plan's step time, the best move from a plan, the migration between
    two plans, and the options offered. `Replay` is the pipeline planner's space (stages of
    replicas); `tasks.replan.joint.JointReplay` the joint planner's (stages with their own data x
    model meshes)."""

    trace: Trace
    states: list[tuple[float, ResourceState]]

    def solved(self, i: int) -> tuple[ReplannedPlan, float] | None:
        raise NotImplementedError

    def step_seconds(self, i: int, plan: Any) -> float:
        raise NotImplementedError

    def best_move(self, i: int, plan: Any) -> tuple[ReplannedPlan, float] | None:
        raise NotImplementedError

    def migration(self, i: int, old: Any, new: Any) -> Migration:
        raise NotImplementedError

    def candidates(self, i: int, plan: ReplannedPlan) -> tuple[Candidate, ...]:
        """Keep (always listed, inf when it cannot run), the best move and the re-solve (which
        does not depend on the running plan), priced."""
        out = [Candidate(Option.KEEP, plan, self.step_seconds(i, plan), 0.0, 0.0)]
        move = self.best_move(i, plan)
        if move is not None:
            out.append(Candidate(Option.MOVE, move[0], move[1], *self.migration(i, plan, move[0])))
        solved = self.solved(i)
        if solved is not None and solved[0] != plan:  # re-solving to the running plan is keeping it
            out.append(Candidate(Option.RESOLVE, solved[0], solved[1], *self.migration(i, plan, solved[0])))
        return tuple(out)


class Replay(PlanReplay):
    """The pipeline planner's space over a trace: a cost model per state and the state's
    re-solved plan (computed once)."""

    def __init__(self, trace: Trace, workload: Workload):
        from hlomap.tasks.placement.pipeline_costs import PipelineModel

        self.trace, self.workload = trace, workload
        self.states = trace.states()
        self.models = [PipelineModel(state.cluster) if state.cluster is not None else None for _, state in self.states]
        self._solved: dict[int, tuple[RunningPlan, float] | None] = {}

    def solved(self, i: int) -> tuple[RunningPlan, float] | None:
        if i not in self._solved:
            self._solved[i] = resolve(self.workload, self.states[i][1], self.models[i])
        return self._solved[i]

    def step_seconds(self, i: int, plan: RunningPlan) -> float:
        return plan_step_seconds(self.workload, plan, self.states[i][1], self.models[i])

    def best_move(self, i: int, plan: RunningPlan) -> tuple[RunningPlan, float] | None:
        return best_move(self.workload, plan, self.states[i][1], self.models[i])

    def migration(self, i: int, old: RunningPlan, new: RunningPlan) -> Migration:
        return migration(self.workload, old, new, self.states[i][1])


def _simulate(replay: PlanReplay, initial: ReplannedPlan, decide: Chooser, policy: ReplanPolicy) -> PolicyRun:
    """Play `decide` over the replay's states from the running plan `initial`."""
    states = replay.states
    plan = initial
    decisions: list[Decision] = []
    segments: list[Segment] = []
    carry = 0.0  # migration still running at the start of the next interval
    for i, (now, state) in enumerate(states):
        offered = replay.candidates(i, plan)
        choice = decide(i, now, state, offered)
        decisions.append(Decision(now, choice.option, choice.plan, choice.step_seconds, choice.migration_seconds,
                                  choice.moved_bytes, offered[0].step_seconds))
        plan = choice.plan
        end = states[i + 1][0] if i + 1 < len(states) else math.inf
        blocked = carry + choice.migration_seconds
        segments.append(Segment(now, end, choice.step_seconds, blocked))
        carry = max(0.0, blocked - (end - now)) if math.isfinite(end) else 0.0
    return _account(policy, replay, initial, decisions, segments)


def _account(policy: ReplanPolicy, replay: PlanReplay, initial: ReplannedPlan, decisions: list[Decision],
             segments: list[Segment]) -> PolicyRun:
    horizon = replay.trace.horizon
    reference = replay.step_seconds(0, initial)
    target = WORKLOAD_SHARE * horizon / reference if math.isfinite(reference) else 0.0
    done, by_horizon, finish = 0.0, 0.0, math.inf
    for seg in segments:
        start = seg.start + seg.blocked
        rate = 1.0 / seg.step_seconds if math.isfinite(seg.step_seconds) and seg.step_seconds > 0 else 0.0
        if start < min(seg.end, horizon):
            by_horizon += (min(seg.end, horizon) - start) * rate
        if math.isfinite(finish) or rate == 0.0 or start >= seg.end:
            continue
        length = seg.end - start
        if done + length * rate >= target:
            finish = start + (target - done) / rate
        done += length * rate
    return PolicyRun(policy, tuple(decisions), tuple(segments), target, finish, by_horizon)


def run_policy(replay: PlanReplay, initial: ReplannedPlan, policy: ReplanPolicy | str, *,
               chooser: Chooser | None = None) -> PolicyRun:
    """Play `policy` over the replay's trace from the running plan `initial`; `chooser` decides
    for META."""
    policy = ReplanPolicy(policy)
    if policy is ReplanPolicy.ORACLE:
        return _oracle(replay, initial)
    if policy is ReplanPolicy.META:
        if chooser is None:
            raise ValueError("the meta policy needs a chooser (hlomap.tasks.replan.meta.MetaPolicy)")
        return _simulate(replay, initial, chooser, policy)
    horizon = replay.trace.horizon
    decide: Chooser = {
        ReplanPolicy.STATIC: _static,
        ReplanPolicy.RESOLVE: _resolve,
        ReplanPolicy.ARBITER: lambda i, now, state, options: arbiter_choice(now, horizon, options),
    }[policy]
    return _simulate(replay, initial, decide, policy)


def oracle_pool(replay: PlanReplay, initial: ReplannedPlan) -> list[ReplannedPlan]:
    """The plans the oracle chooses among: the initial plan, each change's re-solve, and the best
    move from the initial plan and from each re-solve at each change."""
    pool: list[ReplannedPlan] = [initial]
    for i in range(len(replay.states)):
        solved = replay.solved(i)
        if solved and solved[0] not in pool:
            pool.append(solved[0])
        for base in [initial] + ([solved[0]] if solved else []):
            moved = replay.best_move(i, base)
            if moved is not None and moved[0] not in pool:
                pool.append(moved[0])
    return pool


def play(replay: PlanReplay, initial: ReplannedPlan, sequence: Sequence[ReplannedPlan],
         policy: ReplanPolicy = ReplanPolicy.ORACLE) -> PolicyRun:
    """Hold `sequence[i]` from change i on (migrating to it when it differs from the running plan)."""
    def decide(i: int, now: float, state: ResourceState, options: Sequence[Candidate]) -> Candidate:
        plan, current = sequence[i], options[0]
        if plan == current.plan:
            return current
        moved = replay.migration(i, current.plan, plan)
        kind = next((c.option for c in options if c.plan == plan), Option.RESOLVE)
        return Candidate(kind, plan, replay.step_seconds(i, plan), moved.seconds, moved.nbytes)

    return _simulate(replay, initial, decide, policy)


def _oracle(replay: PlanReplay, initial: ReplannedPlan) -> PolicyRun:
    """Dynamic programming over (change, plan) with every plan an option offered at any change
    (each change's re-solve, and the best move from the initial plan and from each re-solve),
    maximizing the iterations trained by the horizon. A migration longer than its interval is
    charged to that interval only, inside the DP; the chosen sequence is then played by the same
    accounting as every policy."""
    states = replay.states
    pool = oracle_pool(replay, initial)
    step = [[replay.step_seconds(i, p) for p in pool] for i in range(len(states))]
    ends = [t for t, _ in states[1:]] + [replay.trace.horizon]
    n, k = len(states), len(pool)
    value = [[0.0] * k for _ in range(n + 1)]  # value[i][p]: most iterations from change i holding p
    choice = [[0] * k for _ in range(n)]
    for i in range(n - 1, -1, -1):
        now, state = states[i]
        length = max(ends[i] - now, 0.0)
        for p in range(k):
            best, best_q = -1.0, p
            for q in range(k):
                if not math.isfinite(step[i][q]):
                    continue
                cost = 0.0 if q == p else replay.migration(i, pool[p], pool[q]).seconds
                gained = max(length - cost, 0.0) / step[i][q] + value[i + 1][q]
                if gained > best + 1e-9:
                    best, best_q = gained, q
            value[i][p], choice[i][p] = max(best, 0.0), best_q
    sequence, p = [], 0
    for i in range(n):
        p = choice[i][p]
        sequence.append(pool[p])
    return play(replay, initial, sequence)

