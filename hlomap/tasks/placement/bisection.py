"""Recursive bisection (METIS-style, written here: no graph-partitioning dependency): split the
logical positions' communication graph and the devices in halves of matching sizes, put each
half of positions on a half of the devices, and recurse until one position meets one device.

- positions: a dense [n, n] weight matrix (the affinity proxy's weights at mean link speeds,
  `construct.scalar_weights`), bisected by greedy graph growing from a seed (the free position
  most attached to the part so far joins it: METIS's GGGP initial partition) and refined by
  Kernighan-Lin swaps (the pair whose exchange cuts the most weight, until none helps);
- devices on a grid (a torus or mesh: a cluster with a network): recursive coordinate
  bisection, each part cut across its longest axis at the median, so parts are compact boxes
  whatever the device ids are (tables on a grid price a pair as if alone, which says nothing of
  which links flows share);
- other devices (servers, random blocks, uniform distances): the same graph bisection over the
  devices, weighted by how cheaply each pair talks (1 / its proxy cost), which keeps servers and
  well-connected blocks together.

Cost: O(n^2) per level and swap pass over dense matrices; a few hundred milliseconds at 512.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from hlomap.tasks.placement.curves import row_major, sorted_by

__all__ = ["bisect_coordinates", "bisect_graph", "compact_devices", "recursive_bisection"]

#: Kernighan-Lin swaps per bisection at most, as a multiple of the part size (each swap strictly
#: lowers the cut, so this only bounds pathological plateaus of tiny gains).
SWAPS_PER_NODE = 1
#: A swap must cut at least this share of the total weight to count (float noise is no gain).
MIN_GAIN = 1e-12


def bisect_graph(weights: np.ndarray, size: int) -> np.ndarray:
    """A boolean mask choosing `size` of the graph's nodes (symmetric non-negative `weights`)
    so that little weight crosses the cut: greedy growing from node 0, then Kernighan-Lin swaps."""
    n = len(weights)
    inside = np.zeros(n, dtype=bool)
    if size <= 0 or size >= n:
        inside[:] = size >= n
        return inside
    inside[0] = True
    pull = weights[0].astype(np.float64).copy()
    for _ in range(size - 1):
        # ties (no edge to the part yet) go to the lowest index: contiguous positions stay together
        v = int(np.argmax(np.where(inside, -np.inf, pull)))
        inside[v] = True
        pull += weights[v]
    to_inside = weights[:, inside].sum(axis=1)
    to_outside = weights.sum(axis=1) - to_inside
    tolerance = MIN_GAIN * max(float(weights.sum()), 1e-300)
    for _ in range(SWAPS_PER_NODE * min(size, n - size)):
        a_nodes, b_nodes = np.flatnonzero(inside), np.flatnonzero(~inside)
        # the cut saved by moving a node across: its weight to the other side less to its own
        d_a = to_outside[a_nodes] - to_inside[a_nodes]
        d_b = to_inside[b_nodes] - to_outside[b_nodes]
        gain = d_a[:, None] + d_b[None, :] - 2 * weights[np.ix_(a_nodes, b_nodes)]
        i, j = np.unravel_index(int(np.argmax(gain)), gain.shape)
        if gain[i, j] <= tolerance:
            break
        a, b = int(a_nodes[i]), int(b_nodes[j])
        inside[a], inside[b] = False, True
        to_inside += weights[:, b] - weights[:, a]
        to_outside += weights[:, a] - weights[:, b]
    return inside


def bisect_coordinates(coords: np.ndarray, size: int) -> np.ndarray:
    """A boolean mask choosing `size` devices on one side of a cut across the longest axis of
    their bounding box (ties: the lower axis), in row-major order along it."""
    extent = coords.max(axis=0) - coords.min(axis=0)
    axis = int(np.argmax(extent))
    order = sorted_by([coords[:, axis]] + [coords[:, a] for a in range(coords.shape[1]) if a != axis])
    inside = np.zeros(len(coords), dtype=bool)
    inside[order[:size]] = True
    return inside


def recursive_bisection(position_weights: np.ndarray, devices: Sequence[int], coords: np.ndarray | None,
                        device_weights: np.ndarray | None) -> np.ndarray:
    """The device of each position: positions and `devices` (as many as positions) bisected
    together (module docstring). `coords` ([device id, axis]) bisects the devices geometrically;
    otherwise `device_weights` ([device id, device id]) by graph."""
    pool = np.asarray(devices, dtype=np.int64)
    n = len(position_weights)
    if len(pool) != n:
        raise ValueError(f"recursive bisection maps {n} positions onto {len(pool)} devices: give as many")
    if coords is None and device_weights is None:
        raise ValueError("recursive bisection needs device coordinates or device weights")
    out = np.empty(n, dtype=np.int64)
    stack = [(np.arange(n), pool)]
    while stack:
        positions, part = stack.pop()
        if len(positions) == 1:
            out[positions[0]] = part[0]
            continue
        half = len(positions) // 2
        if coords is not None:
            side = bisect_coordinates(coords[part], half)
        else:
            assert device_weights is not None
            side = bisect_graph(device_weights[np.ix_(part, part)], half)
        mine = bisect_graph(position_weights[np.ix_(positions, positions)], half)
        stack.append((positions[mine], part[side]))
        stack.append((positions[~mine], part[~side]))
    return out


def compact_devices(coords: np.ndarray, count: int) -> np.ndarray:
    """`count` devices that sit close together: the first in row-major coordinate order."""
    return row_major(coords)[:count]
