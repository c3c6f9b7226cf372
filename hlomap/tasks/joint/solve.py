"""The exact outer level of the joint planner: dynamic programming over stage cuts, device
groups and per-stage options (mesh shape and sharding plan), for each microbatch count.

State F[q, i, d]: the least value of a pipeline suffix that starts at layer i on device d with
q more stages after the first; a stage takes the next `option.devices` devices (a slice of one
server, or whole servers), its layers [i, j) and its option. As in `tasks/pipeline/dp.py`
(Alpa's section 5.2 method), a MAX pass finds the least bottleneck tau*, SUM passes under a
threshold tau give sum_s t_s + 2 sum u_s with every stage and transfer <= tau, and
L = min over candidate tau of SUM(tau) + (M - 1) tau, found by branch and bound over the sorted
candidates (SUM only falls as tau grows). The inner level (each (range, option)'s cost) is the
memoized prefix sums of `costs.JointModel`, so every distinct stage is priced once.

The transfer after a stage is priced from the sending stage's side (`costs.transfer_seconds`:
its data shards go to the next devices in order), which keeps the state free of the next
stage's option, and `plans.evaluate` prices plans the same way, so the DP is exact for it.
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hlomap.cost.pipeline.stages import DEFAULT_SCHEDULE, Schedule, in_flight
from hlomap.tasks.joint.costs import JointModel, StageOption, transfer_seconds
from hlomap.tasks.joint.plans import JointCost, JointPlan, JointStage, evaluate, stage_memory, stage_seconds
from hlomap.tasks.pipeline.solution import NoFeasiblePlan

log = logging.getLogger(__name__)

__all__ = ["JointProblem", "JointSpace", "StageTables", "aligned",
           "microbatch_choices", "problem_for", "solve"]

#: Relative tolerance under which two bottlenecks count as equal.
TIE_RTOL = 1e-9


@dataclass(frozen=True)
class JointSpace:
    """What a joint plan may choose: stage options, microbatch counts, the schedule, at most
    `max_stages` stages; every device is used; memory is checked unless told not to."""

    options: tuple[StageOption, ...]
    microbatches: tuple[int, ...]
    schedule: Schedule = DEFAULT_SCHEDULE
    max_stages: int | None = None
    check_memory: bool = True


def microbatch_choices(batch: int, most: int = 32) -> tuple[int, ...]:
    """Microbatch counts that split `batch` evenly, up to `most`."""
    return tuple(m for m in range(1, min(batch, most) + 1) if batch % m == 0)


def aligned(per_node: int, device: int, size: int) -> bool:
    """A device group [device, device + size) is a slice of one server or whole servers."""
    if per_node <= 1:
        return True
    if size < per_node:
        return device % per_node + size <= per_node and device % size == 0
    return device % per_node == 0 and size % per_node == 0


def _per_node(model: JointModel) -> int:
    cluster = model.cluster
    return max(len(cluster.devices_on(node)) for node in set(cluster.node_of))


def _valid(model: JointModel, option: StageOption, microbatches: int) -> bool:
    """Each data replica gets a whole number of samples of every microbatch."""
    return model.batch % (microbatches * option.data) == 0


class _Mode(enum.Enum):
    MAX = "max"
    SUM = "sum"


class StageTables(NamedTuple):
    """Per option: [i, j] stage seconds (inf where j <= i), per held count the [i, j] memory,
    per first device the [j] transfer seconds after layer j - 1."""

    stage: list[np.ndarray]
    memory: list[dict[int, np.ndarray]]
    transfer: list[dict[int, np.ndarray]]


class _Pass(NamedTuple):
    value: np.ndarray  # [Q, L + 1, D + 1]
    next_layer: np.ndarray
    option: np.ndarray


@dataclass(eq=False)
class JointProblem:
    """One microbatch count's problem: the options valid for it and their tables (`tables`),
    shared by the DP and the DQN's environment."""

    model: JointModel
    space: JointSpace
    microbatches: int
    options: tuple[StageOption, ...]
    per_node: int

    @property
    def layers(self) -> int:
        return self.model.n_layers

    @property
    def devices(self) -> int:
        return self.model.cluster.n_devices

    @property
    def stages(self) -> int:
        most = min(self.layers, self.devices)
        return most if self.space.max_stages is None else min(most, self.space.max_stages)

    def held(self, after: int) -> int:
        return in_flight(self.space.schedule, 0, after + 1, self.microbatches)

    def tables(self) -> StageTables:
        n, m = self.layers, self.microbatches
        i, j = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
        upper = j > i
        stage, memory, transfer = [], [], []
        for option in self.options:
            a = self.model.arrays(option)
            t = np.where(upper, stage_seconds(a, i, j, m), np.inf)
            stage.append(t)
            memory.append({self.held(q): np.where(upper, stage_memory(a, i, j, self.held(q), m), np.inf)
                           for q in range(self.stages)})
            per_device = {}
            for d in range(self.devices):
                e = d + option.devices
                if e >= self.devices or not aligned(self.per_node, d, option.devices):
                    continue
                u = np.zeros(n + 1)
                for k in range(1, n):
                    nbytes = float(a.crossing[k - 1]) * option.data / m
                    u[k] = transfer_seconds(self.model.cluster, option, d, e, nbytes)
                per_device[d] = u
            transfer.append(per_device)
        return StageTables(stage, memory, transfer)

    def capacity(self, device: int, size: int) -> float:
        cluster = self.model.cluster
        return min(cluster.devices[x].memory_bytes for x in range(device, device + size))


def _run(problem: JointProblem, tables: StageTables, mode: _Mode, tau: float = math.inf) -> _Pass:
    """One pass over every (first device, option), all stage counts at once (q is an array axis:
    F[q, ., d] needs F[q - 1, ., e] for e > d only, all done when devices go right to left)."""
    n, devices, stages = problem.layers, problem.devices, problem.stages
    value = np.full((stages, n + 1, devices + 1), np.inf)
    next_layer = np.full(value.shape, -1, dtype=np.int32)
    chosen = np.full(value.shape, -1, dtype=np.int32)
    grid = np.indices((stages - 1, n + 1))
    costs = [_stage_costs(problem, tables, k, mode, tau) for k in range(len(problem.options))]
    for d in range(devices - 1, -1, -1):
        for k, option in enumerate(problem.options):
            e = d + option.devices
            if e > devices or not aligned(problem.per_node, d, option.devices):
                continue
            cost = costs[k][problem.capacity(d, option.devices)]  # [Q, i, j]
            if e == devices:  # the last stage: every remaining layer
                total = cost[0, :, n]
                better = total < value[0, :, d]
                value[0, :, d] = np.where(better, total, value[0, :, d])
                next_layer[0, :, d] = np.where(better, n, next_layer[0, :, d])
                chosen[0, :, d] = np.where(better, k, chosen[0, :, d])
                continue
            u = tables.transfer[k].get(d)
            if u is None or stages < 2:
                continue
            if mode is _Mode.SUM:
                u = np.where(u <= tau, 2 * u, np.inf)
            tail = value[:-1, :, e].copy()
            tail[:, n] = np.inf  # the next stage needs layers
            through = np.maximum(u[None, :], tail) if mode is _Mode.MAX else u[None, :] + tail
            inner = cost[1:]
            total = np.maximum(inner, through[:, None, :]) if mode is _Mode.MAX else inner + through[:, None, :]
            j = np.argmin(total, axis=2)
            best = total[grid[0], grid[1], j]
            better = best < value[1:, :, d]
            value[1:, :, d] = np.where(better, best, value[1:, :, d])
            next_layer[1:, :, d] = np.where(better, j, next_layer[1:, :, d])
            chosen[1:, :, d] = np.where(better, k, chosen[1:, :, d])
    return _Pass(value, next_layer, chosen)


def _stage_costs(problem: JointProblem, tables: StageTables, k: int, mode: _Mode,
                 tau: float) -> dict[float, np.ndarray]:
    """capacity -> [Q, i, j]: option k's stage times where the stage fits with q stages after it
    (and, in SUM mode, is within the threshold), inf elsewhere; one entry per distinct device
    memory a group of the option can have."""
    stage = tables.stage[k]
    if mode is _Mode.SUM:
        stage = np.where(stage <= tau, stage, np.inf)
    option = problem.options[k]
    capacities = {problem.capacity(d, option.devices) for d in range(problem.devices - option.devices + 1)}
    out = {}
    for capacity in capacities:
        if not problem.space.check_memory:
            out[capacity] = np.broadcast_to(stage, (problem.stages, *stage.shape))
            continue
        out[capacity] = np.stack([np.where(tables.memory[k][problem.held(q)] <= capacity, stage, np.inf)
                                  for q in range(problem.stages)])
    return out


def _best(problem: JointProblem, result: _Pass) -> tuple[float, JointPlan | None]:
    start = result.value[:, 0, 0]
    if not np.isfinite(start).any():
        return math.inf, None
    q = int(np.argmin(start))
    stages, layer, device = [], 0, 0
    for remaining in range(q, -1, -1):
        k = int(result.option[remaining, layer, device])
        stop = int(result.next_layer[remaining, layer, device])
        option = problem.options[k]
        stages.append(JointStage.of(layer, stop, device, option))
        layer, device = stop, device + option.devices
    return float(start[q]), JointPlan(tuple(stages), problem.microbatches, problem.space.schedule)


def _candidates(problem: JointProblem, tables: StageTables, floor: float) -> np.ndarray:
    values = [t[np.isfinite(t) & (t >= floor)] for t in tables.stage]
    values += [u[(u >= floor) & (u > 0)] for per in tables.transfer for u in per.values()]
    return np.unique(np.concatenate(values)) if values else np.zeros(0)


def problem_for(model: JointModel, space: JointSpace, microbatches: int) -> JointProblem | None:
    """The problem of one microbatch count (None when no option splits the batch that way)."""
    options = tuple(o for o in space.options if _valid(model, o, microbatches))
    return JointProblem(model, space, microbatches, options, _per_node(model)) if options else None


def _solve_for(model: JointModel, space: JointSpace, microbatches: int,
               bound: float) -> tuple[JointPlan, JointCost] | None:
    """The least-L plan with `microbatches` microbatches (None when none fits or beats `bound`)."""
    problem = problem_for(model, space, microbatches)
    if problem is None:
        return None
    tables = problem.tables()
    tau_star, _ = _best(problem, _run(problem, tables, _Mode.MAX))
    if not math.isfinite(tau_star):
        return None
    least_sum, unconstrained = _best(problem, _run(problem, tables, _Mode.SUM))
    m = microbatches
    if least_sum + (m - 1) * tau_star >= bound:
        return None  # cannot beat the plan found with another microbatch count
    found: list[tuple[JointPlan, JointCost]] = []

    def consider(plan: JointPlan | None) -> float:
        if plan is None:
            return math.inf
        cost = evaluate(model, plan)
        if space.check_memory and not cost.fits:
            return math.inf
        found.append((plan, cost))
        return cost.latency

    best_value = min(consider(_best(problem, _run(problem, tables, _Mode.SUM, tau_star * (1 + TIE_RTOL)))[1]),
                     consider(unconstrained))
    if m > 1:
        taus = _candidates(problem, tables, tau_star)
        taus = taus[(m - 1) * taus + least_sum < min(best_value, bound)]
        sums: dict[int, float] = {}

        def least_sum_at(index: int) -> float:
            nonlocal best_value
            if index not in sums:
                total, plan = _best(problem, _run(problem, tables, _Mode.SUM, float(taus[index])))
                sums[index] = total
                if plan is not None and total + (m - 1) * float(taus[index]) < best_value:
                    best_value = min(best_value, consider(plan))
            return sums[index]

        pending = [(0, len(taus) - 1)] if len(taus) else []
        while pending:
            lo, hi = pending.pop()
            if least_sum_at(hi) + (m - 1) * float(taus[lo]) >= best_value or lo == hi:
                continue
            mid = (lo + hi) // 2
            pending.append((mid + 1, hi))
            pending.append((lo, mid))
        log.debug("joint DP, M = %d: %d of %d thresholds", m, len(sums), len(taus))
    if not found:
        return None
    return min(found, key=lambda pc: pc[1].latency)


def solve(model: JointModel, space: JointSpace) -> tuple[JointPlan, JointCost]:
    """The joint plan of least L over `space` (every microbatch count); raises NoFeasiblePlan."""
    best: tuple[JointPlan, JointCost] | None = None
    for m in sorted(space.microbatches, reverse=True):  # many microbatches usually win: a good bound early
        found = _solve_for(model, space, m, best[1].latency if best else math.inf)
        if found is not None and (best is None or found[1].latency < best[1].latency):
            best = found
    if best is None:
        raise NoFeasiblePlan(f"{model.cap.source}: no joint plan of {model.n_layers} layers fits on "
                             f"{model.cluster.n_devices} devices of {model.cluster.name} "
                             f"(memory per device {min(d.memory_bytes for d in model.cluster.devices) / 2**30:.1f} GiB)")
    return best

