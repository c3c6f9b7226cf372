"""Incremental pricing of placements for local search: swap two slots, re-price only what moved.

A search state holds a permutation `order` of every device of the cluster: slot i < n holds the
device of logical position i, slots >= n hold the unused devices (so moving a position onto an
unused device is a swap too). `try_swap(a, b)` returns the (value, tiebreak) the state would have
with slots a and b exchanged, without changing it; `swap(a, b)` commits. Each try re-prices only
what the two slots touch, which is what lets a 512-device placement run thousands of moves a
second:

- mesh layouts: per communication term, the device groups holding a or b, plus (when the swap
  changes how many of a group's members sit on a node) every group sharing a node whose NIC load
  changed; each group is priced by `cost.collectives.GroupCost` under the term's joint load, as
  `collective_time` prices each of its groups, so the value equals `problem.step_seconds`. On a
  cluster with a network (a torus or mesh), every group's flows share links with the others', so
  a swap that touches a term re-prices all of its groups at once (`collective_group_times`);
- stage layouts: the (at most two) stages holding a or b and the cuts next to them, priced by the
  pipeline cost model through `PipelineModel`; L is recombined from the per-stage and per-cut
  times exactly as `cost.pipeline.costs.evaluate_plan` combines them (a test holds them equal);
- joint layouts: the same, each stage priced by its mesh's collectives on its placed groups
  (`MeshStage.time`), L combined by `JointLayout.latency`;
- stage layouts of several model chunks per stage (interleaved 1F1B, a circular GPipe): no closed
  form combines per-stage times there, so every trial prices the whole plan (`step_seconds`; the
  event timeline over S V logical stages), with its communication seconds as the tie-break.

The value is the step time. Many moves leave it unchanged (a max over groups or ring edges only
moves when its argmax does), so the tiebreak - the mean over groups, or the sum of every stage and
cut time - lets a search walk such plateaus towards a lower max. `Affinity` is a cheaper, smoother
proxy (pairwise latency and inverse-bandwidth weights between positions) that ranks candidate
devices for a position; it never decides a reported time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol, Sequence

import numpy as np

from hlomap.cost.cluster import Cluster
from hlomap.cost.collectives import Collective, GroupCost, collective_group_times
from hlomap.cost.mapping import AxisMapping
from hlomap.cost.pipeline.costs import allreduce_share, pipeline_latency, stage_sync_seconds
from hlomap.cost.pipeline.profile import replicated_seconds
from hlomap.cost.pipeline.stages import Stage
from hlomap.tasks.placement.pipeline_costs import PipelineModel
from hlomap.tasks.placement.problem import JointLayout, MeshLayout, PlacementProblem, StageLayout

__all__ = ["Affinity", "SearchState", "affinity", "new_state"]

#: Groups up to this size get an affinity edge between every pair of members (collectives are as
#: slow as the slowest pair); larger ones only between ring neighbours.
ALL_PAIRS_LIMIT = 16


class SearchState(Protocol):
    """What the placement task needs from an incremental pricing state (module docstring)."""

    problem: PlacementProblem
    order: np.ndarray
    value: float
    tiebreak: float

    def try_swap(self, a: int, b: int) -> tuple[float, float]: ...

    def swap(self, a: int, b: int) -> None: ...



# ---------------------------------------------------------------------------------------------
# Mesh layouts
# ---------------------------------------------------------------------------------------------


class _TermTrial(NamedTuple):
    times: np.ndarray
    load: np.ndarray
    costs: dict[int, GroupCost]
    node_rows: dict[int, np.ndarray]


class _TermState:
    """One communication term: its groups of slots, each analysed once (`GroupCost`), and each
    group's time under the joint load (`load[node]`: cross-node streams on the node, summed)."""

    def __init__(self, cluster: Cluster, kind: Collective, nbytes: float, count: float, groups: np.ndarray,
                 n_slots: int, order: np.ndarray, node_of: np.ndarray, n_nodes: int):
        self.cluster, self.kind, self.nbytes, self.count = cluster, kind, nbytes, count
        self.groups = groups
        self.group_of = np.full(n_slots, -1, dtype=np.int64)
        for g, members in enumerate(groups):
            self.group_of[members] = g
        self.node_of = node_of
        self.n_nodes = n_nodes
        self.nics = cluster.nics_per_node
        devices = order[groups]
        self.costs = [GroupCost(kind, cluster, devices[g]) for g in range(len(groups))]
        self.load = np.sum([self._streams(c) for c in self.costs], axis=0)
        self.node_count = np.stack([np.bincount(node_of[devices[g]], minlength=n_nodes) for g in range(len(groups))])
        self.times = np.array([c.seconds(nbytes, self.load) for c in self.costs])

    def _streams(self, cost: GroupCost) -> np.ndarray:
        out = np.zeros(self.n_nodes, dtype=np.int64)
        for node, count in cost.streams.items():
            out[node] = count
        return out

    def _shares(self, groups: np.ndarray, load: np.ndarray) -> np.ndarray:
        """NIC-sharing factor of each of `groups` under `load` (as `collectives` computes it)."""
        worst = np.where(self.node_count[groups] > 0, load[None, :], 0).max(axis=1)
        return np.maximum(1.0, worst / self.nics)

    def price(self, times: np.ndarray) -> tuple[float, float]:
        return self.count * float(times.max()), self.count * float(times.mean())

    def trial(self, order: np.ndarray, a: int, b: int) -> _TermTrial | None:
        """The term after exchanging slots a and b of `order` (None: it does not change)."""
        ga, gb = int(self.group_of[a]), int(self.group_of[b])
        changed = sorted({g for g in (ga, gb) if g >= 0})
        if not changed:
            return None
        swapped = order.copy()
        swapped[a], swapped[b] = order[b], order[a]
        costs = {g: GroupCost(self.kind, self.cluster, swapped[self.groups[g]]) for g in changed}
        rows: dict[int, np.ndarray] = {}
        load = self.load
        affected: list[int] = []
        if ga != gb and self.node_of[order[a]] != self.node_of[order[b]]:
            load = self.load.copy()
            for g in changed:
                load += self._streams(costs[g]) - self._streams(self.costs[g])
                rows[g] = np.bincount(self.node_of[costs[g].devices], minlength=self.n_nodes)
            moved = np.flatnonzero(load != self.load)
            if moved.size:
                # Other groups are re-priced only where the change alters their NIC share.
                others = np.setdiff1d(np.flatnonzero(self.node_count[:, moved].any(axis=1)), changed)
                if others.size:
                    differs = self._shares(others, load) != self._shares(others, self.load)
                    affected = others[differs].tolist()
        times = self.times.copy()
        for g in changed:
            times[g] = costs[g].seconds(self.nbytes, load)
        for g in affected:
            times[g] = self.costs[g].seconds(self.nbytes, load)
        return _TermTrial(times, load, costs, rows)

    def commit(self, trial: _TermTrial) -> None:
        self.times, self.load = trial.times, trial.load
        for g, cost in trial.costs.items():
            self.costs[g] = cost
        for g, row in trial.node_rows.items():
            self.node_count[g] = row


class _JointTermState:
    """One communication term on a cluster with a network: its groups' flows share links, so a
    group's time depends on where every other group sits, and a trial re-prices the whole term
    (`collective_group_times`, which `collective_time` takes the max of)."""

    def __init__(self, cluster: Cluster, kind: Collective, nbytes: float, count: float, groups: np.ndarray,
                 n_slots: int, order: np.ndarray):
        self.cluster, self.kind, self.nbytes, self.count = cluster, kind, nbytes, count
        self.groups = groups
        self.in_term = np.zeros(n_slots, dtype=bool)
        self.in_term[groups.reshape(-1)] = True
        self.times = collective_group_times(kind, cluster, order[groups], nbytes)

    def price(self, times: np.ndarray) -> tuple[float, float]:
        return self.count * float(times.max()), self.count * float(times.mean())

    def trial(self, order: np.ndarray, a: int, b: int) -> _TermTrial | None:
        if not (self.in_term[a] or self.in_term[b]):
            return None
        swapped = order.copy()
        swapped[a], swapped[b] = order[b], order[a]
        times = collective_group_times(self.kind, self.cluster, swapped[self.groups], self.nbytes)
        return _TermTrial(times, np.zeros(0, dtype=np.int64), {}, {})

    def commit(self, trial: _TermTrial) -> None:
        self.times = trial.times


class MeshState:
    """Incremental pricing of an SPMD layout (module docstring)."""

    def __init__(self, problem: PlacementProblem, order: Sequence[int]):
        layout = problem.layout
        assert isinstance(layout, MeshLayout)
        self.problem = problem
        self.order = np.array(order, dtype=np.int64)
        cluster = problem.cluster
        node_of = np.asarray(cluster.node_of, dtype=np.int64)
        n_nodes = int(node_of.max()) + 1
        slots = layout.mapping(np.arange(layout.n_positions))
        self.terms: list[_TermState | _JointTermState] = [
            _JointTermState(cluster, t.kind, t.nbytes, t.count, np.asarray(slots.groups(t.axes), dtype=np.int64),
                            problem.n_devices, self.order) if cluster.network is not None else
            _TermState(cluster, t.kind, t.nbytes, t.count, np.asarray(slots.groups(t.axes), dtype=np.int64),
                       problem.n_devices, self.order, node_of, n_nodes)
            for t in layout.terms if len(slots.groups(t.axes)[0]) > 1]
        self.compute = layout.compute_seconds
        self.value, self.tiebreak = self._price([term.times for term in self.terms])
        self._pending: tuple[tuple[int, int], list[_TermTrial | None], tuple[float, float]] | None = None

    def _price(self, times: Sequence[np.ndarray]) -> tuple[float, float]:
        value, tiebreak = self.compute, 0.0
        for term, t in zip(self.terms, times):
            v, tb = term.price(t)
            value, tiebreak = value + v, tiebreak + tb
        return value, tiebreak

    def try_swap(self, a: int, b: int) -> tuple[float, float]:
        trials = [term.trial(self.order, a, b) for term in self.terms]
        priced = self._price([t.times if t is not None else term.times for term, t in zip(self.terms, trials)])
        self._pending = ((a, b), trials, priced)
        return priced

    def swap(self, a: int, b: int) -> None:
        if self._pending is None or self._pending[0] != (a, b):
            self.try_swap(a, b)
        assert self._pending is not None
        _, trials, (self.value, self.tiebreak) = self._pending
        for term, trial in zip(self.terms, trials):
            if trial is not None:
                term.commit(trial)
        self.order[a], self.order[b] = self.order[b], self.order[a]
        self._pending = None


# ---------------------------------------------------------------------------------------------
# Stage layouts
# ---------------------------------------------------------------------------------------------


class _StagedState:
    """Incremental pricing of stages in a row (module docstring): a swap re-prices the stages
    holding its two slots and the cuts beside them; subclasses price one stage (`_stage`), one
    cut (`_cut`) and combine them (`_price`)."""

    def __init__(self, problem: PlacementProblem, order: Sequence[int], positions: tuple[range, ...]):
        self.problem = problem
        self.order = np.array(order, dtype=np.int64)
        self.positions = positions
        self.stage_of = np.full(problem.n_devices, -1, dtype=np.int64)
        for s, members in enumerate(positions):
            self.stage_of[list(members)] = s
        n = len(positions)
        self.t = np.array([self._stage(s, self.order) for s in range(n)])
        self.u = np.array([self._cut(k, self.order) for k in range(n - 1)])
        self.value, self.tiebreak = self._price(self.t, self.u)
        self._pending: tuple[tuple[int, int], np.ndarray, np.ndarray, tuple[float, float]] | None = None

    def _stage(self, s: int, order: np.ndarray) -> float:
        raise NotImplementedError

    def _cut(self, k: int, order: np.ndarray) -> float:
        raise NotImplementedError

    def _price(self, t: np.ndarray, u: np.ndarray) -> tuple[float, float]:
        raise NotImplementedError

    def _devices(self, s: int, order: np.ndarray) -> list[int]:
        return order[list(self.positions[s])].tolist()

    def try_swap(self, a: int, b: int) -> tuple[float, float]:
        stages = sorted({int(s) for s in (self.stage_of[a], self.stage_of[b]) if s >= 0})
        if not stages:
            priced = (self.value, self.tiebreak)
            self._pending = ((a, b), self.t, self.u, priced)
            return priced
        swapped = self.order.copy()
        swapped[a], swapped[b] = self.order[b], self.order[a]
        t, u = self.t.copy(), self.u.copy()
        cuts = set()
        for s in stages:
            t[s] = self._stage(s, swapped)
            cuts |= {k for k in (s - 1, s) if 0 <= k < len(u)}
        for k in cuts:
            u[k] = self._cut(k, swapped)
        priced = self._price(t, u)
        self._pending = ((a, b), t, u, priced)
        return priced

    def swap(self, a: int, b: int) -> None:
        if self._pending is None or self._pending[0] != (a, b):
            self.try_swap(a, b)
        assert self._pending is not None
        _, self.t, self.u, (self.value, self.tiebreak) = self._pending
        self.order[a], self.order[b] = self.order[b], self.order[a]
        self._pending = None


class StageState(_StagedState):
    """Incremental pricing of a pipeline layout (module docstring)."""

    def __init__(self, problem: PlacementProblem, order: Sequence[int]):
        layout = problem.layout
        assert isinstance(layout, StageLayout)
        self.layout = layout
        profile = layout.profile
        # compute per replica, and each stage's optimizer update amortized over the microbatches
        # as the closed form does (`costs.evaluate_plan`; every replica updates all its parameters)
        self.compute = (replicated_seconds(profile.compute_time, profile.compute_fixed, np.asarray(layout.replication))
                        + profile.update_time / layout.microbatches)
        self.profile = profile
        self.params = profile.parameter_bytes
        self.buffers = profile.gradient_buffers
        self.cut_bytes = profile.activation_bytes
        self.m = layout.microbatches
        self.model = PipelineModel(problem.cluster)
        super().__init__(problem, order, layout.stage_positions())

    def _stage(self, s: int, order: np.ndarray) -> float:
        devices = self._devices(s, order)
        allreduce = self.model.allreduce(devices, float(self.params[s]), float(self.buffers[s]))
        # the all-reduces the stage's passes run over its replicas, every microbatch
        syncs = sum(stage_sync_seconds(self.profile, self.problem.cluster, Stage(s, s + 1, tuple(devices))))
        # its gradient all-reduce per microbatch as the executors run it (`costs.allreduce_share`)
        return float(self.compute[s]) + allreduce_share(self.problem.cluster, allreduce, self.m) + syncs

    def _cut(self, k: int, order: np.ndarray) -> float:
        return self.model.transfer(self._devices(k, order), self._devices(k + 1, order), float(self.cut_bytes[k]))

    def _price(self, t: np.ndarray, u: np.ndarray) -> tuple[float, float]:
        """(L, the fill-and-drain part of L as the tie-break), from the one closed form."""
        latency, _ = pipeline_latency(t.tolist(), u.tolist(), self.m)
        return latency, float(t.sum()) + 2 * float(u.sum())


class JointState(_StagedState):
    """Incremental pricing of a joint plan's layout: each stage priced on its mesh (module
    docstring)."""

    def __init__(self, problem: PlacementProblem, order: Sequence[int]):
        layout = problem.layout
        assert isinstance(layout, JointLayout)
        self.joint = layout
        super().__init__(problem, order, layout.stage_positions())

    def _stage(self, s: int, order: np.ndarray) -> float:
        return self.joint.stages[s].time(self.problem.cluster, self._devices(s, order))

    def _cut(self, k: int, order: np.ndarray) -> float:
        return self.joint.stages[k].send_time(self.problem.cluster, self._devices(k, order), self._devices(k + 1, order))

    def _price(self, t: np.ndarray, u: np.ndarray) -> tuple[float, float]:
        return self.joint.latency(t.tolist(), u.tolist()), float(t.sum()) + 2 * float(u.sum())


class ChunkedState:
    """Pricing of a pipeline layout with several model chunks per stage: each trial re-prices the
    whole plan (module docstring)."""

    def __init__(self, problem: PlacementProblem, order: Sequence[int]):
        layout = problem.layout
        assert isinstance(layout, StageLayout) and layout.repeats > 1
        self.problem = problem
        self.layout = layout
        self.model = PipelineModel(problem.cluster)
        self.order = np.array(order, dtype=np.int64)
        self.value, self.tiebreak = self._priced(self.order)
        self._pending: tuple[tuple[int, int], tuple[float, float]] | None = None

    def _priced(self, order: np.ndarray) -> tuple[float, float]:
        cost = self.model.plan_cost(self.layout.profile, self.layout.plan(order[:self.layout.n_positions].tolist()))
        return cost.latency, float(sum(cost.stage_allreduce)) + 2 * float(sum(cost.cut_transfer))

    def try_swap(self, a: int, b: int) -> tuple[float, float]:
        n = self.layout.n_positions
        if a >= n and b >= n:  # two unused devices: nothing moves
            priced = (self.value, self.tiebreak)
        else:
            swapped = self.order.copy()
            swapped[a], swapped[b] = self.order[b], self.order[a]
            priced = self._priced(swapped)
        self._pending = ((a, b), priced)
        return priced

    def swap(self, a: int, b: int) -> None:
        if self._pending is None or self._pending[0] != (a, b):
            self.try_swap(a, b)
        assert self._pending is not None
        self.value, self.tiebreak = self._pending[1]
        self.order[a], self.order[b] = self.order[b], self.order[a]
        self._pending = None


def new_state(problem: PlacementProblem, order: Sequence[int] | None = None) -> SearchState:
    """A search state at `order` (a permutation of all devices; default: the identity placement
    followed by the unused devices)."""
    full = problem.full_order(problem.identity) if order is None else np.asarray(order, dtype=np.int64)
    if sorted(full.tolist()) != list(range(problem.n_devices)):
        raise ValueError(f"order must be a permutation of the {problem.n_devices} devices")
    if isinstance(problem.layout, MeshLayout):
        return MeshState(problem, full)
    if isinstance(problem.layout, JointLayout):
        return JointState(problem, full)
    if problem.layout.repeats > 1:
        return ChunkedState(problem, full)
    return StageState(problem, full)


# ---------------------------------------------------------------------------------------------
# Affinity: a pairwise proxy of the communication between positions
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Affinity:
    """Pairwise weights between logical positions: placing p on device d and q on e costs
    `w_latency * latency[d, e] + w_bytes / bandwidth[d, e]` per edge (p, q). A proxy of the step
    time that is additive over pairs, so the cost of putting one position on every device at
    once is one matrix-vector product (`increments`)."""

    neighbors: tuple[np.ndarray, ...]
    w_latency: tuple[np.ndarray, ...]
    w_bytes: tuple[np.ndarray, ...]
    latency: np.ndarray
    inverse_bandwidth: np.ndarray

    @property
    def n_positions(self) -> int:
        return len(self.neighbors)

    def increments(self, position: int, devices: np.ndarray, placed: np.ndarray | None = None) -> np.ndarray:
        """[n_devices]: the proxy cost between `position` on each device and its neighbours on
        their devices `devices[q]` (only neighbours with `placed[q]`, when given)."""
        nb = self.neighbors[position]
        wl, wb = self.w_latency[position], self.w_bytes[position]
        if placed is not None:
            keep = placed[nb]
            nb, wl, wb = nb[keep], wl[keep], wb[keep]
        if nb.size == 0:
            return np.zeros(self.latency.shape[0])
        where = devices[nb]
        return self.latency[:, where] @ wl + self.inverse_bandwidth[:, where] @ wb

    def swap_delta(self, devices: np.ndarray, a: int, b: int) -> float:
        """Change of the proxy cost when positions (slots) a and b exchange devices; slots past
        the logical positions have no edges."""
        da, db = devices[a], devices[b]
        delta = 0.0
        for p, old, new, other in ((a, da, db, b), (b, db, da, a)):
            if p >= self.n_positions:
                continue
            nb = self.neighbors[p]
            keep = nb != other
            where = devices[nb[keep]]
            wl, wb = self.w_latency[p][keep], self.w_bytes[p][keep]
            delta += float((self.latency[new, where] - self.latency[old, where]) @ wl
                           + (self.inverse_bandwidth[new, where] - self.inverse_bandwidth[old, where]) @ wb)
        return delta

    def total(self, devices: np.ndarray) -> float:
        """The proxy cost of a whole placement (every edge once)."""
        cost = 0.0
        for p in range(self.n_positions):
            cost += float(self.increments(p, devices)[devices[p]])
        return cost / 2


def _edges_of_group(members: Sequence[int], latency_weight: float, bytes_weight: float,
                    all_pairs: bool) -> list[tuple[int, int, float, float]]:
    """Ring edges carry the latency weight (a ring pays its slowest neighbour hop per step) and,
    for large groups, the bytes; small groups spread the bytes over every pair (the slowest pair
    sets a collective's bandwidth)."""
    k = len(members)
    edges = [(members[i], members[(i + 1) % k], latency_weight / k, 0.0 if all_pairs else bytes_weight / k)
             for i in range(k)] if k > 2 else [(members[0], members[1], latency_weight, 0.0 if all_pairs else bytes_weight)]
    if all_pairs:
        pairs = k * (k - 1) / 2
        edges += [(members[i], members[j], 0.0, bytes_weight / pairs) for i in range(k) for j in range(i + 1, k)]
    return edges


def _collective_weights(kind: Collective, k: int, nbytes: float) -> tuple[float, float]:
    """(latency steps, bytes each member moves) of a ring collective of k members."""
    if kind is Collective.ALL_REDUCE:
        return 2 * (k - 1), 2 * (k - 1) / k * nbytes
    return k - 1, (k - 1) / k * nbytes


def _term_edges(slots: AxisMapping, kind: Collective, axes: tuple[str, ...], nbytes: float,
                count: float) -> list[tuple[int, int, float, float]]:
    """The edges of a collective run `count` times over every group of `axes` in `slots`."""
    edges: list[tuple[int, int, float, float]] = []
    for group in slots.groups(axes):
        k = len(group)
        if k < 2:
            continue
        steps, volume = _collective_weights(kind, k, nbytes)
        edges += _edges_of_group(list(group), count * steps, count * volume, k <= ALL_PAIRS_LIMIT)
    return edges


def _joint_edges(layout: JointLayout) -> list[tuple[int, int, float, float]]:
    """A joint layout's edges: each stage's collectives over its mesh (latency and bytes weighted
    per microbatch as the stage pays them), and each cut between the sending replicas' first
    devices and the receivers, weighted like a pipeline's cuts."""
    edges: list[tuple[int, int, float, float]] = []
    positions = layout.stage_positions()
    m = layout.microbatches
    for s, (stage, members) in enumerate(zip(layout.stages, positions)):
        slots = stage.mapping(list(members))
        for term in stage.terms:
            per_latency, per_byte = term.count * term.latency_weight, term.count * term.bytes_weight
            edges += [(p, q, wl * per_latency, wb * per_byte)
                      for p, q, wl, wb in _term_edges(slots, term.kind, term.axes, term.nbytes, 1.0)]
        if s + 1 < len(positions) and stage.send_bytes > 0:
            receivers = positions[s + 1]
            weight = m + 1  # 2 u_k in the sum, and u_k is often the bottleneck of M - 1 periods
            for c in range(stage.data):
                edges.append((members[c * stage.model], receivers[c % len(receivers)], weight / stage.data,
                              weight * stage.send_bytes / stage.data / stage.data))
    return edges


def affinity(problem: PlacementProblem) -> Affinity:
    """The affinity of a problem's layout (weights from its terms, stages and cuts)."""
    layout = problem.layout
    edges: list[tuple[int, int, float, float]] = []
    if isinstance(layout, MeshLayout):
        slots = layout.mapping(np.arange(layout.n_positions))
        for term in layout.terms:
            edges += _term_edges(slots, term.kind, term.axes, term.nbytes, term.count)
    elif isinstance(layout, JointLayout):
        edges = _joint_edges(layout)
    else:
        m = layout.microbatches
        positions = layout.stage_positions()
        profile = layout.profile
        n_stages = len(positions)
        for s, members in enumerate(positions):
            r = len(members)
            params = float(profile.parameter_bytes[s::n_stages].sum())  # every chunk the stage runs
            if r > 1 and params > 0:
                steps, volume = 2 * (r - 1), 2 * (r - 1) / r * params
                edges += _edges_of_group(list(members), steps / m, volume / m, False)
        for k in range(profile.n_layers - 1):  # logical stage k runs on device stage k mod S
            src, dst = positions[k % n_stages], positions[(k + 1) % n_stages]
            chunks = max(len(src), len(dst))
            weight = m + 1  # 2 u_k in the sum, and u_k is often the bottleneck of M - 1 periods
            for c in range(chunks):
                edges.append((src[c % len(src)], dst[c % len(dst)], weight / chunks,
                              weight * float(profile.activation_bytes[k]) / chunks / chunks))
    n = problem.n_positions
    table: list[dict[int, list[float]]] = [{} for _ in range(n)]
    for p, q, wl, wb in edges:
        if p == q:
            continue
        for x, y in ((p, q), (q, p)):
            entry = table[x].setdefault(y, [0.0, 0.0])
            entry[0] += wl
            entry[1] += wb
    cluster = problem.cluster
    with np.errstate(divide="ignore"):
        inverse = np.where(np.isinf(cluster.bandwidth), 0.0, 1.0 / cluster.bandwidth)
    return Affinity(
        neighbors=tuple(np.fromiter(t.keys(), dtype=np.int64, count=len(t)) for t in table),
        w_latency=tuple(np.array([v[0] for v in t.values()]) for t in table),
        w_bytes=tuple(np.array([v[1] for v in t.values()]) for t in table),
        latency=np.asarray(cluster.latency),
        inverse_bandwidth=inverse,
    )
