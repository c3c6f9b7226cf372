"""Packing leaves of different shapes into flat buffers, one per dtype.

Executor A runs different code on each stage inside one SPMD program, so everything that varies
between stages must have one shape: each stage's parameters (and optimizer state) are flattened
into a row, rows padded to the longest and stacked `[S, L]` (sharded on the `stage` axis), and the
activations crossing each cut are packed into one padded buffer that `ppermute` moves. Values
with a leading microbatch dim keep it (`[mb, F]`), so that a data-parallel axis inside the stage
still splits them without gathering.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["BatchedLayout", "FlatLayout", "Slot", "buffer_lengths"]


@dataclass(frozen=True)
class Slot:
    """Where one leaf sits: `size` elements from `offset` of the buffer of its dtype."""

    dtype: str
    offset: int
    size: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class FlatLayout:
    """Leaves (by key) packed into one flat buffer per dtype, in the given order."""

    keys: tuple[Any, ...]
    slots: tuple[Slot, ...]

    @classmethod
    def of(cls, items: Sequence[tuple[Any, Any]], start: Mapping[str, int] | None = None) -> FlatLayout:
        """Layout of (key, aval) items; `start` offsets each dtype (a region before them)."""
        offsets = dict(start or {})
        slots = []
        for _, aval in items:
            dtype = np.dtype(aval.dtype).name
            size = math.prod(aval.shape)
            slots.append(Slot(dtype, offsets.get(dtype, 0), size, tuple(aval.shape)))
            offsets[dtype] = offsets.get(dtype, 0) + size
        return cls(tuple(k for k, _ in items), tuple(slots))

    @property
    def lengths(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for slot in self.slots:
            out[slot.dtype] = max(out.get(slot.dtype, 0), slot.offset + slot.size)
        return out

    def pack(self, values: Mapping[Any, Any], lengths: Mapping[str, int]) -> dict[str, Any]:
        """dtype -> flat buffer of `lengths[dtype]` elements (zeros where no leaf sits)."""
        parts: dict[str, list[tuple[int, Any]]] = {d: [] for d in lengths}
        for key, slot in zip(self.keys, self.slots):
            parts[slot.dtype].append((slot.offset, jnp.ravel(values[key]).astype(slot.dtype)))
        return {dtype: _assemble(parts[dtype], length, dtype) for dtype, length in lengths.items()}

    def unpack(self, buffers: Mapping[str, Any]) -> dict[Any, Any]:
        return {key: buffers[slot.dtype][slot.offset:slot.offset + slot.size].reshape(slot.shape)
                for key, slot in zip(self.keys, self.slots)}


def _assemble(parts: list[tuple[int, Any]], length: int, dtype: str, lead: tuple[int, ...] = ()) -> Any:
    """Concatenate (offset, value) parts laid end to end from offset 0, padded to `length`."""
    pieces, end = [], 0
    for offset, value in sorted(parts, key=lambda p: p[0]):
        if offset > end:
            pieces.append(jnp.zeros(lead + (offset - end,), dtype))
        pieces.append(value)
        end = offset + value.shape[-1]
    if length > end:
        pieces.append(jnp.zeros(lead + (length - end,), dtype))
    if not pieces:
        return jnp.zeros(lead + (0,), dtype)
    return jnp.concatenate(pieces, axis=-1) if len(pieces) > 1 else pieces[0]


def buffer_lengths(layouts: Sequence[FlatLayout | BatchedLayout], dtypes: Sequence[str] = ()) -> dict[str, int]:
    """The longest buffer of each dtype over several layouts (rows of different stages)."""
    out = {d: 0 for d in dtypes}
    for layout in layouts:
        for dtype, length in layout.lengths.items():
            out[dtype] = max(out.get(dtype, 0), length)
    return out


@dataclass(frozen=True)
class BatchedLayout:
    """Values crossing a cut: those whose leading dim is the microbatch go to `[mb, F]` buffers
    (batched), the rest to flat buffers (unbatched), one of each per dtype."""

    microbatch: int
    batched: FlatLayout  # over the trailing elements of each batched value
    unbatched: FlatLayout

    @classmethod
    def of(cls, avals: Sequence[Any], microbatch: int) -> BatchedLayout:
        batched, unbatched = [], []
        for i, aval in enumerate(avals):
            if aval.shape and aval.shape[0] == microbatch:
                batched.append((i, jax.ShapeDtypeStruct(aval.shape[1:], aval.dtype)))
            else:
                unbatched.append((i, aval))
        return cls(microbatch, FlatLayout.of(batched), FlatLayout.of(unbatched))

    @property
    def lengths(self) -> dict[tuple[str, bool], int]:
        out = {(d, True): n for d, n in self.batched.lengths.items()}
        out.update({(d, False): n for d, n in self.unbatched.lengths.items()})
        return out

    def pack(self, values: Sequence[Any], lengths: Mapping[tuple[str, bool], int]) -> dict[tuple[str, bool], Any]:
        mb = self.microbatch
        parts: dict[tuple[str, bool], list[tuple[int, Any]]] = {key: [] for key in lengths}
        for key, slot in zip(self.batched.keys, self.batched.slots):
            parts[(slot.dtype, True)].append((slot.offset, jnp.reshape(values[key], (mb, slot.size)).astype(slot.dtype)))
        for key, slot in zip(self.unbatched.keys, self.unbatched.slots):
            parts[(slot.dtype, False)].append((slot.offset, jnp.ravel(values[key]).astype(slot.dtype)))
        return {(dtype, batched): _assemble(parts[(dtype, batched)], length, dtype, (mb,) if batched else ())
                for (dtype, batched), length in lengths.items()}

    def unpack(self, buffers: Mapping[tuple[str, bool], Any]) -> list[Any]:
        mb = self.microbatch
        out: dict[int, Any] = {}
        for key, slot in zip(self.batched.keys, self.batched.slots):
            out[key] = buffers[(slot.dtype, True)][:, slot.offset:slot.offset + slot.size].reshape((mb,) + slot.shape)
        for key, slot in zip(self.unbatched.keys, self.unbatched.slots):
            out[key] = buffers[(slot.dtype, False)][slot.offset:slot.offset + slot.size].reshape(slot.shape)
        return [out[i] for i in range(len(out))]
