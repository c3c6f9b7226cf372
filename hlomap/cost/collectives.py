"""Collective communication times on a `Cluster` (alpha-beta model, ring algorithms).

Conventions (p = group size, n = `nbytes`, B = bandwidth, a = latency):
- all-reduce: n is the buffer on each device. Ring: 2(p-1)/p * n/B + 2(p-1) a.
- all-gather: n is the gathered OUTPUT on each device (p x the shard). Ring: (p-1)/p * n/B + (p-1) a.
- reduce-scatter: n is the INPUT on each device (p x the result shard). Same ring cost as all-gather.
- all-to-all: n is the buffer on each device, of which it keeps 1/p and sends (p-1)/p, one block
  per peer in p-1 pairwise-exchange steps: (p-1) * (a + n/(p B)).
- collective-permute: n is what each source sends; pairs run at once; the slowest pair decides.

The slowest link in the group sets the speed: B is the smallest point-to-point bandwidth between
any two members. Latency is the largest between neighbours of the ring, taken in the group's own
order and closing back to its first device (on a torus the natural ring is one hop per step).

An all-reduce whose group spans nodes with k >= 2 members on each of m >= 2 nodes runs
hierarchically, as NCCL does: reduce-scatter inside each node, k concurrent all-reduces across
nodes on 1/k of the data each, all-gather inside each node:
    t = 2 * [(k-1)/k * n/B_in + (k-1) a_in] + 2(m-1)/m * (n/k)/B_x' + 2(m-1) a_x
(B_in, a_in over same-node pairs; B_x, a_x over cross-node pairs). Groups spread unevenly over
nodes fall back to one flat ring.

NIC sharing: streams that leave a node share its `cluster.nics_per_node` interfaces. A node with s
concurrent cross-node streams gives each `B_x * min(1, nics/s)` (that is B_x' above). A flat ring
puts one stream per node on the network, a hierarchical all-reduce k, an all-to-all k; when
several groups run at once (`collective_time` with many groups, e.g. every data-parallel group
of a mesh axis), their streams add up. With one NIC per 8-GPU server, the k rings of a
hierarchical all-reduce therefore move n bytes over the network in total, not n/k. Contention on
links inside a node is not modeled (each GPU has its own NVLinks).

A cluster measured by `hlomap calibrate` carries its collectives' own alpha-beta fits per kind
and group size (`Cluster.measured`, `hlomap.cost.measured`); they replace everything above for
that cluster (`measured_terms`): a fit already holds the algorithm, the links and their sharing.
A collective-permute then takes the fit over the devices its pairs touch.

For fixed devices every time here is affine in n: `all_reduce_terms` and
`collective_permute_terms` return the alpha-beta terms the scalar functions evaluate, so that
callers pricing many byte counts at once (the pipeline DP, `hlomap.cost.pipeline.links`) use the
very same numbers.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from typing import Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from hlomap.cost.cluster import Cluster

_LOG = logging.getLogger(__name__)

Group = Sequence[int]
#: Cross-node streams per node: a mapping node -> streams, or an array indexed by node id.
Load = Mapping[int, int] | np.ndarray


class Collective(enum.Enum):
    """Collective kinds; values are the HLO opcode names, so `Collective(inst.base_opcode)`."""

    ALL_REDUCE = "all-reduce"
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_TO_ALL = "all-to-all"
    COLLECTIVE_PERMUTE = "collective-permute"


class AlphaBeta(NamedTuple):
    """A time affine in the byte count n: `alpha + beta * n` seconds (alpha: latencies, beta:
    seconds per byte)."""

    alpha: float
    beta: float

    def seconds(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes


_FREE = AlphaBeta(0.0, 0.0)


# ---------------------------------------------------------------------------------------------
# Closed forms on one ring of p devices with bandwidth B and per-step latency a
# ---------------------------------------------------------------------------------------------


def ring_all_reduce_terms(p: int, bandwidth: float, latency: float) -> AlphaBeta:
    """Ring all-reduce (reduce-scatter then all-gather): 2(p-1) steps of n/p bytes each."""
    if p <= 1:
        return _FREE
    return AlphaBeta(2 * (p - 1) * latency, 2 * (p - 1) / p / bandwidth)


def ring_all_gather_terms(p: int, bandwidth: float, latency: float) -> AlphaBeta:
    """Ring all-gather or reduce-scatter of an n-byte full buffer: p-1 steps of n/p bytes."""
    if p <= 1:
        return _FREE
    return AlphaBeta((p - 1) * latency, (p - 1) / p / bandwidth)


def ring_all_reduce_seconds(p: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """2(p-1)/p * n/B + 2(p-1) a."""
    return ring_all_reduce_terms(p, bandwidth, latency).seconds(nbytes)


def ring_all_gather_seconds(p: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """(p-1)/p * n/B + (p-1) a."""
    return ring_all_gather_terms(p, bandwidth, latency).seconds(nbytes)


# ---------------------------------------------------------------------------------------------
# Group analysis
# ---------------------------------------------------------------------------------------------


class _Links(NamedTuple):
    bandwidth: float  # slowest link (inf when there is no pair of that class)
    latency: float    # largest latency (0 when there is no pair of that class)


class _Layout(NamedTuple):
    """How a group sits on the nodes of a cluster, and its links by class (same node or not)."""

    devices: np.ndarray
    node_ids: np.ndarray          # the distinct nodes of the group
    per_node: Counter[int]        # node -> members of the group on it
    inside: _Links                # over ordered pairs of distinct members on one node
    across: _Links                # over ordered pairs of members on different nodes
    ring_latency: float           # largest latency between ring neighbours, in group order

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def nodes(self) -> int:
        return len(self.per_node)

    @property
    def per_node_max(self) -> int:
        return max(self.per_node.values())

    @property
    def balanced(self) -> bool:
        return len(set(self.per_node.values())) == 1


def _layout(cluster: Cluster, group: Group, what: str) -> _Layout:
    """The analysis every group price starts from; vectorized, since searches call it a lot.
    The tables' diagonals (bandwidth inf, latency 0) never win a min / max, so a device's pair
    with itself needs no masking out."""
    devices = (group.astype(np.int64).reshape(-1) if isinstance(group, np.ndarray)
               else np.fromiter((int(d) for d in group), dtype=np.int64))
    if devices.size == 0:
        raise ValueError(f"{what}: empty device group")
    if devices.min() < 0 or devices.max() >= cluster.n_devices:
        bad = [int(d) for d in devices if not 0 <= d < cluster.n_devices]
        raise ValueError(f"{what}: device id(s) {bad} out of range for cluster {cluster.name!r} "
                         f"with {cluster.n_devices} devices (group {list(group)})")
    listed = devices.tolist()
    if len(set(listed)) != len(listed):
        raise ValueError(f"{what}: group {list(group)} lists a device twice")
    nodes = cluster.node_array[devices]
    per_node = Counter(nodes.tolist())
    rows, cols = devices[:, None], devices[None, :]
    bandwidth, latency = cluster.bandwidth[rows, cols], cluster.latency[rows, cols]
    ring = max(float(latency[-1, 0]), float(np.diagonal(latency, 1).max(initial=0.0)))
    if len(per_node) == 1:
        inside, across = _Links(float(bandwidth.min()), float(latency.max())), _Links(np.inf, 0.0)
    elif len(per_node) == len(listed):
        inside, across = _Links(np.inf, 0.0), _Links(float(bandwidth.min()), float(latency.max()))
    else:
        same = nodes[:, None] == nodes[None, :]
        inside = _Links(float(np.where(same, bandwidth, np.inf).min()), float(np.where(same, latency, 0.0).max()))
        across = _Links(float(np.where(same, np.inf, bandwidth).min()), float(np.where(same, 0.0, latency).max()))
    return _Layout(devices, np.fromiter(per_node, dtype=np.int64, count=len(per_node)), per_node, inside, across,
                   ring)


def _cross_node_streams(kind: Collective, layout: _Layout) -> dict[int, int]:
    """Streams each node of the group puts on the network (see the module docstring)."""
    if layout.nodes <= 1:
        return {}
    if kind is Collective.ALL_TO_ALL or (kind is Collective.ALL_REDUCE and _hierarchical(layout)):
        return dict(layout.per_node)
    return {node: 1 for node in layout.per_node}


def _hierarchical(layout: _Layout) -> bool:
    return layout.nodes >= 2 and layout.per_node_max >= 2 and layout.balanced


def _nic_share(cluster: Cluster, layout: _Layout, load: Load) -> float:
    """Factor (>= 1) by which NIC sharing slows this group's cross-node streams."""
    if isinstance(load, np.ndarray):
        worst = int(load[layout.node_ids].max())
    else:
        worst = max((load.get(node, 0) for node in layout.per_node), default=0)
    return max(1.0, worst / cluster.nics_per_node)


# ---------------------------------------------------------------------------------------------
# One group, given its NIC share
# ---------------------------------------------------------------------------------------------


def _flat_bandwidth(cluster: Cluster, layout: _Layout, share: float) -> float:
    return min(layout.inside.bandwidth, layout.across.bandwidth / share)


def _all_reduce_terms(cluster: Cluster, layout: _Layout, share: float) -> AlphaBeta:
    if layout.size <= 1:
        return _FREE
    if _hierarchical(layout):
        k, m = layout.per_node_max, layout.nodes
        inside, across = layout.inside, layout.across
        intra = ring_all_gather_terms(k, inside.bandwidth, inside.latency)
        # The rings across nodes each carry 1/k of the buffer.
        inter = ring_all_reduce_terms(m, across.bandwidth / share, across.latency)
        return AlphaBeta(2 * intra.alpha + inter.alpha, 2 * intra.beta + inter.beta / k)
    if layout.nodes >= 2 and layout.per_node_max >= 2:
        _LOG.debug("all-reduce over %s spreads unevenly over nodes %s; using one flat ring",
                   layout.devices.tolist(), dict(layout.per_node))
    bandwidth = _flat_bandwidth(cluster, layout, share)
    return ring_all_reduce_terms(layout.size, bandwidth, layout.ring_latency)


def _all_reduce(cluster: Cluster, layout: _Layout, nbytes: float, share: float) -> float:
    return _all_reduce_terms(cluster, layout, share).seconds(nbytes)


def _all_gather(cluster: Cluster, layout: _Layout, nbytes: float, share: float) -> float:
    if layout.size <= 1:
        return 0.0
    bandwidth = _flat_bandwidth(cluster, layout, share)
    return ring_all_gather_seconds(layout.size, nbytes, bandwidth, layout.ring_latency)


def _all_to_all(cluster: Cluster, layout: _Layout, nbytes: float, share: float) -> float:
    p = layout.size
    if p <= 1:
        return 0.0
    block = nbytes / p
    inside, across = layout.inside, layout.across
    if layout.nodes == 1:
        return (p - 1) * (inside.latency + block / inside.bandwidth)
    if layout.balanced:
        # Schedule the k-1 same-node partners first, then the p-k remote ones, during which
        # all k members of a node send across at once (that is the share).
        k = layout.per_node_max
        return ((k - 1) * (inside.latency + block / inside.bandwidth)
                + (p - k) * (across.latency + block * share / across.bandwidth))
    bandwidth = min(inside.bandwidth, across.bandwidth / share)
    return (p - 1) * (max(inside.latency, across.latency) + block / bandwidth)


def measured_terms(kind: Collective, cluster: Cluster, group_size: int) -> AlphaBeta | None:
    """The terms of `kind` over `group_size` devices as the cluster's calibration measured them
    (`hlomap.cost.measured`: the smallest measured group at least as large), or None when the
    cluster has no such measurement and the links price it."""
    if cluster.measured is None:
        return None
    fit = cluster.measured.collective(kind.value, group_size)
    return None if fit is None else AlphaBeta(fit.latency, fit.seconds_per_byte)


_GROUP_TIME = {
    Collective.ALL_REDUCE: _all_reduce,
    Collective.ALL_GATHER: _all_gather,
    Collective.REDUCE_SCATTER: _all_gather,  # the same ring traffic, reversed
    Collective.ALL_TO_ALL: _all_to_all,
}


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


class GroupCost:
    """One device group of a collective, analysed once: `streams`, the cross-node streams it puts
    on each node's NICs (concurrent groups add theirs up into a joint load), and `seconds(nbytes,
    load)`, its time while the nodes' NICs carry `load` streams in all, its own included (a
    mapping node -> streams, or an array indexed by node id).
    `collective_time` is the largest `seconds` over its groups; a search that moves a few devices
    at a time keeps one per group and rebuilds only those a move touches."""

    def __init__(self, kind: Collective, cluster: Cluster, group: Group, *, what: str | None = None):
        if kind is Collective.COLLECTIVE_PERMUTE:
            raise ValueError("collective-permute takes (src, dst) pairs: use collective_permute_time")
        self.kind = kind
        self.cluster = cluster
        self.layout = _layout(cluster, group, what or f"{kind.value} group")
        self.streams: Counter[int] = Counter(_cross_node_streams(kind, self.layout))

    @property
    def devices(self) -> np.ndarray:
        return self.layout.devices

    def seconds(self, nbytes: float, load: Load) -> float:
        if nbytes < 0:
            raise ValueError(f"{self.kind.value}: nbytes must be >= 0, got {nbytes!r}")
        return self.seconds_at_share(float(nbytes), _nic_share(self.cluster, self.layout, load))

    def seconds_at_share(self, nbytes: float, share: float) -> float:
        """Its time when its cross-node streams run `share` times slower (`_nic_share`)."""
        fit = measured_terms(self.kind, self.cluster, self.layout.size)
        if fit is not None:
            return fit.seconds(nbytes)
        return _GROUP_TIME[self.kind](self.cluster, self.layout, nbytes, share)


def _concurrent_groups(kind: Collective, cluster: Cluster,
                       groups: Iterable[Group]) -> tuple[tuple[GroupCost, float], ...]:
    """Each group of a collective run at once over `groups`, analysed, with the NIC share the
    others' streams give it. Memoized per cluster (which is immutable) and group list: a cost
    model pricing a step asks the same axes' groups for every collective of the step."""
    listed = [g.astype(np.int64).reshape(-1) if isinstance(g, np.ndarray) else np.fromiter(
        (int(d) for d in g), dtype=np.int64) for g in groups]
    key = (kind, tuple(tuple(g.tolist()) for g in listed))
    cache = cluster.collective_memo
    found = cache.get(key)
    if found is not None:
        return found
    costs = [GroupCost(kind, cluster, g, what=f"{kind.value} group {i}") for i, g in enumerate(listed)]
    seen: set[int] = set()
    for cost in costs:
        overlap = seen.intersection(cost.devices.tolist())
        if overlap:
            raise ValueError(f"{kind.value}: concurrent groups must be disjoint; device(s) "
                             f"{sorted(overlap)} appear in more than one group")
        seen.update(cost.devices.tolist())
    load: Counter[int] = Counter()
    for cost in costs:
        load.update(cost.streams)
    found = tuple((cost, _nic_share(cluster, cost.layout, load)) for cost in costs)
    if len(cache) < _MEMO_LIMIT:
        cache[key] = found
    return found


#: Group lists memoized per cluster, at most (a planner over a few thousand devices asks a few
#: hundred: one per mesh axis of each stage option).
_MEMO_LIMIT = 4096


def collective_time(kind: Collective, cluster: Cluster, groups: Iterable[Group], nbytes: float) -> float:
    """Seconds for collective `kind` run at once over each of `groups` (disjoint device groups,
    e.g. `AxisMapping.groups("data")`): the slowest group decides. `nbytes` per the module
    docstring. For collective-permute use `collective_permute_time`."""
    if kind is Collective.COLLECTIVE_PERMUTE:
        raise ValueError("collective-permute takes (src, dst) pairs: use collective_permute_time")
    if nbytes < 0:
        raise ValueError(f"{kind.value}: nbytes must be >= 0, got {nbytes!r}")
    return max((cost.seconds_at_share(float(nbytes), share)
                for cost, share in _concurrent_groups(kind, cluster, groups)), default=0.0)


def group_streams(kind: Collective, cluster: Cluster, group: Group) -> Counter[int]:
    """`GroupCost(kind, cluster, group).streams`."""
    return GroupCost(kind, cluster, group).streams


def group_time(kind: Collective, cluster: Cluster, group: Group, nbytes: float, load: Load) -> float:
    """`GroupCost(kind, cluster, group).seconds(nbytes, load)`: one group's time under a joint
    NIC load (`group_streams` summed over every group running at once, this one included)."""
    return GroupCost(kind, cluster, group).seconds(nbytes, load)


def all_reduce_time(cluster: Cluster, group: Group, nbytes: float) -> float:
    """All-reduce of an `nbytes` buffer over `group` (hierarchical when it spans nodes)."""
    return collective_time(Collective.ALL_REDUCE, cluster, [group], nbytes)


def all_reduce_terms(cluster: Cluster, group: Group) -> AlphaBeta:
    """The terms of `all_reduce_time(cluster, group, n)`, which is `alpha + beta * n` for every
    n >= 0 (zero terms for one device)."""
    layout = _layout(cluster, group, "all-reduce group")
    fit = measured_terms(Collective.ALL_REDUCE, cluster, layout.size)
    if fit is not None:
        return fit
    load = Counter(_cross_node_streams(Collective.ALL_REDUCE, layout))
    return _all_reduce_terms(cluster, layout, _nic_share(cluster, layout, load))


def all_gather_time(cluster: Cluster, group: Group, nbytes: float) -> float:
    """All-gather whose gathered result is `nbytes` on each device."""
    return collective_time(Collective.ALL_GATHER, cluster, [group], nbytes)


def reduce_scatter_time(cluster: Cluster, group: Group, nbytes: float) -> float:
    """Reduce-scatter of an `nbytes` input on each device (each keeps nbytes/p)."""
    return collective_time(Collective.REDUCE_SCATTER, cluster, [group], nbytes)


def all_to_all_time(cluster: Cluster, group: Group, nbytes: float) -> float:
    """All-to-all of an `nbytes` buffer on each device."""
    return collective_time(Collective.ALL_TO_ALL, cluster, [group], nbytes)


def collective_permute_terms(cluster: Cluster, pairs: Sequence[tuple[int, int]]) -> tuple[AlphaBeta, ...]:
    """The terms of the pairs that move data (src != dst), in the order given: when every pair
    sends n bytes at once, the i-th of them takes `terms[i].seconds(n)`. Cross-node pairs share
    their nodes' NICs (send and receive side), which multiplies their seconds per byte."""
    checked = []
    for src, dst in pairs:
        for d in (src, dst):
            if not 0 <= int(d) < cluster.n_devices:
                raise ValueError(f"collective-permute pair ({src}, {dst}): device {d} out of range for "
                                 f"cluster {cluster.name!r} with {cluster.n_devices} devices")
        checked.append((int(src), int(dst)))
    moving = [(s, d) for s, d in checked if s != d]
    fit = measured_terms(Collective.COLLECTIVE_PERMUTE, cluster, len({x for pair in moving for x in pair}))
    if fit is not None and moving:
        return (fit,) * len(moving)
    node = cluster.node_of
    remote = [(s, d) for s, d in checked if node[s] != node[d]]
    out_load = Counter(node[s] for s, _ in remote)
    in_load = Counter(node[d] for _, d in remote)
    terms = []
    for src, dst in checked:
        if src == dst:
            continue
        share = 1.0
        if node[src] != node[dst]:
            share = max(1.0, max(out_load[node[src]], in_load[node[dst]]) / cluster.nics_per_node)
        terms.append(AlphaBeta(float(cluster.latency[src, dst]), share / float(cluster.bandwidth[src, dst])))
    return tuple(terms)


def collective_permute_time(cluster: Cluster, pairs: Sequence[tuple[int, int]], nbytes: float) -> float:
    """Every (src, dst) pair sends `nbytes` at once (a collective-permute, or pipeline p2p);
    the slowest pair decides. Cross-node pairs share their nodes' NICs (send and receive side)."""
    if nbytes < 0:
        raise ValueError(f"collective-permute: nbytes must be >= 0, got {nbytes!r}")
    return max((term.seconds(nbytes) for term in collective_permute_terms(cluster, pairs)), default=0.0)
