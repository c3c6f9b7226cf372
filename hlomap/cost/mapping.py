"""How the axes of a logical device mesh map onto the device ids of a cluster.

A plan shards tensors over named mesh axes ({"data": 2, "model": 8}); what a collective along an
axis costs depends on which physical devices that axis connects. `axis_devices` lays the mesh out
in a chosen nesting order: the LAST axis of `order` is innermost, i.e. it varies fastest over
consecutive device ids, so with node-by-node device ids it stays inside a node. The result is an
`AxisMapping`: the device-id array shaped like the mesh, and per axis the groups of devices that
communicate along it. Any other layout (e.g. a topology-aware permutation found by a search) is
given explicitly with `AxisMapping(axes, devices)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from hlomap.cost.cluster import Cluster

Group = tuple[int, ...]


class MappingError(ValueError):
    """Mesh axes and devices do not fit together."""


@dataclass(frozen=True, eq=False)
class AxisMapping:
    """`axes`: (name, size) in mesh order; `devices`: int array of shape (size, ...) in that
    order, `devices[i, j]` the device id at mesh coordinate (i, j). Read-only."""

    axes: tuple[tuple[str, int], ...]
    devices: np.ndarray

    def __post_init__(self) -> None:
        axes = tuple((str(name), int(size)) for name, size in self.axes)
        names = [name for name, _ in axes]
        if len(set(names)) != len(names):
            raise MappingError(f"duplicate mesh axis name in {names}")
        devices = np.array(self.devices, dtype=np.int64)
        shape = tuple(size for _, size in axes)
        if devices.shape != shape:
            raise MappingError(f"device array has shape {devices.shape}, mesh axes {dict(axes)} need {shape}")
        if len(np.unique(devices)) != devices.size:
            raise MappingError(f"a device appears twice in the mapping {devices.tolist()}")
        if devices.size and devices.min() < 0:
            raise MappingError(f"negative device id in the mapping {devices.tolist()}")
        devices.flags.writeable = False
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "devices", devices)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.axes)

    def axis_index(self, axis: str) -> int:
        try:
            return self.axis_names.index(axis)
        except ValueError:
            raise MappingError(f"unknown mesh axis {axis!r}; axes are {self.axis_names}") from None

    def groups(self, axis: str | Sequence[str]) -> tuple[Group, ...]:
        """The device groups that communicate along `axis` (or along several axes at once, e.g.
        a collective over ("data", "model")): one group per coordinate of the other axes, each
        ordered by the coordinate along the axis (row-major over several axes)."""
        names = (axis,) if isinstance(axis, str) else tuple(axis)
        idx = [self.axis_index(a) for a in names]
        if len(set(idx)) != len(idx):
            raise MappingError(f"axis named twice in {names}")
        moved = np.moveaxis(self.devices, idx, list(range(-len(idx), 0)))
        size = math.prod(self.shape[i] for i in idx)
        return tuple(tuple(int(d) for d in row) for row in moved.reshape(-1, size))

    def check_fits(self, cluster: Cluster) -> None:
        if self.devices.size and int(self.devices.max()) >= cluster.n_devices:
            raise MappingError(f"mapping uses device {int(self.devices.max())} but cluster "
                               f"{cluster.name!r} has {cluster.n_devices} devices")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AxisMapping):
            return NotImplemented
        return self.axes == other.axes and np.array_equal(self.devices, other.devices)

    def __hash__(self) -> int:
        return hash((self.axes, self.devices.tobytes()))

    def __repr__(self) -> str:
        return f"AxisMapping({dict(self.axes)}, devices={self.devices.tolist()})"

    def to_json(self) -> dict[str, Any]:
        return {"axes": dict(self.axes), "devices": self.devices.tolist()}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], *, source: str = "<dict>") -> AxisMapping:
        for key in ("axes", "devices"):
            if key not in d:
                raise MappingError(f"{source}: missing field {key!r}")
        if not isinstance(d["axes"], Mapping):
            raise MappingError(f"{source}: field 'axes': expected an object name -> size, got {d['axes']!r}")
        try:
            return cls(tuple(d["axes"].items()), np.asarray(d["devices"]))
        except (MappingError, ValueError, TypeError) as err:
            raise MappingError(f"{source}: field 'devices': {err}") from None


def axis_devices(cluster: Cluster, axes: Mapping[str, int], order: Sequence[str] | None = None,
                 devices: Sequence[int] | None = None) -> AxisMapping:
    """Lay the mesh `axes` out over `devices` (default: the cluster's first prod(sizes) ids).

    `order` lists the axes outermost first; the last is innermost (consecutive device ids).
    Default: the order of `axes`. Example on two 8-GPU servers:
    `axis_devices(cluster, {"data": 2, "model": 8}, order=("data", "model"))` keeps each `model`
    group inside a server and puts `data` across servers; `order=("model", "data")` does the
    opposite.
    """
    sizes = dict(axes)
    if any(int(s) < 1 for s in sizes.values()):
        raise MappingError(f"mesh axis sizes must be >= 1, got {sizes}")
    order = tuple(order) if order is not None else tuple(sizes)
    if sorted(order) != sorted(sizes):
        raise MappingError(f"order {order} must name each mesh axis {tuple(sizes)} exactly once")
    total = math.prod(sizes.values())
    pool = list(range(cluster.n_devices)) if devices is None else [int(d) for d in devices]
    if total > len(pool):
        raise MappingError(f"mesh {sizes} needs {total} devices; only {len(pool)} available "
                           f"on cluster {cluster.name!r}")
    chosen = np.asarray(pool[:total], dtype=np.int64)
    nested = chosen.reshape([sizes[a] for a in order])
    mesh_order = tuple(sizes)
    array = np.transpose(nested, [order.index(a) for a in mesh_order])
    mapping = AxisMapping(tuple(sizes.items()), array)
    mapping.check_fits(cluster)
    return mapping
