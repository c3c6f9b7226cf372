"""The one stage DP: exact dynamic programming over cut states, stage options and linear device
order, for the pipeline task and the joint task alike.

A plan cuts a problem's cut states into stages that take devices in linear order from device 0;
each stage has an option (a device-group size, and whatever else prices it: a replication
factor for the pipeline task, a data x model mesh and sharding plan for the joint task). A
problem describes itself to the DP as `StageOptions`: per (first device, option) the [a, b]
stage times, which stages fit in memory with q stages behind them, and the [a, option'] times
of the cut after state a to a next stage of option'. The pipeline task's problem has one option
per replication factor (`solve_states`); the joint task builds its own (`tasks.joint.solve`).

Cut states. A straight pipeline's stages run one after the other, so the layers before any cut
form a set closed under predecessors; `CutStates` lists the sets the search may cut at (state 0
holds no layer, state K - 1 all of them) with their totals, which of them nest, and the bytes
crossing a cut after each. A stage runs the layers of a state b not in a nested state a and
costs totals[b] - totals[a]. `solve` takes the K = n + 1 prefixes of one layer order (the
chain of a profile; the DQN, the inference network and the greedy search cut the same order);
`downsets.solve_downsets` takes the downsets of a layer DAG, the cuts a branching graph allows.

State. F[q, a, d, o]: the best value of a suffix of the pipeline that starts after cut state a
on device d with a first stage of option o and q more stages after it. Working right to left
fixes each stage's distance from the end, which 1F1B's memory needs (stage s stashes
min(S - s, M) microbatches, and S - s = q + 1), and knowing the option of the next stage prices
the cut between them (a transfer may depend on both device groups).

Passes (Alpa, section 5.2). Two kinds of pass share one recursion:
- MAX: value = max over stages and cuts of their per-microbatch time: the least achievable
  bottleneck tau* (PipeDream's objective).
- SUM under a threshold tau: value = sum_s t_s + 2 sum_k u_k, with every stage and cut time
  <= tau (others masked out).
`least_bottleneck` runs MAX, then SUM at tau* to break ties by latency. `least_latency`
minimizes L = sum + (M - 1) max: for each candidate value tau of the max (every stage or cut
time that can occur), L(tau) = SUM(tau) + (M - 1) tau; the optimal plan's own max is a
candidate, so the least L(tau) is the optimum. Only candidates in
[tau*, (best L - unconstrained least sum) / (M - 1)) can win, and since SUM(tau) only falls as
tau grows, a range [a, b] of candidates is pruned whole once SUM(b) + (M - 1) a reaches the
best L found (branch and bound on sorted candidates).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np

from hlomap.cost.cluster import Cluster
from hlomap.cost.pipeline.costs import CommModel, allreduce_share, evaluate_plan
from hlomap.cost.pipeline.links import GroupPrices, group_memory, is_node_boundary
from hlomap.cost.pipeline.profile import PipelineProfile, Prefix
from hlomap.cost.pipeline.stages import PipelinePlan, in_flight
from hlomap.tasks.pipeline.solution import NoFeasiblePlan, Solution
from hlomap.tasks.pipeline.space import TIE_RTOL, PipelineObjective, PipelineSpace

__all__ = ["CutStates", "Realize", "StageChain", "StageOptions", "StateSolution", "chain_states",
           "least_bottleneck", "least_latency", "solve", "solve_states"]

log = logging.getLogger(__name__)


class StageOptions(Protocol):
    """A problem as the stage DP sees it (module docstring). Times are per microbatch; every
    array is indexed by cut states, K = `n_states`, and by option, O = len(`sizes`)."""

    @property
    def n_states(self) -> int: ...

    @property
    def n_devices(self) -> int: ...

    @property
    def sizes(self) -> tuple[int, ...]:
        """Devices of a stage of each option."""
        ...

    @property
    def max_stages(self) -> int: ...

    @property
    def use_all_devices(self) -> bool:
        """The last stage must end on the last device."""
        ...

    def stage_seconds(self, device: int, option: int) -> np.ndarray | None:
        """[K, K]: the time of a stage from state a to state b of `option` on the group from
        `device` (inf where there is no such stage); None when the group may not start there."""
        ...

    def fits(self, device: int, option: int, behind: np.ndarray) -> np.ndarray | None:
        """[len(behind), K, K] bool: the stage fits in its devices' memory with behind[i]
        stages after it; None when memory is not checked."""
        ...

    def cut_seconds(self, device: int, option: int) -> np.ndarray | None:
        """[K, O]: per-direction time of the cut after state a from the stage of `option` on
        the group from `device` to a next stage of each option; None when no cut may follow
        the group."""
        ...


class StageChain(NamedTuple):
    """A plan as the DP sees it: the cut states its stages end at (0 first, K - 1 last) and
    each stage's option index; stage s takes the devices after stage s - 1's."""

    states: tuple[int, ...]
    options: tuple[int, ...]


#: Cells of the [q, a, b] arrays one step of a pass holds at once: with thousands of cut
#: states, all stage counts at once would not fit in memory.
_CHUNK_CELLS = 1 << 23


class _Mode(enum.Enum):
    MAX = "max"
    SUM = "sum"


class _Pass(NamedTuple):
    value: np.ndarray  # F[q, a, d, o]
    next_state: np.ndarray  # the cut state the next stage starts after
    next_option: np.ndarray  # the next stage's option


def _combine(mode: _Mode, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.maximum(a, b) if mode is _Mode.MAX else a + b


class _Tail(NamedTuple):
    """The suffixes after a cut into device `end`, over the next stage's option: the best value
    per (q, b), that option, and the stage counts where some suffix exists."""

    best: np.ndarray  # [Q - 1, K]
    option: np.ndarray  # [Q - 1, K]
    live: np.ndarray


def _tail(value: np.ndarray, end: int) -> _Tail:
    tail = value[:-1, :, end, :]
    option = np.argmin(tail, axis=2)
    best = np.take_along_axis(tail, option[..., None], axis=2)[..., 0]
    return _Tail(best, option, np.flatnonzero(np.isfinite(best).any(axis=1)))


def _run(problem: StageOptions, mode: _Mode, tau: float = math.inf, *, chains: bool = True) -> _Pass:
    """One DP pass (module docstring); `tau` masks stage and cut times in SUM mode. Stage
    counts q are an array axis: F[q, ., d, .] needs F[q - 1, ., e, .] for e > d only, all
    done when devices go right to left. Without `chains` only the values are kept (the MAX
    pass's bottleneck needs no plan).

    A problem whose cut times do not depend on the next stage's option
    (`cut_depends_on_next` False: the joint task prices a cut from its sending side) combines a
    cut with the best suffix over the next option, found once per device the suffix starts on
    (`_tail`) instead of once per stage before it: under SUM, u + min(tail) = min(u + tail);
    under MAX, max(u, min(tail)) = min(max(u, tail))."""
    count, devices, sizes = problem.n_states, problem.n_devices, problem.sizes
    stages, last = problem.max_stages, problem.n_states - 1
    shape = (stages, count, devices + 1, len(sizes))
    value = np.full(shape, np.inf)
    kept = shape if chains else (1, 1, 1, 1)
    next_state = np.full(kept, -1, dtype=np.int32)
    next_option = np.full(kept, -1, dtype=np.int32)
    first = np.zeros(1, dtype=np.int64)
    per_chunk = max(1, _CHUNK_CELLS // (count * count))  # stage counts done at once
    shared = not getattr(problem, "cut_depends_on_next", True)
    tails: dict[int, _Tail] = {}
    for d in range(devices - 1, -1, -1):
        for k, size in enumerate(sizes):
            end = d + size
            if end > devices:
                continue
            stage = problem.stage_seconds(d, k)
            if stage is None:
                continue
            if mode is _Mode.SUM:
                stage = np.where(stage <= tau, stage, np.inf)
            if end == devices or not problem.use_all_devices:  # a last stage: q = 0
                fits = problem.fits(d, k, first)
                cost = stage if fits is None else np.where(fits[0], stage, np.inf)
                value[0, :, d, k] = cost[:, last]
            if stages < 2 or end >= devices:
                continue
            if shared:
                if end not in tails:
                    tails[end] = _tail(value, end)
                live = tails[end].live
            else:
                # Only stage counts some suffix from the next device reaches (with one device
                # per stage on all devices, only q = D - 1 - d).
                tail = value[:-1, :, end, :]  # [Q - 1, b, o']: suffixes after a cut at state b
                live = np.flatnonzero(np.isfinite(tail).any(axis=(1, 2)))
            if not len(live):
                continue
            u = problem.cut_seconds(d, k)
            if u is None:
                continue
            if mode is _Mode.SUM:
                u = np.where(u <= tau, 2 * u, np.inf)
            for chunk in np.array_split(live, -(-len(live) // per_chunk)):
                if shared:
                    best_next = _combine(mode, u[None, :, 0], tails[end].best[chunk])  # [L, b]
                    choice = tails[end].option[chunk]
                else:
                    through = _combine(mode, u[None], tail[chunk])  # [L, b, o']
                    choice = np.argmin(through, axis=2)  # the best next option after a cut at b
                    best_next = np.take_along_axis(through, choice[..., None], axis=2)[..., 0]
                fits = problem.fits(d, k, chunk + 1)
                cost = stage[None] if fits is None else np.where(fits, stage[None], np.inf)
                total = _combine(mode, cost, best_next[:, None, :])  # [L, a, b]
                if not chains:
                    value[chunk + 1, :, d, k] = total.min(axis=2)
                    continue
                j = np.argmin(total, axis=2)  # [L, a]
                value[chunk + 1, :, d, k] = np.take_along_axis(total, j[..., None], axis=2)[..., 0]
                next_state[chunk + 1, :, d, k] = j
                next_option[chunk + 1, :, d, k] = np.take_along_axis(choice, j, axis=1)
    return _Pass(value, next_state, next_option)


def _best_chain(problem: StageOptions, result: _Pass) -> tuple[float, StageChain | None]:
    """The least F[q, 0, 0, o] over stage counts and first options, and its chain."""
    start = result.value[:, 0, 0, :]
    if not np.isfinite(start).any():
        return math.inf, None
    q, k = (int(x) for x in np.unravel_index(int(np.argmin(start)), start.shape))
    best = float(start[q, k])
    states, options = [0], []
    state, device = 0, 0
    for remaining in range(q, -1, -1):
        options.append(k)
        if remaining == 0:
            states.append(problem.n_states - 1)
            break
        nxt = int(result.next_state[remaining, state, device, k])
        after = int(result.next_option[remaining, state, device, k])
        states.append(nxt)
        state, device, k = nxt, device + problem.sizes[k], after
    return best, StageChain(tuple(states), tuple(options))


def _candidates(problem: StageOptions, floor: float) -> np.ndarray:
    """Every stage or cut time >= floor that some admissible plan can contain, ascending."""
    values = []
    devices, inner = problem.n_devices, slice(1, problem.n_states - 1)
    first = np.zeros(1, dtype=np.int64)
    for d in range(devices):
        for k, size in enumerate(problem.sizes):
            if d + size > devices:
                continue
            stage = problem.stage_seconds(d, k)
            if stage is None:
                continue
            # No stages behind stashes the fewest microbatches: the most permissive memory mask.
            fits = problem.fits(d, k, first)
            mask = np.isfinite(stage) if fits is None else np.isfinite(stage) & fits[0]
            values.append(stage[mask & (stage >= floor)])
            u = problem.cut_seconds(d, k) if d + size < devices else None
            if u is not None:
                u = u[inner]  # cuts happen after neither the empty nor the full state
                values.append(u[np.isfinite(u) & (u >= floor)])
    return np.unique(np.concatenate(values)) if values else np.zeros(0)


def _least_max(problem: StageOptions) -> float:
    start = _run(problem, _Mode.MAX, chains=False).value[:, 0, 0, :]
    return float(start.min()) if np.isfinite(start).any() else math.inf


def _least_sum(problem: StageOptions, tau: float = math.inf) -> tuple[float, StageChain | None]:
    return _best_chain(problem, _run(problem, _Mode.SUM, tau))


def least_bottleneck(problem: StageOptions) -> tuple[float, StageChain] | None:
    """The least bottleneck tau* and, among plans within it, the one of least sum (None when no
    plan exists)."""
    tau_star = _least_max(problem)
    if not math.isfinite(tau_star):
        return None
    _, chain = _least_sum(problem, tau_star * (1 + TIE_RTOL))
    assert chain is not None, "the SUM pass at tau* must reach the plan the MAX pass found"
    return tau_star, chain


def least_latency(
    problem: StageOptions,
    microbatches: int,
    latency: Callable[[StageChain], float],
    *,
    bound: float = math.inf,
    max_thresholds: int | None = None,
    source: str = "",
) -> StageChain | None:
    """The chain of least L = sum + (M - 1) max (module docstring); `latency` prices a chain
    (inf for one the caller rejects). None when no plan exists or none beats `bound`."""
    tau_star = _least_max(problem)
    if not math.isfinite(tau_star):
        return None
    m = microbatches
    least_sum, unconstrained = _least_sum(problem)
    if least_sum + (m - 1) * tau_star >= bound:
        return None
    best: StageChain | None = None
    best_value = bound  # only plans that beat it count

    def consider(chain: StageChain | None) -> None:
        nonlocal best, best_value
        if chain is not None:
            value = latency(chain)
            if value < best_value:
                best, best_value = chain, value

    consider(_least_sum(problem, tau_star * (1 + TIE_RTOL))[1])
    consider(unconstrained)
    if m == 1:  # L is the plain sum: the unconstrained pass is the optimum.
        return best
    taus = _candidates(problem, tau_star)
    # Only thresholds with (M - 1) tau + least_sum < best can win.
    taus = taus[(m - 1) * taus + least_sum < best_value]
    sums: dict[int, float] = {}

    def least_sum_at(index: int) -> float:
        """SUM(taus[index]), memoized; every evaluation may improve the best plan."""
        if index not in sums:
            tau = float(taus[index])
            total, chain = _least_sum(problem, tau)
            sums[index] = total
            if total + (m - 1) * tau < best_value:
                consider(chain)
        return sums[index]

    # Branch and bound over ranges of thresholds: SUM only falls as tau grows, so every tau in
    # [taus[lo], taus[hi]] has L(tau) >= SUM(taus[hi]) + (M - 1) taus[lo].
    pending = [(0, len(taus) - 1)] if len(taus) else []
    while pending:
        lo, hi = pending.pop()
        if max_thresholds is not None and len(sums) >= max_thresholds:
            log.warning(
                "%s: stopped after %d bottleneck thresholds; the plan is the best found, not "
                "proven optimal", source, len(sums),
            )
            break
        if least_sum_at(hi) + (m - 1) * float(taus[lo]) >= best_value or lo == hi:
            continue
        mid = (lo + hi) // 2
        pending.append((mid + 1, hi))
        pending.append((lo, mid))  # popped first: small thresholds first
    log.debug("%s: latency DP, M = %d: tried %d of %d thresholds", source, m, len(sums), len(taus))
    return best


# The pipeline task: one option per replication factor.


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


def _pair(values: np.ndarray) -> np.ndarray:
    """[a, b]: values[b] - values[a], the total of a stage from state a to state b."""
    return values[None, :] - values[:, None]


@dataclass(frozen=True)
class _ReplicationOptions:
    """The pipeline task's `StageOptions`: a stage's option is its replication factor r (its
    data axis; model axis 1) on the next r devices, priced by `hlomap.cost.pipeline.links` on
    the cluster's topology over whole tables of byte counts: the same numbers
    `costs.evaluate_plan` computes one plan at a time."""

    states: CutStates
    cluster: Cluster
    space: PipelineSpace
    prices: GroupPrices  # every pass prices the same device groups
    compute: np.ndarray = field(init=False)  # [a, b] pair tables
    parameter: np.ndarray = field(init=False)
    stash: np.ndarray = field(init=False)
    allowed: np.ndarray = field(init=False)  # a is nested in b, and trains something if required
    sizes: tuple[int, ...] = field(init=False)  # the replication factors that fit the cluster

    def __post_init__(self) -> None:
        totals = self.states.totals
        allowed = self.states.nested
        if self.space.require_trainable:
            allowed = allowed & (_pair(totals.trainable) > 0.5)
        object.__setattr__(self, "compute", _pair(totals.compute))
        object.__setattr__(self, "parameter", _pair(totals.parameter))
        object.__setattr__(self, "stash", _pair(totals.stash))
        object.__setattr__(self, "allowed", allowed)
        object.__setattr__(self, "sizes", tuple(r for r in self.space.replication
                                                if r <= self.cluster.n_devices))

    @property
    def n_states(self) -> int:
        return self.states.count

    @property
    def n_devices(self) -> int:
        return self.cluster.n_devices

    @property
    def max_stages(self) -> int:
        most = min(self.states.n_layers, self.n_devices // self.sizes[0])
        return most if self.space.max_stages is None else min(most, self.space.max_stages)

    @property
    def use_all_devices(self) -> bool:
        return self.space.use_all_devices

    @property
    def _comm(self) -> bool:
        return self.space.cost.comm is CommModel.OVERLAPPED

    def stage_seconds(self, device: int, option: int) -> np.ndarray:
        """compute / r plus the stage's gradient all-reduce amortized over the microbatches, or
        all of it per microbatch where the executors sync every microbatch
        (`costs.allreduce_share`, `links.allreduce_time`)."""
        r = self.sizes[option]
        t = self.compute / r
        if self._comm and r > 1:
            allreduce = self.prices.allreduce(range(device, device + r))
            t = t + allreduce_share(self.prices.cluster, allreduce(self.parameter), self.space.microbatches)
        return np.where(self.allowed, t, np.inf)

    def fits(self, device: int, option: int, behind: np.ndarray) -> np.ndarray | None:
        space = self.space
        if not space.check_memory:
            return None
        r = self.sizes[option]
        held = np.asarray([in_flight(space.schedule, 0, int(q) + 1, space.microbatches)
                           for q in behind], dtype=float)
        need = (space.cost.param_memory_factor * self.parameter[None]
                + held[:, None, None] * (self.stash / r)[None])
        return need <= group_memory(self.cluster, range(device, device + r))

    def cut_seconds(self, device: int, option: int) -> np.ndarray | None:
        """Transfers as collective-permutes whose cross-server streams share NICs
        (`links.transfer_time`); a cut falls on a server boundary when the space says so."""
        end = device + self.sizes[option]
        if end >= self.n_devices or (
            self.space.cut_on_node_boundary and not is_node_boundary(self.cluster, end)
        ):
            return None
        nbytes = self.states.cut_bytes
        out = np.full((len(nbytes), len(self.sizes)), np.inf)
        for k, r in enumerate(self.sizes):
            if end + r <= self.n_devices:
                out[:, k] = (self.prices.transfer(range(device, end), range(end, end + r))(nbytes)
                             if self._comm else 0.0)
        return out


def _solution(problem: _ReplicationOptions, realize: Realize, chain: StageChain) -> StateSolution:
    """The chain's plan on the profile `realize` lays it out on, priced by `evaluate_plan`."""
    profile, bounds = realize(chain.states)
    space = problem.space
    replication = tuple(problem.sizes[k] for k in chain.options)
    plan = PipelinePlan.linear(bounds, replication, microbatches=space.microbatches,
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
    problem = _ReplicationOptions(states, cluster, space, GroupPrices(cluster))
    solutions: dict[StageChain, StateSolution] = {}

    def solution_of(chain: StageChain) -> StateSolution:
        if chain not in solutions:
            solutions[chain] = _solution(problem, realize, chain)
        return solutions[chain]

    if space.objective is PipelineObjective.BOTTLENECK:
        found = least_bottleneck(problem)
        chain = None if found is None else found[1]
    else:
        chain = least_latency(
            problem, space.microbatches, lambda c: solution_of(c).solution.cost.latency,
            max_thresholds=space.max_thresholds, source=states.source,
        )
    if chain is None:
        raise NoFeasiblePlan(
            f"{states.source}: no plan of {states.n_layers} layers on {cluster.n_devices} "
            f"devices satisfies {space} (memory per device "
            f"{group_memory(cluster, range(cluster.n_devices)):.4g} bytes)"
        )
    return solution_of(chain)


def solve(profile: PipelineProfile, cluster: Cluster, space: PipelineSpace) -> Solution:
    """The plan of `space` that cuts the profile's layer chain with the least objective on
    `cluster`; raises `NoFeasiblePlan`."""

    def realize(chain: Sequence[int]) -> tuple[PipelineProfile, tuple[int, ...]]:
        return profile, tuple(chain)  # state p is the prefix [0, p)

    return solve_states(chain_states(profile), realize, cluster, space).solution
