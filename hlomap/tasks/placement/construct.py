"""Constructed and structured placements: where placement's local search and the PPO policy's
episodes start.

- the identity (the plan's own order) and, for a mesh, every nesting order of its axes
  (`cost.mapping.axis_devices`): the structured starts;
- a constructive placement (Parmesan's mapping is a constructive greedy in the same spirit): the
  positions, most connected first (`placement_order`), each on the free device that adds the
  least affinity cost to its already placed partners (`objective.Affinity`).
"""

from __future__ import annotations

import itertools

import numpy as np

from hlomap.cost.mapping import axis_devices
from hlomap.tasks.placement.objective import Affinity, affinity
from hlomap.tasks.placement.problem import MeshLayout, PlacementProblem

__all__ = ["construct", "placement_order", "scalar_weights", "structured_starts"]


def scalar_weights(problem: PlacementProblem, aff: Affinity) -> list[np.ndarray]:
    """Each position's affinity to each neighbour as one number (weights at mean link speeds)."""
    off = ~np.eye(problem.n_devices, dtype=bool)
    mean_latency = float(aff.latency[off].mean()) if off.any() else 0.0
    mean_inverse = float(aff.inverse_bandwidth[off].mean()) if off.any() else 0.0
    return [wl * mean_latency + wb * mean_inverse for wl, wb in zip(aff.w_latency, aff.w_bytes)]


def placement_order(problem: PlacementProblem, aff: Affinity) -> np.ndarray:
    """The order a constructive placement visits positions: Prim's order from position 0, the
    next position being the one most attached to those already placed (scalar affinity at mean
    link speeds). It depends only on which positions are placed, not on their devices."""
    n = problem.n_positions
    weights = scalar_weights(problem, aff)
    placed = np.zeros(n, dtype=bool)
    pull = np.full(n, -1.0)
    order = []
    p = 0
    for _ in range(n):
        order.append(p)
        placed[p] = True
        nb = aff.neighbors[p]
        pull[nb] = np.maximum(pull[nb], 0.0) + weights[p]
        if len(order) < n:
            p = int(np.argmax(np.where(placed, -np.inf, pull)))
    return np.asarray(order, dtype=np.int64)


def construct(problem: PlacementProblem, aff: Affinity | None = None, *,
              first_device: int | None = None) -> np.ndarray:
    """A constructive placement: positions in `placement_order`, each on the free device that
    adds the least affinity cost to its placed partners; ties go to the lowest device id (the
    first position goes to its identity device). Returns a full order of all devices."""
    aff = aff or affinity(problem)
    n, d = problem.n_positions, problem.n_devices
    devices = np.zeros(d, dtype=np.int64)
    placed = np.zeros(d, dtype=bool)   # indexed by slot (slots >= n are never placed)
    free = np.ones(d, dtype=bool)      # indexed by device
    for step, p in enumerate(placement_order(problem, aff)):
        if step == 0:
            device = problem.identity[0] if first_device is None else first_device
        else:
            device = int(np.argmin(np.where(free, aff.increments(p, devices, placed), np.inf)))
        devices[p] = device
        placed[p] = True
        free[device] = False
    devices[n:] = np.flatnonzero(free)
    return devices


def structured_starts(problem: PlacementProblem, aff: Affinity) -> list[np.ndarray]:
    """The identity, every nesting order of a mesh's axes, and the constructive placement."""
    starts = [problem.full_order(problem.identity)]
    layout = problem.layout
    if isinstance(layout, MeshLayout) and len(layout.axes) > 1:
        names = [name for name, _ in layout.axes]
        for order in itertools.permutations(names):
            mapping = axis_devices(problem.cluster, dict(layout.axes), order=order, devices=problem.identity)
            starts.append(problem.full_order(mapping.devices.reshape(-1).tolist()))
    starts.append(construct(problem, aff))
    return starts
