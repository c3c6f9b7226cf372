"""Interconnect topologies as point-to-point tables: who shares a node, and the bandwidth and
latency between every ordered pair of devices (the alpha-beta, or postal, model).

Everything here is array math with no notion of device specs; `hlomap.cost.cluster` wraps the
tables into a `Cluster`. Device ids are row-major positions (in the mesh shape, or node by node).
Diagonals hold bandwidth `inf` and latency 0: a device sends to itself for free.

Multi-hop paths (mesh, torus) use dimension-order routing: a message between two devices crosses
the links of every axis on which their coordinates differ. Its bandwidth is that of the slowest
link crossed (the bottleneck) and its latency the sum of the per-hop latencies: a pair as if alone
on the network. Messages sharing a link are modeled elsewhere: on meshes and tori by
`hlomap.cost.network` (the links themselves, routes, max-min fair sharing), which prices their
collectives; on servers by `hlomap.cost.collectives`' NIC sharing (many streams leaving a node
through few NICs). Random and uniform topologies are these tables only.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

#: A scalar, or a (low, high) range from which random topologies draw uniformly.
Range = float | tuple[float, float]

#: Most devices a topology's dense tables hold: two float64 [n, n] tables of 8192 devices take
#: 1 GiB; the next power of two would take 4 GiB, and a 64x64x64 torus 1 TiB.
MAX_TABLE_DEVICES = 8192


class TopologyTooLarge(ValueError):
    """A topology has more devices than dense all-pairs tables are built for."""


def require_table_size(n_devices: int, what: str) -> None:
    """Refuse, before anything is allocated, a topology whose dense tables would not fit: the
    cost model prices every pair of devices from [n, n] tables."""
    if n_devices > MAX_TABLE_DEVICES:
        gib = 2 * 8 * n_devices**2 / 2**30
        raise TopologyTooLarge(
            f"{what} has {n_devices} devices; clusters hold dense all-pairs bandwidth and latency tables "
            f"({gib:,.0f} GiB for this one), built for at most {MAX_TABLE_DEVICES} devices. Name a topology "
            f"of at most {MAX_TABLE_DEVICES} devices (e.g. torus:16x16x32): a plan is placed on the devices "
            "of one slice of the machine")


class LinkTables(NamedTuple):
    """`node_of[i]`: node (server, or block) of device i; `bandwidth[i, j]`: bytes/s from i to j;
    `latency[i, j]`: seconds for a zero-byte message from i to j."""

    node_of: np.ndarray
    bandwidth: np.ndarray
    latency: np.ndarray


def _positive(value: float, what: str) -> float:
    if not value > 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return float(value)


def _non_negative(value: float, what: str) -> float:
    if not value >= 0:
        raise ValueError(f"{what} must be >= 0, got {value!r}")
    return float(value)


def _with_diagonal(node_of: np.ndarray, bandwidth: np.ndarray, latency: np.ndarray) -> LinkTables:
    np.fill_diagonal(bandwidth, np.inf)
    np.fill_diagonal(latency, 0.0)
    return LinkTables(node_of.astype(np.int64), bandwidth, latency)


def block_tables(node_of: Sequence[int], intra_bw: float, inter_bw: np.ndarray | float,
                 intra_lat: float, inter_lat: np.ndarray | float) -> LinkTables:
    """Two-level tables: pairs on one node get the intra values; pairs on nodes a, b get
    `inter_bw[a, b]` (a per-node-pair matrix, or one number for all)."""
    node = np.asarray(node_of, dtype=np.int64)
    n_nodes = int(node.max()) + 1 if node.size else 0
    inter_bw_nodes = np.broadcast_to(np.asarray(inter_bw, dtype=np.float64), (n_nodes, n_nodes))
    inter_lat_nodes = np.broadcast_to(np.asarray(inter_lat, dtype=np.float64), (n_nodes, n_nodes))
    same = node[:, None] == node[None, :]
    bandwidth = np.where(same, intra_bw, inter_bw_nodes[node[:, None], node[None, :]])
    latency = np.where(same, intra_lat, inter_lat_nodes[node[:, None], node[None, :]])
    return _with_diagonal(node, bandwidth.astype(np.float64), latency.astype(np.float64))


def hierarchical_tables(nodes: int, gpus_per_node: int, intra_bw: float, inter_bw: float,
                        intra_lat: float, inter_lat: float) -> LinkTables:
    """`nodes` servers of `gpus_per_node` devices; devices 0..g-1 on node 0, g..2g-1 on node 1..."""
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"need nodes >= 1 and gpus_per_node >= 1, got {nodes} x {gpus_per_node}")
    require_table_size(nodes * gpus_per_node, f"a hierarchical topology of {nodes}x{gpus_per_node}")
    node_of = np.repeat(np.arange(nodes), gpus_per_node)
    return block_tables(node_of, _positive(intra_bw, "intra_bw"), _positive(inter_bw, "inter_bw"),
                        _non_negative(intra_lat, "intra_lat"), _non_negative(inter_lat, "inter_lat"))


def _per_axis(value: float | Sequence[float], rank: int, what: str) -> np.ndarray:
    values = np.broadcast_to(np.asarray(value, dtype=np.float64), (rank,)) if np.ndim(value) == 0 \
        else np.asarray(value, dtype=np.float64)
    if values.shape != (rank,):
        raise ValueError(f"{what}: expected one value or {rank} (one per mesh axis), got {value!r}")
    return values


def mesh_tables(shape: Sequence[int], link_bw: float | Sequence[float],
                link_lat: float | Sequence[float], torus: bool) -> LinkTables:
    """An n-D mesh (or torus, with wrap-around links) of devices, one device per node.

    `link_bw`/`link_lat` are per link, either one value or one per axis (e.g. a faster X ring).
    Device id = row-major index of its coordinates.
    """
    dims = tuple(int(d) for d in shape)
    if not dims or any(d < 1 for d in dims):
        raise ValueError(f"mesh shape must be non-empty with positive sizes, got {tuple(shape)!r}")
    bw_axis = _per_axis(link_bw, len(dims), "link_bw")
    lat_axis = _per_axis(link_lat, len(dims), "link_lat")
    if np.any(bw_axis <= 0) or np.any(lat_axis < 0):
        raise ValueError(f"link_bw must be positive and link_lat >= 0, got {link_bw!r}, {link_lat!r}")
    kind = "torus" if torus else "mesh"
    require_table_size(int(np.prod(dims)), f"the {kind} {'x'.join(map(str, dims))}")
    coords = np.unravel_index(np.arange(int(np.prod(dims))), dims)
    n = len(coords[0])
    bandwidth = np.full((n, n), np.inf)
    latency = np.zeros((n, n))
    for axis, size in enumerate(dims):  # one axis at a time: no [n, n, rank] intermediate
        diff = np.abs(coords[axis][:, None] - coords[axis][None, :])
        if torus:
            diff = np.minimum(diff, size - diff)
        np.minimum(bandwidth, np.where(diff > 0, bw_axis[axis], np.inf), out=bandwidth)
        latency += diff * lat_axis[axis]
    return _with_diagonal(np.arange(n), bandwidth, latency)


def _draw(rng: np.random.Generator, value: Range, size: tuple[int, ...], what: str) -> np.ndarray:
    """`value` everywhere, or uniform draws from the (low, high) range `value`."""
    if isinstance(value, tuple):
        low, high = (float(v) for v in value)
        if not 0 <= low <= high:
            raise ValueError(f"{what}: range must satisfy 0 <= low <= high, got {value!r}")
        return rng.uniform(low, high, size=size)
    return np.full(size, float(value))


def _symmetric(rng: np.random.Generator, value: Range, n: int, what: str) -> np.ndarray:
    upper = np.triu(_draw(rng, value, (n, n), what), 1)
    return upper + upper.T


def random_block_tables(n_devices: int, n_blocks: int, intra_bw: float, inter_bw: Range,
                        intra_lat: float, inter_lat: Range, rng: np.random.Generator) -> LinkTables:
    """Devices split into `n_blocks` contiguous blocks of random (non-empty) sizes; fast links
    inside a block, and between blocks a per-block-pair bandwidth/latency (fixed or drawn from a
    range). This is the "random block" family of topologies used to evaluate Parmesan's
    topology-aware mapping: heterogeneous islands of devices with uneven links between them."""
    if not 1 <= n_blocks <= n_devices:
        raise ValueError(f"need 1 <= n_blocks <= n_devices, got {n_blocks} blocks for {n_devices} devices")
    require_table_size(n_devices, f"a random-block topology of {n_devices} devices")
    cuts = np.sort(rng.choice(np.arange(1, n_devices), size=n_blocks - 1, replace=False))
    sizes = np.diff(np.concatenate([[0], cuts, [n_devices]]))
    node_of = np.repeat(np.arange(n_blocks), sizes)
    bw = _symmetric(rng, inter_bw, n_blocks, "inter_bw")
    lat = _symmetric(rng, inter_lat, n_blocks, "inter_lat")
    off = ~np.eye(n_blocks, dtype=bool)
    if np.any(bw[off] <= 0):
        raise ValueError(f"inter_bw must be positive, got {inter_bw!r}")
    return block_tables(node_of, _positive(intra_bw, "intra_bw"), bw,
                        _non_negative(intra_lat, "intra_lat"), lat)


def uniform_tables(n_devices: int, bandwidth: Range, latency: Range,
                   rng: np.random.Generator) -> LinkTables:
    """Every pair of devices joined directly, one device per node. With scalar values every pair
    is at the same distance (a single non-blocking switch); with (low, high) ranges each pair's
    bandwidth and latency are drawn uniformly and symmetrically (Parmesan's uniform-distance
    random topologies)."""
    if n_devices < 1:
        raise ValueError(f"n_devices must be >= 1, got {n_devices}")
    require_table_size(n_devices, f"a uniform topology of {n_devices} devices")
    bw = _symmetric(rng, bandwidth, n_devices, "bandwidth")
    lat = _symmetric(rng, latency, n_devices, "latency")
    off = ~np.eye(n_devices, dtype=bool)
    if np.any(bw[off] <= 0):
        raise ValueError(f"bandwidth must be positive, got {bandwidth!r}")
    return _with_diagonal(np.arange(n_devices), bw, lat)
