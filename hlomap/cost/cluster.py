"""Clusters: devices plus a point-to-point bandwidth/latency table (alpha-beta model).

Interface shared with hlomap.pipeline (keep these names): `Cluster(name, devices, node_of,
bandwidth, latency)` with `n_devices`, `p2p_time(src, dst, nbytes)`, `to_json()`,
`from_json(d)`; `cluster_preset("A" | "B" | "C")`; `load_cluster("A" | "B" | "C" | path | topology string)`.

A message of n bytes from i to j takes `latency[i, j] + n / bandwidth[i, j]`. Devices are grouped
into nodes (servers): collectives that span nodes run hierarchically, and the streams that leave
a node share its `nics_per_node` network interfaces (see `hlomap.cost.collectives`). A torus or
mesh also keeps its links and routes (`Cluster.network`, `hlomap.cost.network`): its collectives
are priced as flows sharing those links, every group of a mesh axis at once.

JSON (units: bytes, bytes/s, seconds):
    {"name": "A", "devices": ["V100-16GB", ... | {full DeviceSpec}], "node_of": [0, 0, ...],
     "bandwidth": [[null, 1.3e11, ...], ...], "latency": [[0, 5e-06, ...], ...],
     "nics_per_node": 1}
The bandwidth diagonal is written as null (JSON has no infinity); "nics_per_node" is optional; so
is "network" (a torus or mesh's links, `hlomap.cost.network.Grid.to_json`: {"topology": "torus",
"shape": [8, 8], "link_bandwidth": [5e10, 5e10], "link_latency": [1e-06, 1e-06]}, from which the
links and routes are rebuilt, and "device_nodes" when the device ids are not the grid's row-major
node ids); so is "coords" (each device's topology coordinates, `Cluster.coordinates`: [server,
slot] on servers and random blocks; a grid's are its network's); so is "measured" (collectives
and dispatch as measured, `hlomap.cost.measured`, written by `hlomap calibrate`); a "calibration"
object (every fit and sample behind it, `hlomap.cost.calibration`) is ignored here.

Auto-MAP's configurations A, B, C are 2, 3 and 4 servers of 8 V100 GPUs, NVLink inside a server
and 25 Gbps Ethernet between servers (arXiv 2007.04069, section 5). The paper does not give the
V100 memory size; the presets use the 16 GB board.

Topology strings (what `--cluster` accepts besides A/B/C and JSON files; `parse_topology`):
    torus:8x8x8   mesh:4x4      n-D torus / mesh, one device per node (`mesh_topology`)
    hier:4x8      4 servers x 8 GPUs, NVLink inside, 25 GbE between (`hierarchical`)
    random:64:7   random-block: 64 devices in random contiguous blocks (64 // 8 of them, at least
                  2; `random:64:7:5` says 5), uneven links between blocks, seed 7 (`random_block`)
    uniform:16    16 devices, every pair at the same distance; `uniform:16:3` draws each pair's
                  bandwidth and latency (seed 3) (`uniform`)
Any of them takes `@DEVICE` (a device preset, e.g. `torus:4x4@H100-80GB`). A cluster built from a
string is named by its canonical spelling, so `load_cluster(cluster.name)` rebuilds it, and its
JSON round-trips like any other cluster's.

`local` names the devices JAX sees, as `hlomap calibrate` measures them: calibrated on first use
and cached on disk (`hlomap.run.local`), resolved by `hlomap.api.load_cluster` (measuring runs the
devices, which the cost model does not).
"""

from __future__ import annotations

import collections
import enum
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from hlomap.cost import topology
from hlomap.cost.devices import DeviceSpec, DeviceSpecError, device_preset
from hlomap.cost.measured import MeasuredCosts, MeasuredCostsError
from hlomap.cost.network import Grid, Network, NetworkSpecError

#: The name of the calibrated present devices (`hlomap.run.local`, `hlomap.api.load_cluster`).
LOCAL = "local"
#: Host devices a CPU-only machine shows for `local` when JAX has not started yet: the count the
#: examples and `hlomap run` plan for (a CPU backend shows one device unless XLA_FLAGS asks).
LOCAL_CPU_DEVICES = 8

#: Effective NVLink bandwidth between two V100s of a DGX-1-class server, bytes/s. The hybrid
#: cube-mesh gives each V100 six NVLink2 links of 25 GB/s per direction (150 GB/s), but pairs
#: are joined by one, two or no direct links; NCCL's rings over all six links measure a bus
#: bandwidth of about 130 GB/s, which is the rate a ring collective sees per step. We use that.
NVLINK_V100_BW = 130e9
#: One-way latency of a small NVLink transfer through NCCL, seconds (a few microseconds).
NVLINK_LATENCY = 5e-6
#: 25 Gbit/s Ethernet in bytes/s.
ETHERNET_25G_BW = 25e9 / 8
#: One-way small-message latency over 25 GbE between servers (TCP or RoCE: 10-20 us), seconds.
ETHERNET_LATENCY = 15e-6


class ClusterSpecError(ValueError):
    """A cluster description (JSON, preset name or builder arguments) is malformed."""


@dataclass(frozen=True, eq=False)
class Cluster:
    """Devices (index = device id), the node of each, and [n, n] bandwidth/latency tables.

    The arrays are copied and made read-only, so a Cluster can be shared freely; their diagonals
    are set to bandwidth inf and latency 0 (a device sends to itself for free). `nics_per_node`
    is how many cross-node streams a node can drive at the full table bandwidth at once.
    `measured`: the collectives and dispatch as a calibration measured them
    (`hlomap.cost.measured`), which price collectives instead of the links when present.
    `network`: the links and routes of a torus or mesh (`hlomap.cost.network`), over which
    collectives are priced with flows sharing links; its node i is device i (it may have more
    nodes than the cluster has devices: `first_devices` of a torus still routes over the rest).
    `coords`: each device's topology coordinates (`coordinates`), given where the topology has
    some and the network does not say them: [server, slot in the server] on servers and random
    blocks. Placement starts from orders over them (row-major, snake, space-filling curves).
    `slowdown`: each device's compute time against its kind's (a straggler at half speed: 2.0);
    None (every device at its kind's speed) unless a re-planning trace slows some. The pipeline
    cost model, simulator and DP charge a stage the slowest of its devices
    (`compute_slowdown`: data replicas wait for each other). Kept in memory only, not in JSON.
    """

    name: str
    devices: tuple[DeviceSpec, ...]
    node_of: tuple[int, ...]
    bandwidth: np.ndarray
    latency: np.ndarray
    nics_per_node: int = 1
    measured: MeasuredCosts | None = None
    network: Network | None = None
    coords: tuple[tuple[int, ...], ...] | None = None
    slowdown: tuple[float, ...] | None = None
    node_array: np.ndarray = field(init=False, repr=False, compare=False)
    # collective analyses per group list (`collectives._concurrent_groups`): valid while the cluster
    # is, since nothing in it changes
    collective_memo: dict[Any, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "node_of", tuple(int(x) for x in self.node_of))
        if self.coords is not None:
            object.__setattr__(self, "coords", tuple(tuple(int(c) for c in row) for row in self.coords))
        if self.slowdown is not None:
            object.__setattr__(self, "slowdown", tuple(float(x) for x in self.slowdown))
        for field_name, diagonal in (("bandwidth", math.inf), ("latency", 0.0)):
            array = np.array(getattr(self, field_name), dtype=np.float64)  # a copy
            if array.ndim == 2 and array.shape[0] == array.shape[1]:
                np.fill_diagonal(array, diagonal)  # a device sends to itself for free
            array.flags.writeable = False
            object.__setattr__(self, field_name, array)
        _validate(self)
        object.__setattr__(self, "collective_memo", {})
        node_array = np.asarray(self.node_of, dtype=np.int64)
        node_array.flags.writeable = False
        object.__setattr__(self, "node_array", node_array)  # `node_of` as an array, for vector code

    # -- queries ---------------------------------------------------------------------------------
    @property
    def n_devices(self) -> int:
        return len(self.devices)

    @property
    def n_nodes(self) -> int:
        return len(set(self.node_of))

    @property
    def most_per_node(self) -> int:
        """The most devices one node holds (a server's GPUs; 1 on a torus or mesh)."""
        return max(collections.Counter(self.node_of).values())

    @property
    def coordinates(self) -> np.ndarray:
        """[device, axis] integer topology coordinates of every device: a grid's node
        coordinates (its network's), the given `coords`, else [node, slot in the node] (slots
        numbered in device-id order). Distinct per device; placement orders devices by them."""
        if self.network is not None:
            return self.network.device_coords[: self.n_devices]
        if self.coords is not None:
            return np.asarray(self.coords, dtype=np.int64).reshape(self.n_devices, -1)
        return node_slot_coordinates(self.node_of)

    def devices_on(self, node: int) -> tuple[int, ...]:
        return tuple(i for i, n in enumerate(self.node_of) if n == node)

    def shift_period(self) -> int:
        """The least T > 0 such that device i + T is to every cost what device i is: the same
        kind and speed, the same links to j + T as i's to j, and the server after i's server
        (servers of T devices in id order, all alike, as `hierarchical` builds them); 0 when
        there is none or no second server. Then any device groups shifted by a multiple of T
        communicate as they do unshifted, so a planner prices one of them (memoized)."""
        key = ("shift period",)
        if key not in self.collective_memo:
            self.collective_memo[key] = self._shift_period()
        return int(self.collective_memo[key])

    def _shift_period(self) -> int:
        if self.network is not None or self.n_nodes < 2:
            return 0
        period = len(self.devices_on(self.node_of[0]))
        count = self.n_devices
        if count % period:
            return 0
        nodes = self.node_array
        same = (np.array_equal(nodes[period:], nodes[:-period] + 1)
                and self.devices[period:] == self.devices[:-period]
                and (self.slowdown is None or self.slowdown[period:] == self.slowdown[:-period])
                and np.array_equal(self.bandwidth[period:, period:], self.bandwidth[:-period, :-period])
                and np.array_equal(self.latency[period:, period:], self.latency[:-period, :-period]))
        return period if same else 0

    def p2p_time(self, src: int, dst: int, nbytes: float) -> float:
        """Seconds to send `nbytes` from device `src` to `dst`: alpha + nbytes / beta."""
        self._check_device(src)
        self._check_device(dst)
        if src == dst:
            return 0.0
        return float(self.latency[src, dst] + nbytes / self.bandwidth[src, dst])

    def _check_device(self, device: int) -> None:
        if not 0 <= device < self.n_devices:
            raise IndexError(f"device id {device} out of range for cluster {self.name!r} "
                             f"with {self.n_devices} devices")

    # -- equality (numpy arrays need array comparison) ---------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Cluster):
            return NotImplemented
        return (self.name == other.name and self.devices == other.devices
                and self.node_of == other.node_of and self.nics_per_node == other.nics_per_node
                and self.measured == other.measured and self.network == other.network
                and self.coords == other.coords
                and np.array_equal(self.bandwidth, other.bandwidth)
                and np.array_equal(self.latency, other.latency))

    def __hash__(self) -> int:
        return hash((self.name, self.devices, self.node_of, self.nics_per_node, self.measured, self.network,
                     self.coords))

    def __repr__(self) -> str:
        kinds = sorted({d.name for d in self.devices})
        return (f"Cluster({self.name!r}, {self.n_devices} x {'/'.join(kinds)}, "
                f"{self.n_nodes} nodes, nics_per_node={self.nics_per_node})")

    # -- JSON ------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        bandwidth = [[None if math.isinf(v) else v for v in row] for row in self.bandwidth.tolist()]
        out = {
            "name": self.name,
            "devices": [_device_to_json(d) for d in self.devices],
            "node_of": list(self.node_of),
            "bandwidth": bandwidth,
            "latency": self.latency.tolist(),
            "nics_per_node": self.nics_per_node,
        }
        if self.network is not None:
            out["network"] = self.network.grid.to_json()
        if self.coords is not None:
            out["coords"] = [list(row) for row in self.coords]
        if self.measured is not None:
            out["measured"] = self.measured.to_json()
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any], *, source: str = "<dict>") -> Cluster:
        """Build from the JSON object of `to_json`; errors name `source` and the field."""
        return _cluster_from_json(d, source)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def busy_speedup(cluster: Cluster, busy: int) -> float:
    """How much faster each device computes when only `busy` of the cluster's devices work: > 1
    only for a measured cluster whose devices share hardware (`MeasuredCosts.busy_speedup`)."""
    return 1.0 if cluster.measured is None else cluster.measured.busy_speedup(busy)


def compute_slowdown(cluster: Cluster, devices: Iterable[int]) -> float:
    """How much longer a stage on `devices` computes than on devices at their kind's speed: its
    slowest device's `Cluster.slowdown` (data replicas wait for each other), 1.0 without one."""
    if cluster.slowdown is None:
        return 1.0
    return max((cluster.slowdown[int(d)] for d in devices), default=1.0)


def with_busy_devices(cluster: Cluster, busy: int) -> Cluster:
    """`cluster` with every device's compute and memory rates scaled by `busy_speedup`: what a
    plan keeping `busy` devices at work computes on. The cluster itself when nothing changes."""
    factor = busy_speedup(cluster, busy)
    if factor == 1.0:
        return cluster
    devices = tuple(sped_up(d, factor) for d in cluster.devices)
    return Cluster(cluster.name, devices, cluster.node_of, cluster.bandwidth, cluster.latency, cluster.nics_per_node,
                   cluster.measured, cluster.network, cluster.coords, cluster.slowdown)


def sped_up(device: DeviceSpec, factor: float) -> DeviceSpec:
    """`device` computing and moving memory `factor` times faster."""
    if factor == 1.0:
        return device
    return DeviceSpec(device.name, {k: v * factor for k, v in device.peak_flops.items()}, device.hbm_bandwidth * factor,
                      device.memory_bytes, device.efficiency, device.narrow)


def first_devices(cluster: Cluster, count: int) -> Cluster:
    """The cluster's first `count` devices with the links between them, named `NAME[:count]`:
    what a step running on `count` of the cluster's devices is priced on (device ids run server by
    server, so these fill the first servers). The cluster itself when it has exactly `count`."""
    if not 1 <= count <= cluster.n_devices:
        raise ClusterSpecError(f"cluster {cluster.name!r} has {cluster.n_devices} devices; cannot take the first "
                               f"{count}")
    if count == cluster.n_devices:
        return cluster
    return Cluster(f"{cluster.name}[:{count}]", cluster.devices[:count], cluster.node_of[:count],
                   cluster.bandwidth[:count, :count], cluster.latency[:count, :count], cluster.nics_per_node,
                   cluster.measured, cluster.network, None if cluster.coords is None else cluster.coords[:count],
                   None if cluster.slowdown is None else cluster.slowdown[:count])


def node_slot_coordinates(node_of: Sequence[int]) -> np.ndarray:
    """[device, 2]: each device's node and its slot in the node (the devices of a node numbered
    0, 1, ... in id order): the coordinates of servers and blocks."""
    node = np.asarray(node_of, dtype=np.int64)
    order = np.argsort(node, kind="stable")
    first = np.searchsorted(node[order], node[order])  # where each device's node starts in `order`
    slot = np.empty_like(node)
    slot[order] = np.arange(len(node)) - first
    return np.stack([node, slot], axis=1)


def _device_to_json(device: DeviceSpec) -> str | dict[str, Any]:
    """A preset's name when the spec is exactly that preset (compact files), else the full spec."""
    try:
        if device_preset(device.name) == device:
            return device.name
    except DeviceSpecError:
        pass
    return device.to_json()


def _validate(cluster: Cluster) -> None:
    n = cluster.n_devices
    where = f"cluster {cluster.name!r}"
    if n == 0:
        raise ClusterSpecError(f"{where}: has no devices")
    if len(cluster.node_of) != n:
        raise ClusterSpecError(f"{where}: node_of has {len(cluster.node_of)} entries for {n} devices")
    if min(cluster.node_of) < 0:
        raise ClusterSpecError(f"{where}: node_of has a negative node id")
    for field_name in ("bandwidth", "latency"):
        shape = getattr(cluster, field_name).shape
        if shape != (n, n):
            raise ClusterSpecError(f"{where}: {field_name} has shape {shape}, expected ({n}, {n})")
    off = ~np.eye(n, dtype=bool)
    bad_bw = np.argwhere(off & ~(cluster.bandwidth > 0))
    if bad_bw.size:
        i, j = bad_bw[0]
        raise ClusterSpecError(f"{where}: bandwidth[{i}][{j}] = {cluster.bandwidth[i, j]!r} must be > 0")
    bad_lat = np.argwhere(off & ~(np.isfinite(cluster.latency) & (cluster.latency >= 0)))
    if bad_lat.size:
        i, j = bad_lat[0]
        raise ClusterSpecError(f"{where}: latency[{i}][{j}] = {cluster.latency[i, j]!r} must be finite and >= 0")
    if cluster.nics_per_node < 1:
        raise ClusterSpecError(f"{where}: nics_per_node = {cluster.nics_per_node} must be >= 1")
    if cluster.network is not None and cluster.network.n_nodes < n:
        raise ClusterSpecError(f"{where}: its network has {cluster.network.n_nodes} nodes for {n} devices")
    if cluster.coords is not None:
        ranks = {len(row) for row in cluster.coords}
        if len(cluster.coords) != n or len(ranks) != 1 or 0 in ranks:
            raise ClusterSpecError(f"{where}: coords must give {n} devices the same number (>= 1) of coordinates")
        if any(c < 0 for row in cluster.coords for c in row) or len(set(cluster.coords)) != n:
            raise ClusterSpecError(f"{where}: coords must be non-negative and distinct per device")
        if cluster.network is not None:
            # one source of truth: a grid's coordinates are its network's
            raise ClusterSpecError(f"{where}: a cluster with a network takes its coords from it (device_nodes)")
    if cluster.slowdown is not None and (len(cluster.slowdown) != n
                                         or not all(math.isfinite(x) and x > 0 for x in cluster.slowdown)):
        raise ClusterSpecError(f"{where}: slowdown must give each of its {n} devices a finite factor > 0")


def _matrix(value: Any, n: int, field_name: str, where: str, *, diagonal: float) -> np.ndarray:
    """An n x n list of numbers; the diagonal may be null (it is forced to `diagonal`)."""
    if not isinstance(value, list) or len(value) != n:
        got = f"{len(value)} rows" if isinstance(value, list) else repr(type(value).__name__)
        raise ClusterSpecError(f"{where}: field {field_name!r}: expected a {n}x{n} list of lists, got {got}")
    out = np.empty((n, n))
    for i, row in enumerate(value):
        if not isinstance(row, list) or len(row) != n:
            raise ClusterSpecError(f"{where}: field {field_name!r}: row {i} must be a list of {n} numbers")
        for j, v in enumerate(row):
            if i == j and v is None:
                out[i, j] = diagonal
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out[i, j] = v
            else:
                raise ClusterSpecError(f"{where}: field {field_name!r}[{i}][{j}]: expected a number, got {v!r}")
    np.fill_diagonal(out, diagonal)
    return out


def _cluster_from_json(d: Mapping[str, Any], source: str) -> Cluster:
    if not isinstance(d, Mapping):
        raise ClusterSpecError(f"{source}: expected a JSON object, got {type(d).__name__}")
    missing = [k for k in ("name", "devices", "node_of", "bandwidth", "latency") if k not in d]
    if missing and "mesh" in d and "parameters" in d:
        raise ClusterSpecError(f"{source}: a plan file, not a cluster (a cluster file names its devices and links: "
                               "hlomap calibrate writes one)")
    if missing:
        raise ClusterSpecError(f"{source}: missing field(s) {missing}")
    # "calibration": the fits and samples `hlomap calibrate` keeps beside the cluster it measured
    unknown = sorted(set(d) - {"name", "devices", "node_of", "bandwidth", "latency", "nics_per_node", "measured",
                               "network", "coords", "calibration"})
    if unknown:
        raise ClusterSpecError(f"{source}: unknown field(s) {unknown}")
    if not isinstance(d["name"], str):
        raise ClusterSpecError(f"{source}: field 'name': expected a string, got {d['name']!r}")
    raw_devices = d["devices"]
    if not isinstance(raw_devices, list) or not raw_devices:
        raise ClusterSpecError(f"{source}: field 'devices': expected a non-empty list")
    try:
        devices = tuple(DeviceSpec.from_json(x, where=f"{source}: field 'devices'[{i}]")
                        for i, x in enumerate(raw_devices))
    except DeviceSpecError as err:
        raise ClusterSpecError(str(err)) from None
    n = len(devices)
    node_of = d["node_of"]
    if (not isinstance(node_of, list) or len(node_of) != n
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in node_of)):
        raise ClusterSpecError(f"{source}: field 'node_of': expected {n} non-negative integers, got {node_of!r}")
    nics = d.get("nics_per_node", 1)
    if not isinstance(nics, int) or isinstance(nics, bool) or nics < 1:
        raise ClusterSpecError(f"{source}: field 'nics_per_node': expected an integer >= 1, got {nics!r}")
    bandwidth = _matrix(d["bandwidth"], n, "bandwidth", source, diagonal=math.inf)
    latency = _matrix(d["latency"], n, "latency", source, diagonal=0.0)
    try:
        measured = None if d.get("measured") is None else MeasuredCosts.from_json(d["measured"])
        network = None if d.get("network") is None else Network(Grid.from_json(d["network"], where="field 'network'"))
        coords = d.get("coords")
        if coords is not None and (not isinstance(coords, list) or not all(
                isinstance(row, list) and all(isinstance(c, int) and not isinstance(c, bool) for c in row)
                for row in coords)):
            raise ClusterSpecError(f"{source}: field 'coords': expected a list of lists of integers")
        return Cluster(d["name"], devices, tuple(node_of), bandwidth, latency, nics, measured, network,
                       None if coords is None else tuple(tuple(row) for row in coords))
    except NetworkSpecError as err:
        raise ClusterSpecError(f"{source}: {err}") from None
    except MeasuredCostsError as err:
        raise ClusterSpecError(f"{source}: field {err}") from None
    except ClusterSpecError as err:
        raise ClusterSpecError(f"{source}: {err}") from None


# ---------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------

DeviceLike = DeviceSpec | str


def _device(device: DeviceLike) -> DeviceSpec:
    return device if isinstance(device, DeviceSpec) else device_preset(device)


def _from_tables(name: str, device: DeviceLike, tables: topology.LinkTables, nics_per_node: int = 1,
                 network: Network | None = None, *, servers: bool = False) -> Cluster:
    """`servers`: the devices sit in servers (or blocks), whose [server, slot] coordinates the
    cluster keeps (`Cluster.coords`)."""
    spec = _device(device)
    coords = tuple(map(tuple, node_slot_coordinates(tables.node_of).tolist())) if servers else None
    return Cluster(name, (spec,) * len(tables.node_of), tuple(tables.node_of.tolist()),
                   tables.bandwidth, tables.latency, nics_per_node, network=network, coords=coords)


def hierarchical(nodes: int, gpus_per_node: int, device: DeviceLike = "V100-16GB",
                 intra_bw: float = NVLINK_V100_BW, inter_bw: float = ETHERNET_25G_BW,
                 intra_lat: float = NVLINK_LATENCY, inter_lat: float = ETHERNET_LATENCY,
                 *, nics_per_node: int = 1, name: str | None = None) -> Cluster:
    """`nodes` servers x `gpus_per_node` devices: `intra_*` inside a server (NVLink), `inter_*`
    between servers (the network). Device ids run server by server."""
    tables = topology.hierarchical_tables(nodes, gpus_per_node, intra_bw, inter_bw, intra_lat, inter_lat)
    return _from_tables(name or f"hierarchical-{nodes}x{gpus_per_node}", device, tables, nics_per_node, servers=True)


def mesh_topology(shape: Sequence[int], device: DeviceLike, link_bw: float | Sequence[float],
                  link_lat: float | Sequence[float], torus: bool = False, *, name: str | None = None) -> Cluster:
    """A 2-D/3-D (any rank) mesh or torus, one device per node. Its tables give a path's
    bottleneck link and hops x link latency (`topology.mesh_tables`); its `network` keeps the links
    and dimension-order routes, over which collectives share bandwidth (`hlomap.cost.network`)."""
    tables = topology.mesh_tables(shape, link_bw, link_lat, torus)
    kind = "torus" if torus else "mesh"
    network = Network(Grid(tuple(int(s) for s in shape), torus, _axis_values(link_bw, len(shape)),
                           _axis_values(link_lat, len(shape))))
    return _from_tables(name or f"{kind}-{'x'.join(str(s) for s in shape)}", device, tables, network=network)


def _axis_values(value: float | Sequence[float], rank: int) -> tuple[float, ...]:
    """One value per axis (`mesh_tables` has checked the count)."""
    return (float(value),) * rank if np.ndim(value) == 0 else tuple(float(v) for v in value)  # type: ignore[union-attr]


def _rng(seed: int | np.random.Generator | None) -> np.random.Generator:
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


def random_block(n_devices: int, n_blocks: int, device: DeviceLike, intra_bw: float,
                 inter_bw: topology.Range, intra_lat: float, inter_lat: topology.Range,
                 seed: int | np.random.Generator | None = 0, *, nics_per_node: int = 1,
                 name: str | None = None) -> Cluster:
    """Random contiguous blocks (nodes) of devices; see `topology.random_block_tables`."""
    tables = topology.random_block_tables(n_devices, n_blocks, intra_bw, inter_bw, intra_lat, inter_lat, _rng(seed))
    return _from_tables(name or f"random-block-{n_devices}/{n_blocks}", device, tables, nics_per_node, servers=True)


def uniform(n_devices: int, device: DeviceLike, bandwidth: topology.Range, latency: topology.Range,
            seed: int | np.random.Generator | None = 0, *, name: str | None = None) -> Cluster:
    """All pairs joined directly, with equal or uniformly drawn distances; see
    `topology.uniform_tables`."""
    tables = topology.uniform_tables(n_devices, bandwidth, latency, _rng(seed))
    return _from_tables(name or f"uniform-{n_devices}", device, tables)


# ---------------------------------------------------------------------------------------------
# Presets and loading
# ---------------------------------------------------------------------------------------------

#: Auto-MAP's cluster configurations: name -> number of 8-GPU V100 servers.
AUTOMAP_SERVERS: Mapping[str, int] = {"A": 2, "B": 3, "C": 4}


def cluster_preset(name: str) -> Cluster:
    """Auto-MAP configuration `A`, `B` or `C`: 2/3/4 servers x 8 V100-16GB, NVLink inside a
    server (130 GB/s, 5 us), 25 Gbps Ethernet between servers (3.125 GB/s, 15 us), one NIC each."""
    servers = AUTOMAP_SERVERS.get(name.upper())
    if servers is None:
        raise ClusterSpecError(f"unknown cluster preset {name!r}; known: {', '.join(AUTOMAP_SERVERS)}")
    return hierarchical(servers, 8, "V100-16GB", name=name.upper())


# ---------------------------------------------------------------------------------------------
# Topology strings
# ---------------------------------------------------------------------------------------------


class TopologyKind(enum.Enum):
    """The families a topology string names (the part before the first ':')."""

    TORUS = "torus"
    MESH = "mesh"
    HIER = "hier"
    RANDOM = "random"
    UNIFORM = "uniform"


#: Device of the torus, mesh, random and uniform families when the string names none.
TOPOLOGY_DEVICE = "A100-80GB"
#: A direct chip-to-chip link of a torus or mesh (an ICI-class interconnect, not a specific
#: product): 50 GB/s per direction and about a microsecond per hop, router included.
TORUS_LINK_BW = 50e9
TORUS_HOP_LATENCY = 1e-6
#: Random-block links: NVLink inside a block, 10-100 Gbit/s Ethernet-class links between blocks.
RANDOM_BLOCK_INTER_BW = (10e9 / 8, 100e9 / 8)
RANDOM_BLOCK_INTER_LAT = (5e-6, 50e-6)
#: Devices per block of `random:N:SEED` when the string gives no block count (one server's worth).
RANDOM_BLOCK_SIZE = 8
#: A single non-blocking switch (`uniform:N`), and the ranges of `uniform:N:SEED`'s draws.
UNIFORM_BW = 25e9
UNIFORM_LATENCY = 5e-6
UNIFORM_BW_RANGE = (2.5e9, 50e9)
UNIFORM_LATENCY_RANGE = (1e-6, 20e-6)

_SHAPE = re.compile(r"^[1-9][0-9]*(x[1-9][0-9]*)*$")


def _topology_error(text: str, message: str) -> ClusterSpecError:
    return ClusterSpecError(f"cluster {text!r}: {message}")


def _count(text: str, part: str, what: str) -> int:
    if not part.isdigit() or int(part) < 1:
        raise _topology_error(text, f"{what} {part!r} is not a positive integer")
    return int(part)


def _seed(text: str, part: str) -> int:
    if not part.isdigit():
        raise _topology_error(text, f"seed {part!r} is not a non-negative integer")
    return int(part)


def _shape(text: str, part: str, rank: int | None = None) -> tuple[int, ...]:
    if not _SHAPE.match(part):
        raise _topology_error(text, f"shape {part!r} is not positive sizes joined by 'x' (like 8x8x8)")
    shape = tuple(int(s) for s in part.split("x"))
    if rank is not None and len(shape) != rank:
        raise _topology_error(text, f"shape {part!r} needs {rank} sizes (NODESxGPUS)")
    return shape


def parse_topology(text: str) -> Cluster:
    """The cluster a topology string names (module docstring); errors name the bad part."""
    try:
        return _build_topology(text)
    except topology.TopologyTooLarge as err:
        raise _topology_error(text, str(err)) from None


def _build_topology(text: str) -> Cluster:
    body, at, device_name = text.strip().partition("@")
    device: DeviceSpec | None = None
    if at:
        try:
            device = device_preset(device_name)
        except DeviceSpecError as err:
            raise _topology_error(text, f"device {device_name!r}: {err}") from None
    kind_text, _, rest = body.partition(":")
    try:
        kind = TopologyKind(kind_text.lower())
    except ValueError:
        if kind_text.strip().lower() == LOCAL:  # "local:4", "local@V100-16GB": local names the devices as they are
            raise _topology_error(text, f"{LOCAL!r} takes no size or device: it is the devices JAX sees, "
                                        f"calibrated (write {LOCAL!r} alone)") from None
        raise _topology_error(text, f"unknown topology {kind_text!r}; known: "
                                    f"{', '.join(k.value for k in TopologyKind)}") from None
    parts = rest.split(":") if rest else []
    usage = {TopologyKind.TORUS: "torus:AxBxC", TopologyKind.MESH: "mesh:AxB",
             TopologyKind.HIER: "hier:NODESxGPUS", TopologyKind.RANDOM: "random:N:SEED[:BLOCKS]",
             TopologyKind.UNIFORM: "uniform:N[:SEED]"}[kind]
    arity = {TopologyKind.TORUS: (1,), TopologyKind.MESH: (1,), TopologyKind.HIER: (1,),
             TopologyKind.RANDOM: (2, 3), TopologyKind.UNIFORM: (1, 2)}[kind]
    if len(parts) not in arity:
        raise _topology_error(text, f"expected {usage}")
    chosen = device or device_preset(TOPOLOGY_DEVICE)
    suffix = f"@{chosen.name}" if device is not None else ""
    if kind in (TopologyKind.TORUS, TopologyKind.MESH):
        shape = _shape(text, parts[0])
        name = f"{kind.value}:{'x'.join(map(str, shape))}{suffix}"
        return mesh_topology(shape, chosen, TORUS_LINK_BW, TORUS_HOP_LATENCY,
                             torus=kind is TopologyKind.TORUS, name=name)
    if kind is TopologyKind.HIER:
        nodes, gpus = _shape(text, parts[0], rank=2)
        name = f"hier:{nodes}x{gpus}{suffix}"
        return hierarchical(nodes, gpus, device or "V100-16GB", name=name)
    n = _count(text, parts[0], "device count")
    if kind is TopologyKind.UNIFORM:
        if len(parts) == 1:
            return uniform(n, chosen, UNIFORM_BW, UNIFORM_LATENCY, name=f"uniform:{n}{suffix}")
        seed = _seed(text, parts[1])
        return uniform(n, chosen, UNIFORM_BW_RANGE, UNIFORM_LATENCY_RANGE, seed,
                       name=f"uniform:{n}:{seed}{suffix}")
    seed = _seed(text, parts[1])
    blocks = _count(text, parts[2], "block count") if len(parts) == 3 else max(2, n // RANDOM_BLOCK_SIZE)
    if not 1 <= blocks <= n:
        raise _topology_error(text, f"{blocks} blocks do not fit {n} devices")
    name = f"random:{n}:{seed}" + (f":{blocks}" if len(parts) == 3 else "") + suffix
    return random_block(n, blocks, chosen, NVLINK_V100_BW, RANDOM_BLOCK_INTER_BW, NVLINK_LATENCY,
                        RANDOM_BLOCK_INTER_LAT, seed, name=name)


def load_cluster(spec: str | Path | Cluster) -> Cluster:
    """A preset name (`A`, `B`, `C`), a path to a cluster JSON file, a topology string
    (`torus:8x8x8`, `mesh:4x4`, `hier:4x8`, `random:64:SEED`, `uniform:16`; module docstring),
    or a Cluster (returned as is). `local` (the devices JAX sees, calibrated once and cached) is
    `hlomap.api.load_cluster`'s, which every verb of the api resolves. This is what the CLI's `--cluster` option takes."""
    if isinstance(spec, Cluster):
        return spec
    text = str(spec)
    if text.upper() in AUTOMAP_SERVERS:
        return cluster_preset(text)
    if text.strip().lower() == LOCAL:
        # measuring runs programs on the devices, which only the layers above the cost model do
        raise ClusterSpecError("cluster 'local' is the devices JAX sees, measured by the layers above the cost "
                               "model: load it with hlomap.load_cluster('local') (hlomap.api)")
    path = Path(text)
    if path.is_dir():
        raise ClusterSpecError(f"cluster {text!r}: a folder, not a cluster file")
    if not path.is_file():
        if ":" in text:
            return parse_topology(text)
        raise ClusterSpecError(f"cluster {text!r} is neither a preset ({', '.join(AUTOMAP_SERVERS)}), "
                               f"'local' (the devices JAX sees), a topology (torus:8x8x8, mesh:4x4, hier:4x8, "
                               f"random:64:SEED, uniform:16) "
                               f"nor an existing JSON file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ClusterSpecError(f"{path}:{err.lineno}:{err.colno}: invalid JSON: {err.msg}") from None
    return Cluster.from_json(data, source=str(path))
