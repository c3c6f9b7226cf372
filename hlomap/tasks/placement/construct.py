"""Constructed and structured placements: where placement's local search and the PPO policy's
episodes start.

- the identity (the plan's own order);
- walks over the devices' topology coordinates (`Cluster.coordinates`, `curves`): row-major,
  snake and Hilbert, each laying the logical positions (row-major over a mesh, stage by stage)
  along it; they read coordinates, not device ids, so they hold on a cluster whose ids are
  scrambled;
- for a mesh, every other nesting order of its axes over each walk (`cost.mapping.axis_devices`
  with the walk as the device list): which mesh axis runs along the fastest coordinates;
- recursive bisection of the positions' affinity graph against the devices (`bisection`);
- a constructive placement (Parmesan's mapping is a constructive greedy in the same spirit): the
  positions, most connected first (`placement_order`), each on the free device that adds the
  least affinity cost to its already placed partners (`objective.Affinity`).

The search scores them all and refines the best (`search.greedy.iterated_local_search`), so it
never answers worse than the best of them.
"""

from __future__ import annotations

import itertools
from typing import Callable

import numpy as np

from hlomap.cost.mapping import axis_devices
from hlomap.tasks.placement import curves
from hlomap.tasks.placement.bisection import compact_devices, recursive_bisection
from hlomap.tasks.placement.objective import Affinity, affinity
from hlomap.tasks.placement.problem import MeshLayout, PlacementProblem

__all__ = ["WALKS", "bisection_start", "construct", "named_starts", "placement_order", "position_weights",
           "scalar_weights", "structured_starts", "walk_starts"]

#: The walks over topology coordinates that structured starts lay positions along.
WALKS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "row-major": curves.row_major, "snake": curves.snake, "hilbert": curves.hilbert}


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


def walk_starts(problem: PlacementProblem) -> dict[str, np.ndarray]:
    """Per walk over the coordinates (`WALKS`), the positions laid along it in logical order and,
    for a mesh, along it in every other nesting order of the mesh axes (named `walk a>b`,
    outermost axis first). Full orders of all devices."""
    coords = problem.cluster.coordinates
    n = problem.n_positions
    layout = problem.layout
    out: dict[str, np.ndarray] = {}
    for name, walk in WALKS.items():
        order = walk(coords)
        out[name] = problem.full_order(order[:n].tolist())
        if isinstance(layout, MeshLayout) and len(layout.axes) > 1:
            names = tuple(axis for axis, _ in layout.axes)
            for nesting in itertools.permutations(names):
                if nesting == names:
                    continue  # the plain walk
                mapping = axis_devices(problem.cluster, dict(layout.axes), order=nesting, devices=order.tolist())
                out[f"{name} {'>'.join(nesting)}"] = problem.full_order(mapping.devices.reshape(-1).tolist())
    return out


def position_weights(aff: Affinity, weights: list[np.ndarray]) -> np.ndarray:
    """[positions, positions]: the scalar affinity between every pair (0 where none)."""
    n = aff.n_positions
    dense = np.zeros((n, n))
    for p in range(n):
        dense[p, aff.neighbors[p]] = weights[p]
    return np.maximum(dense, dense.T)  # symmetric already; max guards float asymmetry


def _device_weights(problem: PlacementProblem, aff: Affinity) -> np.ndarray:
    """[devices, devices]: how cheaply each pair talks, 1 / (latency + bytes at its bandwidth)
    with the layout's bytes per latency step (its affinity weights' ratio)."""
    steps = sum(float(w.sum()) for w in aff.w_latency)
    volume = sum(float(w.sum()) for w in aff.w_bytes)
    bytes_per_step = volume / steps if steps > 0 else 1.0
    cost = aff.latency + bytes_per_step * aff.inverse_bandwidth
    with np.errstate(divide="ignore"):
        weights = np.where(cost > 0, 1.0 / cost, 0.0)
    np.fill_diagonal(weights, 0.0)
    return weights / max(float(weights.max()), 1e-300)


def bisection_start(problem: PlacementProblem, aff: Affinity) -> np.ndarray:
    """Recursive bisection of the positions' affinity graph against the devices (`bisection`):
    on a grid the devices are cut by coordinates, elsewhere by how cheaply they talk. The devices
    used are the most compact block (first in row-major coordinate order) when there are spare
    ones."""
    cluster = problem.cluster
    coords = cluster.coordinates
    n = problem.n_positions
    devices = compact_devices(coords, n)
    grid = cluster.network is not None
    placed = recursive_bisection(position_weights(aff, scalar_weights(problem, aff)), devices,
                                 coords if grid else None, None if grid else _device_weights(problem, aff))
    return problem.full_order(placed.tolist())


def named_starts(problem: PlacementProblem, aff: Affinity) -> dict[str, np.ndarray]:
    """Every structured start by name (module docstring): identity, the walks and nestings,
    bisection, construction. Full orders of all devices; two may coincide."""
    return {"identity": problem.full_order(problem.identity), **walk_starts(problem),
            "bisection": bisection_start(problem, aff), "construct": construct(problem, aff)}


def structured_starts(problem: PlacementProblem, aff: Affinity) -> list[np.ndarray]:
    """The distinct `named_starts`, identity first (so it wins ties)."""
    seen: set[bytes] = set()
    out = []
    for order in named_starts(problem, aff).values():
        key = order.tobytes()
        if key not in seen:
            seen.add(key)
            out.append(order)
    return out
