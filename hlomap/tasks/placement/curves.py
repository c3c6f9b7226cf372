"""Orders of devices by their topology coordinates (`Cluster.coordinates`): the walks that
placement's structured starts lay logical positions along.

Device ids need not follow the topology (a scheduler may hand out a scrambled torus), so every
order here reads the coordinates, never the ids:

- `row_major`: axis 0 slowest, the last axis fastest (a torus's rows, a server's slots);
- `snake`: boustrophedon in any rank (the reflected mixed-radix Gray order): every axis reverses
  its direction each time the slower axes step, so consecutive devices are always neighbours
  (on a full grid), also across row ends where row-major jumps back;
- `hilbert`: the n-D Hilbert curve (Skilling, "Programming the Hilbert curve", AIP 2004), whose
  every aligned block of 2^k consecutive devices is a compact sub-cube: positions close in the
  logical order land close in every axis at once, not only along the fastest one. Coordinates
  of any extent are embedded in the smallest power-of-two cube and sorted by curve index, so the
  order exists for every shape (it is a contiguous walk on power-of-two cubes).

Each returns a permutation of the device ids (`np.ndarray` of int64), ties (which distinct
coordinates never give) broken by id.
"""

from __future__ import annotations

import numpy as np

__all__ = ["hilbert", "hilbert_keys", "row_major", "snake", "sorted_by"]


def _as_coordinates(coords: np.ndarray) -> np.ndarray:
    array = np.asarray(coords, dtype=np.int64)
    if array.ndim != 2 or (array.size and array.min() < 0):
        raise ValueError(f"coordinates must be a [devices, axes] array of non-negative integers, got {array.shape}")
    return array


def sorted_by(keys: list[np.ndarray]) -> np.ndarray:
    """Device ids sorted by `keys` (first key slowest), then by id."""
    n = len(keys[0]) if keys else 0
    return np.lexsort([np.arange(n), *reversed(keys)]).astype(np.int64)


def row_major(coords: np.ndarray) -> np.ndarray:
    """Devices in row-major order of their coordinates (axis 0 slowest)."""
    array = _as_coordinates(coords)
    return sorted_by([array[:, a] for a in range(array.shape[1])])


def snake(coords: np.ndarray) -> np.ndarray:
    """Devices in boustrophedon order: axis k runs backwards whenever the walk has stepped an odd
    number of times over the slower axes (for a 2-D grid: every other row reversed)."""
    array = _as_coordinates(coords)
    extent = array.max(axis=0) + 1 if array.size else np.zeros(array.shape[1], np.int64)
    keys, slower = [], np.zeros(len(array), dtype=np.int64)
    for a in range(array.shape[1]):
        # the walk's step along axis a: reflected when the walk has taken an odd number of steps
        # over the slower axes (their mixed-radix index), so each pass starts where the last ended
        digit = np.where(slower % 2 == 1, extent[a] - 1 - array[:, a], array[:, a])
        keys.append(digit)
        slower = slower * extent[a] + digit
    return sorted_by(keys)


def hilbert_keys(coords: np.ndarray) -> np.ndarray:
    """Each device's index along the n-D Hilbert curve through the smallest power-of-two cube
    that holds every coordinate (Skilling's axes-to-transpose, vectorized over devices)."""
    array = _as_coordinates(coords)
    n, rank = array.shape
    bits = max(1, int(array.max(initial=0)).bit_length())
    if rank * bits > 62:
        raise ValueError(f"a Hilbert index of {rank} axes x {bits} bits does not fit 64 bits")
    x = [array[:, a].copy() for a in range(rank)]
    top = 1 << (bits - 1)
    q = top
    while q > 1:  # undo the rotations and reflections, from the coarsest level down
        p = q - 1
        for i in range(rank):
            high = (x[i] & q) != 0
            x[0] = np.where(high, x[0] ^ p, x[0])  # invert the low bits of axis 0
            t = np.where(high, 0, (x[0] ^ x[i]) & p)  # or exchange them with axis i's
            x[0] ^= t
            x[i] ^= t
        q >>= 1
    for i in range(1, rank):  # Gray encode
        x[i] ^= x[i - 1]
    t = np.zeros(n, dtype=np.int64)
    q = top
    while q > 1:
        t = np.where((x[rank - 1] & q) != 0, t ^ (q - 1), t)
        q >>= 1
    for i in range(rank):
        x[i] ^= t
    key = np.zeros(n, dtype=np.int64)
    for b in range(bits - 1, -1, -1):  # interleave: bit b of axis 0, of axis 1, ...
        for i in range(rank):
            key = (key << 1) | ((x[i] >> b) & 1)
    return key


def hilbert(coords: np.ndarray) -> np.ndarray:
    """Devices in Hilbert-curve order of their coordinates (module docstring)."""
    return sorted_by([hilbert_keys(coords)])
