"""`Links`: the part of a cluster a pipeline search needs (alpha-beta links, nodes, memory).

The simulator and the DP take this small frozen dataclass instead of `hlomap.cost.Cluster` so
that they work with hand-made links (a uniform 10 Gbps network for the PipeDream profiles) and do
not depend on the cost package at import time. `Links.from_cluster` adapts a Cluster by reading
only the agreed attributes (bandwidth, latency, node_of, devices[i].memory_bytes).

Communication model, shared by the simulator and the DP:
- point-to-point: `latency + nbytes / bandwidth` on the directed link src -> dst. Links are full
  duplex: activations going forward and gradients coming back do not share a direction.
- stage to stage (`transfer_time`): a stage replicated r ways splits every microbatch evenly over
  its replicas. A tensor going from a stage on devices g (r of them) to one on g' (r') is cut into
  k = max(r, r') equal chunks, chunk c going g[c % r] -> g'[c % r'], all at once; the transfer
  takes as long as its slowest chunk. Contention between chunks sharing a link is ignored.
- gradient all-reduce (`allreduce_time`): a ring over the group in the given order, 2 (k - 1)
  steps of nbytes / k per ring edge, each step as slow as the slowest edge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["Links"]


@dataclass(frozen=True, eq=False)
class Links:
    """Directed alpha-beta links between devices, plus each device's node and memory.

    Attributes:
      bandwidth: [n, n] bytes/s from row device to column device (diagonal ignored).
      latency: [n, n] seconds per message (alpha).
      node_of: server (node) id of each device; stage cuts may be forced onto node boundaries.
      memory_bytes: usable memory of each device, in bytes (math.inf: unchecked).
    """

    bandwidth: np.ndarray
    latency: np.ndarray
    node_of: tuple[int, ...]
    memory_bytes: tuple[float, ...]

    def __post_init__(self) -> None:
        n = len(self.node_of)
        if n == 0:
            raise ValueError("Links needs at least one device")
        for name in ("bandwidth", "latency"):
            matrix = np.array(getattr(self, name), dtype=np.float64, copy=True)
            if matrix.shape != (n, n):
                raise ValueError(f"Links.{name} has shape {matrix.shape}, expected ({n}, {n})")
            off_diagonal = ~np.eye(n, dtype=bool)
            if name == "bandwidth":
                bad = off_diagonal & ~(matrix > 0)
            else:
                bad = off_diagonal & ~(np.isfinite(matrix) & (matrix >= 0))
            if bad.any():
                i, j = (int(v) for v in np.argwhere(bad)[0])
                raise ValueError(f"Links.{name}[{i}, {j}] = {float(matrix[i, j])!r} is not valid")
            matrix.setflags(write=False)
            object.__setattr__(self, name, matrix)
        object.__setattr__(self, "node_of", tuple(int(v) for v in self.node_of))
        memory = tuple(float(v) for v in self.memory_bytes)
        if len(memory) != n:
            raise ValueError(f"Links.memory_bytes has {len(memory)} entries, expected {n}")
        for i, value in enumerate(memory):
            if not value > 0:
                raise ValueError(f"Links.memory_bytes[{i}] = {value!r} must be > 0")
        object.__setattr__(self, "memory_bytes", memory)

    @property
    def n_devices(self) -> int:
        return len(self.node_of)

    @classmethod
    def uniform(
        cls,
        n_devices: int,
        *,
        bandwidth: float,
        latency: float = 0.0,
        memory_bytes: float = math.inf,
        devices_per_node: int | None = None,
    ) -> Links:
        """Every pair of devices joined by the same link (bandwidth in bytes/s).

        `devices_per_node` groups consecutive devices into nodes (default: all on one node).
        """
        per_node = devices_per_node or n_devices
        return cls(
            bandwidth=np.full((n_devices, n_devices), float(bandwidth)),
            latency=np.full((n_devices, n_devices), float(latency)),
            node_of=tuple(d // per_node for d in range(n_devices)),
            memory_bytes=(float(memory_bytes),) * n_devices,
        )

    @classmethod
    def from_cluster(cls, cluster: Any) -> Links:
        """Adapt an `hlomap.cost.Cluster` (or anything with the same agreed attributes)."""
        return cls(
            bandwidth=np.asarray(cluster.bandwidth, dtype=np.float64),
            latency=np.asarray(cluster.latency, dtype=np.float64),
            node_of=tuple(cluster.node_of),
            memory_bytes=tuple(float(device.memory_bytes) for device in cluster.devices),
        )

    def p2p_time(self, src: int, dst: int, nbytes: float) -> float:
        """Seconds to move `nbytes` from src to dst; 0 on the same device or for no data."""
        if src == dst or nbytes <= 0:
            return 0.0
        return float(self.latency[src, dst] + nbytes / self.bandwidth[src, dst])

    def transfer_time(self, src: Sequence[int], dst: Sequence[int], nbytes: float) -> float:
        """Seconds to move a tensor of `nbytes` from a stage on `src` to a stage on `dst`."""
        if nbytes <= 0:
            return 0.0
        chunks = max(len(src), len(dst))
        return max(
            self.p2p_time(src[c % len(src)], dst[c % len(dst)], nbytes / chunks)
            for c in range(chunks)
        )

    def allreduce_time(self, group: Sequence[int], nbytes: float) -> float:
        """Seconds for a ring all-reduce of `nbytes` over `group` (0 for one device)."""
        k = len(group)
        if k <= 1 or nbytes <= 0:
            return 0.0
        step = max(
            self.p2p_time(group[i], group[(i + 1) % k], nbytes / k) for i in range(k)
        )
        return 2 * (k - 1) * step

    def group_memory(self, group: Sequence[int]) -> float:
        """Memory of the smallest device in the group: every replica stores the same data."""
        return min(self.memory_bytes[d] for d in group)

    def is_node_boundary(self, device: int) -> bool:
        """True when a device cut before `device` (in linear order) falls between two nodes."""
        if device <= 0 or device >= self.n_devices:
            return True
        return self.node_of[device - 1] != self.node_of[device]
