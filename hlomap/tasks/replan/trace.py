"""Resource traces: how the links between servers, and the GPUs each server offers, change over time.

A trace describes a cluster at full strength and a series of changes to it; between two changes
the resources are constant. This is what AutoPipe re-plans against: link bandwidth that drifts or
steps as other jobs share the network, and servers that leave and come back.

JSON format (version 1), for users' own traces:

    {"version": 1,
     "name": "my-cluster-tuesday",                (optional)
     "cluster": "hier:4x4" | {cluster JSON},      the cluster at full strength; its nodes are the
                                                  servers (a topology string or `Cluster.to_json`)
     "horizon_seconds": 36000,                    how long the trace lasts; training goes on after
                                                  it on the last state
     "events": [                                  in time order; an event changes what it names
       {"time": 0,                                seconds from the start
        "links": [[0, 1, 1.25e9], [2, 3, 3e8]],   server a, server b, bytes/s between them (both
                                                  directions; pairs not named keep their value)
        "gpus": [4, 4, 4, 4]},                    GPUs available on each server: its first k devices
       {"time": 1800, "links": [[0, 1, 3.125e9]]},
       {"time": 3600, "speed": [[5, 0.5]]},      device 5 computes at half speed (a straggler) ...
       {"time": 4000, "speed": [[5, 1.0]]},      ... and recovers
       {"time": 5400, "gpus": [4, 0, 4, 4]},      server 1 leaves ...
       {"time": 9000, "gpus": [4, 4, 4, 4]}]}     ... and comes back

Links start at the cluster's own bandwidth between the servers, GPUs at every device, every device
at full speed (`speed`: the fraction of its kind's compute speed, in (0, 1]). Latencies do not
change. Events at the same time apply in order.

`generate` builds traces of seven kinds on a cluster: `steps` (server links drop to a fraction of
their bandwidth for a while, then recover), `drift` (every link's bandwidth follows a
multiplicative random walk), `leave` (a server leaves and comes back, over mild bandwidth noise),
`mixed` (all of it), `partial` (some GPUs of a server, not all, leave and come back, over mild
bandwidth noise), `link` (one link between two servers drops to 5-30% of its bandwidth for a
while) and `straggler` (one device computes at half speed for a while); in the last two the other
links keep 80-100% of their bandwidth, drawn afresh at each change, so the one change stands out.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from hlomap.cost.cluster import Cluster, ClusterSpecError, load_cluster, node_slot_coordinates

__all__ = ["Event", "ResourceState", "Trace", "TraceError", "TraceKind", "device_sets", "generate", "load_trace",
           "sub_cluster"]

TRACE_VERSION = 1


class TraceError(ValueError):
    """A trace that is malformed (the message names the file and the field)."""


@dataclass(frozen=True)
class Event:
    """A change at `time`: new bandwidths for server pairs, new GPU counts per server, and/or new
    compute speeds (fractions of full speed) for devices."""

    time: float
    links: tuple[tuple[int, int, float], ...] = ()
    gpus: tuple[int, ...] | None = None
    speed: tuple[tuple[int, float], ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"time": self.time}
        if self.links:
            out["links"] = [[a, b, bw] for a, b, bw in self.links]
        if self.gpus is not None:
            out["gpus"] = list(self.gpus)
        if self.speed:
            out["speed"] = [[d, f] for d, f in self.speed]
        return out


@dataclass(frozen=True, eq=False)
class ResourceState:
    """The resources between two events: each server pair's bandwidth, each server's GPUs and
    each device's compute speed (`speed[d]`, a fraction of full speed; empty: all at full speed).

    `cluster` is the sub-cluster of the available devices (local ids 0..k-1, in increasing global
    order), its `slowdown` the available devices' 1 / speed; `devices[i]` is the global id of
    local device i."""

    base: Cluster
    server_bandwidth: np.ndarray
    gpus: tuple[int, ...]
    speed: tuple[float, ...] = ()
    devices: tuple[int, ...] = field(init=False)
    cluster: Cluster = field(init=False)

    def __post_init__(self) -> None:
        node = self.base.node_array
        slot = node_slot_coordinates(self.base.node_of)[:, 1]  # a server's k GPUs are its first k
        up = np.flatnonzero(slot < np.asarray(self.gpus)[node])
        object.__setattr__(self, "devices", tuple(int(d) for d in up))
        bandwidth = np.array(self.base.bandwidth)
        cross = node[:, None] != node[None, :]
        bandwidth[cross] = self.server_bandwidth[node[:, None], node[None, :]][cross]
        sub = np.ix_(up, up)
        slow = self.speed and any(self.speed[d] < 1.0 for d in up)
        slowdown = tuple(1.0 / self.speed[d] for d in up) if slow else None
        cluster = Cluster(f"{self.base.name}[{len(up)} up]", tuple(self.base.devices[d] for d in up),
                          tuple(int(n) for n in node[up]), bandwidth[sub], self.base.latency[sub],
                          self.base.nics_per_node, slowdown=slowdown) if up.size else None
        object.__setattr__(self, "cluster", cluster)

    @property
    def n_available(self) -> int:
        return len(self.devices)

    def local(self, device: int) -> int | None:
        """The local id of global device `device` (None when it is not available)."""
        index = int(np.searchsorted(self.devices, device))
        return index if index < len(self.devices) and self.devices[index] == device else None

    def bandwidth_share(self) -> float:
        """Mean bandwidth of the server links relative to the full-strength cluster's."""
        base = _server_bandwidth(self.base)
        off = ~np.eye(base.shape[0], dtype=bool)
        return float(np.mean(self.server_bandwidth[off] / base[off])) if off.any() else 1.0

    def gpu_share(self) -> float:
        return self.n_available / self.base.n_devices

    def speed_share(self) -> float:
        """Mean compute speed of the available devices relative to full speed."""
        if not self.speed or not self.devices:
            return 1.0
        return float(np.mean([self.speed[d] for d in self.devices]))


def sub_cluster(cluster: Cluster, keep: Sequence[int]) -> Cluster:
    """The cluster of `cluster`'s devices `keep` (in that order), each as fast as it is there."""
    ix = np.ix_(keep, keep)
    slowdown = tuple(cluster.slowdown[d] for d in keep) if cluster.slowdown else None
    return Cluster(f"{cluster.name}[{len(keep)} of {cluster.n_devices}]", tuple(cluster.devices[d] for d in keep),
                   tuple(cluster.node_of[d] for d in keep), np.asarray(cluster.bandwidth)[ix],
                   np.asarray(cluster.latency)[ix], cluster.nics_per_node, slowdown=slowdown)


def device_sets(cluster: Cluster) -> tuple[tuple[int, ...], ...]:
    """The device sets a re-solve plans on: every device; those at full speed; and those at full
    speed on the servers that offer the most of them. The pipeline and joint DPs fill devices in
    their order, so a plan on every device starts on device 0 even when it is a straggler, and
    their groups align to the servers' largest size, which is right on equal servers only: with 2
    of a server's 4 GPUs gone, every device alone gives groups across servers, the full servers
    alone do not."""
    slowdown = cluster.slowdown or (1.0,) * cluster.n_devices
    every = tuple(range(cluster.n_devices))
    fast = tuple(d for d in every if slowdown[d] <= 1.0)
    per_node: dict[int, list[int]] = {}
    for d in fast:
        per_node.setdefault(cluster.node_of[d], []).append(d)
    most = max((len(v) for v in per_node.values()), default=0)
    full = tuple(sorted(d for v in per_node.values() if len(v) == most for d in v))
    out: list[tuple[int, ...]] = []
    for keep in (every, fast, full):
        if keep and keep not in out:
            out.append(keep)
    return tuple(out)


def _server_bandwidth(cluster: Cluster) -> np.ndarray:
    """[servers, servers]: the slowest bandwidth between devices of two servers."""
    node = cluster.node_array
    servers = int(node.max()) + 1
    out = np.full((servers, servers), np.inf)
    for a in range(servers):
        for b in range(servers):
            if a != b:
                out[a, b] = float(cluster.bandwidth[np.ix_(node == a, node == b)].min())
    return out


@dataclass(frozen=True, eq=False)
class Trace:
    """A cluster at full strength, a horizon and the events changing it (module docstring)."""

    name: str
    cluster: Cluster
    horizon: float
    events: tuple[Event, ...]

    def __post_init__(self) -> None:
        servers = int(self.cluster.node_array.max()) + 1
        if not self.horizon > 0:
            raise TraceError(f"trace {self.name!r}: horizon_seconds = {self.horizon!r} must be positive")
        last = 0.0
        for i, e in enumerate(self.events):
            where = f"trace {self.name!r}: events[{i}]"
            if not (math.isfinite(e.time) and e.time >= last):
                raise TraceError(f"{where}: time {e.time!r} must be >= 0 and not before the previous event's")
            last = e.time
            for a, b, bw in e.links:
                if not (0 <= a < servers and 0 <= b < servers and a != b):
                    raise TraceError(f"{where}: link [{a}, {b}] does not join two of the {servers} servers")
                if not bw > 0:
                    raise TraceError(f"{where}: link [{a}, {b}] bandwidth {bw!r} must be positive")
            if e.gpus is not None:
                if len(e.gpus) != servers:
                    raise TraceError(f"{where}: gpus lists {len(e.gpus)} servers; the cluster has {servers}")
                sizes = np.bincount(self.cluster.node_array, minlength=servers)
                for s, (k, size) in enumerate(zip(e.gpus, sizes)):
                    if not 0 <= k <= size:
                        raise TraceError(f"{where}: gpus[{s}] = {k} is not between 0 and the server's {size}")
            for d, f in e.speed:
                if not 0 <= d < self.cluster.n_devices:
                    raise TraceError(f"{where}: speed: device {d} is not one of the cluster's "
                                     f"{self.cluster.n_devices}")
                if not 0 < f <= 1:
                    raise TraceError(f"{where}: speed: device {d} at {f!r}; a speed is a fraction of full speed "
                                     "in (0, 1]")
            if e.time > self.horizon:
                raise TraceError(f"{where}: time {e.time} is past the horizon {self.horizon}")

    @property
    def n_servers(self) -> int:
        return int(self.cluster.node_array.max()) + 1

    def states(self) -> list[tuple[float, ResourceState]]:
        """The resources from each change on: [(time, state)], the first at time 0."""
        bandwidth = _server_bandwidth(self.cluster)
        gpus = tuple(int(k) for k in np.bincount(self.cluster.node_array))
        speed = [1.0] * self.cluster.n_devices
        out: list[tuple[float, ResourceState]] = []
        times = sorted({0.0, *(e.time for e in self.events)})
        for t in times:
            for e in self.events:
                if e.time == t:
                    bandwidth = bandwidth.copy()
                    for a, b, bw in e.links:
                        bandwidth[a, b] = bandwidth[b, a] = bw
                    gpus = e.gpus if e.gpus is not None else gpus
                    for d, f in e.speed:
                        speed[d] = f
            slowed = tuple(speed) if min(speed) < 1.0 else ()
            out.append((t, ResourceState(self.cluster, bandwidth, tuple(gpus), slowed)))
        return out

    def to_json(self) -> dict[str, Any]:
        cluster: Any = self.cluster.name if _rebuilds(self.cluster) else self.cluster.to_json()
        return {"version": TRACE_VERSION, "name": self.name, "cluster": cluster, "horizon_seconds": self.horizon,
                "events": [e.to_json() for e in self.events]}

    def save(self, path: str | Path) -> None:
        """The JSON of `to_json`, one event per line."""
        data = self.to_json()
        events = ",\n  ".join(json.dumps(e) for e in data.pop("events"))
        head = json.dumps(data, indent=1)[:-2]
        Path(path).write_text(f"{head},\n \"events\": [\n  {events}\n ]\n}}\n")

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, where: str = "trace") -> Trace:
        if not isinstance(data, Mapping):
            raise TraceError(f"{where}: expected a JSON object")
        if data.get("version") != TRACE_VERSION:
            raise TraceError(f"{where}: trace version {data.get('version')!r} is not supported "
                             f"(expected {TRACE_VERSION})")
        for key in ("cluster", "horizon_seconds", "events"):
            if key not in data:
                raise TraceError(f"{where}: missing field {key!r}")
        unknown = sorted(set(data) - {"version", "name", "cluster", "horizon_seconds", "events"})
        if unknown:
            raise TraceError(f"{where}: unknown field(s) {unknown}")
        try:
            raw = data["cluster"]
            cluster = Cluster.from_json(raw, source=f"{where}: cluster") if isinstance(raw, Mapping) \
                else load_cluster(str(raw))
        except ClusterSpecError as err:
            raise TraceError(f"{where}: cluster: {err}") from None
        horizon = data["horizon_seconds"]
        if isinstance(horizon, bool) or not isinstance(horizon, (int, float)):
            raise TraceError(f"{where}: field 'horizon_seconds': expected a number, got {horizon!r}")
        if not isinstance(data["events"], list):
            raise TraceError(f"{where}: field 'events': expected a list")
        events = tuple(_event(e, f"{where}: events[{i}]") for i, e in enumerate(data["events"]))
        name = str(data.get("name", where))
        try:
            return cls(name, cluster, float(horizon), events)
        except TraceError as err:  # named once: where it was read from, not again by its name
            raise TraceError(f"{where}: {str(err).removeprefix(f'trace {name!r}: ')}") from None


def _rebuilds(cluster: Cluster) -> bool:
    """Whether the cluster's name rebuilds it (a preset or topology string)."""
    try:
        return load_cluster(cluster.name) == cluster
    except (ClusterSpecError, OSError):
        return False


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceError(f"{where}: expected a number, got {value!r}")
    return float(value)


def _event(data: Any, where: str) -> Event:
    if not isinstance(data, Mapping) or "time" not in data:
        raise TraceError(f"{where}: expected an object with a 'time'")
    unknown = sorted(set(data) - {"time", "links", "gpus", "speed"})
    if unknown:
        raise TraceError(f"{where}: unknown field(s) {unknown}")
    for key in ("links", "speed"):
        if not isinstance(data.get(key, []), list):
            raise TraceError(f"{where}: {key}: expected a list, got {data[key]!r}")
    links = []
    for k, link in enumerate(data.get("links", [])):
        if not isinstance(link, list) or len(link) != 3:
            raise TraceError(f"{where}: links[{k}]: expected [server_a, server_b, bytes_per_second]")
        a, b = (int(_number(x, f"{where}: links[{k}]")) for x in link[:2])
        links.append((a, b, _number(link[2], f"{where}: links[{k}]")))
    gpus = data.get("gpus")
    if gpus is not None and (not isinstance(gpus, list) or not all(isinstance(g, int) and not isinstance(g, bool)
                                                                   for g in gpus)):
        raise TraceError(f"{where}: gpus: expected a list of integers, got {gpus!r}")
    speed = []
    for k, entry in enumerate(data.get("speed", [])):
        if not isinstance(entry, list) or len(entry) != 2:
            raise TraceError(f"{where}: speed[{k}]: expected [device, fraction_of_full_speed]")
        speed.append((int(_number(entry[0], f"{where}: speed[{k}]")), _number(entry[1], f"{where}: speed[{k}]")))
    return Event(_number(data["time"], f"{where}: time"), tuple(links), None if gpus is None else tuple(gpus),
                 tuple(speed))


def load_trace(path: str | Path) -> Trace:
    path = Path(path)
    if path.is_dir():
        raise TraceError(f"{path}: is a directory, not a trace file")
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    try:
        data = json.loads(path.read_text())
    except UnicodeDecodeError as err:
        raise TraceError(f"{path}: not a trace file (binary data at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise TraceError(f"{path}:{err.lineno}:{err.colno}: invalid JSON: {err.msg}") from None
    return Trace.from_json(data, where=str(path))


# ---------------------------------------------------------------------------------------------
# Generated traces
# ---------------------------------------------------------------------------------------------


class TraceKind(str, enum.Enum):
    STEPS = "steps"
    DRIFT = "drift"
    LEAVE = "leave"
    MIXED = "mixed"
    PARTIAL = "partial"  # the kinds before it keep their random streams (keyed by index)
    LINK = "link"
    STRAGGLER = "straggler"

    def __str__(self) -> str:
        return self.value


def _pairs(servers: int) -> list[tuple[int, int]]:
    return [(a, b) for a in range(servers) for b in range(a + 1, servers)]


def _recover(down: dict[tuple[int, int], float], current: dict[tuple[int, int], float], base: np.ndarray,
             t: float) -> list[tuple[int, int, float]]:
    """The links of `down` whose slow spell is over at `t`, back at full bandwidth: taken out of
    `down`, set in `current`, and returned as link changes."""
    back = [pair for pair, until in down.items() if t >= until]
    for pair in back:
        current[pair] = float(base[pair])
        del down[pair]
    return [(*pair, float(base[pair])) for pair in back]


def generate(kind: TraceKind | str, cluster: Cluster | str = "hier:4x4", *, horizon: float = 36_000.0,
             seed: int = 0, period: float = 1_800.0) -> Trace:
    """A generated trace (module docstring) with a change about every `period` seconds."""
    kind = TraceKind(kind)
    cluster = load_cluster(cluster)
    rng = np.random.default_rng([seed, list(TraceKind).index(kind)])
    base = _server_bandwidth(cluster)
    servers = base.shape[0]
    pairs = _pairs(servers)
    sizes = tuple(int(k) for k in np.bincount(cluster.node_array))
    if kind is TraceKind.PARTIAL and max(sizes) < 2:
        raise TraceError(f"a '{kind.value}' trace takes part of a server away: {cluster.name} has no server of "
                         "2 GPUs or more")
    if kind is TraceKind.LINK and not pairs:
        raise TraceError(f"a '{kind.value}' trace slows a link between two servers: {cluster.name} has one server")
    events: list[Event] = []
    current = {p: float(base[p]) for p in pairs}
    slow: tuple[int, float] | None = None    # STRAGGLER: device slowed until
    down: dict[tuple[int, int], float] = {}  # STEPS: pair -> time it recovers
    away: tuple[int, float] | None = None    # LEAVE: server away until
    t = 0.0
    while True:
        t += float(rng.exponential(period))
        if t >= horizon:
            break
        links: list[tuple[int, int, float]] = []
        gpus: tuple[int, ...] | None = None
        speed: tuple[tuple[int, float], ...] = ()
        if kind is TraceKind.LINK:
            links.extend(_recover(down, current, base, t))
            if not down and rng.random() < 0.7:
                # One link between two servers drops to 5-30% for 1-4 periods.
                pair = pairs[int(rng.integers(len(pairs)))]
                value = float(base[pair]) * float(rng.uniform(0.05, 0.3))
                links.append((*pair, value))
                current[pair] = value
                down[pair] = t + float(rng.uniform(1, 4)) * period
        if kind is TraceKind.STRAGGLER:
            # One device computes at half speed for 1-3 periods, then recovers.
            if slow is not None and t >= slow[1]:
                speed = ((slow[0], 1.0),)
                slow = None
            elif slow is None and rng.random() < 0.6:
                device = int(rng.integers(cluster.n_devices))
                slow = (device, t + float(rng.uniform(1, 3)) * period)
                speed = ((device, 0.5),)
        if kind in (TraceKind.STEPS, TraceKind.MIXED):
            links.extend(_recover(down, current, base, t))
            free = [p for p in pairs if p not in down]
            if free and rng.random() < 0.7:
                # A congested server: every link from it drops to 5-30% for 1-4 periods.
                server = int(rng.integers(servers))
                factor = float(rng.uniform(0.05, 0.3))
                until = t + float(rng.uniform(1, 4)) * period
                for pair in free:
                    if server in pair:
                        links.append((*pair, float(base[pair]) * factor))
                        current[pair] = float(base[pair]) * factor
                        down[pair] = until
        if kind in (TraceKind.LINK, TraceKind.STRAGGLER):
            # Independent mild noise (80-100% of full strength), so the one change stands out.
            for pair in pairs:
                if pair in down:
                    continue
                value = float(base[pair]) * float(np.clip(np.exp(rng.normal(0.0, 0.05)), 0.8, 1.0))
                current[pair] = value
                links.append((*pair, value))
        if kind in (TraceKind.DRIFT, TraceKind.MIXED, TraceKind.LEAVE, TraceKind.PARTIAL):
            scale = 0.5 if kind is TraceKind.DRIFT else 0.15
            for pair in pairs:
                if pair in down:
                    continue
                value = current[pair] * float(np.exp(rng.normal(0.0, scale)))
                value = float(np.clip(value, 0.05 * base[pair], 1.2 * base[pair]))
                current[pair] = value
                links.append((*pair, value))
        if kind is TraceKind.PARTIAL:
            # Part of a server leaves (at least one GPU, not all) and comes back: the device
            # count stops being a multiple of the server size.
            if away is not None and t >= away[1]:
                gpus = sizes
                away = None
            elif away is None and rng.random() < 0.5:
                server = int(rng.choice([s for s, k in enumerate(sizes) if k >= 2]))
                lost = int(rng.integers(1, sizes[server]))
                away = (server, t + float(rng.uniform(1, 3)) * period)
                gpus = tuple(k - lost if s == server else k for s, k in enumerate(sizes))
        if kind in (TraceKind.LEAVE, TraceKind.MIXED):
            if away is not None and t >= away[1]:
                gpus = sizes
                away = None
            elif away is None and rng.random() < (0.5 if kind is TraceKind.LEAVE else 0.25):
                server = int(rng.integers(servers))
                away = (server, t + float(rng.uniform(1, 3)) * period)
                gpus = tuple(0 if s == server else k for s, k in enumerate(sizes))
        if links or gpus is not None or speed:
            latest = {(a, b): bw for a, b, bw in links}  # a link that recovers and drops again: the drop
            events.append(Event(round(t, 3), tuple((a, b, bw) for (a, b), bw in latest.items()), gpus, speed))
    return Trace(f"{kind.value}-{seed}", cluster, horizon, tuple(events))
