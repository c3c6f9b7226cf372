"""Exact dynamic programming over cut states, replication factors and linear device order.

The DP returns a plan of `PipelineSpace` with the least `costmodel` objective, the same optimum
the tests' oracle (`tests/tasks/oracle.py`) finds by enumeration, in O(D * |R| * Q * K^2) per
pass (K cut states, D devices, R replication factors, Q <= D stages).

Cut states. A straight pipeline's stages run one after the other, so the layers before any cut
form a set closed under predecessors; `CutStates` lists the sets the search may cut at (state 0
holds no layer, state K - 1 all of them) with their totals, which of them nest, and the bytes
crossing a cut after each. A stage runs the layers of a state b not in a nested state a and
costs totals[b] - totals[a]. `solve` takes the K = n + 1 prefixes of one layer order (the
chain of a profile; the DQN, the inference network and the greedy search cut the same order);
`downsets.solve_downsets` takes the downsets of a layer DAG, the cuts a branching graph allows.

State. F[q, a, d, k]: the best value of a suffix of the pipeline that starts after cut state a
on device d with a first stage of replication R[k] and q more stages after it. Working right to
left fixes each stage's distance from the end, which 1F1B's memory needs (stage s stashes
min(S - s, M) microbatches, and S - s = q + 1), and knowing the replication of the next stage
prices the cut between them (a transfer depends on both device groups).

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
from typing import Callable, NamedTuple, Sequence

import numpy as np

from hlomap.cost.cluster import Cluster
from hlomap.cost.pipeline.costs import CommModel, evaluate_plan
from hlomap.cost.pipeline.links import GroupPrices, group_memory, is_node_boundary
from hlomap.cost.pipeline.profile import PipelineProfile, Prefix
from hlomap.cost.pipeline.stages import PipelinePlan, in_flight
from hlomap.tasks.pipeline.solution import NoFeasiblePlan, Solution
from hlomap.tasks.pipeline.space import TIE_RTOL, PipelineObjective, PipelineSpace

__all__ = ["CutStates", "Realize", "StateSolution", "chain_states", "solve", "solve_states"]

log = logging.getLogger(__name__)


class CutStates(NamedTuple):
    """The sets of layers a straight pipeline may have run before a cut (module docstring).

    totals: per-state sums of the per-layer arrays ([K] each, `Prefix`'s fields); a stage from
      state a to state b costs totals[b] - totals[a].
    nested: [K, K] bool, state a is a proper subset of state b: a stage from a to b may exist.
    cut_bytes: [K] bytes of activations that cross a cut leaving exactly state a before it.
    n_layers, source: for messages.
    """

    totals: Prefix
    nested: np.ndarray
    cut_bytes: np.ndarray
    n_layers: int
    source: str

    @property
    def count(self) -> int:
        return len(self.cut_bytes)


#: Turns a chain of state indices (0 first, K - 1 last) into the layers of a profile in an order
#: that runs each stage contiguously, and the stage bounds in that order.
Realize = Callable[[tuple[int, ...]], tuple[PipelineProfile, tuple[int, ...]]]


@dataclass(frozen=True)
class StateSolution:
    """A solution over cut states: `solution.plan` indexes the layers of `profile`, and `states`
    are the cut states its stages end at (0 first, K - 1 last)."""

    solution: Solution
    profile: PipelineProfile
    states: tuple[int, ...]


def chain_states(profile: PipelineProfile) -> CutStates:
    """The n + 1 prefixes of the profile's layer chain: cut state p holds layers [0, p)."""
    n = profile.n_layers
    cut_bytes = np.zeros(n + 1)
    cut_bytes[1:n] = profile.activation_bytes
    return CutStates(
        totals=profile.prefix(),
        nested=np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1),
        cut_bytes=cut_bytes,
        n_layers=n,
        source=profile.source,
    )


class _Mode(enum.Enum):
    MAX = "max"
    SUM = "sum"


class _Tables(NamedTuple):
    """Pair tables [a, b] for a stage from cut state a to cut state b, and cut bytes."""

    compute: np.ndarray
    parameter: np.ndarray
    stash: np.ndarray
    allowed: np.ndarray  # bool: a is nested in b, and the stage trains something when required
    cut_bytes: np.ndarray  # [K]: bytes crossing a cut after state a


@dataclass(frozen=True)
class _Problem:
    states: CutStates
    realize: Realize
    cluster: Cluster
    space: PipelineSpace
    tables: _Tables
    prices: GroupPrices  # every pass prices the same device groups

    @property
    def count(self) -> int:
        return self.states.count

    @property
    def devices(self) -> int:
        return self.cluster.n_devices

    @property
    def factors(self) -> tuple[int, ...]:
        return tuple(r for r in self.space.replication if r <= self.cluster.n_devices)

    @property
    def max_stages(self) -> int:
        most = min(self.states.n_layers, self.devices // self.factors[0])
        return most if self.space.max_stages is None else min(most, self.space.max_stages)

    @property
    def comm(self) -> bool:
        return self.space.cost.comm is CommModel.OVERLAPPED


class _Pass(NamedTuple):
    value: np.ndarray  # F[q, a, d, k]
    next_state: np.ndarray  # the cut state the next stage starts after
    next_factor: np.ndarray  # index into factors of the next stage's replication


def _tables(states: CutStates, space: PipelineSpace) -> _Tables:
    def pair(values: np.ndarray) -> np.ndarray:
        return values[None, :] - values[:, None]

    totals = states.totals
    allowed = states.nested
    if space.require_trainable:
        allowed = allowed & (pair(totals.trainable) > 0.5)
    return _Tables(
        compute=pair(totals.compute),
        parameter=pair(totals.parameter),
        stash=pair(totals.stash),
        allowed=allowed,
        cut_bytes=states.cut_bytes,
    )


def _stage_time(problem: _Problem, device: int, r: int) -> np.ndarray:
    """[a, b]: per-microbatch time of a stage from a to b on devices [device, device + r):
    compute / r plus its gradient all-reduce amortized over the microbatches
    (`links.allreduce_time`)."""
    t = problem.tables.compute / r
    if problem.comm and r > 1:
        allreduce = problem.prices.allreduce(range(device, device + r))
        t = t + allreduce(problem.tables.parameter) / problem.space.microbatches
    return t


def _cut_time(problem: _Problem, device: int, r: int, r_next: int) -> np.ndarray:
    """[a]: per-microbatch, per-direction time of the cut after state a from a stage on devices
    [device, device + r) to one on the next r_next devices (`links.transfer_time`)."""
    nbytes = problem.tables.cut_bytes
    if not problem.comm:
        return np.zeros_like(nbytes)
    end = device + r
    return problem.prices.transfer(range(device, end), range(end, end + r_next))(nbytes)


def _memory_ok(problem: _Problem, device: int, r: int, after: int) -> np.ndarray | None:
    """[a, b] bool: the stage fits on its devices with `after` stages behind it (None: all do)."""
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
    count, devices, factors = problem.count, problem.devices, problem.factors
    stages, space, last = problem.max_stages, problem.space, problem.count - 1
    shape = (stages, count, devices + 1, len(factors))
    value = np.full(shape, np.inf)
    next_state = np.full(shape, -1, dtype=np.int32)
    next_factor = np.full(shape, -1, dtype=np.int16)
    rows = np.arange(count)
    # Devices right to left: F[., ., d, .] needs only F[., ., e, .] for e > d.
    for d in range(devices - 1, -1, -1):
        for k, r in enumerate(factors):
            end = d + r
            if end > devices:
                continue
            stage = np.where(problem.tables.allowed, _stage_time(problem, d, r), np.inf)
            if mode is _Mode.SUM:
                stage = np.where(stage <= tau, stage, np.inf)
            # The best continuation after a cut at state b, over the next stage's
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
                if q == 0:
                    if space.use_all_devices and end != devices:
                        continue
                    fits = _memory_ok(problem, d, r, q)
                    cost = stage if fits is None else np.where(fits, stage, np.inf)
                    value[0, :, d, k] = cost[:, last]
                    continue
                # No continuation with q stages from the next device: nothing to extend (with
                # one device per stage on all devices, only q = D - 1 - d survives).
                if not cuts or not np.isfinite(value[q - 1, :, end, :]).any():
                    continue
                fits = _memory_ok(problem, d, r, q)
                cost = stage if fits is None else np.where(fits, stage, np.inf)
                best_next = np.full(count, np.inf)
                best_factor = np.full(count, -1, dtype=np.int16)
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
                next_state[q, :, d, k] = j
                next_factor[q, :, d, k] = best_factor[j]
    return _Pass(value, next_state, next_factor)


class _Chain(NamedTuple):
    """A plan as the DP sees it: the cut states its stages end at (0 first) and replications."""

    states: tuple[int, ...]
    replication: tuple[int, ...]


def _best_chain(problem: _Problem, result: _Pass) -> tuple[float, _Chain | None]:
    """The least F[q, 0, 0, k] over stage counts and first replications, and its chain."""
    start = result.value[:, 0, 0, :]
    if not np.isfinite(start).any():
        return math.inf, None
    q, k = np.unravel_index(int(np.argmin(start)), start.shape)
    best = float(start[q, k])
    states, replication = [0], []
    state, device = 0, 0
    for remaining in range(int(q), -1, -1):
        r = problem.factors[k]
        replication.append(r)
        if remaining == 0:
            states.append(problem.count - 1)
            break
        nxt = int(result.next_state[remaining, state, device, k])
        k = int(result.next_factor[remaining, state, device, k])
        states.append(nxt)
        state, device = nxt, device + r
    return best, _Chain(tuple(states), tuple(replication))


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
                    # Cuts happen after neither the empty nor the full state.
                    u = _cut_time(problem, d, r, r2)[1 : problem.count - 1]
                    values.append(u[u >= floor])
    return np.unique(np.concatenate(values)) if values else np.zeros(0)


def _solution(problem: _Problem, chain: _Chain) -> StateSolution:
    """The chain's plan on the profile `realize` lays it out on, priced by `evaluate_plan`."""
    profile, bounds = problem.realize(chain.states)
    space = problem.space
    plan = PipelinePlan.linear(bounds, chain.replication, microbatches=space.microbatches,
                               schedule=space.schedule)
    cost = evaluate_plan(profile, problem.cluster, plan, space.cost, prices=problem.prices)
    return StateSolution(Solution(plan=plan, cost=cost, objective=space.objective), profile,
                         chain.states)


def solve_states(
    states: CutStates, realize: Realize, cluster: Cluster, space: PipelineSpace
) -> StateSolution:
    """The plan of `space` over the cut `states` with the least objective on `cluster`;
    raises `NoFeasiblePlan`. `realize` lays a chain of states out as a profile's stages."""
    if not any(r <= cluster.n_devices for r in space.replication):
        raise NoFeasiblePlan(
            f"{states.source}: replication factors {space.replication} all exceed the "
            f"{cluster.n_devices} devices"
        )
    problem = _Problem(states, realize, cluster, space, _tables(states, space),
                       GroupPrices(cluster))
    tau_star, _ = _best_chain(problem, _run(problem, _Mode.MAX))
    if not math.isfinite(tau_star):
        raise NoFeasiblePlan(
            f"{states.source}: no plan of {states.n_layers} layers on {cluster.n_devices} "
            f"devices satisfies {space} (memory per device "
            f"{group_memory(cluster, range(cluster.n_devices)):.4g} bytes)"
        )
    _, chain = _best_chain(problem, _run(problem, _Mode.SUM, tau_star * (1 + TIE_RTOL)))
    assert chain is not None, "the SUM pass at tau* must reach the plan the MAX pass found"
    best = _solution(problem, chain)
    if space.objective is PipelineObjective.BOTTLENECK:
        return best

    m = space.microbatches
    least_sum, unconstrained = _best_chain(problem, _run(problem, _Mode.SUM))
    if unconstrained is not None:
        other = _solution(problem, unconstrained)
        if other.solution.cost.latency < best.solution.cost.latency:
            best = other
    if m == 1:
        return best  # L is the plain sum: the unconstrained pass is the optimum.
    best_value = best.solution.cost.latency
    taus = _candidates(problem, tau_star)
    # Only thresholds with (M - 1) tau + least_sum < best can win.
    taus = taus[(m - 1) * taus + least_sum < best_value]
    sums: dict[int, float] = {}

    def least_sum_at(index: int) -> float:
        """SUM(taus[index]), memoized; every evaluation may improve the best plan."""
        nonlocal best, best_value
        if index not in sums:
            tau = float(taus[index])
            total, candidate = _best_chain(problem, _run(problem, _Mode.SUM, tau))
            sums[index] = total
            if candidate is not None and total + (m - 1) * tau < best_value:
                best = _solution(problem, candidate)
                best_value = min(total + (m - 1) * tau, best.solution.cost.latency)
        return sums[index]

    # Branch and bound over ranges of thresholds: SUM only falls as tau grows, so every tau in
    # [taus[lo], taus[hi]] has L(tau) >= SUM(taus[hi]) + (M - 1) taus[lo].
    pending = [(0, len(taus) - 1)] if len(taus) else []
    while pending:
        lo, hi = pending.pop()
        if space.max_thresholds is not None and len(sums) >= space.max_thresholds:
            log.warning(
                "%s: stopped after %d bottleneck thresholds; the plan is the best found, not "
                "proven optimal", states.source, len(sums),
            )
            break
        if least_sum_at(hi) + (m - 1) * float(taus[lo]) >= best_value or lo == hi:
            continue
        mid = (lo + hi) // 2
        pending.append((mid + 1, hi))
        pending.append((lo, mid))  # popped first: small thresholds first
    log.debug("%s: latency DP tried %d of %d thresholds", states.source, len(sums), len(taus))
    return best


def solve(profile: PipelineProfile, cluster: Cluster, space: PipelineSpace) -> Solution:
    """The plan of `space` that cuts the profile's layer chain with the least objective on
    `cluster`; raises `NoFeasiblePlan`."""

    def realize(chain: Sequence[int]) -> tuple[PipelineProfile, tuple[int, ...]]:
        return profile, tuple(chain)  # state p is the prefix [0, p)

    return solve_states(chain_states(profile), realize, cluster, space).solution
