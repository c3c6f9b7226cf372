"""Exact pipeline DP on branching layer graphs: cuts at downsets, not at positions of one order.

A straight pipeline runs its stages one after the other, so the layers that run before a cut
must include every predecessor of each of them: they form a *downset* of the layer DAG. One
topological order allows only its n + 1 prefixes; a graph with branches (residual blocks,
Inception modules, GNMT's layers) has more downsets, and a stage may be the difference of any two
nested ones. PipeDream's optimizer (Narayanan et al., SOSP 2019, section 3.1) searches them as its
"antichain DAG": a state is everything up to an antichain, and an edge adds one more layer; from
any state it can add any layer whose predecessors are all in, so it reaches every downset that
holds the first source. `dp.solve_states` runs the one DP recursion of `dp` over these states
with the same cost model (per-stage compute, replication all-reduce, cut transfers, memory,
priced on the `Cluster`), for every objective of `PipelineSpace`.

The bytes crossing a cut are the tensors made by the layers before it that some layer after it
reads, each tensor once however many readers it has beyond the cut (as `pipedream.to_profile`
counts them): a tensor that skips over a stage crosses both of its cuts. A PipeDream layer has
one output tensor; a layer of a captured step (a segment of its forward chain, `step_dag`) may
make several, each read by other layers (`LayerDag.tensors`).

Bound. Wide graphs have far too many downsets (Inception-v3 and NASNet: over 200,000; the DP's
tables are K x K). `downset_family` keeps the downsets within a *lookahead* h of the straight
order: D is kept when every layer of D lies at most h positions after the first layer D leaves
out, in the straight order (prefixes have lookahead 0, every downset lies within n - 1). It takes
the largest h whose family has at most `max_states` members, so the DP is exact over all
downsets when they fit, and otherwise over a family that always contains every prefix of the
straight order: its optimum is never worse than the straight one, and `DownsetSolution.complete`
says which. When the straight order is the only topological order (a chain, skip edges allowed)
the downsets are its prefixes and `solve_downsets` runs the linear DP (`dp.solve`) directly.

A plan on downsets is still a plan of one order: list each stage's layers, in the straight order,
stage after stage. `DownsetSolution.profile` is that order's profile and `solution.plan` cuts it,
so `costs.evaluate_plan`, the simulator and the runner price and run it unchanged. The DQN, the
inference network and the greedy search keep cutting the straight order (`dag.straight`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from hlomap.cost.cluster import Cluster
from hlomap.cost.pipeline.profile import SYNC_FIELDS, PipelineProfile, Prefix
from hlomap.tasks.pipeline.dp import CutStates, solve, solve_states
from hlomap.tasks.pipeline.solution import Solution
from hlomap.tasks.pipeline.space import PipelineSpace

__all__ = [
    "DEFAULT_MAX_STATES",
    "DagTensor",
    "DownsetFamily",
    "DownsetSolution",
    "LayerDag",
    "downset_family",
    "downset_states",
    "solve_downsets",
]

log = logging.getLogger(__name__)

#: Default bound on the DP's cut states: its tables are K x K (32 MiB each at 2048) and a pass
#: costs O(D K^2). PipeDream's ResNet, ResNeXt, DenseNet, SqueezeNet and gnmt graphs have fewer
#: downsets than this; gnmt_large has 16,886, inception_v3 221,565, the NASNets more.
DEFAULT_MAX_STATES = 2048


class DagTensor(NamedTuple):
    """A tensor one layer makes and later layers read: it crosses a cut that has its producer
    before it and one of its readers after it."""

    producer: int
    readers: tuple[int, ...]
    nbytes: float


@dataclass(frozen=True, eq=False)
class LayerDag:
    """Layers and the tensors between them, numbered in one topological order (the straight
    order: PipeDream's node numbers, a module's instruction order).

    Attributes:
      names, forward_time, backward_time, parameter_bytes, stash_bytes, source: per layer, as in
        `PipelineProfile` (seconds and bytes per microbatch).
      output_bytes: [n] bytes of each layer's output tensor (with `tensors`: of all its outputs).
      consumers: for each layer, the later layers that read its output.
      tensors: the tensors that cross cuts, when a layer makes several read by different layers
        (their readers must be among the producer's consumers); default: one per layer, its
        output of `output_bytes` read by all its consumers.
      update_seconds_per_byte: as in `PipelineProfile` (the optimizer update per parameter byte).
      pass_buffers, state_leaves: as in `PipelineProfile` (what the executors' costs grow with).
    """

    names: tuple[str, ...]
    forward_time: np.ndarray
    backward_time: np.ndarray
    parameter_bytes: np.ndarray
    stash_bytes: np.ndarray | None
    output_bytes: np.ndarray
    consumers: tuple[tuple[int, ...], ...]
    source: str = "<dag>"
    tensors: tuple[DagTensor, ...] | None = None
    update_seconds_per_byte: float = 0.0
    forward_fixed: np.ndarray | None = None
    backward_fixed: np.ndarray | None = None
    forward_syncs: np.ndarray | None = None  # the in-pass all-reduces (`PipelineProfile.forward_syncs`)
    backward_syncs: np.ndarray | None = None
    forward_sync_bytes: np.ndarray | None = None
    backward_sync_bytes: np.ndarray | None = None
    gradient_buffers: np.ndarray | None = None  # each layer's trainable arrays (`PipelineProfile.gradient_buffers`)
    replica_transposes: np.ndarray | None = None  # `PipelineProfile.replica_transposes`
    pass_buffers: float = 0.0
    state_leaves: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.names)
        if len(self.consumers) != n:
            raise ValueError(
                f"{self.source}: LayerDag has {n} layers but consumers for {len(self.consumers)}"
            )
        for i, readers in enumerate(self.consumers):
            bad = [c for c in readers if not i < c < n]
            if bad:
                raise ValueError(
                    f"{self.source}: layer {i} ({self.names[i]}) feeds {bad}: consumers must "
                    f"be later layers of the straight order, in [{i + 1}, {n})"
                )
        object.__setattr__(self, "consumers", tuple(tuple(sorted(set(int(c) for c in readers)))
                                                    for readers in self.consumers))
        output = np.array(self.output_bytes, dtype=np.float64).reshape(-1)
        if output.shape != (n,) or not (np.isfinite(output) & (output >= 0)).all():
            raise ValueError(
                f"{self.source}: LayerDag.output_bytes needs {n} finite values >= 0, got "
                f"{output.shape[0]} ({output[:4]}...)"
            )
        output.setflags(write=False)
        object.__setattr__(self, "output_bytes", output)
        object.__setattr__(self, "tensors", self._checked_tensors())
        # The straight order's profile checks (and freezes a copy of) every per-layer array.
        straight = self.linearize(range(n))
        for name in ("forward_time", "backward_time", "parameter_bytes", "stash_bytes", "forward_fixed",
                     "backward_fixed", *SYNC_FIELDS):
            object.__setattr__(self, name, getattr(straight, name))
        object.__setattr__(self, "_straight", straight)

    def _checked_tensors(self) -> tuple[DagTensor, ...]:
        """The given tensors, checked, in producer order; or one per layer with consumers."""
        if self.tensors is None:
            return tuple(DagTensor(i, readers, float(self.output_bytes[i]))
                         for i, readers in enumerate(self.consumers) if readers)
        checked = []
        for t in self.tensors:
            producer, readers, nbytes = int(t.producer), tuple(sorted(set(int(r) for r in t.readers))), float(t.nbytes)
            outside = [r for r in readers if r not in self.consumers[producer]] if 0 <= producer < len(self.names) \
                else list(readers)
            if outside or not readers or not (math.isfinite(nbytes) and nbytes >= 0):
                raise ValueError(
                    f"{self.source}: tensor of layer {producer} read by {list(readers)} ({nbytes} bytes): a tensor "
                    f"needs finite bytes >= 0 and readers among its producer's consumers"
                )
            checked.append(DagTensor(producer, readers, nbytes))
        return tuple(sorted(checked, key=lambda t: (t.producer, t.readers)))

    @property
    def n_layers(self) -> int:
        return len(self.names)

    @property
    def straight(self) -> PipelineProfile:
        """The profile of the straight order (what `pipedream.to_profile` returns)."""
        return self._straight  # type: ignore[attr-defined,no-any-return]

    @property
    def is_chain(self) -> bool:
        """Every layer feeds the next one: the straight order is the only topological order, so
        its prefixes are the only downsets."""
        return all(i + 1 in readers for i, readers in enumerate(self.consumers[:-1]))

    def predecessors(self) -> list[int]:
        """For each layer, the bit mask (a Python int over layer indices) of its producers."""
        masks = [0] * self.n_layers
        for producer, readers in enumerate(self.consumers):
            for reader in readers:
                masks[reader] |= 1 << producer
        return masks

    def crossing_bytes(self, members: np.ndarray) -> np.ndarray:
        """[K]: bytes that cross a cut after each of K sets of layers (`members` [K, n] bool),
        each crossing tensor counted once, summed in producer order (so that equal sets give
        equal bits whichever way they were built)."""
        tensors = self.tensors or ()
        frontier = np.zeros((members.shape[0], len(tensors)), dtype=bool)
        for t, tensor in enumerate(tensors):
            left_behind = ~members[:, list(tensor.readers)].all(axis=1)
            frontier[:, t] = members[:, tensor.producer] & left_behind
        return _sequential_sum(frontier, np.array([t.nbytes for t in tensors], dtype=np.float64))

    def reordered(self, order: Sequence[int]) -> LayerDag:
        """The same DAG with its layers numbered in `order` (a topological order: layer
        order[i] becomes layer i), so that it is the straight order the lookahead bounds."""
        order = [int(i) for i in order]
        self.linearize(order)  # checks that `order` is a topological order of every layer
        new = {old: i for i, old in enumerate(order)}

        def moved(values: np.ndarray | None) -> np.ndarray | None:
            return None if values is None else np.asarray(values)[order]

        return LayerDag(
            names=tuple(self.names[i] for i in order),
            forward_time=moved(self.forward_time),  # type: ignore[arg-type]
            backward_time=moved(self.backward_time),  # type: ignore[arg-type]
            parameter_bytes=moved(self.parameter_bytes),  # type: ignore[arg-type]
            stash_bytes=moved(self.stash_bytes),
            output_bytes=moved(self.output_bytes),  # type: ignore[arg-type]
            consumers=tuple(tuple(new[c] for c in self.consumers[i]) for i in order),
            source=self.source,
            tensors=tuple(DagTensor(new[t.producer], tuple(new[r] for r in t.readers), t.nbytes)
                          for t in self.tensors or ()),
            update_seconds_per_byte=self.update_seconds_per_byte,
            forward_fixed=moved(self.forward_fixed),
            backward_fixed=moved(self.backward_fixed),
            **{name: moved(getattr(self, name)) for name in SYNC_FIELDS},
            pass_buffers=self.pass_buffers,
            state_leaves=self.state_leaves,
        )

    def latest_order(self) -> tuple[int, ...]:
        """A topological order that runs every layer as late as its readers allow: a depth-first
        walk from the sinks backwards that takes a layer as soon as all its readers are taken
        (the last one ready first; of layers ready together, the earliest of the straight order
        first), reversed. A branch that feeds a layer far ahead (T5's decoder embedding and
        first self-attention, read only with the encoder's output) moves up next to it, so
        that the lookahead family around this order holds the cuts that keep it out of the
        stages in between; a label's one-hot, read only by the loss, moves next to the loss."""
        remaining = [len(readers) for readers in self.consumers]
        producers: list[list[int]] = [[] for _ in self.names]
        for producer, readers in enumerate(self.consumers):
            for reader in readers:
                producers[reader].append(producer)
        stack = sorted((i for i, count in enumerate(remaining) if count == 0), reverse=True)
        backwards: list[int] = []
        while stack:
            layer = stack.pop()
            backwards.append(layer)
            ready = []
            for producer in producers[layer]:
                remaining[producer] -= 1
                if remaining[producer] == 0:
                    ready.append(producer)
            stack.extend(sorted(ready, reverse=True))  # the earliest on top
        return tuple(reversed(backwards))

    def linearize(self, order: Sequence[int] | range | None = None) -> PipelineProfile:
        """The profile of the layers in `order` (a topological order; default: the straight one),
        its pivots crossed by `crossing_bytes` of each prefix."""
        n = self.n_layers
        order = np.arange(n) if order is None else np.asarray(order, dtype=np.int64)
        position = np.full(n, -1)
        position[order] = np.arange(len(order))
        if len(order) != n or (position < 0).any():
            raise ValueError(f"{self.source}: an order must list each of the {n} layers once")
        for producer, readers in enumerate(self.consumers):
            late = [r for r in readers if position[r] < position[producer]]
            if late:
                raise ValueError(
                    f"{self.source}: the order puts {self.names[late[0]]} before its input "
                    f"{self.names[producer]}"
                )
        prefixes = position[None, :] < np.arange(n + 1)[:, None]
        crossing = self.crossing_bytes(prefixes)

        def ordered(values: np.ndarray | None) -> np.ndarray | None:
            return None if values is None else np.asarray(values, dtype=np.float64)[order]

        return PipelineProfile(
            names=tuple(self.names[i] for i in order),
            forward_time=ordered(self.forward_time),
            backward_time=ordered(self.backward_time),
            activation_bytes=crossing[1:n],
            parameter_bytes=ordered(self.parameter_bytes),
            stash_bytes=ordered(self.stash_bytes),
            source=self.source,
            update_seconds_per_byte=self.update_seconds_per_byte,
            forward_fixed=ordered(self.forward_fixed),
            backward_fixed=ordered(self.backward_fixed),
            **{name: ordered(getattr(self, name)) for name in SYNC_FIELDS},
            pass_buffers=self.pass_buffers,  # the step's, whatever the order of its layers
            state_leaves=self.state_leaves,
        )


def _sequential_sum(mask: np.ndarray, values: np.ndarray) -> np.ndarray:
    """[K]: sum of values[v] over the v set in each row of `mask`, added left to right as
    `PipelineProfile.prefix` adds them, so that a prefix's total equals its prefix sum exactly."""
    if mask.shape[1] == 0:
        return np.zeros(mask.shape[0])
    return np.cumsum(np.where(mask, values[None, :], 0.0), axis=1)[:, -1]


class DownsetFamily(NamedTuple):
    """The cut states of a downset DP: `members` [K, n] bool (row 0 empty, row K - 1 all
    layers), the `lookahead` that bounded them, and whether they are all the DAG's downsets."""

    members: np.ndarray
    lookahead: int
    complete: bool


def _within(predecessors: list[int], n: int, lookahead: int, limit: int) -> list[int] | None:
    """Bit masks of the downsets of lookahead <= `lookahead` (module docstring), or None when
    there are more than `limit`. Each is found once, from the first layer it leaves out (p):
    the prefix [0, p) plus a downset-closed set of layers among p + 1 .. p + lookahead."""
    found: list[int] = []
    for p in range(n + 1):
        prefix = (1 << p) - 1
        sets = [prefix]
        for v in range(p + 1, min(p + lookahead, n - 1) + 1):
            needs = predecessors[v]
            grown = [s | (1 << v) for s in sets if needs & ~s == 0]
            sets.extend(grown)
            if len(found) + len(sets) > limit:
                return None
        found.extend(sets)
        if len(found) > limit:
            return None
    return found


def downset_family(dag: LayerDag, max_states: int = DEFAULT_MAX_STATES) -> DownsetFamily:
    """Every downset of `dag` when there are at most `max_states`; otherwise those within the
    largest lookahead whose family fits (at least the n + 1 prefixes, whatever `max_states`)."""
    n = dag.n_layers
    predecessors = dag.predecessors()
    limit = max(max_states, n + 1)
    masks = _within(predecessors, n, n - 1, limit)
    lookahead, complete = n - 1, masks is not None
    if masks is None:
        fits, too_many = 0, n - 1  # lookahead 0 gives the n + 1 prefixes, which fit
        while too_many - fits > 1:
            middle = (fits + too_many) // 2
            if _within(predecessors, n, middle, limit) is None:
                too_many = middle
            else:
                fits = middle
        lookahead = fits
        masks = _within(predecessors, n, lookahead, limit)
        assert masks is not None
        log.info("%s: %d downsets within lookahead %d (all downsets: more than %d)",
                 dag.source, len(masks), lookahead, limit)
    members = np.zeros((len(masks), n), dtype=bool)
    for row, mask in enumerate(masks):
        bits = np.frombuffer(mask.to_bytes((n + 7) // 8, "little"), dtype=np.uint8)
        members[row] = np.unpackbits(bits, bitorder="little")[:n].astype(bool)
    return DownsetFamily(members, lookahead, complete)


def _proper_subsets(members: np.ndarray) -> np.ndarray:
    """[K, K] bool: row a's set is a proper subset of row b's."""
    k, n = members.shape
    words = np.packbits(members, axis=1, bitorder="little")
    words = np.pad(words, ((0, 0), (0, -words.shape[1] % 8))).view(np.uint64)
    sizes = members.sum(axis=1)
    nested = np.zeros((k, k), dtype=bool)
    for a in range(k):
        inside = ~np.any(words[a][None, :] & ~words, axis=1)
        nested[a] = inside & (sizes > sizes[a])
    return nested


def downset_states(dag: LayerDag, family: DownsetFamily) -> CutStates:
    """The DP's view of a downset family: per-downset totals, nesting, crossing bytes."""
    members = family.members
    compute = dag.forward_time + dag.backward_time
    stash = dag.stash_bytes if dag.stash_bytes is not None else np.zeros(dag.n_layers)
    totals = Prefix(
        forward=_sequential_sum(members, dag.forward_time),
        backward=_sequential_sum(members, dag.backward_time),
        compute=_sequential_sum(members, compute),
        parameter=_sequential_sum(members, dag.parameter_bytes),
        stash=_sequential_sum(members, stash),
        trainable=_sequential_sum(members, (dag.parameter_bytes > 0).astype(np.float64)),
        fixed=_sequential_sum(members, dag.forward_fixed + dag.backward_fixed),  # type: ignore[operator]
        **{name: _sequential_sum(members, getattr(dag, name)) for name in SYNC_FIELDS},
    )
    return CutStates(
        totals=totals,
        nested=_proper_subsets(members),
        cut_bytes=dag.crossing_bytes(members),
        n_layers=dag.n_layers,
        source=dag.source,
        update_per_byte=dag.update_seconds_per_byte,
    )


@dataclass(frozen=True)
class DownsetSolution:
    """The best straight pipeline over a DAG's downsets.

    solution: the plan and its cost; the plan's layer indices are positions in `profile`.
    profile: the DAG's layers in `order`, an order in which every stage is contiguous.
    order: layer indices (of the straight order) in the plan's order.
    states: how many downsets the DP searched; lookahead: the bound they were taken within;
    complete: True when they were all the DAG's downsets (the optimum over every straight
      pipeline), False when the bound cut them (the optimum over that family only).
    """

    solution: Solution
    profile: PipelineProfile
    order: tuple[int, ...]
    states: int
    lookahead: int
    complete: bool

    @property
    def value(self) -> float:
        return self.solution.value

    def stage_layers(self) -> tuple[tuple[str, ...], ...]:
        """The names of each stage's layers."""
        names = self.profile.names
        return tuple(names[s.start:s.stop] for s in self.solution.plan.stages)


def _stage_order(members: np.ndarray, chain: Sequence[int]) -> tuple[int, ...]:
    """The layers of each stage of a chain of nested downsets, stage after stage, each stage's
    in the straight order: a topological order in which every stage is contiguous."""
    order: list[int] = []
    for before, after in zip(chain[:-1], chain[1:]):
        order.extend(int(i) for i in np.flatnonzero(members[after] & ~members[before]))
    return tuple(order)


def solve_downsets(
    dag: LayerDag,
    cluster: Cluster,
    space: PipelineSpace,
    *,
    max_states: int = DEFAULT_MAX_STATES,
    extra: np.ndarray | None = None,
) -> DownsetSolution:
    """The plan of `space` with the least objective over the downsets of `dag` (module
    docstring; at most `max_states` of them, else a lookahead family, to which `extra` [E, n]
    bool adds more downsets, such as the prefixes of another order); raises `NoFeasiblePlan`."""
    n = dag.n_layers
    if dag.is_chain:
        solution = solve(dag.straight, cluster, space)
        return DownsetSolution(solution, dag.straight, tuple(range(n)), n + 1, 0, True)
    family = downset_family(dag, max_states)
    members = family.members
    if extra is not None and not family.complete:
        members = np.unique(np.concatenate([members, np.asarray(extra, dtype=bool)]), axis=0)
        members = members[np.argsort(members.sum(axis=1), kind="stable")]  # empty first, all layers last
        family = DownsetFamily(members, family.lookahead, False)

    def realize(chain: Sequence[int]) -> tuple[PipelineProfile, tuple[int, ...]]:
        bounds = tuple(int(members[state].sum()) for state in chain)
        return dag.linearize(_stage_order(members, chain)), bounds

    found = solve_states(downset_states(dag, family), realize, cluster, space)
    order = _stage_order(members, found.states)
    return DownsetSolution(found.solution, found.profile, order, len(members), family.lookahead,
                           family.complete)
