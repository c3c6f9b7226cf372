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

Tori and meshes (clusters with a `network`, `hlomap.cost.network`) are priced over their links
instead of the tables above: every collective is its algorithm's flows, routed in dimension order,
and flows that run at once share each link's bandwidth. A collective over several groups (every
group of a mesh axis) runs them at the same time, so the groups' flows share links too:
- ring all-reduce: 2(p-1) phases, ring all-gather and reduce-scatter: p-1 phases; in each, every
  member sends n/p bytes to its successor in group order (the last to the first). The phases of a
  ring move the same flows, so they are routed and counted once;
- all-to-all: every member sends n/p bytes to each of the p-1 others, all at once (as NCCL posts
  an all-to-all's sends together): one phase of p(p-1) flows, whose busiest link on a torus is
  within a tie-break of the bisection bound; its latency stays p-1 steps of the group's longest
  route, as the tables price it;
- collective-permute: every pair at once, n bytes each.
A group's phase takes the longest latency of its flows' routes plus n/p bytes at the share of the
busiest link its flows cross, `max_l flows_l / bandwidth_l` seconds per byte with flows_l counting
every group's flows; a group's time is that per phase, the collective's the slowest group's (a
collective-permute pair's: its route's latency plus n at its own busiest link's share). For flows
of one size that start together, the largest of these bandwidth terms is exactly when the last
flow finishes under max-min fair sharing (`hlomap.cost.network`); a group whose own busiest link
is less loaded finishes no later than its term says. Taking the largest latency and the busiest
link per group keeps every time affine in n (`all_reduce_terms`). With every link alone (one
group on a torus ring) this is the ring closed form above.

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
from hlomap.cost.network import Network

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


# ---------------------------------------------------------------------------------------------
# Clusters with a network: flows sharing links (module docstring)
# ---------------------------------------------------------------------------------------------


def _listed(groups: Iterable[Group]) -> list[np.ndarray]:
    return [g.astype(np.int64).reshape(-1) if isinstance(g, np.ndarray) else np.fromiter(
        (int(d) for d in g), dtype=np.int64) for g in groups]


def _check_groups(kind: Collective, cluster: Cluster, listed: Sequence[np.ndarray]) -> None:
    """Refuse a group with a device out of range or listed twice, and groups that overlap (as
    `_layout` and `_concurrent_groups` refuse them)."""
    every = np.concatenate(listed) if listed else np.zeros(0, np.int64)
    if (all(g.size for g in listed) and (not every.size or (every.min() >= 0 and every.max() < cluster.n_devices))
            and np.unique(every).size == every.size):
        return  # the common case, vectorized; the loop below names what is wrong
    seen: set[int] = set()
    for i, devices in enumerate(listed):
        what = f"{kind.value} group {i}"
        if devices.size == 0:
            raise ValueError(f"{what}: empty device group")
        members = devices.tolist()
        bad = [d for d in members if not 0 <= d < cluster.n_devices]
        if bad:
            raise ValueError(f"{what}: device id(s) {bad} out of range for cluster {cluster.name!r} "
                             f"with {cluster.n_devices} devices (group {members})")
        if len(set(members)) != len(members):
            raise ValueError(f"{what}: group {members} lists a device twice")
        overlap = seen.intersection(members)
        if overlap:
            raise ValueError(f"{kind.value}: concurrent groups must be disjoint; device(s) "
                             f"{sorted(overlap)} appear in more than one group")
        seen.update(members)


#: Flows routed at a time when a phase has many (an all-to-all over thousands of devices): bounds
#: the [flows, hops] route table in memory.
_ROUTE_CHUNK = 1 << 18


def _group_flows(kind: Collective, groups: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sources, destinations, offsets): the flows every group puts on the network at once,
    group by group (group i's from `offsets[i]`; a group of one device has none). A ring: each
    member to its successor in group order. An all-to-all: each member to every other."""
    p = len(groups[0]) if groups else 0
    if p > 1 and all(len(g) == p for g in groups):  # one mesh axis: a [groups, p] block at once
        block = np.stack(groups)
        if kind is Collective.ALL_TO_ALL:
            others = (np.arange(p)[:, None] + np.arange(1, p)[None, :]) % p
            src, dst = np.repeat(block, p - 1, axis=1).reshape(-1), block[:, others].reshape(-1)
        else:
            src, dst = block.reshape(-1), np.roll(block, -1, axis=1).reshape(-1)
        per_group = p * (p - 1) if kind is Collective.ALL_TO_ALL else p
        return src, dst, np.arange(len(groups), dtype=np.int64) * per_group
    src, dst, counts = [], [], []
    for g in groups:
        p = len(g)
        if p < 2:
            counts.append(0)
            continue
        if kind is Collective.ALL_TO_ALL:
            shifts = np.arange(1, p)
            src.append(np.repeat(g, p - 1))
            dst.append(g[(np.arange(p)[:, None] + shifts[None, :]) % p].reshape(-1))
        else:
            src.append(g)
            dst.append(np.roll(g, -1))
        counts.append(len(src[-1]))
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    if not src:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), offsets
    return np.concatenate(src), np.concatenate(dst), offsets


def _shared_links(network: Network, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(route latency, busiest link's seconds per byte) of each flow, every flow counted on the
    links it shares; routed a chunk at a time (counted in one pass, priced in a second)."""
    chunks = range(0, len(src), _ROUTE_CHUNK)
    if len(src) <= _ROUTE_CHUNK:
        routes = network.routes(src, dst)
        return network.route_latency(routes), network.busiest_link_seconds_per_byte(routes)
    flows = np.zeros(network.n_links, dtype=np.int64)
    for i in chunks:
        flows += network.link_flows(network.routes(src[i:i + _ROUTE_CHUNK], dst[i:i + _ROUTE_CHUNK]))
    latency, per_byte = np.empty(len(src)), np.empty(len(src))
    for i in chunks:
        routes = network.routes(src[i:i + _ROUTE_CHUNK], dst[i:i + _ROUTE_CHUNK])
        latency[i:i + _ROUTE_CHUNK] = network.route_latency(routes)
        per_byte[i:i + _ROUTE_CHUNK] = network.busiest_link_seconds_per_byte(routes, flows)
    return latency, per_byte


def _network_group_terms(kind: Collective, cluster: Cluster, groups: Sequence[np.ndarray]) -> tuple[AlphaBeta, ...]:
    """Each group's time as `alpha + beta * nbytes` when `kind` runs over all of `groups` at once
    on the cluster's network (module docstring): flows of every group share the links. Not
    memoized (`collective_group_times` is); the groups must be checked (`_check_groups`)."""
    network = cluster.network
    if network is None:
        raise ValueError(f"cluster {cluster.name!r} has no network")
    if kind is Collective.COLLECTIVE_PERMUTE:
        raise ValueError("collective-permute takes (src, dst) pairs: use collective_permute_terms")
    sizes = np.array([len(g) for g in groups], dtype=np.float64)
    # latency steps, and phases each moving n/p bytes per flow (module docstring)
    steps = {Collective.ALL_REDUCE: 2 * (sizes - 1), Collective.ALL_GATHER: sizes - 1,
             Collective.REDUCE_SCATTER: sizes - 1, Collective.ALL_TO_ALL: sizes - 1}[kind]
    phases = np.ones_like(sizes) if kind is Collective.ALL_TO_ALL else steps
    src, dst, offsets = _group_flows(kind, groups)
    alpha, beta = np.zeros(len(groups)), np.zeros(len(groups))
    moving = sizes > 1
    if src.size:
        latency, per_byte = _shared_links(network, src, dst)
        starts = offsets[moving]
        alpha[moving] = steps[moving] * np.maximum.reduceat(latency, starts)
        beta[moving] = phases[moving] * np.maximum.reduceat(per_byte, starts) / sizes[moving]
    return tuple(AlphaBeta(float(a), float(b)) for a, b in zip(alpha, beta))


def _network_terms(kind: Collective, cluster: Cluster, groups: Iterable[Group]) -> tuple[AlphaBeta, ...]:
    """`_network_group_terms`, after the measured fits (which take precedence per group size),
    memoized per cluster and group list like `_concurrent_groups`."""
    listed = _listed(groups)
    key = ("network", kind, tuple(tuple(g.tolist()) for g in listed))
    cache = cluster.collective_memo
    found = cache.get(key)
    if found is not None:
        return found  # checked when it was stored
    _check_groups(kind, cluster, listed)
    terms = list(_network_group_terms(kind, cluster, listed))
    for i, devices in enumerate(listed):
        fit = measured_terms(kind, cluster, len(devices))
        if fit is not None:
            terms[i] = fit if len(devices) > 1 else _FREE
    found = tuple(terms)
    if len(cache) < _MEMO_LIMIT:
        cache[key] = found
    return found


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
        # on a network, the group alone (its flows sharing links among themselves only)
        self._alone: AlphaBeta | None = None

    @property
    def devices(self) -> np.ndarray:
        return self.layout.devices

    def seconds(self, nbytes: float, load: Load) -> float:
        if nbytes < 0:
            raise ValueError(f"{self.kind.value}: nbytes must be >= 0, got {nbytes!r}")
        return self.seconds_at_share(float(nbytes), _nic_share(self.cluster, self.layout, load))

    def seconds_at_share(self, nbytes: float, share: float) -> float:
        """Its time when its cross-node streams run `share` times slower (`_nic_share`). On a
        cluster with a network there are no NICs to share: the group's time alone on the links
        (other groups' flows on its links are `collective_group_times`')."""
        fit = measured_terms(self.kind, self.cluster, self.layout.size)
        if fit is not None:
            return fit.seconds(nbytes)
        if self.cluster.network is not None:
            if self._alone is None:
                self._alone = _network_terms(self.kind, self.cluster, [self.layout.devices])[0]
            return self._alone.seconds(nbytes)
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
    return float(collective_group_times(kind, cluster, groups, nbytes).max(initial=0.0))


def collective_group_times(kind: Collective, cluster: Cluster, groups: Iterable[Group], nbytes: float) -> np.ndarray:
    """Each group's seconds when `kind` runs at once over all of `groups`, of which
    `collective_time` is the largest: under the joint NIC load, or, on a cluster with a network,
    with every group's flows sharing the links."""
    if kind is Collective.COLLECTIVE_PERMUTE:
        raise ValueError("collective-permute takes (src, dst) pairs: use collective_permute_time")
    if nbytes < 0:
        raise ValueError(f"{kind.value}: nbytes must be >= 0, got {nbytes!r}")
    if cluster.network is not None:
        return np.array([t.seconds(float(nbytes)) for t in _network_terms(kind, cluster, groups)], dtype=np.float64)
    return np.array([cost.seconds_at_share(float(nbytes), share)
                     for cost, share in _concurrent_groups(kind, cluster, groups)], dtype=np.float64)


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
    if cluster.network is not None:
        return _network_terms(Collective.ALL_REDUCE, cluster, [layout.devices])[0]
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
    if cluster.network is not None:
        return _network_permute_terms(cluster, moving)
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


def _network_permute_terms(cluster: Cluster, pairs: Sequence[tuple[int, int]]) -> tuple[AlphaBeta, ...]:
    """Every pair a flow at once on the cluster's network: its route's latency, and its busiest
    link's share with every pair's flow counted (module docstring)."""
    assert cluster.network is not None
    if not pairs:
        return ()
    src, dst = np.array(pairs, dtype=np.int64).T
    routes = cluster.network.routes(src, dst)
    latency = cluster.network.route_latency(routes)
    per_byte = cluster.network.busiest_link_seconds_per_byte(routes)
    return tuple(AlphaBeta(float(a), float(b)) for a, b in zip(latency, per_byte))


def collective_permute_time(cluster: Cluster, pairs: Sequence[tuple[int, int]], nbytes: float) -> float:
    """Every (src, dst) pair sends `nbytes` at once (a collective-permute, or pipeline p2p);
    the slowest pair decides. Cross-node pairs share their nodes' NICs (send and receive side)."""
    if nbytes < 0:
        raise ValueError(f"collective-permute: nbytes must be >= 0, got {nbytes!r}")
    return max((term.seconds(nbytes) for term in collective_permute_terms(cluster, pairs)), default=0.0)
