"""Pipeline communication on a `Cluster`, priced by `hlomap.cost.collectives`: one model.

The simulator, the closed form, the DP, the brute force and the cut environment all price a
pipeline's communication with these functions, on the cluster's real topology:

- Gradient all-reduce of a stage replicated over devices g: `collectives.all_reduce_time` over g:
  a ring inside a server; across servers hierarchical, as NCCL runs it (reduce-scatter inside
  each server, k rings across servers, all-gather), the k rings sharing each server's NICs.
- Stage-to-stage transfer of an n-byte tensor from a stage on src (r devices) to one on dst
  (r'): each replica holds 1/r of every microbatch, so the tensor moves as k = max(r, r') chunks
  of n / k bytes, chunk c from src[c % r] to dst[c % r'], all at once: a collective-permute of
  those pairs (`collectives.collective_permute_time`), in which the streams leaving or entering a
  server share its `nics_per_node` NICs. Between two 8-GPU servers with one NIC each, the 8
  chunks take as long as the whole tensor over one link.
- Links are full duplex: activations going forward and gradients coming back use opposite
  directions and do not slow each other; transfers at different cuts do not share NICs in this
  model (each direction of each cut is its own resource in the simulator).
- Nothing to send (no bytes, or an all-reduce over one device) takes no time.
- A stage's replicas all hold its parameters: the group's smallest device memory bounds it.
- Stage boundaries fall on servers where `Cluster.node_of` changes.

For fixed devices each of these times is affine in the byte count (the hierarchical all-reduce
too), and a set of concurrent pairs is a max of affine functions: `AffineMax` holds the terms
`collectives.all_reduce_terms` and `collectives.collective_permute_terms` give, and every price,
one byte count or a whole array of them (the DP, the cut environment), is that AffineMax
evaluated, so all callers get the very same numbers. Working out a group's terms (its layout over
servers, its slowest links, NIC loads) costs far more than evaluating them, so callers that price
the same groups many times keep a `GroupPrices`: an explicit memo of one cluster's terms.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import numpy as np

from hlomap.cost.cluster import Cluster
from hlomap.cost.collectives import all_reduce_terms, collective_permute_terms
from hlomap.cost.estimate import per_buffer_seconds

__all__ = [
    "AffineMax",
    "GroupPrices",
    "allreduce_cost",
    "allreduce_time",
    "gradient_buffer_seconds",
    "group_memory",
    "is_node_boundary",
    "transfer_cost",
    "transfer_pairs",
    "transfer_time",
    "with_device_memory",
]

Group = Sequence[int]


class AffineMax(NamedTuple):
    """t(x) = max_c(alpha_c + beta_c x) for x > 0, and 0 for x <= 0: the time of a transfer or a
    gradient all-reduce of x bytes over fixed devices, vectorized over x."""

    alpha: np.ndarray
    beta: np.ndarray

    def __call__(self, nbytes: np.ndarray | float) -> np.ndarray:
        x = np.asarray(nbytes, dtype=np.float64)
        if self.alpha.size == 0:
            return np.zeros_like(x)
        t = np.max(self.alpha[:, None] + self.beta[:, None] * x.reshape(1, -1), axis=0)
        return np.where(x > 0, t.reshape(x.shape), 0.0)


def transfer_pairs(src: Group, dst: Group) -> tuple[tuple[int, int], ...]:
    """The (src, dst) device pair of each of the k = max(r, r') chunks of a stage transfer."""
    chunks = max(len(src), len(dst))
    return tuple((int(src[c % len(src)]), int(dst[c % len(dst)])) for c in range(chunks))


def transfer_cost(cluster: Cluster, src: Group, dst: Group) -> AffineMax:
    """The time of a transfer of x bytes from a stage on `src` to one on `dst`, as an `AffineMax`
    of x: the k chunks' pairs priced by `collectives.collective_permute_terms`, x / k bytes each."""
    pairs = transfer_pairs(src, dst)
    terms = collective_permute_terms(cluster, pairs)
    return AffineMax(np.array([t.alpha for t in terms], dtype=np.float64),
                     np.array([t.beta / len(pairs) for t in terms], dtype=np.float64))


def allreduce_cost(cluster: Cluster, group: Group) -> AffineMax:
    """The time of an all-reduce of x bytes of gradients over a stage's devices `group`, as an
    `AffineMax` of x (`collectives.all_reduce_terms`; none over one device)."""
    if len(group) <= 1:
        return AffineMax(np.zeros(0), np.zeros(0))
    terms = all_reduce_terms(cluster, group)
    return AffineMax(np.array([terms.alpha]), np.array([terms.beta]))


def transfer_time(cluster: Cluster, src: Group, dst: Group, nbytes: float) -> float:
    """Seconds to move an `nbytes` tensor from a stage on `src` to a stage on `dst`."""
    return float(transfer_cost(cluster, src, dst)(nbytes))


def gradient_buffer_seconds(cluster: Cluster, group_size: int, buffers: Any) -> Any:
    """What the `buffers` arrays of a gradient all-reduce over `group_size` devices add to the
    all-reduce of their bytes (a float, or an array of them for an array of counts): XLA combines
    a stage's gradient all-reduces into one (as it does an SPMD step's), whose every buffer after
    the first costs a measured cluster what its calibration timed
    (`hlomap.cost.estimate.per_buffer_seconds`: host devices reduce the operands one after
    another); nothing on a datasheet cluster or one device."""
    per_buffer = per_buffer_seconds(cluster, group_size)
    extra = per_buffer * np.maximum(np.asarray(buffers, dtype=np.float64) - 1.0, 0.0)
    return float(extra) if extra.ndim == 0 else extra


def allreduce_time(cluster: Cluster, group: Group, nbytes: float, buffers: float = 1.0) -> float:
    """Seconds to all-reduce `nbytes` of gradients in `buffers` arrays over a stage's devices
    `group` (`gradient_buffer_seconds`)."""
    return float(allreduce_cost(cluster, group)(nbytes)) + gradient_buffer_seconds(cluster, len(group), buffers)


class GroupPrices:
    """`allreduce_cost` and `transfer_cost` of one cluster's device groups, each worked out once.

    An explicit cache owned by its caller (a cut environment, one DP solve, a brute force): the
    same stage groups are priced for every plan, and their analysis dominates the evaluation.
    """

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._allreduces: dict[tuple[int, ...], AffineMax] = {}
        self._transfers: dict[tuple[tuple[int, ...], tuple[int, ...]], AffineMax] = {}

    def allreduce(self, group: Group) -> AffineMax:
        key = tuple(int(d) for d in group)
        if key not in self._allreduces:
            self._allreduces[key] = allreduce_cost(self.cluster, key)
        return self._allreduces[key]

    def transfer(self, src: Group, dst: Group) -> AffineMax:
        key = (tuple(int(d) for d in src), tuple(int(d) for d in dst))
        if key not in self._transfers:
            self._transfers[key] = transfer_cost(self.cluster, *key)
        return self._transfers[key]


def group_memory(cluster: Cluster, group: Group) -> float:
    """Memory of the smallest device in the group: every replica stores the same parameters."""
    return min(float(cluster.devices[d].memory_bytes) for d in group)


def is_node_boundary(cluster: Cluster, device: int) -> bool:
    """True when a device cut before `device` (in linear order) falls between two nodes."""
    if device <= 0 or device >= cluster.n_devices:
        return True
    return cluster.node_of[device - 1] != cluster.node_of[device]


def with_device_memory(cluster: Cluster, memory_bytes: float) -> Cluster:
    """`cluster` with every device's memory set to `memory_bytes`; `math.inf` makes memory never
    bind (PipeDream's optimizer; random problems without a memory limit)."""
    devices = tuple(dataclasses.replace(d, memory_bytes=memory_bytes) for d in cluster.devices)
    return dataclasses.replace(cluster, devices=devices)
