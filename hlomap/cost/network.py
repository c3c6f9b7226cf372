"""Links, routes and shared bandwidth: the network of a torus or mesh cluster.

The point-to-point tables of `hlomap.cost.topology` give each pair of devices its bottleneck
bandwidth as if the pair were alone on the network. On a torus every link has the same bandwidth,
so the tables price a pair 8 hops apart like neighbours, and flows that cross one link share
nothing. A `Network` keeps the links themselves:

- links: directed, one per (node, axis, direction) that has a neighbour, each with a bandwidth
  and a latency (per axis, as `mesh_topology` takes them);
- routes: dimension-order routing, axis 0 first, then 1, ...; on a torus ring (an axis of more
  than 2 nodes with wrap-around) the shorter way round, the positive direction on a tie (half
  way round). An axis of 2 nodes has one link each way, wrap-around or not. Routes are worked out
  vectorized per batch of flows (`Network.routes`), never as an all-pairs table;
- sharing: flows that run at once share each link's bandwidth max-min fairly (`max_min_rates`,
  `fluid_finish_times`, an exact fluid model by progressive filling).

For flows of equal size that start together the fluid model has a closed form, which is what
collectives use (`hlomap.cost.collectives`): every flow's max-min rate is at least the smallest
share `bandwidth_l / flows_l` over the links it crosses (its bottleneck link is saturated by
flows none faster than it), and shares only grow as flows finish. So no flow takes longer than
`size * max_l(flows_l / bandwidth_l)` over its own links, and the flows of the most loaded link of
all take exactly that: the last flow finishes at `size * max_l(flows_l / bandwidth_l)` over every
link (`busiest_link_seconds_per_byte`). Latency is added per route (the sum of its links').
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

#: Relative slack under which a link counts as saturated in progressive filling (float rounding).
_SATURATED = 1e-12


class NetworkSpecError(ValueError):
    """A network description (grid shape, link figures, JSON) is malformed."""


@dataclass(frozen=True)
class Grid:
    """What a grid network is built from, and all its JSON keeps: the node counts per axis,
    wrap-around links or not, each axis's link bandwidth (bytes/s) and latency (s), and
    `device_nodes`, the grid node (row-major index of its coordinates) of each device id: None
    when device i is node i, a permutation of the nodes for a cluster whose ids are scrambled
    (ids handed out by a scheduler in no physical order)."""

    shape: tuple[int, ...]
    torus: bool
    link_bandwidth: tuple[float, ...]
    link_latency: tuple[float, ...]
    device_nodes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        shape = tuple(int(s) for s in self.shape)
        rank = len(shape)
        if not shape or any(s < 1 for s in shape):
            raise NetworkSpecError(f"grid shape must be non-empty with positive sizes, got {self.shape!r}")
        bw = _per_axis(self.link_bandwidth, rank, "link_bandwidth")
        lat = _per_axis(self.link_latency, rank, "link_latency")
        if any(not (b > 0 and math.isfinite(b)) for b in bw) or any(not (a >= 0 and math.isfinite(a)) for a in lat):
            raise NetworkSpecError(f"link bandwidths must be positive and latencies >= 0, got {bw!r}, {lat!r}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "torus", bool(self.torus))
        object.__setattr__(self, "link_bandwidth", bw)
        object.__setattr__(self, "link_latency", lat)
        if self.device_nodes is not None:
            nodes = tuple(int(x) for x in self.device_nodes)
            if sorted(nodes) != list(range(math.prod(shape))):
                raise NetworkSpecError(f"device_nodes must list each of the {math.prod(shape)} grid nodes once, got "
                                       f"{len(nodes)} entries")
            # the identity is spelled None, so that equal networks compare (and hash) equal
            object.__setattr__(self, "device_nodes", None if nodes == tuple(range(len(nodes))) else nodes)

    @property
    def n_nodes(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"topology": "torus" if self.torus else "mesh", "shape": list(self.shape),
                               "link_bandwidth": list(self.link_bandwidth), "link_latency": list(self.link_latency)}
        if self.device_nodes is not None:
            out["device_nodes"] = list(self.device_nodes)
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any], *, where: str = "network") -> Grid:
        if not isinstance(d, Mapping):
            raise NetworkSpecError(f"{where}: expected an object, got {type(d).__name__}")
        unknown = sorted(set(d) - {"topology", "shape", "link_bandwidth", "link_latency", "device_nodes"})
        missing = [k for k in ("topology", "shape", "link_bandwidth", "link_latency") if k not in d]
        if unknown or missing:
            raise NetworkSpecError(f"{where}: unknown field(s) {unknown}, missing field(s) {missing}")
        if d["topology"] not in ("torus", "mesh"):
            raise NetworkSpecError(f"{where}: field 'topology': expected 'torus' or 'mesh', got {d['topology']!r}")
        shape = d["shape"]
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
            raise NetworkSpecError(f"{where}: field 'shape': expected a list of integers, got {shape!r}")
        for key in ("link_bandwidth", "link_latency"):
            value = d[key]
            if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                      for v in value):
                raise NetworkSpecError(f"{where}: field {key!r}: expected a list of numbers, got {value!r}")
        nodes = d.get("device_nodes")
        if nodes is not None and (not isinstance(nodes, list)
                                  or not all(isinstance(x, int) and not isinstance(x, bool) for x in nodes)):
            raise NetworkSpecError(f"{where}: field 'device_nodes': expected a list of integers, got {nodes!r}")
        try:
            return cls(tuple(shape), d["topology"] == "torus", tuple(d["link_bandwidth"]), tuple(d["link_latency"]),
                       None if nodes is None else tuple(nodes))
        except NetworkSpecError as err:
            raise NetworkSpecError(f"{where}: {err}") from None


def _per_axis(value: float | Sequence[float], rank: int, what: str) -> tuple[float, ...]:
    values = (float(value),) * rank if np.ndim(value) == 0 else tuple(float(v) for v in value)  # type: ignore[union-attr]
    if len(values) != rank:
        raise NetworkSpecError(f"{what}: expected one value or {rank} (one per axis), got {value!r}")
    return values


def _wraps(grid: Grid, axis: int) -> bool:
    """Whether routes on `axis` go round a ring (and may take the negative way round)."""
    return grid.torus and grid.shape[axis] > 2


@dataclass(frozen=True, eq=False)
class Network:
    """The directed links of a grid (`src[l] -> dst[l]`, `bandwidth[l]` bytes/s, `latency[l]`
    s) and its dimension-order routes (module docstring). Node ids are row-major coordinates;
    `routes` takes device ids, which are node ids unless the grid's `device_nodes` says
    otherwise. Equal (and hashed) by its `grid`."""

    grid: Grid
    src: np.ndarray = field(init=False, repr=False)
    dst: np.ndarray = field(init=False, repr=False)
    bandwidth: np.ndarray = field(init=False, repr=False)
    latency: np.ndarray = field(init=False, repr=False)
    # [node, axis, direction (0: +1, 1: -1)] -> link id leaving the node that way, or -1
    link_of: np.ndarray = field(init=False, repr=False)
    # [node, axis, direction] -> the neighbour that link reaches (the node itself where none)
    next_node: np.ndarray = field(init=False, repr=False)
    coords: np.ndarray = field(init=False, repr=False)  # [node, axis]
    node_of_device: np.ndarray = field(init=False, repr=False)  # [device] -> node

    def __post_init__(self) -> None:
        grid = self.grid
        shape, rank, n = grid.shape, len(grid.shape), grid.n_nodes
        coords = np.stack(np.unravel_index(np.arange(n), shape), axis=1).astype(np.int64)
        strides = np.array([math.prod(shape[a + 1:]) for a in range(rank)], dtype=np.int64)
        link_of = np.full((n, rank, 2), -1, dtype=np.int64)
        next_node = np.repeat(np.arange(n, dtype=np.int64)[:, None, None], rank, axis=1).repeat(2, axis=2)
        src, dst, bw, lat = [], [], [], []
        count = 0
        for axis, size in enumerate(shape):
            for d, step in enumerate((1, -1)):
                if size == 1 or (d == 1 and grid.torus and size == 2):
                    continue  # a 2-node ring has one link each way: the +1 link of each end
                target = coords[:, axis] + step
                if grid.torus:
                    target %= size
                exists = (target >= 0) & (target < size)
                nodes = np.flatnonzero(exists)
                neighbours = nodes + (target[nodes] - coords[nodes, axis]) * strides[axis]
                ids = np.arange(count, count + nodes.size)
                link_of[nodes, axis, d] = ids
                next_node[nodes, axis, d] = neighbours
                src.append(nodes)
                dst.append(neighbours)
                bw.append(np.full(nodes.size, grid.link_bandwidth[axis]))
                lat.append(np.full(nodes.size, grid.link_latency[axis]))
                count += nodes.size
        for name, parts, dtype in (("src", src, np.int64), ("dst", dst, np.int64), ("bandwidth", bw, np.float64),
                                   ("latency", lat, np.float64)):
            array = np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)
            array.flags.writeable = False
            object.__setattr__(self, name, array)
        node_of_device = (np.arange(n, dtype=np.int64) if grid.device_nodes is None
                          else np.asarray(grid.device_nodes, dtype=np.int64))
        for name, array in (("link_of", link_of), ("next_node", next_node), ("coords", coords),
                            ("node_of_device", node_of_device)):
            array.flags.writeable = False
            object.__setattr__(self, name, array)

    @property
    def n_nodes(self) -> int:
        return self.grid.n_nodes

    @property
    def n_links(self) -> int:
        return len(self.src)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Network):
            return NotImplemented
        return self.grid == other.grid

    def __hash__(self) -> int:
        return hash(self.grid)

    # -- routes ----------------------------------------------------------------------------------
    @property
    def max_hops(self) -> int:
        """The longest route's link count: the width of `routes`' table."""
        return sum(size // 2 if _wraps(self.grid, a) else size - 1 for a, size in enumerate(self.grid.shape))

    @property
    def device_coords(self) -> np.ndarray:
        """[device, axis]: the grid coordinates of each device id."""
        return self.coords[self.node_of_device]

    def routes(self, src: np.ndarray | Sequence[int], dst: np.ndarray | Sequence[int]) -> np.ndarray:
        """[flows, max_hops] link ids of each flow's route in the order crossed, padded with -1
        (so that `values[routes]` over an array with one extra 0 at its end, index -1, ignores the
        padding), from device `src[f]` to device `dst[f]`. Vectorized over the flows: one pass
        per hop of the longest route."""
        s = np.asarray(src, dtype=np.int64).reshape(-1)
        t = np.asarray(dst, dtype=np.int64).reshape(-1)
        if s.shape != t.shape:
            raise ValueError(f"routes: {s.size} sources but {t.size} destinations")
        n = self.n_nodes
        if s.size and (min(s.min(), t.min()) < 0 or max(s.max(), t.max()) >= n):
            raise ValueError(f"routes: node id out of range for a network of {n} nodes")
        if self.grid.device_nodes is not None:
            s, t = self.node_of_device[s], self.node_of_device[t]
        out = np.full((s.size, self.max_hops), -1, dtype=np.int64)
        current = s.copy()
        column = 0
        for axis, size in enumerate(self.grid.shape):
            delta = self.coords[t, axis] - self.coords[s, axis]
            if _wraps(self.grid, axis):
                forward = delta % size
                positive = forward <= size - forward  # the shorter way; a tie goes the + way
                hops = np.where(positive, forward, size - forward)
            elif self.grid.torus and size == 2:
                positive, hops = np.ones(s.size, bool), delta % size
            else:
                positive, hops = delta > 0, np.abs(delta)
            direction = np.where(positive, 0, 1)
            width = size // 2 if _wraps(self.grid, axis) else size - 1
            for step in range(width):
                moving = hops > step
                if not moving.any():
                    break
                out[:, column + step] = np.where(moving, self.link_of[current, axis, direction], -1)
                current = np.where(moving, self.next_node[current, axis, direction], current)
            column += width
        return out

    def route(self, src: int, dst: int) -> tuple[int, ...]:
        """The link ids from device `src` to device `dst`, in the order crossed (empty when equal)."""
        row = self.routes([src], [dst])[0]
        return tuple(int(x) for x in row[row >= 0])

    def route_latency(self, routes: np.ndarray) -> np.ndarray:
        """Each route's latency: the sum of its links' (seconds)."""
        return _padded(self.latency, 0.0)[routes].sum(axis=1) if routes.size else np.zeros(len(routes))

    def link_flows(self, routes: np.ndarray) -> np.ndarray:
        """[links]: how many of the routed flows cross each link."""
        return np.bincount(routes[routes >= 0], minlength=self.n_links)

    def busiest_link_seconds_per_byte(self, routes: np.ndarray, flows: np.ndarray | None = None) -> np.ndarray:
        """Per flow, `max over its links of flows_l / bandwidth_l` (0 for an empty route), with
        `flows` (default: `link_flows(routes)`) counting every flow that runs at once. For flows of
        equal size S starting together, S times the largest of these is when the last one finishes
        under max-min fair sharing (module docstring)."""
        counts = self.link_flows(routes) if flows is None else flows
        if not routes.size:
            return np.zeros(len(routes))
        return _padded(counts / self.bandwidth, 0.0)[routes].max(axis=1)


def _padded(values: np.ndarray, pad: float) -> np.ndarray:
    """`values` with one more entry, `pad`, that route padding (-1) indexes."""
    return np.append(values, pad)


def grid_network(shape: Sequence[int], link_bandwidth: float | Sequence[float], link_latency: float | Sequence[float],
                 torus: bool) -> Network:
    """The network of an n-D mesh or torus, one device per node (`Grid`, `Network`)."""
    return Network(Grid(tuple(shape), torus, _per_axis(link_bandwidth, len(shape), "link_bandwidth"),
                        _per_axis(link_latency, len(shape), "link_latency")))


# ---------------------------------------------------------------------------------------------
# Flows of any sizes: max-min fair sharing and the fluid model
# ---------------------------------------------------------------------------------------------


def max_min_rates(routes: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Max-min fair rates (bytes/s) of flows routed over links of `capacity` (bytes/s), by
    progressive filling: raise every unfrozen flow's rate together until a link saturates, freeze
    the flows crossing it, repeat. A flow with an empty route is not limited (rate inf)."""
    n_flows, n_links = len(routes), len(capacity)
    rates = np.zeros(n_flows)
    crossing = routes >= 0
    frozen = ~crossing.any(axis=1) if routes.size else np.ones(n_flows, bool)
    rates[frozen] = np.inf
    left = np.asarray(capacity, dtype=np.float64).copy()
    while not frozen.all():
        live = routes[~frozen]
        counts = np.bincount(live[live >= 0], minlength=n_links)
        with np.errstate(divide="ignore"):
            share = np.where(counts > 0, left / np.maximum(counts, 1), np.inf)
        level = float(share.min())
        rates[~frozen] += level
        left = left - level * counts
        saturated = (counts > 0) & (left <= _SATURATED * np.asarray(capacity))
        hit = _padded(saturated, False)[routes].any(axis=1) & ~frozen
        frozen |= hit
    return rates


def fluid_finish_times(routes: np.ndarray, sizes: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """When each flow (all starting at 0, `sizes` bytes) finishes if the flows still running
    share the links max-min fairly at every instant (`max_min_rates`, recomputed whenever one
    finishes). Exact for the fluid model; costs one progressive filling per finishing time."""
    sizes = np.asarray(sizes, dtype=np.float64)
    left = sizes.copy()
    done = np.zeros(len(sizes))
    running = left > 0
    now = 0.0
    while running.any():
        index = np.flatnonzero(running)
        rates = max_min_rates(routes[index], capacity)
        if np.isinf(rates).any():  # empty routes finish at once
            free = index[np.isinf(rates)]
            done[free], left[free], running[free] = now, 0.0, False
            continue
        step = float((left[index] / rates).min())
        now += step
        left[index] -= rates * step
        finished = index[left[index] <= _SATURATED * sizes[index]]
        finished = finished if finished.size else index[np.argmin(left[index] / rates)]
        done[finished], left[finished], running[finished] = now, 0.0, False
    return done


def flows_makespan(network: Network, src: Sequence[int], dst: Sequence[int], sizes: Sequence[float]) -> float:
    """Seconds until every flow (src -> dst, sizes bytes, all starting together) has arrived:
    the largest route latency plus fluid finishing time (`fluid_finish_times`)."""
    routes = network.routes(src, dst)
    if not len(routes):
        return 0.0
    finish = fluid_finish_times(routes, np.asarray(sizes, dtype=np.float64), network.bandwidth)
    return float((network.route_latency(routes) + finish).max())
