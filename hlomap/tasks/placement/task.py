"""Device placement as a `hlomap.search` task: every driver (greedy, random, exact, ppo, identity)
searches it under one budget, tracker and result record.

Decisions: a permutation `order` of every device of the cluster; slot i < n holds the device of
logical position i, slots >= n the unused devices (so moving a position onto an unused device is a
swap, as in `objective`). The score is the speedup over the plan as given, `identity / step` (> 0,
1 for the identity), and its tie-break the negated plateau measure of `objective` relative to the
identity's step: so scores compare on one scale for any cluster.

Starts (`starts`, `construct.structured_starts`): the identity, walks over the topology coordinates
and mesh-axis nestings over them, recursive bisection and the constructive placement; the greedy
driver (and the PPO driver's polish) scores them and descends from the best.

Moves (the greedy driver's iterated local search, `LocalSearchTask`): a sweep visits positions,
the most expensive under the affinity proxy first; each tries swapping with the `NEAREST`
devices the proxy makes cheapest plus `RANDOM` random slots, priced incrementally
(`objective.SearchState.try_swap`); the proxy's change tells equal step times apart. A kick swaps
`max(2, n / 32)` random pairs of slots.

Exact: every permutation of the devices (Heap's algorithm: one swap per permutation, each priced
incrementally) up to `EXACT_LIMIT`; the objective is not linear in the assignment (rings are as
slow as their slowest hop, groups as their slowest pair, NIC sharing depends on how groups spread
over nodes), so there is no compact MILP of it.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np

from hlomap.search.score import Score
from hlomap.search.tracker import Tracker
from hlomap.tasks.placement.construct import structured_starts
from hlomap.tasks.placement.objective import Affinity, SearchState, affinity, new_state
from hlomap.tasks.placement.problem import PlacementError, PlacementProblem

__all__ = ["EXACT_LIMIT", "PlacedOrder", "PlacementTask", "PlacementTooLarge", "SwapNeighbourhood"]

#: Most permutations the exact driver enumerates (8! = 40320).
EXACT_LIMIT = 40_320
#: Candidate devices a position tries per sweep: the cheapest by affinity, plus random slots.
NEAREST = 8
RANDOM = 4


class PlacementTooLarge(PlacementError):
    """The exact driver was asked for more permutations than it enumerates."""


class PlacedOrder(NamedTuple):
    """A placement (`devices[i]`: device of logical position i) and its step time against the
    plan as given, both priced from scratch: what a search's `SearchResult.plan` holds."""

    devices: tuple[int, ...]
    step_seconds: float
    identity_seconds: float

    @property
    def gain(self) -> float:
        """Fraction of the identity's step time the placement saves."""
        return 1.0 - self.step_seconds / self.identity_seconds if self.identity_seconds > 0 else 0.0


class SwapNeighbourhood:
    """Pairwise swaps of slots, priced incrementally (module docstring)."""

    def __init__(self, task: PlacementTask, state: SearchState) -> None:
        self.task, self.state = task, state
        self.problem = state.problem

    @property
    def decisions(self) -> np.ndarray:
        return self.state.order

    @property
    def score(self) -> Score:
        return self.task.score_of(self.state.value, self.state.tiebreak)

    def sweep(self, rng: np.random.Generator) -> Iterator[Sequence[tuple[int, int]]]:
        aff, state = self.task.affinity, self.state
        n, d = self.problem.n_positions, self.problem.n_devices
        nearest = min(NEAREST, d - 1)
        slot_of = np.empty(d, dtype=np.int64)
        own = np.array([aff.increments(p, state.order)[state.order[p]] for p in range(n)])
        for a in np.argsort(-own, kind="stable"):
            a = int(a)
            cost = aff.increments(a, state.order)
            cost[state.order[a]] = np.inf
            closest = np.argpartition(cost, nearest - 1)[:nearest] if nearest < d else np.arange(d)
            slot_of[state.order] = np.arange(d)  # earlier groups' swaps moved devices
            slots = set(slot_of[closest].tolist())
            if d > nearest + 1:
                slots |= set(rng.integers(0, d, RANDOM).tolist())
            slots.discard(a)
            yield [(a, b) for b in sorted(slots) if a < n or b < n]

    def try_move(self, move: tuple[int, int]) -> tuple[Score, float]:
        self.task.evaluations += 1
        value, tiebreak = self.state.try_swap(*move)
        return self.task.score_of(value, tiebreak), self.task.affinity.swap_delta(self.state.order, *move)

    def apply(self, move: tuple[int, int]) -> None:
        self.state.swap(*move)


class PlacementTask:
    """`PlacementProblem` as a `SearchTask` and `LocalSearchTask` (module docstring)."""

    reward = "speedup"

    def __init__(self, problem: PlacementProblem) -> None:
        self.problem = problem
        self.evaluations = 0
        self.identity = problem.full_order(problem.identity)
        self.identity_seconds = float(new_state(problem, self.identity).value)
        self._affinity: Affinity | None = None

    @property
    def affinity(self) -> Affinity:
        """The pairwise proxy (built on first use: the random driver never needs it)."""
        if self._affinity is None:
            self._affinity = affinity(self.problem)
        return self._affinity

    def score_of(self, seconds: float, tiebreak: float) -> Score:
        """The score of a placement of step time `seconds` and plateau measure `tiebreak`."""
        scale = self.identity_seconds if self.identity_seconds > 0 else 1.0
        speedup = self.identity_seconds / seconds if seconds > 0 else 1.0
        return Score(speedup, -tiebreak / scale, step_time=float(seconds))

    # -- the search protocol --------------------------------------------------------------------
    @property
    def episode_length(self) -> int:
        return self.problem.n_positions

    def make_env(self) -> Any:
        from hlomap.tasks.placement.ppo import PlacementEnv

        return PlacementEnv(self.problem, task=self)

    def default_dqn_config(self, budget: Any) -> Any:
        raise TypeError("placement is searched by greedy, random, exact, ppo or identity, not dqn")

    def initial(self) -> np.ndarray:
        return self.identity.copy()

    def trivial_plan(self) -> np.ndarray:
        return self.identity.copy()

    def score(self, decisions: np.ndarray) -> Score:
        self.evaluations += 1
        state = new_state(self.problem, decisions)
        return self.score_of(state.value, state.tiebreak)

    def score_many(self, decisions: np.ndarray) -> list[Score]:
        return [self.score(row) for row in decisions]

    def plan_of(self, decisions: np.ndarray) -> PlacedOrder:
        devices = tuple(int(d) for d in decisions[: self.problem.n_positions])
        return PlacedOrder(devices, float(new_state(self.problem, decisions).value), self.identity_seconds)

    def neighbours(self, decisions: np.ndarray) -> np.ndarray:
        raise TypeError("placement's moves are priced incrementally: search it through neighbourhood()")

    def fine_tune_moves(self, best: np.ndarray, start: int) -> Iterator[tuple[int, np.ndarray]]:
        return iter(())

    def sample(self, rng: np.random.Generator, num: int) -> np.ndarray:
        return np.stack([rng.permutation(self.problem.n_devices) for _ in range(num)])

    def known_optimum(self) -> Score | None:
        return None

    def plan_count(self) -> int | None:
        return None

    def solve_exactly(self, tracker: Tracker, *, limit: int = EXACT_LIMIT) -> None:
        """Every permutation of the devices (Heap's algorithm); `tracker.optimal` when all were
        priced within the budget."""
        d = self.problem.n_devices
        if math.factorial(d) > limit:
            count = math.factorial(d)
            count_text = str(count) if count < 10**12 else f"about 10^{len(str(count)) - 1}"
            raise PlacementTooLarge(f"exact placement enumerates {d}! = {count_text} permutations of the "
                                    f"devices of {self.problem.cluster.name!r}, more than its limit {limit}; "
                                    "use greedy")
        hood = self.neighbourhood(self.identity)
        tracker.record(hood.decisions, hood.score)
        counters = [0] * d
        i, complete = 1, True
        while i < d:
            if counters[i] < i:
                move = (0 if i % 2 == 0 else counters[i], i)
                self.evaluations += 1
                hood.apply(move)
                tracker.record(hood.decisions, hood.score)
                counters[i] += 1
                i = 1
                if tracker.exhausted():
                    complete = False
                    break
            else:
                counters[i] = 0
                i += 1
        tracker.optimal = complete

    # -- the local-search protocol --------------------------------------------------------------
    def starts(self) -> list[np.ndarray]:
        return structured_starts(self.problem, self.affinity)

    def neighbourhood(self, decisions: np.ndarray) -> SwapNeighbourhood:
        self.evaluations += 1
        return SwapNeighbourhood(self, new_state(self.problem, np.array(decisions, dtype=np.int64, copy=True)))

    def perturb(self, decisions: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
        d = self.problem.n_devices
        if d <= 2:
            return None
        order = np.array(decisions, copy=True)
        for _ in range(max(2, self.problem.n_positions // 32)):
            a, b = rng.choice(d, 2, replace=False)
            order[a], order[b] = order[b], order[a]
        return order
