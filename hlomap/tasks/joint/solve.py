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
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from hlomap.cost.pipeline.costs import syncs_each_microbatch
from hlomap.cost.pipeline.stages import DEFAULT_SCHEDULE, Schedule, in_flight, splits_batch
from hlomap.tasks.joint.costs import JointModel, StageArrays, StageOption, transfer_seconds_of
from hlomap.tasks.joint.plans import (
    JointCost,
    JointPlan,
    JointStage,
    evaluate,
    stage_memory,
    stage_seconds,
)
from hlomap.tasks.pipeline.dp import StageChain, least_latency
from hlomap.tasks.pipeline.solution import NoFeasiblePlan

__all__ = ["JointProblem", "JointSpace", "StageTables", "aligned", "holds_parameters",
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


def _per_node(model: JointModel) -> int:
    cluster = model.cluster
    return max(len(cluster.devices_on(node)) for node in set(cluster.node_of))


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


class StageTables(NamedTuple):
    """Per option: [i, j] stage seconds (inf where j <= i), per held count the [i, j] memory,
    per first device the [j] transfer seconds after layer j - 1."""

    stage: list[np.ndarray]
    memory: list[dict[int, np.ndarray]]
    transfer: list[dict[int, np.ndarray]]


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
        each_microbatch = syncs_each_microbatch(self.model.cluster)
        for option in self.options:
            a = self.model.arrays(option)
            t = np.where(upper & holds_parameters(a, i, j),
                         stage_seconds(a, i, j, m, sync_each_microbatch=each_microbatch), np.inf)
            stage.append(t)
            memory.append({self.held(q): np.where(upper, stage_memory(a, i, j, self.held(q), m), np.inf)
                           for q in range(self.stages)})
            per_device = {}
            for d in range(self.devices):
                e = d + option.devices
                if e >= self.devices or not aligned(self.per_node, d, option.devices):
                    continue
                u = np.zeros(n + 1)
                u[1:n] = transfer_seconds_of(self.model.cluster, option, d, e, a.crossing[:n - 1] * option.data / m)
                per_device[d] = u
            transfer.append(per_device)
        return StageTables(stage, memory, transfer)

    def capacity(self, device: int, size: int) -> float:
        cluster = self.model.cluster
        return min(cluster.devices[x].memory_bytes for x in range(device, device + size))


@dataclass(frozen=True)
class _JointOptions:
    """A microbatch count's problem as the stage DP's `StageOptions`: cut states are the n + 1
    layer prefixes, a stage's option one of `problem.options` on an `aligned` device group, and
    the cut after a stage is priced from the sending side, whatever the next option."""

    problem: JointProblem
    tables: StageTables
    sizes: tuple[int, ...] = field(init=False)
    _fits: dict[tuple[int, float], np.ndarray] = field(init=False)  # by (option, capacity)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(option.devices for option in self.problem.options))
        object.__setattr__(self, "_fits", {})

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
        return self.tables.stage[option]

    def fits(self, device: int, option: int, behind: np.ndarray) -> np.ndarray | None:
        problem = self.problem
        if not problem.space.check_memory:
            return None
        capacity = problem.capacity(device, self.sizes[option])
        key = (option, capacity)
        if key not in self._fits:
            memory = self.tables.memory[option]
            self._fits[key] = np.stack([memory[problem.held(q)] <= capacity
                                        for q in range(problem.stages)])
        return self._fits[key][behind]

    #: A cut is priced from its sending side (`transfer_seconds`), whatever the next option.
    cut_depends_on_next = False

    def cut_seconds(self, device: int, option: int) -> np.ndarray | None:
        u = self.tables.transfer[option].get(device)
        return None if u is None else np.broadcast_to(u[:, None], (len(u), len(self.sizes)))


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
    (some of) these (the same devices, mesh and plan) fits every stage it could run, the whole
    model with every microbatch in flight, and is never slower: recomputing always costs time;
    splitting the state costs an all-gather and saves part of the update, so it is never faster
    when, layer by layer, the gather's bandwidth time is at least the update time it saves. Then
    in any plan the twin can replace it on the same devices with the same cuts, transfers and no
    more time, so the optimum never needs it (exact pruning; it halves the options of a step
    that fits)."""
    valid = [o for o in space.options if _valid(model, o, microbatches)]
    options = tuple(o for o in valid if not _dominated(model, o, microbatches, space))
    return JointProblem(model, space, microbatches, options, _per_node(model)) if options else None


def _dominated(model: JointModel, option: StageOption, microbatches: int, space: JointSpace) -> bool:
    """A twin of `option` with fewer extras always fits and is never slower (`problem_for`)."""
    twins = {dataclasses.replace(option, recompute=r, split_state=z)
             for r in {False, option.recompute} for z in {False, option.split_state}} - {option}
    return any(_twin_always_fits(model, twin, microbatches, space) and _never_slower(model, twin, option)
               for twin in twins)


def _never_slower(model: JointModel, twin: StageOption, option: StageOption) -> bool:
    if not option.split_state or twin.split_state:
        return True  # dropping recomputation only saves time
    a = model.arrays(option)
    params, update = np.diff(a.params), np.diff(a.update)
    return bool(np.all(a.gather_beta * params >= update * (1.0 - 1.0 / a.data)))


def _twin_always_fits(model: JointModel, twin_option: StageOption, microbatches: int, space: JointSpace) -> bool:
    if not space.check_memory:
        return True  # memory does not bound the search: recomputing only costs time
    twin = model.arrays(twin_option)
    n = model.n_layers
    # parameters and stash are prefix sums of non-negative terms: [0, n) bounds every stage
    need = float(stage_memory(twin, 0, n, microbatches, microbatches))
    capacity = min(d.memory_bytes for d in model.cluster.devices)
    return need <= capacity


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

    problem, tables = without_dominated(problem, problem.tables())
    chain = least_latency(_JointOptions(problem, tables), microbatches, latency,
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

