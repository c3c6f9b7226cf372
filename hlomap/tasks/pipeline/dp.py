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
best L found (branch and bound on sorted candidates); L >= M tau* skips a microbatch count
after its MAX pass alone, and a bounded problem with no plan left skips it before any pass
(`any_plan`).

Cuts priced from the sending side (the joint task: `cut_depends_on_next` False) need no option
axis: `_run_shared` keeps per (q, a, d) the best suffix over the first stage's option, merges
the stage counts whose stages hold alike (`stage_counts`: under 1F1B every count from M on), and
computes only the cells a plan from device 0 can reach (a stage on device d starts at a state
no smaller than the fewest stages that reach d; a stage with q more after it ends q layers
before the last). Each is exact: the tests compare it with enumeration and with `_run`.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np

from hlomap.cost.cluster import Cluster, compute_slowdown
from hlomap.cost.pipeline.costs import CommModel, allreduce_share, evaluate_plan, sync_seconds
from hlomap.cost.pipeline.links import GroupPrices, group_memory, is_node_boundary
from hlomap.cost.pipeline.profile import SYNC_FIELDS, PipelineProfile, Prefix, replicated_seconds
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


def _stages(problem: StageOptions, mode: _Mode, tau: float, devices: Iterable[int],
            ) -> Iterator[tuple[int, int, int, np.ndarray]]:
    """(first device, option, device after the group, [a, b] stage times) of every group that
    may start on each of `devices`, in that order; under SUM, times above `tau` are inf."""
    for d in devices:
        for k, size in enumerate(problem.sizes):
            end = d + size
            if end > problem.n_devices:
                continue
            stage = problem.stage_seconds(d, k)
            if stage is None:
                continue
            yield d, k, end, (np.where(stage <= tau, stage, np.inf) if mode is _Mode.SUM else stage)


class _SharedPass(NamedTuple):
    """A pass of a problem whose cuts are priced from the sending side: per (q, a, d) only the
    best suffix over the first stage's option is kept (the stage before needs nothing more),
    with that option and the state its stage ends at."""

    value: np.ndarray  # T[q, a, d]
    option: np.ndarray  # its first stage's option (int16)
    next_state: np.ndarray  # the cut state its first stage ends at
    merged: bool  # the last stage-count index stands for that many stages after or more


def stage_counts(problem: StageOptions) -> tuple[int, bool]:
    """How many stage-count indices a pass needs, and whether the last one stands for "this many
    stages after, or more". A problem whose stages depend on the count after them only through
    what they hold (`saturated_stages`: from that count on, every stage holds the same, as
    1F1B's min(S - s, M) does from M on) needs no more indices: the plans of more stages are
    priced and checked alike, and no count limit is lost when `max_stages` is only what the
    layers and devices allow (`bounded_stages` False)."""
    stages = problem.max_stages
    saturated = getattr(problem, "saturated_stages", None)
    if saturated is None or getattr(problem, "bounded_stages", True):
        return stages, False
    needed = max(saturated + 1, 2)  # index 0 is the last stage itself, never merged
    return (stages, False) if needed >= stages else (needed, True)


#: Stage counts one step of the shared pass takes at once: its [counts, a, b] block is cut to the
#: states the smallest count leaves room for (b <= last - q), so small chunks waste few cells.
_COUNTS_PER_STEP = 16


def fewest_stages_before(problem: StageOptions) -> list[float]:
    """Per device d, the fewest stages (of sizes some group may start with) whose devices
    cover exactly [0, d): inf where no sequence of stages ends there."""
    devices, sizes = problem.n_devices, problem.sizes
    fewest = [0.0] + [math.inf] * devices
    for d in range(devices):
        if math.isinf(fewest[d]):
            continue
        for k, size in enumerate(sizes):
            if d + size <= devices and fewest[d] + 1 < fewest[d + size] and problem.stage_seconds(d, k) is not None:
                fewest[d + size] = fewest[d] + 1
    return fewest


#: The shared pass takes a stage table's band (b - a up to its width) instead of the whole
#: [a, b] block when the block is this many times wider.
_BAND_SHARE = 3


def stage_width(stage: np.ndarray) -> int:
    """The most layers a stage of this [a, b] table takes (b - a over its finite cells; 1 when
    none is finite)."""
    finite = np.isfinite(stage)
    if not finite.any():
        return 1
    a, b = np.nonzero(finite)
    return max(1, int((b - a).max()))


def _run_shared(problem: StageOptions, mode: _Mode, tau: float = math.inf, *, chains: bool = True,
                reach: Sequence[float] | None = None) -> _SharedPass:
    """`_run` for a problem whose cut times do not depend on the next stage's option: the
    suffix after a cut into device e is the best over its first option, T[q - 1, b, e], so per
    (q, a, d) only the best over d's options is stored: no option axis, and each (device,
    option) is combined with one tail (under SUM, u + min(T) = min(u + T); under MAX,
    max(u, min(T)) = min(max(u, T))). With merged stage counts (`stage_counts`) the top index
    Q - 1 takes its suffix from Q - 2 or Q - 1 alike.

    Only cells some plan from (state 0, device 0) can use are computed: a stage that starts on
    device d follows at least `fewest_stages_before(d)` stages of a layer each, so it starts at
    a state a >= that; a stage followed by q more ends at b <= last - q (each of them takes a
    layer). The others stay inf, which no reachable cell reads. A table whose stages take few
    layers is combined on its band b - a <= width only (`stage_width`). `reach`: the problem's
    `fewest_stages_before`, when the caller has it (every pass of one problem needs the same)."""
    count, devices = problem.n_states, problem.n_devices
    n_counts, merged = stage_counts(problem)
    last = count - 1
    shape = (n_counts, count, devices + 1)
    value = np.full(shape, np.inf)
    kept = shape if chains else (1, 1, 1)
    option_of = np.full(kept, -1, dtype=np.int16)
    next_state = np.full(kept, -1, dtype=np.int32)
    first = np.zeros(1, dtype=np.int64)
    every_count = np.arange(n_counts)
    per_step = max(1, min(_COUNTS_PER_STEP, _CHUNK_CELLS // (count * count)))
    reach = fewest_stages_before(problem) if reach is None else reach
    tails: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def keep(q: slice | int, rows: slice, d: int, k: int, best: np.ndarray, j: np.ndarray) -> None:
        """Fold option k's best values (and the states its stage ends at) into T[q, rows, d]."""
        better = best < value[q, rows, d]
        value[q, rows, d] = np.where(better, best, value[q, rows, d])
        if chains:
            option_of[q, rows, d] = np.where(better, k, option_of[q, rows, d])
            next_state[q, rows, d] = np.where(better, j, next_state[q, rows, d])

    # a stage on device d starts no earlier than the fewest stages that reach d (a layer each)
    reachable = [d for d in range(devices - 1, -1, -1) if reach[d] < last]
    for d, k, end, stage in _stages(problem, mode, tau, reachable):
        a0 = int(reach[d])
        from_a0 = slice(a0, count)
        if end == devices or not problem.use_all_devices:  # a last stage: q = 0
            fits = problem.fits(d, k, first)
            alone = stage[from_a0, last]
            if fits is not None:
                alone = np.where(fits[0][from_a0, last], alone, np.inf)
            keep(0, from_a0, d, k, alone, np.full(len(alone), last))
        if n_counts < 2 or end >= devices:
            continue
        if end not in tails:
            after = value[:-1, :, end].copy()  # [Q - 1, b]: suffixes for q = 1 .. Q - 1
            if merged:
                after[-1] = np.minimum(after[-1], value[-1, :, end])
            tails[end] = (after, np.flatnonzero(np.isfinite(after).any(axis=1)))
        after, live = tails[end]
        if not len(live):
            continue
        u = problem.cut_seconds(d, k)
        if u is None:
            continue
        u = u[:, 0]
        if mode is _Mode.SUM:
            u = np.where(u <= tau, 2 * u, np.inf)
        fits_all = problem.fits(d, k, every_count)
        # the most layers a stage of this table takes (a problem whose tables do not change
        # with the device knows it once per option)
        width = problem.stage_width(d, k) if hasattr(problem, "stage_width") else stage_width(stage)
        for lo in range(int(live[0]), int(live[-1]) + 1, per_step):
            hi = min(lo + per_step, int(live[-1]) + 1)  # tail rows [lo, hi): counts lo + 1 .. hi
            b_hi = last - (lo + 1)  # the fewest counts of the chunk leave the most layers
            if b_hi <= a0:
                break
            a_rows = slice(a0, b_hi)
            if width * _BAND_SHARE < b_hi - a0:
                # few layers fit a stage of this option: only the band b in (a, a + width]
                starts = np.arange(a0, b_hi)
                ends = starts[:, None] + 1 + np.arange(width)[None, :]  # [a, j]: b = a + 1 + j
                inside = ends <= b_hi
                ends = np.minimum(ends, b_hi)
                cost = np.where(inside, stage[starts[:, None], ends], np.inf)[None]  # [1, a, j]
                if fits_all is not None:
                    cost = np.where(fits_all[lo + 1:hi + 1][:, starts[:, None], ends], cost, np.inf)
                total = _combine(mode, cost, _combine(mode, u[ends][None], after[lo:hi][:, ends]))
                j = np.argmin(total, axis=-1)
                best = np.take_along_axis(total, j[..., None], axis=-1)[..., 0]
                keep(slice(lo + 1, hi + 1), a_rows, d, k, best, j + starts[None, :] + 1)
                continue
            b_cols = slice(a0 + 1, b_hi + 1)
            best_next = _combine(mode, u[None, b_cols], after[lo:hi, b_cols])  # [L, b]
            cost = stage[None, a_rows, b_cols]
            if fits_all is not None:
                cost = np.where(fits_all[lo + 1:hi + 1, a_rows, b_cols], cost, np.inf)
            total = _combine(mode, cost, best_next[:, None, :])  # [L, a, b]
            j = np.argmin(total, axis=-1)
            best = np.take_along_axis(total, j[..., None], axis=-1)[..., 0]
            keep(slice(lo + 1, hi + 1), a_rows, d, k, best, j + a0 + 1)
    return _SharedPass(value, option_of, next_state, merged)


def holds_monotonically(problem: StageOptions) -> bool:
    """A stage's memory check only gets harder with more stages after it (`fits` is monotone
    in the count: stages hold no fewer microbatches with more after them), as under 1F1B and
    GPipe; problems that do not say so are not assumed to."""
    return bool(getattr(problem, "monotone_in_stages", False))


def any_plan(problem: StageOptions, reach: Sequence[float] | None = None) -> bool:
    """Whether any plan of the shared-cut problem exists (a plan from device 0 whose stages and
    cuts are all finite and fit), without a stage-count axis: with memory monotone in the count
    after a stage (`holds_monotonically`), the suffix of fewest stages from a cut is the easiest
    for every stage before it, so H[a, d], the fewest stages of a plan's suffix from state a on
    device d, decides. A fraction of a pass's work; a bounded problem with none left is ruled
    out without one. `reach` as for `_run_shared`."""
    count, devices = problem.n_states, problem.n_devices
    n_counts, _ = stage_counts(problem)
    last = count - 1
    fewest = np.full((count, devices + 1), np.inf)  # H[a, d]
    reach = fewest_stages_before(problem) if reach is None else reach
    reachable = [d for d in range(devices - 1, -1, -1) if reach[d] < last]
    first = np.zeros(1, dtype=np.int64)
    every_count = np.arange(n_counts)
    for d, k, end, stage in _stages(problem, _Mode.MAX, math.inf, reachable):
        a0 = int(reach[d])
        if end == devices or not problem.use_all_devices:  # a last stage
            fits = problem.fits(d, k, first)
            alone = np.isfinite(stage[a0:, last]) & (True if fits is None else fits[0][a0:, last])
            fewest[a0:, d] = np.where(alone, np.minimum(fewest[a0:, d], 1.0), fewest[a0:, d])
        if end >= devices:
            continue
        after = fewest[:, end]  # [b]: the fewest stages from a cut at b
        u = problem.cut_seconds(d, k)
        if u is None or not np.isfinite(after).any():
            continue
        usable = np.isfinite(after) & np.isfinite(u[:, 0])
        counts = np.minimum(np.where(usable, after, 0), n_counts - 1).astype(np.int64)  # stages after this one
        ok = np.isfinite(stage[a0:, :]) & usable[None, :]
        fits = problem.fits(d, k, every_count)
        if fits is not None:
            ok &= fits[counts[None, :], np.arange(a0, count)[:, None], np.arange(count)[None, :]]
        through = np.where(ok, 1.0 + after[None, :], np.inf).min(axis=1)
        fewest[a0:, d] = np.minimum(fewest[a0:, d], through)
    return bool(np.isfinite(fewest[0, 0]))


def _best_shared_chain(problem: StageOptions, result: _SharedPass) -> tuple[float, StageChain | None]:
    """The least T[q, 0, 0] over stage counts, and its chain (a merged top count takes its next
    stage's count from whichever of Q - 2 and Q - 1 was its suffix)."""
    start = result.value[:, 0, 0]
    if not np.isfinite(start).any():
        return math.inf, None
    q = int(np.argmin(start))
    best = float(start[q])
    states, options = [0], []
    state, device, top = 0, 0, len(start) - 1
    while True:
        k = int(result.option[q, state, device])
        nxt = int(result.next_state[q, state, device])
        options.append(k)
        states.append(nxt)
        if q == 0:
            break
        device += problem.sizes[k]
        # a merged top count stays there when its suffix came from the top count itself
        if not (result.merged and q == top and result.value[top, nxt, device] < result.value[top - 1, nxt, device]):
            q -= 1
        state = nxt
    return best, StageChain(tuple(states), tuple(options))


def _run(problem: StageOptions, mode: _Mode, tau: float = math.inf, *, chains: bool = True) -> _Pass:
    """One DP pass (module docstring); `tau` masks stage and cut times in SUM mode. Stage
    counts q are an array axis: F[q, ., d, .] needs F[q - 1, ., e, .] for e > d only, all
    done when devices go right to left. Without `chains` only the values are kept (the MAX
    pass's bottleneck needs no plan). Problems whose cuts do not depend on the next stage's
    option take `_run_shared` instead."""
    count, devices, sizes = problem.n_states, problem.n_devices, problem.sizes
    stages, last = problem.max_stages, problem.n_states - 1
    shape = (stages, count, devices + 1, len(sizes))
    value = np.full(shape, np.inf)
    kept = shape if chains else (1, 1, 1, 1)
    next_state = np.full(kept, -1, dtype=np.int32)
    next_option = np.full(kept, -1, dtype=np.int32)
    first = np.zeros(1, dtype=np.int64)
    per_chunk = max(1, _CHUNK_CELLS // (count * count))  # stage counts done at once
    for d, k, end, stage in _stages(problem, mode, tau, range(devices - 1, -1, -1)):
        if end == devices or not problem.use_all_devices:  # a last stage: q = 0
            fits = problem.fits(d, k, first)
            cost = stage if fits is None else np.where(fits[0], stage, np.inf)
            value[0, :, d, k] = cost[:, last]
        if stages < 2 or end >= devices:
            continue
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


def _shares_cuts(problem: StageOptions) -> bool:
    """The problem prices a cut from its sending side, whatever the next stage's option."""
    return not getattr(problem, "cut_depends_on_next", True)


def _reach(problem: StageOptions) -> list[float] | None:
    """What every shared pass of `problem` needs alike (`fewest_stages_before`), worked out once
    per search; None for the general pass, which does not use it."""
    return fewest_stages_before(problem) if _shares_cuts(problem) else None


def _least_max(problem: StageOptions, reach: Sequence[float] | None = None) -> float:
    if _shares_cuts(problem):
        start = _run_shared(problem, _Mode.MAX, chains=False, reach=reach).value[:, 0, 0]
    else:
        start = _run(problem, _Mode.MAX, chains=False).value[:, 0, 0]
    return float(start.min()) if np.isfinite(start).any() else math.inf


def _least_sum(problem: StageOptions, tau: float = math.inf,
               reach: Sequence[float] | None = None) -> tuple[float, StageChain | None]:
    if _shares_cuts(problem):
        return _best_shared_chain(problem, _run_shared(problem, _Mode.SUM, tau, reach=reach))
    return _best_chain(problem, _run(problem, _Mode.SUM, tau))


def least_bottleneck(problem: StageOptions) -> tuple[float, StageChain] | None:
    """The least bottleneck tau* and, among plans within it, the one of least sum (None when no
    plan exists)."""
    reach = _reach(problem)
    tau_star = _least_max(problem, reach)
    if not math.isfinite(tau_star):
        return None
    _, chain = _least_sum(problem, tau_star * (1 + TIE_RTOL), reach)
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
    reach = _reach(problem)
    if reach is not None and holds_monotonically(problem) and not any_plan(problem, reach):
        return None  # nothing left (a bounded problem leaves out what cannot beat the bound)
    tau_star = _least_max(problem, reach)
    if not math.isfinite(tau_star):
        return None
    m = microbatches
    if m * tau_star >= bound:  # L >= sum + (M - 1) max >= M max >= M tau*
        return None
    least_sum, unconstrained = _least_sum(problem, reach=reach)
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

    consider(_least_sum(problem, tau_star * (1 + TIE_RTOL), reach)[1])
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
            total, chain = _least_sum(problem, tau, reach)
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
    update_per_byte: the optimizer update's seconds per step per parameter byte on one device
      (`PipelineProfile.update_seconds_per_byte`).
    """

    totals: Prefix
    nested: np.ndarray
    cut_bytes: np.ndarray
    n_layers: int
    source: str
    update_per_byte: float = 0.0

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
        update_per_byte=profile.update_seconds_per_byte,
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
    fixed: np.ndarray = field(init=False)  # the part of compute a batch split leaves on every replica
    syncs: dict[str, np.ndarray] = field(init=False)  # the in-pass all-reduces' counts and bytes, by direction
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
        object.__setattr__(self, "fixed", _pair(totals.fixed))
        object.__setattr__(self, "syncs", {name: _pair(getattr(totals, name)) for name in SYNC_FIELDS})
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
        """Compute on each of r replicas (`replicated_seconds`: its fixed part whole, the rest / r)
        plus the all-reduces its passes run over them (`costs.stage_sync_seconds`), plus the
        stage's gradient all-reduce amortized over the microbatches, or
        all of it per microbatch where the executors sync every microbatch
        (`costs.allreduce_share`, `links.allreduce_time`), plus its optimizer update amortized
        (each replica updates all the stage's parameters once per step)."""
        r = self.sizes[option]
        slowdown = compute_slowdown(self.cluster, range(device, device + r))
        t = replicated_seconds(self.compute, self.fixed, r) * slowdown
        if self.states.update_per_byte:  # every replica updates all of the stage's parameters
            t = t + self.parameter * (self.states.update_per_byte * slowdown / self.space.microbatches)
        if self._comm and r > 1:
            allreduce = self.prices.allreduce(range(device, device + r))
            t = t + allreduce_share(self.prices.cluster, allreduce(self.parameter), self.space.microbatches)
            # the passes' own all-reduces, every microbatch (`costs.stage_sync_seconds`)
            t = t + sync_seconds(allreduce, self.syncs["forward_syncs"], self.syncs["forward_sync_bytes"])
            t = t + sync_seconds(allreduce, self.syncs["backward_syncs"], self.syncs["backward_sync_bytes"])
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
