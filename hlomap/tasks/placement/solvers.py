"""Placement solvers: identity, random sampling, greedy construction + local search, exhaustive.

- identity: the plan's own order (linear device ids), the reference every gain is measured from.
- random: uniformly random placements, the best of as many as the budget allows.
- greedy: the best of the structured starts (the identity; for a mesh, every nesting order of its
  axes, `cost.mapping.axis_devices`) and a constructive placement that puts positions, most
  connected first, each on the free device closest to its already placed partners (`Affinity`),
  followed by local search over pairwise swaps: each position tries the devices its partners
  make cheapest plus a few random ones, best improving swap first, priced incrementally
  (`objective`). When no swap improves, it perturbs the best placement with a few random swaps
  and searches again until the budget ends or `PATIENCE` restarts in a row found nothing better
  (iterated local search). Parmesan's mapping is a
  constructive greedy refined by swaps in the same spirit.
- exact: every permutation of the devices (Heap's algorithm: one swap per permutation, so each
  is priced incrementally), for small clusters; the optimum, checked against brute force over
  `problem.step_seconds` in the tests.

The objective is not linear in the assignment (rings are as slow as their slowest hop, groups as
their slowest pair, hierarchical collectives and NIC sharing depend on how groups spread over
nodes), so there is no compact MILP of it; the exhaustive solver is the exact one, for up to
`EXACT_LIMIT` permutations.
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from hlomap.cost.mapping import axis_devices
from hlomap.search.tracker import Budget
from hlomap.tasks.placement.objective import Affinity, SearchState, affinity, new_state
from hlomap.tasks.placement.problem import MeshLayout, PlacementError, PlacementProblem

__all__ = ["EXACT_LIMIT", "PlacementResult", "PlacementTooLarge", "Solver", "SolverClock", "construct",
           "placement_order",
           "exact_search", "greedy_search", "identity", "local_search", "random_search", "solve"]

log = logging.getLogger(__name__)

#: Most permutations the exact solver enumerates (8! = 40320).
EXACT_LIMIT = 40_320
#: Candidate devices a position tries per local-search visit: the cheapest by affinity, plus random.
NEAREST_CANDIDATES = 8
RANDOM_CANDIDATES = 4
#: Perturbed restarts in a row without a better placement after which the greedy solver stops
#: before its budget ends.
PATIENCE = 50
#: Relative tolerance under which two step times count as equal.
RTOL = 1e-12


class Solver(str, enum.Enum):
    IDENTITY = "identity"
    RANDOM = "random"
    GREEDY = "greedy"
    EXACT = "exact"
    PPO = "ppo"

    def __str__(self) -> str:
        return self.value


class PlacementTooLarge(PlacementError):
    """The exact solver was asked for more permutations than it enumerates."""


@dataclass(frozen=True)
class PlacementResult:
    """A placement (`devices[i]`: device of logical position i), its estimated step time, the
    identity's, and what the search spent."""

    solver: Solver
    devices: tuple[int, ...]
    step_seconds: float
    identity_seconds: float
    evaluations: int
    seconds: float
    optimal: bool = False
    notes: tuple[str, ...] = field(default=())

    @property
    def gain(self) -> float:
        """Fraction of the identity's step time the placement saves."""
        return 1.0 - self.step_seconds / self.identity_seconds if self.identity_seconds > 0 else 0.0


class SolverClock:
    """A budget being spent: wall-clock seconds and evaluations (one swap tried, or one
    placement priced from scratch)."""

    def __init__(self, budget: Budget):
        self.budget = budget
        self.start = time.perf_counter()
        self.evaluations = 0

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def spend(self, evaluations: int = 1) -> None:
        self.evaluations += evaluations

    def exhausted(self) -> bool:
        if self.budget.evaluations is not None and self.evaluations >= self.budget.evaluations:
            return True
        return self.budget.seconds is not None and self.seconds >= self.budget.seconds


def better(value: float, tiebreak: float, than_value: float, than_tiebreak: float) -> bool:
    """Strictly lower step time, or an equal one with a lower tiebreak."""
    if value < than_value * (1 - RTOL):
        return True
    return value <= than_value * (1 + RTOL) and tiebreak < than_tiebreak * (1 - RTOL)


def _improves(value: float, tiebreak: float, proxy_delta: float, than: tuple[float, float, float]) -> bool:
    """Lexicographic: step time, then the state's tiebreak, then the affinity proxy's change (a
    ring as slow as its slowest hop only speeds up once its last slow hop goes, so the swaps
    before that are told apart by the proxy alone)."""
    value_0, tiebreak_0, delta_0 = than
    if value < value_0 * (1 - RTOL):
        return True
    if value > value_0 * (1 + RTOL):
        return False
    if tiebreak < tiebreak_0 - RTOL * abs(tiebreak_0):
        return True
    if tiebreak > tiebreak_0 + RTOL * abs(tiebreak_0):
        return False
    return proxy_delta < delta_0 - 1e-15


def _result(problem: PlacementProblem, solver: Solver, state: SearchState, identity_seconds: float,
            clock: SolverClock, *, optimal: bool = False, notes: Sequence[str] = ()) -> PlacementResult:
    devices = tuple(int(d) for d in state.order[: problem.n_positions])
    return PlacementResult(solver, devices, float(state.value), identity_seconds, clock.evaluations, clock.seconds,
                           optimal, tuple(notes))


def identity(problem: PlacementProblem) -> PlacementResult:
    clock = SolverClock(Budget(None, None))
    state = new_state(problem)
    clock.spend()
    return _result(problem, Solver.IDENTITY, state, state.value, clock)


# ---------------------------------------------------------------------------------------------
# Random
# ---------------------------------------------------------------------------------------------


def random_search(problem: PlacementProblem, budget: Budget, seed: int = 0) -> PlacementResult:
    """The best of uniformly random placements drawn until the budget ends (at least one)."""
    budget.require_limit("random")
    clock = SolverClock(budget)
    rng = np.random.default_rng(seed)
    reference = new_state(problem)
    clock.spend()
    best: SearchState | None = None
    while best is None or not clock.exhausted():
        state = new_state(problem, rng.permutation(problem.n_devices))
        clock.spend()
        if best is None or better(state.value, state.tiebreak, best.value, best.tiebreak):
            best = state
    return _result(problem, Solver.RANDOM, best, reference.value, clock)


# ---------------------------------------------------------------------------------------------
# Greedy: structured starts, construction, local search
# ---------------------------------------------------------------------------------------------


def _scalar_weights(problem: PlacementProblem, aff: Affinity) -> list[np.ndarray]:
    """Each position's affinity to each neighbour as one number (weights at mean link speeds)."""
    off = ~np.eye(problem.n_devices, dtype=bool)
    mean_latency = float(aff.latency[off].mean()) if off.any() else 0.0
    mean_inverse = float(aff.inverse_bandwidth[off].mean()) if off.any() else 0.0
    return [wl * mean_latency + wb * mean_inverse for wl, wb in zip(aff.w_latency, aff.w_bytes)]


def placement_order(problem: PlacementProblem, aff: Affinity) -> np.ndarray:
    """The order a constructive placement visits positions: Prim's order from position 0, the
    next position being the one most attached to those already placed (scalar affinity at mean
    link speeds). It depends only on which positions are placed, not on their devices."""
    n = problem.n_positions
    weights = _scalar_weights(problem, aff)
    placed = np.zeros(n, dtype=bool)
    pull = np.full(n, -1.0)
    order = []
    p = 0
    for _ in range(n):
        order.append(p)
        placed[p] = True
        nb = aff.neighbors[p]
        pull[nb] = np.maximum(pull[nb], 0.0) + weights[p]
        if len(order) < n:
            p = int(np.argmax(np.where(placed, -np.inf, pull)))
    return np.asarray(order, dtype=np.int64)


def construct(problem: PlacementProblem, aff: Affinity | None = None, *,
              first_device: int | None = None) -> np.ndarray:
    """A constructive placement: positions in `placement_order`, each on the free device that
    adds the least affinity cost to its placed partners; ties go to the lowest device id (the
    first position goes to its identity device). Returns a full order of all devices."""
    aff = aff or affinity(problem)
    n, d = problem.n_positions, problem.n_devices
    devices = np.zeros(d, dtype=np.int64)
    placed = np.zeros(d, dtype=bool)   # indexed by slot (slots >= n are never placed)
    free = np.ones(d, dtype=bool)      # indexed by device
    for step, p in enumerate(placement_order(problem, aff)):
        if step == 0:
            device = problem.identity[0] if first_device is None else first_device
        else:
            device = int(np.argmin(np.where(free, aff.increments(p, devices, placed), np.inf)))
        devices[p] = device
        placed[p] = True
        free[device] = False
    devices[n:] = np.flatnonzero(free)
    return devices


def _starts(problem: PlacementProblem, aff: Affinity) -> list[np.ndarray]:
    """The identity, every nesting order of a mesh's axes, and the constructive placement."""
    starts = [problem.full_order(problem.identity)]
    layout = problem.layout
    if isinstance(layout, MeshLayout) and len(layout.axes) > 1:
        names = [name for name, _ in layout.axes]
        for order in itertools.permutations(names):
            mapping = axis_devices(problem.cluster, dict(layout.axes), order=order, devices=problem.identity)
            starts.append(problem.full_order(mapping.devices.reshape(-1).tolist()))
    starts.append(construct(problem, aff))
    return starts


def local_search(state: SearchState, aff: Affinity, clock: SolverClock, rng: np.random.Generator) -> bool:
    """Best-improving pairwise swaps until none improves or the budget ends; True when it
    reached a local optimum (of the candidate neighbourhood) rather than the budget."""
    problem = state.problem
    n, d = problem.n_positions, problem.n_devices
    nearest = min(NEAREST_CANDIDATES, d - 1)
    while True:
        improved = False
        slot_of = np.empty(d, dtype=np.int64)
        slot_of[state.order] = np.arange(d)
        # Visit the positions that cost the most first.
        own = np.array([aff.increments(p, state.order)[state.order[p]] for p in range(n)])
        for a in np.argsort(-own, kind="stable"):
            a = int(a)
            cost = aff.increments(a, state.order)
            cost[state.order[a]] = np.inf
            closest = np.argpartition(cost, nearest - 1)[:nearest] if nearest < d else np.arange(d)
            slots = set(slot_of[closest].tolist())
            if d > nearest + 1:
                slots |= set(rng.integers(0, d, RANDOM_CANDIDATES).tolist())
            slots.discard(a)
            best_b, best = -1, (state.value, state.tiebreak, 0.0)
            for b in sorted(slots):
                if a >= n and b >= n:
                    continue
                value, tiebreak = state.try_swap(a, b)
                clock.spend()
                candidate = (value, tiebreak, aff.swap_delta(state.order, a, b))
                if _improves(*candidate, than=best):
                    best_b, best = b, candidate
                if clock.exhausted():
                    break
            if best_b >= 0:
                state.swap(a, best_b)
                slot_of[state.order[a]], slot_of[state.order[best_b]] = a, best_b
                improved = True
            if clock.exhausted():
                return False
        if not improved:
            return True


def greedy_search(problem: PlacementProblem, budget: Budget, seed: int = 0, *,
                  starts: Sequence[np.ndarray] | None = None, solver: Solver = Solver.GREEDY) -> PlacementResult:
    """Structured starts and construction, local search, then iterated local search (module
    docstring) until the budget ends; without a budget, one local search to its optimum."""
    clock = SolverClock(budget)
    rng = np.random.default_rng(seed)
    aff = affinity(problem)
    reference = new_state(problem)
    clock.spend()
    candidates = [new_state(problem, order) for order in (starts if starts is not None else _starts(problem, aff))]
    clock.spend(len(candidates))
    state = min(candidates, key=lambda s: (s.value, s.tiebreak))
    converged = local_search(state, aff, clock, rng)
    best_order, best = state.order.copy(), (state.value, state.tiebreak)
    restarts = stale = 0
    n = problem.n_positions
    kicks = max(2, n // 32)
    while (converged and not budget.unlimited and not clock.exhausted() and problem.n_devices > 2
           and stale < PATIENCE):
        restarts += 1
        stale += 1
        order = best_order.copy()
        for _ in range(kicks):
            a, b = rng.choice(problem.n_devices, 2, replace=False)
            order[a], order[b] = order[b], order[a]
        state = new_state(problem, order)
        clock.spend()
        converged = local_search(state, aff, clock, rng)
        if better(state.value, state.tiebreak, *best):
            best_order, best = state.order.copy(), (state.value, state.tiebreak)
            stale = 0
    final = new_state(problem, best_order)
    return _result(problem, solver, final, reference.value, clock, notes=(f"{restarts} restarts",))


# ---------------------------------------------------------------------------------------------
# Exact
# ---------------------------------------------------------------------------------------------


def exact_search(problem: PlacementProblem, budget: Budget = Budget(None, None), *,
                 limit: int = EXACT_LIMIT) -> PlacementResult:
    """The optimum over every permutation of the devices (Heap's algorithm). Raises
    PlacementTooLarge above `limit` permutations; a budget that runs out first returns the best
    so far, not marked optimal."""
    d = problem.n_devices
    if math.factorial(d) > limit:
        raise PlacementTooLarge(f"exact placement enumerates {d}! = {math.factorial(d)} permutations of the "
                                f"devices of {problem.cluster.name!r}, more than its limit {limit}; use greedy")
    clock = SolverClock(budget)
    state = new_state(problem)
    reference = state.value
    clock.spend()
    best_order, best = state.order.copy(), (state.value, state.tiebreak)
    counters = [0] * d
    i, complete = 1, True
    while i < d:
        if counters[i] < i:
            a = 0 if i % 2 == 0 else counters[i]
            state.swap(a, i)
            clock.spend()
            if better(state.value, state.tiebreak, *best):
                best_order, best = state.order.copy(), (state.value, state.tiebreak)
            counters[i] += 1
            i = 1
            if clock.exhausted():
                complete = False
                break
        else:
            counters[i] = 0
            i += 1
    final = new_state(problem, best_order)
    return _result(problem, Solver.EXACT, final, reference, clock, optimal=complete)


# ---------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------


def solve(problem: PlacementProblem, solver: Solver | str, budget: Budget = Budget(60.0, None), seed: int = 0,
          **options: object) -> PlacementResult:
    """Place `problem` with `solver` under `budget`. Options: `policy` (a path or a loaded
    placement policy) and `finetune_seconds` for ppo."""
    solver = Solver(solver)
    runners: dict[Solver, Callable[[], PlacementResult]] = {
        Solver.IDENTITY: lambda: identity(problem),
        Solver.RANDOM: lambda: random_search(problem, budget, seed),
        Solver.GREEDY: lambda: greedy_search(problem, budget, seed),
        Solver.EXACT: lambda: exact_search(problem, budget),
    }
    if solver is Solver.PPO:
        from hlomap.tasks.placement.ppo import ppo_search

        return ppo_search(problem, budget, seed, **options)  # type: ignore[arg-type]
    return runners[solver]()
