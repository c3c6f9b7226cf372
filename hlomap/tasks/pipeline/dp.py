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
best L found (branch and bound on sorted candidates; a pass at tau whose plan's own max is
tau' gives SUM on every candidate in [tau', tau] at once; candidates equal but for rounding,
within TIE_RTOL, share one pass at the largest, the bound taking the least, so the latency
found is the optimum to within that rounding); L >= M tau* skips a microbatch count
after its MAX pass alone, and a bounded problem whose stages cannot cover the layers with the
devices there are skips it before any pass (`device_budgets`).

Cuts priced from the sending side (the joint task: `cut_depends_on_next` False) need no option
axis: `_run_shared` keeps per (q, a, d) the best suffix over the first stage's option, merges
the stage counts whose stages hold alike (`stage_counts`: under 1F1B every count from M on), and
computes only the cells a plan from device 0 can reach: a stage on device d starts at a state
no smaller than the fewest stages that reach d, and its prefix and suffix need no more devices
than there are before and after d (`device_budgets`, the fewest devices any stages of the tables
take to cover them, where groups may start and which cut is whose ignored); on a large cluster
this leaves a narrow band of states per device. The options that may start on a device are
combined at once, on the band of layers their stages take (`SharedTables`, gathered once per
search), the options of one size reduced first to the least time per count of stages after
(`_least_heads`: they share the tail after them, so under SUM and MAX alike the least head
gives the least total). Each is exact: the tests compare it with enumeration and with `_run`.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np

from hlomap.cost.cluster import Cluster, compute_slowdown
from hlomap.cost.pipeline.costs import CommModel, allreduce_share, evaluate_plan, sync_seconds
from hlomap.cost.pipeline.links import GroupPrices, gradient_buffer_seconds, group_memory, is_node_boundary
from hlomap.cost.pipeline.profile import SYNC_FIELDS, PipelineProfile, Prefix, replicated_seconds
from hlomap.cost.pipeline.stages import PipelinePlan, in_flight
from hlomap.tasks.pipeline.solution import NoFeasiblePlan, Solution
from hlomap.tasks.pipeline.space import TIE_RTOL, PipelineObjective, PipelineSpace

__all__ = ["CutStates", "Realize", "StageChain", "StageOptions", "StateSolution", "chain_states",
           "least_bottleneck", "least_latency", "solve", "solve_states", "too_few_devices"]

log = logging.getLogger(__name__)


class StageOptions(Protocol):
    """A problem as the stage DP sees it (module docstring). Times are per microbatch; every
    array is indexed by cut states, K = `n_states`, and by option, O = len(`sizes`).

    A problem whose cuts are priced from the sending side may also say, to make its passes
    cheap on many devices (`shared_tables` reads them when present): `table_groups(k, starts)`,
    option k's group starts sorted by what they share, as (key, starts) with one key per stage
    table (None included) and memory check; `group_starts(k)`, the devices a group of option k
    may start on; `most_after(d, k)`, [K, K] the most stages after with which a stage fits
    (what `fits` says for every count at once)."""

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


def fewest_stages_before(problem: StageOptions) -> list[float]:
    """Per device d, the fewest stages (of sizes some group may start with) whose devices
    cover exactly [0, d): inf where no sequence of stages ends there."""
    devices = problem.n_devices
    sizes_at: list[set[int]] = [set() for _ in range(devices)]
    for k, size in enumerate(problem.sizes):
        for d in _starts(problem, k):
            if d + size <= devices and problem.stage_seconds(d, k) is not None:
                sizes_at[d].add(size)
    fewest = [0.0] + [math.inf] * devices
    for d in range(devices):
        if not math.isinf(fewest[d]):
            for size in sizes_at[d]:
                fewest[d + size] = min(fewest[d + size], fewest[d] + 1)
    return fewest


def _starts(problem: StageOptions, option: int) -> Iterable[int]:
    """The devices a group of `option` may start on: the problem's `group_starts` when it knows
    them (skipping the devices it would refuse), else every device."""
    starts_of = getattr(problem, "group_starts", None)
    return range(problem.n_devices - problem.sizes[option] + 1) if starts_of is None else starts_of(option)


def stage_width(stage: np.ndarray) -> int:
    """The most layers a stage of this [a, b] table takes (b - a over its finite cells; 1 when
    none is finite)."""
    finite = np.isfinite(stage)
    if not finite.any():
        return 1
    a, b = np.nonzero(finite)
    return max(1, int((b - a).max()))


def _table_groups(problem: StageOptions, option: int,
                  starts: Sequence[int]) -> Iterable[tuple[Hashable, Sequence[int]]]:
    """The groups of `option` from `starts` by the stage table and memory check they share, as
    (key, starts in order): a problem whose tables depend on the option and the group's capacity
    only says so (`table_groups`), so each distinct table is gathered once; others get one per
    group."""
    grouped = getattr(problem, "table_groups", None)
    return [((device, option), (device,)) for device in starts] if grouped is None else grouped(option, starts)


@dataclass(frozen=True)
class SharedTables:
    """A shared-cut problem gathered once per search for its passes (`shared_tables`).

    stage: [U, K, K] the stage seconds of each distinct table; most_after: [U, K, K] the most
    stages after a stage with which it fits in memory (-1: none; the problem's `fits` is
    monotone, so one count says it all); sizes: [U] the devices of its option; widths: [U] the
    most layers its stages take; least_cut: [U, K] the least time of the cut after state b over
    the groups that use the table. groups: per device d that a plan may reach (right to left),
    the options that may start there, their tables, the devices after their groups, their cut
    seconds [options, K] (inf where no cut may follow) and whether each may be the last stage.
    reach: `fewest_stages_before`; counts, merged: `stage_counts`."""

    stage: np.ndarray
    most_after: np.ndarray
    sizes: np.ndarray
    widths: np.ndarray
    least_cut: np.ndarray
    groups: tuple[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray], ...]
    reach: tuple[float, ...]
    counts: int
    merged: bool
    # `device_budgets` per threshold: every pass asks, and MAX passes and the feasibility check alike
    budgets: dict[float, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, compare=False, repr=False)


def _most_after(problem: StageOptions, device: int, option: int, counts: int) -> np.ndarray:
    """[K, K]: the most stages after (of `counts`) with which the stage fits, -1 for none: the
    problem's `most_after` when it has one, else its monotone `fits` summed over the counts."""
    own = getattr(problem, "most_after", None)
    most = own(device, option) if own is not None else None
    if most is not None:
        return np.minimum(np.asarray(most, dtype=np.int32), counts - 1)
    count = problem.n_states
    fits = None if own is not None else problem.fits(device, option, np.arange(counts))
    if fits is None:
        return np.full((count, count), counts - 1, dtype=np.int32)
    return np.asarray(fits).sum(axis=0).astype(np.int32) - 1


def _add_group(problem: StageOptions, d: int, k: int, table: int, cuts_of: list[list[np.ndarray]],
               at_device: dict[int, list[tuple[int, int, int, np.ndarray, bool]]]) -> None:
    """Records the group of option k from device d (its table's index `table`) for the pass:
    its cut seconds after each state (inf where no cut may follow) and whether it may close."""
    end = d + problem.sizes[k]
    u = problem.cut_seconds(d, k) if end < problem.n_devices else None
    u = np.full(problem.n_states, np.inf) if u is None else np.asarray(u, dtype=float)[:, 0]
    cuts_of[table].append(u)
    at_device.setdefault(d, []).append((k, table, end, u, end == problem.n_devices or not problem.use_all_devices))


def shared_tables(problem: StageOptions, *, groups: bool = True) -> SharedTables:
    """`problem`'s `SharedTables` (its `fits` must be monotone in the count of stages after).
    Without `groups`, only the distinct tables, every cut taken as free (least_cut 0): enough for
    `device_budgets` to rule a problem out (a looser relaxation) without visiting its cuts."""
    count, devices = problem.n_states, problem.n_devices
    last = count - 1
    counts, merged = stage_counts(problem)
    reach = fewest_stages_before(problem) if groups else [0.0] * (devices + 1)
    index: dict[Hashable, int] = {}
    stage, most_after, sizes, widths, cuts_of = [], [], [], [], []
    at_device: dict[int, list[tuple[int, int, int, np.ndarray, bool]]] = {}
    for k, size in enumerate(problem.sizes):
        for key, members in _table_groups(problem, k, _starts(problem, k)):
            members = [d for d in members if reach[d] < last]
            if not members:
                continue
            at = index.get(key)
            if at is None:
                table = problem.stage_seconds(members[0], k)
                if table is None:
                    continue
                at = index[key] = len(stage)
                stage.append(np.asarray(table, dtype=float))
                most_after.append(_most_after(problem, members[0], k, counts))
                sizes.append(size)
                widths.append(stage_width(table))
                cuts_of.append([])
            if groups:
                for d in members:
                    _add_group(problem, d, k, at, cuts_of, at_device)
    grouped = []
    for d in sorted(at_device, reverse=True):
        options, ids, ends, cuts, closing = zip(*at_device[d])
        grouped.append((d, np.asarray(options), np.asarray(ids), np.asarray(ends), np.stack(cuts), np.asarray(closing)))
    if not stage:
        none = np.zeros((0, count, count))
        return SharedTables(none, none.astype(np.int32), np.zeros(0, dtype=int), np.zeros(0, dtype=int),
                            np.zeros((0, count)), (), tuple(reach), counts, merged)
    least_cut = (np.stack([np.min(np.stack(rows), axis=0) for rows in cuts_of]) if groups
                 else np.zeros((len(stage), count)))
    return SharedTables(np.stack(stage), np.stack(most_after), np.asarray(sizes), np.asarray(widths), least_cut,
                        tuple(grouped), tuple(reach), counts, merged)


def device_budgets(tables: SharedTables, tau: float = math.inf) -> tuple[np.ndarray, np.ndarray]:
    """The fewest devices a part of a plan can take, from the tables alone (where a group may
    start and which device's cut it is are ignored: every stage of some option's table that
    fits somewhere, every cut finite after it somewhere): [Q, K] for a suffix from state a whose
    first stage has q stages after it, and [K] for a prefix ending at state a (its stages' memory
    checked with none after, the most permissive). Stages and cuts above `tau` are left out (a
    SUM pass's threshold; inf for a MAX pass). A relaxation: no plan takes fewer, so a cell
    (q, a, d) with suffix[q, a] > D - d or prefix[a] > d is in no plan from (0, 0) (`_run_shared`
    skips it), and min suffix[:, 0] > D means there is no plan at all. Memoized per threshold."""
    if tau not in tables.budgets:
        tables.budgets[tau] = _device_budgets(tables, tau)
    return tables.budgets[tau]


def _device_budgets(tables: SharedTables, tau: float) -> tuple[np.ndarray, np.ndarray]:
    count = tables.stage.shape[1]
    last = count - 1
    usable = np.isfinite(tables.stage) & (tables.stage <= tau)
    cut_ok = np.isfinite(tables.least_cut) & (tables.least_cut <= tau)
    cut_ok[:, last] = False
    sizes = tables.sizes.astype(float)[:, None, None]
    states = np.arange(count)[:, None]
    suffix = np.full((tables.counts, count), np.inf)
    fits_alone = usable & (tables.most_after >= 0)
    suffix[0] = np.where(fits_alone[:, :, last], sizes[:, :, 0], np.inf).min(axis=0, initial=np.inf)
    # the band b = a + 1 + j (j < the widest table's width): no stage of the tables is longer
    span = np.arange(count)[:, None] + 1 + np.arange(max(1, int(tables.widths.max(initial=1))))[None, :]
    inside = span <= last
    span = np.minimum(span, last)
    through = usable[:, states, span] & inside[None] & cut_ok[:, span]  # [U, a, j]: a stage, then a cut
    # least[q, a, j]: the fewest devices of a stage from a to span[a, j] that fits with q stages
    # after it (the tail does not depend on the table, so the tables reduce first, as the pass
    # reduces its options: row r of `_least_heads` from tail row -1 serves most_after >= r)
    least = _least_heads(np.where(through, sizes, np.inf), tables.most_after[:, states, span], -1, tables.counts - 1)
    for q in range(1, tables.counts):
        tail = suffix[q - 1]
        while True:  # once, or to the fixed point where the top count stands for more too
            suffix[q] = np.minimum(suffix[q], (least[q] + tail[span]).min(axis=1, initial=np.inf))
            if not (tables.merged and q == tables.counts - 1):
                break
            top = np.minimum(suffix[q - 1], suffix[q])
            if np.array_equal(top, tail):
                break
            tail = top
    prefix = np.full(count, np.inf)
    prefix[0] = 0.0
    entering = fits_alone & cut_ok[:, None, :]
    for b in range(1, last):
        prefix[b] = np.where(entering[:, :b, b], sizes[:, :, 0] + prefix[None, :b], np.inf).min(initial=np.inf)
    return suffix, prefix


def fits_devices(problem: StageOptions, tables: SharedTables) -> bool:
    """Whether the stages of `tables` can cover the layers with the problem's devices at all
    (`device_budgets`; False means no plan exists)."""
    return bool((device_budgets(tables)[0][:, 0] <= problem.n_devices).any())


def too_few_devices(problem: StageOptions) -> bool:
    """No plan of a shared-cut problem fits its devices, from its stage tables alone, every cut
    taken as free (`device_budgets` of `shared_tables(groups=False)`): a caller can rule a
    problem out this way before it prices a single cut. False for other problems (not checked)."""
    return _shares_cuts(problem) and not fits_devices(problem, shared_tables(problem, groups=False))


def _run_shared(problem: StageOptions, tables: SharedTables, mode: _Mode, tau: float = math.inf, *,
                chains: bool = True) -> _SharedPass:
    """`_run` for a problem whose cut times do not depend on the next stage's option: the
    suffix after a cut into device e is the best over its first option, T[q - 1, b, e], so per
    (q, a, d) only the best over d's options is stored: no option axis, and each option is
    combined with one tail (under SUM, u + min(T) = min(u + T); under MAX,
    max(u, min(T)) = min(max(u, T))). With merged stage counts (`stage_counts`) the top index
    Q - 1 takes its suffix from Q - 2 or Q - 1 alike.

    Only cells some plan from (state 0, device 0) can use are computed: a stage on device d
    starts at a state a >= `fewest_stages_before(d)` (a layer per stage) with
    prefix[a] <= d <= D - suffix[q, a] (`device_budgets`); a stage takes at most its table's
    width of layers. The other cells stay inf, which no computed cell reads. All options that
    may start on a device are combined at once, on the band b - a <= width of their tables."""
    count, devices = problem.n_states, problem.n_devices
    last, counts, merged = count - 1, tables.counts, tables.merged
    value = np.full((devices + 1, counts, count), np.inf)  # [d, q, a]; `_SharedPass` holds it as [q, a, d]
    kept = (devices + 1, counts, count) if chains else (1, 1, 1)
    option_of = np.full(kept, -1, dtype=np.int16)
    next_state = np.full(kept, -1, dtype=np.int32)
    # per device e done: its tail rows q - 1 that are finite ([lo, hi)), and its merged top row
    live = np.zeros((devices + 1, 2), dtype=np.int64)
    top_tail = np.full((devices + 1, count), np.inf) if merged and counts > 1 else None
    suffix, prefix = device_budgets(tables, tau)
    fewest = suffix.min(axis=0)
    stage = tables.stage if mode is _Mode.MAX else np.where(tables.stage <= tau, tables.stage, np.inf)
    states = np.arange(count)
    done = devices + 1  # devices from here on have their tails summarized
    written: set[int] = set()  # devices whose rows a stage may have set (the others stay inf)
    for d, options, ids, ends, cuts, closing in tables.groups:
        for e in range(done - 1, d, -1):
            if e not in written:
                continue  # live (0, 0), top tail inf
            finite = np.flatnonzero(np.isfinite(value[e, :-1]).any(axis=1))
            live[e] = (finite[0], finite[-1] + 1) if len(finite) else (0, 0)
            if top_tail is not None:
                top_tail[e] = np.minimum(value[e, -2], value[e, -1])
                if np.isfinite(top_tail[e]).any():
                    live[e] = (min(live[e, 0], counts - 2) if live[e, 1] else counts - 2, counts - 1)
        done = d + 1
        rows = states[(states >= tables.reach[d]) & (states < last) & (prefix <= d) & (fewest <= devices - d)]
        if not len(rows):
            continue
        written.add(d)
        if closing.any():  # a last stage: q = 0
            ids_c = ids[closing]
            alone = np.where(tables.most_after[ids_c[:, None], rows[None, :], last] >= 0,
                             stage[ids_c[:, None], rows[None, :], last], np.inf)  # [options, A]
            k = np.argmin(alone, axis=0)
            best = alone[k, np.arange(len(rows))]
            better = best < value[d, 0, rows]
            value[d, 0, rows] = np.where(better, best, value[d, 0, rows])
            if chains:
                option_of[d, 0, rows] = np.where(better, options[closing][k], option_of[d, 0, rows])
                next_state[d, 0, rows] = np.where(better, last, next_state[d, 0, rows])
        go = ends < devices
        if counts < 2 or not go.any():
            continue
        options, ids, ends, cuts = options[go], ids[go], ends[go], cuts[go]
        width = int(tables.widths[ids].max())
        span = states[:width, None] + 1 + rows[None, :]  # [W, A]: b = a + 1 + j
        inside = span <= last
        span = np.minimum(span, last)
        if mode is _Mode.SUM:
            cuts = np.where(cuts <= tau, 2 * cuts, np.inf)
        at = ids[:, None, None], rows[None, None, :], span[None]
        head = _combine(mode, np.where(inside[None], stage[at], np.inf), cuts[:, span])  # [options, W, A]
        most = tables.most_after[at]
        columns = np.arange(len(rows))
        for end in np.unique(ends):  # the options of one size share the tail after them
            q_lo, q_hi = (int(x) for x in live[end])  # tail rows; the stage has row + 1 after
            if q_lo >= q_hi:
                continue
            group = np.flatnonzero(ends == end)
            least = _least_heads(head[group], most[group], q_lo, q_hi)  # [Qs, W, A]
            tails = value[end, q_lo:q_hi]  # [Qs, K]
            if top_tail is not None and q_hi == counts - 1:
                tails = tails.copy()
                tails[-1] = top_tail[end]
            total = _combine(mode, tails[:, span], least)  # [Qs, W, A]
            best = total.min(axis=1)  # [Qs, A]
            block = value[d, q_lo + 1:q_hi + 1]
            better = best < block[:, rows]
            if not better.any():
                continue
            block[:, rows] = np.where(better, best, block[:, rows])
            if chains:  # the end state reaching the best, as argmin picks, and the first option there
                j = np.argmin(total, axis=1)  # [Qs, A]
                cell = (slice(None), j, columns[None, :])
                reached = least[np.arange(q_hi - q_lo)[:, None], j, columns[None, :]]
                fits = most[group][cell] > np.arange(q_lo, q_hi)[None, :, None]
                picked = group[np.argmax((head[group][cell] == reached[None]) & fits, axis=0)]  # [Qs, A]
                chosen, after = option_of[d, q_lo + 1:q_hi + 1], next_state[d, q_lo + 1:q_hi + 1]
                chosen[:, rows] = np.where(better, options[picked], chosen[:, rows])
                after[:, rows] = np.where(better, rows[None, :] + 1 + j, after[:, rows])
    return _SharedPass(np.moveaxis(value, 0, 2), np.moveaxis(option_of, 0, 2), np.moveaxis(next_state, 0, 2), merged)


def _least_heads(head: np.ndarray, most: np.ndarray, q_lo: int, q_hi: int) -> np.ndarray:
    """[Qs, W, A]: per tail row q in [q_lo, q_hi) and cell [w, a], the least head over the
    options ([O, W, A], inf where none) whose stage fits with q + 1 stages after it (most >=
    q + 1). The tail after the stage is the same for all of them, so under SUM (t + h) and MAX
    (max(t, h)) alike the least head gives the least total: the options reduce before the tail
    rows are added, one [O, W, A] pass instead of [O, Qs, W, A]. Each option goes to the level
    min(most, q_hi) - q_lo - 1 (the last row it may serve), then a running minimum from the top
    level down serves each row with every option at or above it."""
    level = np.minimum(most, q_hi) - (q_lo + 1)
    o, w, a = np.nonzero((level >= 0) & np.isfinite(head))
    least = np.full((q_hi - q_lo, *head.shape[1:]), np.inf)
    np.minimum.at(least, (level[o, w, a], w, a), head[o, w, a])
    return np.minimum.accumulate(least[::-1], axis=0)[::-1]


def holds_monotonically(problem: StageOptions) -> bool:
    """A stage's memory check only gets harder with more stages after it (`fits` is monotone
    in the count: stages hold no fewer microbatches with more after them), as under 1F1B and
    GPipe; problems that do not say so are not assumed to."""
    return bool(getattr(problem, "monotone_in_stages", False))


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


def _candidates(problem: StageOptions, floor: float, tables: SharedTables | None = None) -> np.ndarray:
    """Every stage or cut time >= floor that some admissible plan can contain, ascending (from
    `tables` when the problem has them: the same values, gathered once)."""
    inner = slice(1, problem.n_states - 1)  # cuts happen after neither the empty nor the full state
    values = []
    if tables is not None:
        # No stages behind stashes the fewest microbatches: the most permissive memory mask.
        stage = np.where(tables.most_after >= 0, tables.stage, np.inf)
        values.append(stage[np.isfinite(stage) & (stage >= floor)])
        for _, _, _, _, cuts, _ in tables.groups:
            u = cuts[:, inner]
            values.append(u[np.isfinite(u) & (u >= floor)])
        return np.unique(np.concatenate(values))
    devices = problem.n_devices
    first = np.zeros(1, dtype=np.int64)
    for d in range(devices):
        for k, size in enumerate(problem.sizes):
            if d + size > devices:
                continue
            stage = problem.stage_seconds(d, k)
            if stage is None:
                continue
            fits = problem.fits(d, k, first)
            mask = np.isfinite(stage) if fits is None else np.isfinite(stage) & fits[0]
            values.append(stage[mask & (stage >= floor)])
            u = problem.cut_seconds(d, k) if d + size < devices else None
            if u is not None:
                u = u[inner]
                values.append(u[np.isfinite(u) & (u >= floor)])
    return np.unique(np.concatenate(values)) if values else np.zeros(0)


def _shares_cuts(problem: StageOptions) -> bool:
    """The problem prices a cut from its sending side, whatever the next stage's option, and its
    memory check is monotone in the stages after (`_run_shared` needs both)."""
    return not getattr(problem, "cut_depends_on_next", True) and holds_monotonically(problem)


def _prepare(problem: StageOptions) -> SharedTables | None:
    """What every shared pass of `problem` needs alike (`shared_tables`), gathered once per
    search; None for the general pass, which does not use it."""
    return shared_tables(problem) if _shares_cuts(problem) else None


def _least_max(problem: StageOptions, tables: SharedTables | None = None) -> float:
    if tables is not None:
        start = _run_shared(problem, tables, _Mode.MAX, chains=False).value[:, 0, 0]
    else:
        start = _run(problem, _Mode.MAX, chains=False).value[:, 0, 0]
    return float(start.min()) if np.isfinite(start).any() else math.inf


def _least_sum(problem: StageOptions, tau: float = math.inf,
               tables: SharedTables | None = None) -> tuple[float, StageChain | None]:
    if tables is not None:
        return _best_shared_chain(problem, _run_shared(problem, tables, _Mode.SUM, tau))
    return _best_chain(problem, _run(problem, _Mode.SUM, tau))


def least_bottleneck(problem: StageOptions) -> tuple[float, StageChain] | None:
    """The least bottleneck tau* and, among plans within it, the one of least sum (None when no
    plan exists)."""
    tables = _prepare(problem)
    tau_star = _least_max(problem, tables)
    if not math.isfinite(tau_star):
        return None
    _, chain = _least_sum(problem, tau_star * (1 + TIE_RTOL), tables)
    assert chain is not None, "the SUM pass at tau* must reach the plan the MAX pass found"
    return tau_star, chain


def chain_bottleneck(problem: StageOptions, chain: StageChain) -> float:
    """The largest stage or cut time of `chain` (per microbatch, as the passes mask them)."""
    worst, device = 0.0, 0
    last = len(chain.options) - 1
    for s, (a, b, k) in enumerate(zip(chain.states, chain.states[1:], chain.options)):
        stage = problem.stage_seconds(device, k)
        assert stage is not None, "a chain's stage starts where its group may"
        worst = max(worst, float(stage[a, b]))
        if s < last:
            cut = problem.cut_seconds(device, k)
            assert cut is not None, "a chain's cut follows a group that allows one"
            worst = max(worst, float(cut[b, chain.options[s + 1]]))
        device += problem.sizes[k]
    return worst


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
    tables = None
    if _shares_cuts(problem):
        # no plan fits the devices (a bounded problem leaves out what cannot beat the bound):
        # first from the tables alone, then with the cuts
        if too_few_devices(problem):
            return None
        tables = shared_tables(problem)
        if not fits_devices(problem, tables):
            return None
    tau_star = _least_max(problem, tables)
    if not math.isfinite(tau_star):
        return None
    m = microbatches
    if m * tau_star >= bound:  # L >= sum + (M - 1) max >= M max >= M tau*
        return None
    least_sum, unconstrained = _least_sum(problem, tables=tables)
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

    tau_tied = tau_star * (1 + TIE_RTOL)
    sum_star, at_star = _least_sum(problem, tau_tied, tables)
    consider(at_star)
    consider(unconstrained)
    if m == 1:  # L is the plain sum: the unconstrained pass is the optimum.
        return best
    taus = _candidates(problem, tau_star, tables)
    # Only thresholds with (M - 1) tau + least_sum < best can win.
    taus = taus[(m - 1) * taus + least_sum < best_value]
    # Times equal but for rounding (one stage priced in two tables) share one pass, at the largest
    # of them; the bound below takes the least, so a plan of any of them is still counted.
    first_of = np.flatnonzero(np.r_[True, taus[1:] > taus[:-1] * (1 + TIE_RTOL)]) if len(taus) else []
    floors = taus[first_of]
    taus = taus[np.r_[first_of[1:] - 1, len(taus) - 1]] if len(taus) else taus
    known: list[tuple[int, int, float]] = []  # (first, last, SUM): SUM is that on taus[first..last]
    if unconstrained is not None and len(taus):  # from its own bottleneck up, SUM is the least sum
        known.append((int(np.searchsorted(taus, chain_bottleneck(problem, unconstrained), side="left")),
                      len(taus) - 1, least_sum))
    if at_star is not None and len(taus):  # the pass at tau*, likewise on [its bottleneck, tau*]
        known.append((int(np.searchsorted(taus, chain_bottleneck(problem, at_star), side="left")),
                      int(np.searchsorted(taus, tau_tied, side="right")) - 1, sum_star))
    passes = 0

    def least_sum_at(index: int) -> float:
        """SUM(taus[index]); every pass may improve the best plan. A pass at tau whose chain's own
        bottleneck is tau' <= tau gives SUM on all of [tau', tau] at once: that chain is admissible
        there, so SUM <= its sum, and SUM only falls as tau grows (none under tau: none below)."""
        nonlocal passes
        for first, last, value in known:
            if first <= index <= last:
                return value
        tau = float(taus[index])
        total, chain = _least_sum(problem, tau, tables)
        passes += 1
        first = 0
        if chain is not None:
            own = chain_bottleneck(problem, chain)
            first = int(np.searchsorted(taus, own, side="left"))
            if total + (m - 1) * own < best_value:
                consider(chain)
        known.append((min(first, index), index, total))
        return total

    # Branch and bound over ranges of thresholds: SUM only falls as tau grows, so every tau in
    # [floors[lo], taus[hi]] has L(tau) >= SUM(taus[hi]) + (M - 1) floors[lo].
    pending = [(0, len(taus) - 1)] if len(taus) else []
    while pending:
        lo, hi = pending.pop()
        if max_thresholds is not None and passes >= max_thresholds:
            log.warning(
                "%s: stopped after %d bottleneck thresholds; the plan is the best found, not "
                "proven optimal", source, passes,
            )
            break
        if least_sum_at(hi) + (m - 1) * float(floors[lo]) >= best_value or lo == hi:
            continue
        mid = (lo + hi) // 2
        pending.append((mid + 1, hi))
        pending.append((lo, mid))  # popped first: small thresholds first
    log.debug("%s: latency DP, M = %d: %d passes for %d thresholds", source, m, passes, len(taus))
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
        (`costs.allreduce_share`, `links.allreduce_time`: its bytes and each of its arrays' buffers),
        plus its optimizer update amortized
        (each replica updates all the stage's parameters once per step)."""
        r = self.sizes[option]
        slowdown = compute_slowdown(self.cluster, range(device, device + r))
        t = replicated_seconds(self.compute, self.fixed, r) * slowdown
        if self.states.update_per_byte:  # every replica updates all of the stage's parameters
            t = t + self.parameter * (self.states.update_per_byte * slowdown / self.space.microbatches)
        if self._comm and r > 1:
            allreduce = self.prices.allreduce(range(device, device + r))
            gradients = allreduce(self.parameter) + gradient_buffer_seconds(self.prices.cluster, r,
                                                                            self.syncs["gradient_buffers"])
            t = t + allreduce_share(self.prices.cluster, gradients, self.space.microbatches)
            # the passes' own all-reduces, every microbatch (`costs.stage_sync_seconds`)
            t = t + sync_seconds(allreduce, self.syncs["forward_syncs"], self.syncs["forward_sync_bytes"])
            t = t + sync_seconds(allreduce, self.syncs["backward_syncs"], self.syncs["backward_sync_bytes"])
            # the weight gradients' transposes after the all-reduce, every microbatch (`costs.stage_sync_seconds`)
            t = t + self.syncs["replica_transposes"] * slowdown
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
