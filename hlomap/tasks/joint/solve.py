"""The exact outer level of the joint planner: the stage DP of `tasks/pipeline/dp.py` over
stage cuts, device groups and per-stage options (mesh shape and sharding plan), run for each
microbatch count.

A stage takes the next `option.devices` devices (a slice of one server, or whole servers,
`aligned`), its layers [i, j) and its option; the DP minimizes L = sum + (M - 1) max (Alpa's
section 5.2 method). The inner level (each (range, option)'s cost) is the memoized prefix sums
of `costs.JointModel`, tabulated once per microbatch count by `JointProblem.tables`, so every
distinct stage is priced once.

The transfer after a stage is priced from the sending stage's side (`costs.transfer_seconds`:
its data shards go to the next devices in order), whatever the next stage's option, and
`plans.evaluate` prices plans the same way, so the DP is exact for it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from hlomap.cost.pipeline.costs import syncs_each_microbatch
from hlomap.cost.pipeline.stages import DEFAULT_SCHEDULE, Schedule, in_flight, splits_batch
from hlomap.plan.sections import Recompute
from hlomap.tasks.joint.costs import JointModel, StageArrays, StageOption
from hlomap.tasks.joint.plans import (
    JointCost,
    JointPlan,
    JointStage,
    evaluate,
    stage_memory,
    stage_seconds,
)
from hlomap.tasks.pipeline.dp import StageChain, least_latency, too_few_devices
from hlomap.tasks.pipeline.solution import NoFeasiblePlan

__all__ = ["JointProblem", "JointSpace", "StageTables", "aligned", "holds_parameters", "in_space",
           "microbatch_choices", "problem_for", "solve"]


@dataclass(frozen=True)
class JointSpace:
    """What a joint plan may choose: stage options, microbatch counts, the schedule, at most
    `max_stages` stages; memory is checked unless told not to. With `use_all_devices` every
    device is used; without, the stages take a prefix of the devices and leave the rest idle
    when that is faster (rather than giving them to a stage that has nothing to do)."""

    options: tuple[StageOption, ...]
    microbatches: tuple[int, ...]
    schedule: Schedule = DEFAULT_SCHEDULE
    max_stages: int | None = None
    check_memory: bool = True
    use_all_devices: bool = False


def microbatch_choices(batch: int, most: int | None = None) -> tuple[int, ...]:
    """Microbatch counts that split `batch` evenly (every divisor; up to `most` when given): the
    range follows the batch, since a large model on many devices may need many microbatches to fit
    (GPT-76B on 1,024 GPUs in Megatron-LM's weak scaling) and a fixed cap made it infeasible."""
    top = batch if most is None else min(batch, most)
    return tuple(m for m in range(1, top + 1) if splits_batch(batch, m, 1))


def aligned(per_node: int, device: int, size: int) -> bool:
    """A device group [device, device + size) is a slice of one server or whole servers."""
    if per_node <= 1:
        return True
    if size < per_node:
        return device % per_node + size <= per_node and device % size == 0
    return device % per_node == 0 and size % per_node == 0


def aligned_starts(per_node: int, devices: int, size: int) -> Sequence[int]:
    """The first devices of the `aligned` groups of `size` among `devices` (the same as testing
    each device, without visiting the devices no group may start on)."""
    if per_node <= 1:
        return range(devices - size + 1)
    if size < per_node:
        return tuple(d for d in range(0, devices - size + 1, size) if aligned(per_node, d, size))
    return range(0, devices - size + 1, per_node) if size % per_node == 0 else ()


def _valid(model: JointModel, option: StageOption, microbatches: int) -> bool:
    """Each data replica gets a whole number of samples of every microbatch; a split optimizer
    state needs data replicas the stage's plan leaves the parameters whole on."""
    return splits_batch(model.batch, microbatches, option.data) and (
        not option.split_state or model.can_split_state(option))


def holds_parameters(a: StageArrays, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """[i, j]: layers [i, j) hold some parameter. A stage without one (only the loss after the
    last layer, say) does next to nothing, so it gets no devices of its own: its layers join
    the neighbouring stage (Auto-MAP's rule that every stage trains something)."""
    return (a.params[j] - a.params[i]) > 0


class HeldMemory(Mapping[int, np.ndarray]):
    """One option's [i, j] memory per count of microbatches held (inf where j <= i), computed
    when asked: a problem of many stages has as many counts, and most are never looked at."""

    def __init__(self, arrays: StageArrays, held: Sequence[int], microbatches: int) -> None:
        self._arrays, self._held, self._m = arrays, tuple(sorted(set(held))), microbatches
        self._tables: dict[int, np.ndarray] = {}
        self._most: dict[tuple[tuple[int, ...], float], np.ndarray] = {}

    def __getitem__(self, held: int) -> np.ndarray:
        if held not in self._held:
            raise KeyError(held)
        if held not in self._tables:
            i, j = _pairs(len(self._arrays.params))
            self._tables[held] = np.where(j > i, stage_memory(self._arrays, i, j, held, self._m), np.inf)
        return self._tables[held]

    def __iter__(self) -> Iterator[int]:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)

    def fit(self, held: Sequence[int], capacity: float) -> np.ndarray:
        """[len(held), i, j]: the stage fits `capacity` holding each count, by the same arithmetic
        as `stage_memory` (broadcast over the counts, so plans at the edge agree with `evaluate`)."""
        i, j = _pairs(len(self._arrays.params))
        counts = np.asarray(held)[:, None, None]
        need = stage_memory(self._arrays, i[None], j[None], counts, self._m)
        return (j > i)[None] & (need <= capacity)

    def most_held(self, held: Sequence[int], capacity: float) -> np.ndarray:
        """[i, j]: the last index q of `held` (non-decreasing) at which the stage still fits
        `capacity` holding held[q] (-1: not even held[0]); `fit` summed over q, without the
        [len(held), i, j] table. Memory is linear in the count held, so the line through the
        fewest and the most held places q; then steps of one, with `stage_memory`'s own
        arithmetic, settle the cells that rounding put a count off (plans at the edge agree with
        `evaluate`). Memoized per counts and capacity: the devices check of a microbatch count
        and its search ask alike."""
        key = (tuple(held), float(capacity))
        if key not in self._most:
            self._most[key] = self._most_held(np.asarray(held), capacity)
        return self._most[key]

    def _most_held(self, counts: np.ndarray, capacity: float) -> np.ndarray:
        i, j = _pairs(len(self._arrays.params))
        last = len(counts) - 1

        def fits(q: np.ndarray) -> np.ndarray:
            return stage_memory(self._arrays, i, j, counts[np.clip(q, 0, last)], self._m) <= capacity

        low = stage_memory(self._arrays, i, j, counts[0], self._m)
        high = stage_memory(self._arrays, i, j, counts[-1], self._m)
        with np.errstate(divide="ignore", invalid="ignore"):
            most = counts[0] + (capacity - low) * (counts[-1] - counts[0]) / (high - low)
        guess = np.searchsorted(counts, np.where(np.isfinite(most), most, counts[0]), side="right") - 1
        q = np.where(high <= capacity, last, np.where(low <= capacity, np.clip(guess, 0, last), -1))
        while (down := (q >= 0) & ~fits(q)).any():  # rounding put it above the last count that fits
            q = np.where(down, q - 1, q)
        while (up := (q < last) & fits(q + 1)).any():  # ... or below it
            q = np.where(up, q + 1, q)
        return np.where(j > i, q, -1)


def _pairs(states: int) -> tuple[np.ndarray, np.ndarray]:
    """[K, 1] and [1, K] state indices: a table's [i, j] by broadcasting (each prefix-sum array
    is read K times instead of K^2, with the same arithmetic per cell)."""
    return np.arange(states)[:, None], np.arange(states)[None, :]


class StageTables(NamedTuple):
    """Per option: [i, j] stage seconds (inf where j <= i), per held count the [i, j] memory,
    per first device the [j] transfer seconds after layer j - 1 (`CutTables`)."""

    stage: list[np.ndarray]
    memory: list[HeldMemory]
    transfer: Sequence[dict[int, np.ndarray]]


class CutTables(Sequence[dict[int, np.ndarray]]):
    """Per option, the [j] seconds of the transfer after layer j - 1 from each aligned group that
    a next stage follows, by the group's first device; built when first read: most microbatch
    counts of a large cluster are ruled out by the devices their stages need before any cut is
    looked at. Groups of equal sends (`JointModel.transfer_key`) share one array."""

    def __init__(self, problem: JointProblem) -> None:
        self._problem = problem
        self._built: dict[int, dict[int, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self._problem.options)

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):
            return [self[i] for i in range(len(self))[k]]
        if k not in self._built:
            self._built[k] = self._build(self._problem.options[k])
        return self._built[k]

    def _build(self, option: StageOption) -> dict[int, np.ndarray]:
        problem = self._problem
        model, n, m = problem.model, problem.layers, problem.microbatches
        crossing = model.arrays(option).crossing[:n - 1] * option.data / m
        per_device, by_terms = {}, {}
        for d, key in model.send_groups(option, aligned_starts(problem.per_node, problem.devices, option.devices)):
            if key not in by_terms:
                u = np.zeros(n + 1)
                u[1:n] = model.transfer_seconds_of(option, d, d + option.devices, crossing)
                by_terms[key] = u
            per_device[d] = by_terms[key]
        return per_device


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

    @functools.cached_property
    def held_counts(self) -> tuple[int, ...]:
        """`held(q)` for every count q of stages after a stage (0 .. stages - 1)."""
        return tuple(self.held(q) for q in range(self.stages))

    def tables(self) -> StageTables:
        n, m = self.layers, self.microbatches
        i, j = _pairs(n + 1)
        upper = j > i
        stage, memory = [], []
        each_microbatch = syncs_each_microbatch(self.model.cluster)
        for option in self.options:
            a = self.model.arrays(option)
            t = np.where(upper & holds_parameters(a, i, j),
                         stage_seconds(a, i, j, m, sync_each_microbatch=each_microbatch), np.inf)
            stage.append(t)
            memory.append(HeldMemory(a, self.held_counts, m))
        return StageTables(stage, memory, CutTables(self))

    def capacity(self, device: int, size: int) -> float:
        return self.model.group_capacity(device, size)


@dataclass(frozen=True)
class _JointOptions:
    """A microbatch count's problem as the stage DP's `StageOptions`: cut states are the n + 1
    layer prefixes, a stage's option one of `problem.options` on an `aligned` device group, and
    the cut after a stage is priced from the sending side, whatever the next option.

    With a `bound` (the latency of a plan already found), stages and cuts that no faster plan
    can hold are left out: L = sum t + 2 sum u + (M - 1) max(t, u) >= M t for each stage
    and >= (M + 1) u for each cut, so a stage with M t >= bound or a cut with (M + 1) u >= bound
    only occurs in plans that are not faster (exact pruning). An option with no stage left is
    skipped at every device, which is what makes large clusters cheap: a stage of a few devices
    cannot run even one layer of a large model fast enough."""

    problem: JointProblem
    tables: StageTables
    bound: float = math.inf
    sizes: tuple[int, ...] = field(init=False)
    _fits: dict[tuple[int, float], np.ndarray] = field(init=False)  # by (option, capacity)
    _cuts: dict[tuple[int, int], np.ndarray] = field(init=False)  # by (option, its transfer table)
    _most: dict[tuple[int, float], np.ndarray] = field(init=False)  # by (option, capacity)
    _stage: list[np.ndarray | None] = field(init=False)  # per option, None when no stage is left

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(option.devices for option in self.problem.options))
        object.__setattr__(self, "_fits", {})
        object.__setattr__(self, "_cuts", {})
        object.__setattr__(self, "_most", {})
        m = self.problem.microbatches
        stage = [t if not math.isfinite(self.bound) else np.where(t * m < self.bound, t, np.inf)
                 for t in self.tables.stage]
        object.__setattr__(self, "_stage", [t if np.isfinite(t).any() else None for t in stage])

    def table_groups(self, option: int, starts: Sequence[int]) -> list[tuple[tuple[int, float], list[int]]]:
        """The option's stage table is the same on every device and its memory check depends on
        the group's capacity only: the DP gathers each distinct pair once."""
        starts = np.asarray(starts, dtype=np.int64)
        capacities = self.problem.model.group_capacities(self.sizes[option])[starts]
        distinct, which = np.unique(capacities, return_inverse=True)
        return [((option, float(c)), starts[which == n].tolist()) for n, c in enumerate(distinct)]

    @property
    def saturated_stages(self) -> int:
        """From this count of stages after a stage on, every stage holds as many microbatches
        (1F1B: min(S - s, M) is M from S - s = M on), so the DP need not tell them apart."""
        held = self.problem.held_counts
        q = len(held) - 1
        while q > 0 and held[q - 1] == held[-1]:
            q -= 1
        return q

    @property
    def monotone_in_stages(self) -> bool:
        """A stage holds no fewer microbatches with more stages after it (memory grows with the
        count held), so its memory check only gets harder."""
        held = self.problem.held_counts
        return all(a <= b for a, b in zip(held, held[1:]))

    @property
    def bounded_stages(self) -> bool:
        """The space caps the stage count below what the layers and devices allow."""
        return self.problem.space.max_stages is not None

    @property
    def n_states(self) -> int:
        return self.problem.layers + 1

    @property
    def n_devices(self) -> int:
        return self.problem.devices

    @property
    def max_stages(self) -> int:
        return self.problem.stages

    @property
    def use_all_devices(self) -> bool:
        return self.problem.space.use_all_devices

    def stage_seconds(self, device: int, option: int) -> np.ndarray | None:
        if not aligned(self.problem.per_node, device, self.sizes[option]):
            return None
        return self._stage[option]

    def fits(self, device: int, option: int, behind: np.ndarray) -> np.ndarray | None:
        problem = self.problem
        if not problem.space.check_memory:
            return None
        capacity = problem.capacity(device, self.sizes[option])
        key = (option, capacity)
        if key not in self._fits:
            self._fits[key] = self.tables.memory[option].fit(problem.held_counts, capacity)
        table = self._fits[key]
        if len(behind) and behind[0] == 0 and np.array_equal(behind, np.arange(len(behind))):
            return table[:len(behind)]  # a view: the shared pass asks for every count at once
        return table[behind]

    def most_after(self, device: int, option: int) -> np.ndarray | None:
        """[K, K]: the most stages after a stage of `option` on the group from `device` with which
        it fits (-1: none); None when memory is not checked (`fits` summed over the counts)."""
        problem = self.problem
        if not problem.space.check_memory:
            return None
        key = (option, problem.capacity(device, self.sizes[option]))
        if key not in self._most:
            self._most[key] = self.tables.memory[option].most_held(problem.held_counts, key[1])
        return self._most[key]

    #: A cut is priced from its sending side (`transfer_seconds`), whatever the next option.
    cut_depends_on_next = False

    def cut_seconds(self, device: int, option: int) -> np.ndarray | None:
        u = self.tables.transfer[option].get(device)
        if u is None:
            return None
        key = (option, id(u))  # groups of equal sends share one table (`JointProblem.tables`)
        if key not in self._cuts:
            if math.isfinite(self.bound):
                u = np.where(u * (self.problem.microbatches + 1) < self.bound, u, np.inf)
            self._cuts[key] = np.broadcast_to(u[:, None], (len(u), len(self.sizes)))
        return self._cuts[key]

    def group_starts(self, option: int) -> Sequence[int]:
        """The devices a group of `option` may start on (`aligned`; none when the bound leaves
        the option no stage)."""
        if self._stage[option] is None:
            return ()
        return aligned_starts(self.problem.per_node, self.problem.devices, self.sizes[option])


def _plan(problem: JointProblem, chain: StageChain) -> JointPlan:
    stages, device = [], 0
    for start, stop, k in zip(chain.states, chain.states[1:], chain.options):
        option = problem.options[k]
        stages.append(JointStage.of(start, stop, device, option))
        device += option.devices
    return JointPlan(tuple(stages), problem.microbatches, problem.space.schedule)


def problem_for(model: JointModel, space: JointSpace, microbatches: int) -> JointProblem | None:
    """The problem of one microbatch count (None when no option splits the batch that way).

    An option that recomputes or splits its optimizer state is dropped where a twin without
    (some of) these or recomputing less (the same devices, mesh and plan) fits every stage it
    could run, the whole model with every microbatch in flight, and is never slower: recomputing
    always costs time, selectively less than in full (its work is part of the forward's);
    splitting the state costs an all-gather and saves part of the update, so it is never faster
    when, layer by layer, the gather's bandwidth time is at least the update time it saves;
    splitting the parameters too (FSDP) is checked on every range of layers a stage may take. Then
    in any plan the twin can replace it on the same devices with the same cuts, transfers and no
    more time, so the optimum never needs it (exact pruning; it halves the options of a step
    that fits)."""
    valid = [o for o in space.options if _valid(model, o, microbatches)]
    offered = set(valid)
    options = tuple(o for o in valid if not _dominated(model, o, microbatches, space, offered))
    return JointProblem(model, space, microbatches, options, model.cluster.most_per_node) if options else None


#: Recomputation from the least time it costs to the most (selective runs part of what full does).
_RECOMPUTE_ORDER = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)


#: How a stage keeps its state, from the fewest collectives to the most: (split_state,
#: shard_gradients, shard_parameters) of nothing split, the optimizer state split (ZeRO-1), the
#: gradients too (ZeRO-2), everything split (FSDP).
_STATE_ORDER = ((False, False, False), (True, False, False), (True, True, False), (True, False, True))


def _dominated(model: JointModel, option: StageOption, microbatches: int, space: JointSpace,
               offered: set[StageOption]) -> bool:
    """A twin of `option` among the `offered` ones, with fewer extras, always fits and is never
    slower (`problem_for`)."""
    level = _STATE_ORDER.index((option.split_state, option.shard_gradients, option.shard_parameters))
    twins = {dataclasses.replace(option, recompute=r, split_state=z, shard_gradients=g, shard_parameters=f)
             for r in _RECOMPUTE_ORDER[:_RECOMPUTE_ORDER.index(option.recompute) + 1]
             for z, g, f in _STATE_ORDER[:level + 1]} - {option}
    twins &= offered
    return any(_twin_always_fits(model, twin, microbatches, space) and _never_slower(model, twin, option, microbatches)
               for twin in twins)


def _never_slower(model: JointModel, twin: StageOption, option: StageOption, microbatches: int) -> bool:
    if (option.shard_parameters and not twin.shard_parameters) or (option.shard_gradients and not twin.shard_gradients):
        return _nowhere_slower(model, twin, option, microbatches)
    if not option.split_state or twin.split_state:
        return True  # recomputing less only saves time
    a = model.arrays(option)
    params, update = np.diff(a.params), np.diff(a.update)
    return bool(np.all(a.gather_beta * params >= update * (1.0 - 1.0 / a.data)))


def _nowhere_slower(model: JointModel, twin: StageOption, option: StageOption, microbatches: int) -> bool:
    """`twin` takes no longer than `option` on every range of layers a stage may run."""
    i, j = np.triu_indices(model.n_layers + 1, 1)
    each = syncs_each_microbatch(model.cluster)
    mine = stage_seconds(model.arrays(option), i, j, microbatches, sync_each_microbatch=each)
    theirs = stage_seconds(model.arrays(twin), i, j, microbatches, sync_each_microbatch=each)
    return bool(np.all(theirs <= mine))


def _twin_always_fits(model: JointModel, twin_option: StageOption, microbatches: int, space: JointSpace) -> bool:
    if not space.check_memory:
        return True  # memory does not bound the search: recomputing only costs time
    twin = model.arrays(twin_option)
    n = model.n_layers
    # parameters and stash are prefix sums of non-negative terms: [0, n) bounds every stage
    need = float(stage_memory(twin, 0, n, microbatches, microbatches))
    return need <= model.group_capacity(0, model.cluster.n_devices)  # the least device's memory


def _solve_for(model: JointModel, space: JointSpace, microbatches: int,
               bound: float) -> tuple[JointPlan, JointCost] | None:
    """The least-L plan with `microbatches` microbatches (None when none fits or beats `bound`)."""
    problem = problem_for(model, space, microbatches)
    if problem is None:
        return None
    priced: dict[StageChain, tuple[JointPlan, JointCost]] = {}

    def latency(chain: StageChain) -> float:
        plan = _plan(problem, chain)
        cost = evaluate(model, plan)
        if space.check_memory and not cost.fits:
            return math.inf
        priced[chain] = (plan, cost)
        return cost.latency

    tables = problem.tables()
    if too_few_devices(_JointOptions(problem, tables, bound)):
        return None  # before the cuts are priced and dominated options found: most counts stop here
    problem, tables = without_dominated(problem, tables)
    chain = least_latency(_JointOptions(problem, tables, bound), microbatches, latency,
                          bound=bound, source=f"{model.cap.source} (joint)")
    return None if chain is None or chain not in priced else priced[chain]


def without_dominated(problem: JointProblem, tables: StageTables) -> tuple[JointProblem, StageTables]:
    """`problem` without the options another option of the same device count dominates: its
    stage times, its memory at every count of microbatches held, and the time of a cut after it
    from every device, all at most this one's. In any plan the dominating option can take the
    dominated one's place (the same devices, and a cut into a stage is priced from the sending
    stage's side), and L = sum + (M - 1) max grows with every stage and cut time, so the optimum
    keeps (exact pruning). Of options that dominate each other the first is kept. Memory is
    linear in the count held, so the fewest and the most held decide. On a measured cluster the
    executor's cost depends on which options the stages take (alike or not), so nothing is
    dropped there."""
    if problem.model.cluster.measured is None and len(problem.options) > 1:
        held = sorted(tables.memory[0])
        ends = (held[0], held[-1])
        keep = np.ones(len(problem.options), dtype=bool)
        for size in sorted({o.devices for o in problem.options}):
            members = [k for k, o in enumerate(problem.options) if o.devices == size]
            if len(members) < 2:
                continue
            devices = sorted(tables.transfer[members[0]])
            if any(sorted(tables.transfer[k]) != devices for k in members):
                continue  # not the same device groups: leave them to the DP
            rows = [np.concatenate([tables.stage[k].ravel(), *(tables.memory[k][h].ravel() for h in ends),
                                    *(tables.transfer[k][d] for d in devices)]) for k in members]
            stacked = np.stack(rows)  # [n, cells]
            at_most = np.all(stacked[:, None, :] <= stacked[None, :, :], axis=2)  # [a, b]: a <= b everywhere
            for j, b in enumerate(members):
                beaten = [i for i in range(len(members))
                          if i != j and at_most[i, j] and (not at_most[j, i] or i < j)]
                if beaten:
                    keep[b] = False
        if not keep.all():
            chosen = np.flatnonzero(keep)
            problem = dataclasses.replace(problem, options=tuple(problem.options[k] for k in chosen))
            tables = StageTables([tables.stage[k] for k in chosen], [tables.memory[k] for k in chosen],
                                 [tables.transfer[k] for k in chosen])
    return problem, tables


def in_space(space: JointSpace, plan: JointPlan) -> bool:
    """`plan` is one of the plans `space` allows (its options, microbatch count and schedule)."""
    return (plan.microbatches in space.microbatches and plan.schedule is space.schedule
            and all(stage.option in space.options for stage in plan.stages)
            and (space.max_stages is None or plan.n_stages <= space.max_stages))


#: Relative difference in L below which two plans tie (`solve` then keeps fewer microbatches).
TIE_TOLERANCE = 1e-9


def solve(model: JointModel, space: JointSpace, incumbent: JointPlan | None = None) -> tuple[JointPlan, JointCost]:
    """The joint plan of least L over `space` (every microbatch count); raises NoFeasiblePlan.

    `incumbent`, a plan of the space found by other means (the expert grid's best), bounds the
    search from the start: every microbatch count's DP then only looks for faster plans, and
    leaves out the stages and cuts that cannot be in one (`_JointOptions`). The result is the
    same optimum (the incumbent itself when nothing is faster); only the work shrinks."""
    best: tuple[JointPlan, JointCost] | None = None
    if incumbent is not None and in_space(space, incumbent) and (
            not space.use_all_devices or sum(s.option.devices for s in incumbent.stages) == model.cluster.n_devices):
        cost = evaluate(model, incumbent)
        if cost.fits or not space.check_memory:
            best = (incumbent, cost)
    for m in sorted(space.microbatches, reverse=True):  # many microbatches usually win: a good bound early
        # Ties go to fewer microbatches: each costs the executor a dispatch per stage that a
        # datasheet cluster does not price (one stage of 256 microbatches tied the plain step).
        found = _solve_for(model, space, m, best[1].latency * (1 + TIE_TOLERANCE) if best else math.inf)
        if found is not None and (best is None or found[1].latency <= best[1].latency * (1 + TIE_TOLERANCE)):
            best = found
    if best is None:
        raise NoFeasiblePlan(f"{model.cap.source}: no joint plan of {model.n_layers} layers fits on "
                             f"{model.cluster.n_devices} devices of {model.cluster.name} "
                             f"(memory per device {min(d.memory_bytes for d in model.cluster.devices) / 2**30:.1f} GiB)")
    return best

