"""Exact dynamic programming over contiguous cuts, replication factors and linear device order.

The DP returns a plan of `SearchSpace` with the least `costmodel` objective, the same optimum
`bruteforce.brute_force` finds by enumeration, in O(D * |R| * Q * n^2) per pass (n layers, D
devices, R replication factors, Q <= D stages).

State. F[q, i, d, k]: the best value of a suffix of the pipeline that starts at layer i on device
d with a first stage of replication R[k] and q more stages after it. Working right to left fixes
each stage's distance from the end, which 1F1B's memory needs (stage s stashes min(S - s, M)
microbatches, and S - s = q + 1), and knowing the replication of the next stage prices the cut
between them (a transfer depends on both device groups).

Prices. Stage all-reduces and cut transfers are those of `hlomap.cost.pipeline.links` on the
cluster's topology (the all-reduce of `hlomap.cost.collectives`, transfers as collective-permutes
whose cross-server streams share NICs), evaluated over whole tables of byte counts through their
`AffineMax` terms: the same numbers `costs.evaluate_plan` computes one plan at a time.

Passes. Two kinds of pass share one recursion:
- MAX: value = max over stages and cuts of their per-microbatch time: the least achievable
  bottleneck tau* (PipeDream's objective).
- SUM under a threshold tau: value = sum_s t_s + 2 sum_k u_k, with every stage and cut time
  <= tau (others masked out).
BOTTLENECK runs MAX, then SUM at tau* to break ties by latency. LATENCY minimizes
  L = sum + (M - 1) max
exactly as Alpa does: for each candidate value tau of the max (every stage or cut time that can
occur), L(tau) = SUM(tau) + (M - 1) tau; the optimal plan's own max is a candidate, so the least
L(tau) is the optimum. Only candidates in [tau*, (best L - unconstrained least sum) / (M - 1))
can win, and since SUM(tau) only falls as tau grows, a range [a, b] of candidates is pruned
whole once SUM(b) + (M - 1) a reaches the best L found (branch and bound on sorted candidates).
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hlomap.cost.pipeline.costs import CommModel, evaluate_plan
from hlomap.cost.cluster import Cluster
from hlomap.cost.pipeline.links import GroupPrices, group_memory, is_node_boundary
from hlomap.cost.pipeline.profile import PipelineProfile
from hlomap.tasks.pipeline.solution import NoFeasiblePlan, Solution
from hlomap.tasks.pipeline.space import TIE_RTOL, Objective, SearchSpace
from hlomap.cost.pipeline.stages import PipelinePlan, in_flight

__all__ = ["solve"]

log = logging.getLogger(__name__)


class _Mode(enum.Enum):
    MAX = "max"
    SUM = "sum"


class _Tables(NamedTuple):
    """Pair tables [i, j] for a stage of layers [i, j) (valid where j > i), and cut bytes."""

    compute: np.ndarray
    parameter: np.ndarray
    stash: np.ndarray
    allowed: np.ndarray  # bool: j > i, and the stage has a trainable layer when required
    cut_bytes: np.ndarray  # [n + 1]: bytes crossing boundary j (between layers j - 1 and j)


@dataclass(frozen=True)
class _Problem:
    profile: PipelineProfile
    cluster: Cluster
    space: SearchSpace
    tables: _Tables
    prices: GroupPrices  # every pass prices the same device groups

    @property
    def n(self) -> int:
        return self.profile.n_layers

    @property
    def devices(self) -> int:
        return self.cluster.n_devices

    @property
    def factors(self) -> tuple[int, ...]:
        return tuple(r for r in self.space.replication if r <= self.cluster.n_devices)

    @property
    def max_stages(self) -> int:
        most = min(self.n, self.devices // self.factors[0])
        return most if self.space.max_stages is None else min(most, self.space.max_stages)

    @property
    def comm(self) -> bool:
        return self.space.cost.comm is CommModel.OVERLAPPED


class _Pass(NamedTuple):
    value: np.ndarray  # F[q, i, d, k]
    next_layer: np.ndarray  # where the next stage starts
    next_factor: np.ndarray  # index into factors of the next stage's replication


def _tables(profile: PipelineProfile, space: SearchSpace) -> _Tables:
    prefix = profile.prefix()

    def pair(values: np.ndarray) -> np.ndarray:
        return values[None, :] - values[:, None]

    n = profile.n_layers
    allowed = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)
    if space.require_trainable:
        allowed &= pair(prefix.trainable) > 0.5
    cut_bytes = np.zeros(n + 1)
    cut_bytes[1:n] = profile.activation_bytes
    return _Tables(
        compute=pair(prefix.compute),
        parameter=pair(prefix.parameter),
        stash=pair(prefix.stash),
        allowed=allowed,
        cut_bytes=cut_bytes,
    )


def _stage_time(problem: _Problem, device: int, r: int) -> np.ndarray:
    """[i, j]: per-microbatch time of a stage [i, j) on devices [device, device + r): compute / r
    plus its gradient all-reduce amortized over the microbatches (`links.allreduce_time`)."""
    t = problem.tables.compute / r
    if problem.comm and r > 1:
        allreduce = problem.prices.allreduce(range(device, device + r))
        t = t + allreduce(problem.tables.parameter) / problem.space.microbatches
    return t


def _cut_time(problem: _Problem, device: int, r: int, r_next: int) -> np.ndarray:
    """[j]: per-microbatch, per-direction time of the cut at boundary j from a stage on devices
    [device, device + r) to one on the next r_next devices (`links.transfer_time`)."""
    nbytes = problem.tables.cut_bytes
    if not problem.comm:
        return np.zeros_like(nbytes)
    end = device + r
    return problem.prices.transfer(range(device, end), range(end, end + r_next))(nbytes)


def _memory_ok(problem: _Problem, device: int, r: int, after: int) -> np.ndarray | None:
    """[i, j] bool: the stage fits on its devices with `after` stages behind it (None: all do)."""
    space = problem.space
    if not space.check_memory:
        return None
    count = in_flight(space.schedule, 0, after + 1, space.microbatches)
    need = (
        space.cost.param_memory_factor * problem.tables.parameter
        + count * problem.tables.stash / r
    )
    return need <= group_memory(problem.cluster, range(device, device + r))


def _run(problem: _Problem, mode: _Mode, tau: float = math.inf) -> _Pass:
    """One DP pass (see the module docstring); `tau` masks stage and cut times in SUM mode."""
    n, devices, factors, stages = problem.n, problem.devices, problem.factors, problem.max_stages
    space = problem.space
    shape = (stages, n + 1, devices + 1, len(factors))
    value = np.full(shape, np.inf)
    next_layer = np.full(shape, -1, dtype=np.int32)
    next_factor = np.full(shape, -1, dtype=np.int16)
    rows = np.arange(n + 1)
    # Devices right to left: F[., ., d, .] needs only F[., ., e, .] for e > d.
    for d in range(devices - 1, -1, -1):
        for k, r in enumerate(factors):
            end = d + r
            if end > devices:
                continue
            stage = np.where(problem.tables.allowed, _stage_time(problem, d, r), np.inf)
            if mode is _Mode.SUM:
                stage = np.where(stage <= tau, stage, np.inf)
            # The best continuation after a cut at boundary j, over the next stage's
            # replication, for every count of stages behind; cut time included.
            cuts = []
            if end < devices and (
                not space.cut_on_node_boundary or is_node_boundary(problem.cluster, end)
            ):
                for k2, r2 in enumerate(factors):
                    if end + r2 <= devices:
                        u = _cut_time(problem, d, r, r2)
                        if mode is _Mode.SUM:
                            u = np.where(u <= tau, 2 * u, np.inf)
                        cuts.append((k2, u))
            for q in range(stages):
                fits = _memory_ok(problem, d, r, q)
                cost = stage if fits is None else np.where(fits, stage, np.inf)
                if q == 0:
                    if space.use_all_devices and end != devices:
                        continue
                    value[0, :, d, k] = cost[:, n]
                    continue
                if not cuts:
                    continue
                best_next = np.full(n + 1, np.inf)
                best_factor = np.full(n + 1, -1, dtype=np.int16)
                for k2, u in cuts:
                    tail = value[q - 1, :, end, k2]
                    through = np.maximum(u, tail) if mode is _Mode.MAX else u + tail
                    better = through < best_next
                    best_next = np.where(better, through, best_next)
                    best_factor = np.where(better, k2, best_factor)
                total = (
                    np.maximum(cost, best_next[None, :])
                    if mode is _Mode.MAX
                    else cost + best_next[None, :]
                )
                j = np.argmin(total, axis=1)
                value[q, :, d, k] = total[rows, j]
                next_layer[q, :, d, k] = j
                next_factor[q, :, d, k] = best_factor[j]
    return _Pass(value, next_layer, next_factor)


def _best_plan(problem: _Problem, result: _Pass) -> tuple[float, PipelinePlan | None]:
    """The least F[q, 0, 0, k] over stage counts and first replications, and its plan."""
    start = result.value[:, 0, 0, :]
    if not np.isfinite(start).any():
        return math.inf, None
    q, k = np.unravel_index(int(np.argmin(start)), start.shape)
    best = float(start[q, k])
    bounds, replication = [0], []
    layer, device = 0, 0
    for remaining in range(int(q), -1, -1):
        r = problem.factors[k]
        replication.append(r)
        if remaining == 0:
            bounds.append(problem.n)
            break
        nxt = int(result.next_layer[remaining, layer, device, k])
        k = int(result.next_factor[remaining, layer, device, k])
        bounds.append(nxt)
        layer, device = nxt, device + r
    plan = PipelinePlan.linear(
        bounds,
        replication,
        microbatches=problem.space.microbatches,
        schedule=problem.space.schedule,
    )
    return best, plan


def _candidates(problem: _Problem, floor: float) -> np.ndarray:
    """Every stage or cut time >= floor that some admissible plan can contain, ascending."""
    values = []
    devices, factors = problem.devices, problem.factors
    for d in range(devices):
        for r in factors:
            if d + r > devices:
                continue
            # q = 0 stashes the fewest microbatches, so its memory mask is the most permissive.
            fits = _memory_ok(problem, d, r, 0)
            mask = problem.tables.allowed if fits is None else problem.tables.allowed & fits
            stage = _stage_time(problem, d, r)[mask]
            values.append(stage[stage >= floor])
            for r2 in factors:
                if d + r + r2 <= devices:
                    u = _cut_time(problem, d, r, r2)[1 : problem.n]
                    values.append(u[u >= floor])
    return np.unique(np.concatenate(values)) if values else np.zeros(0)


def _solution(problem: _Problem, plan: PipelinePlan) -> Solution:
    cost = evaluate_plan(problem.profile, problem.cluster, plan, problem.space.cost,
                         prices=problem.prices)
    return Solution(plan=plan, cost=cost, objective=problem.space.objective)


def solve(profile: PipelineProfile, cluster: Cluster, space: SearchSpace) -> Solution:
    """The plan of `space` with the least objective on `cluster`; raises `NoFeasiblePlan`."""
    if not any(r <= cluster.n_devices for r in space.replication):
        raise NoFeasiblePlan(
            f"{profile.source}: replication factors {space.replication} all exceed the "
            f"{cluster.n_devices} devices"
        )
    problem = _Problem(profile, cluster, space, _tables(profile, space), GroupPrices(cluster))
    tau_star, _ = _best_plan(problem, _run(problem, _Mode.MAX))
    if not math.isfinite(tau_star):
        raise NoFeasiblePlan(
            f"{profile.source}: no plan of {profile.n_layers} layers on {cluster.n_devices} devices "
            f"satisfies {space} (memory per device "
            f"{group_memory(cluster, range(cluster.n_devices)):.4g} bytes)"
        )
    _, plan = _best_plan(problem, _run(problem, _Mode.SUM, tau_star * (1 + TIE_RTOL)))
    assert plan is not None, "the SUM pass at tau* must reach the plan the MAX pass found"
    if space.objective is Objective.BOTTLENECK:
        return _solution(problem, plan)

    m = space.microbatches
    best = _solution(problem, plan)
    least_sum, unconstrained = _best_plan(problem, _run(problem, _Mode.SUM))
    if unconstrained is not None:
        other = _solution(problem, unconstrained)
        if other.cost.latency < best.cost.latency:
            best = other
    if m == 1:
        return best  # L is the plain sum: the unconstrained pass is the optimum.
    best_value = best.cost.latency
    taus = _candidates(problem, tau_star)
    # Only thresholds with (M - 1) tau + least_sum < best can win.
    taus = taus[(m - 1) * taus + least_sum < best_value]
    sums: dict[int, float] = {}

    def least_sum_at(index: int) -> float:
        """SUM(taus[index]), memoized; every evaluation may improve the best plan."""
        nonlocal best, best_value
        if index not in sums:
            tau = float(taus[index])
            total, candidate = _best_plan(problem, _run(problem, _Mode.SUM, tau))
            sums[index] = total
            if candidate is not None and total + (m - 1) * tau < best_value:
                best = _solution(problem, candidate)
                best_value = min(total + (m - 1) * tau, best.cost.latency)
        return sums[index]

    # Branch and bound over ranges of thresholds: SUM only falls as tau grows, so every tau in
    # [taus[lo], taus[hi]] has L(tau) >= SUM(taus[hi]) + (M - 1) taus[lo].
    pending = [(0, len(taus) - 1)] if len(taus) else []
    while pending:
        lo, hi = pending.pop()
        if space.max_thresholds is not None and len(sums) >= space.max_thresholds:
            log.warning(
                "%s: stopped after %d bottleneck thresholds; the plan is the best found, not "
                "proven optimal", profile.source, len(sums),
            )
            break
        if least_sum_at(hi) + (m - 1) * float(taus[lo]) >= best_value or lo == hi:
            continue
        mid = (lo + hi) // 2
        pending.append((mid + 1, hi))
        pending.append((lo, mid))  # popped first: small thresholds first
    log.debug("%s: latency DP tried %d of %d thresholds", profile.source, len(sums), len(taus))
    return best
