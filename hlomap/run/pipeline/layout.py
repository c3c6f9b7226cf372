"""Packing leaves of different shapes into flat buffers, one per dtype (and sharding).

The spmd executor runs different code on each stage inside one SPMD program, so everything that varies
between stages must have one shape: each stage's parameters (and optimizer state) are flattened
into a row, rows padded to the longest and stacked `[S, L]` (sharded on the `stage` axis; a leaf
with a counterpart of its size on every stage gets a buffer of its own, `matched_buffers`), and the
activations crossing each cut are packed into one padded buffer that `ppermute` moves. Values
with a leading microbatch dim keep it (`[mb, F]`), so that a data-parallel axis inside the stage
still splits them without gathering; likewise a parameter split over a mesh axis inside the stage
is stored as its local shards (`[S, shards, L]`), so that tensor parallelism inside a stage keeps
its memory saving and needs no resharding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["BatchedLayout", "FlatLayout", "Slot", "buffer_dtype", "buffer_lengths", "matched_buffers", "sharded_buffer"]


@dataclass(frozen=True)
class Slot:
    """Where one leaf sits: `size` elements from `offset` of buffer `buffer` (on its last axis)."""

    buffer: str
    offset: int
    size: int
    shape: tuple[int, ...]


def buffer_dtype(buffer: str) -> str:
    """Buffers are named after their dtype, optionally followed by `@axes` (see `sharded_buffer`)
    and by `#tag` (a buffer of its own for leaves at one place on every stage, `matched_buffers`)."""
    return buffer.split("#", 1)[0].split("@", 1)[0]


def sharded_buffer(dtype: Any, axes: Sequence[str]) -> str:
    """The name of the buffer of `dtype` leaves split over mesh `axes` (`float32@model`)."""
    name = np.dtype(dtype).name
    return f"{name}@{'+'.join(axes)}" if axes else name


def matched_buffers(leaves: Sequence[int], sizes: Mapping[int, int], base: Mapping[int, str],
                    residence: Sequence[frozenset[int]], n_stages: int) -> dict[int, str]:
    """leaf -> its buffer: a buffer of its own for a leaf every stage holds, and for the k-th
    leaf of each (buffer, size) held by one stage when every stage has a k-th such leaf (the
    same layer's weights on every stage of a transformer); the others share their `base` buffer.

    A buffer whose rows each hold one whole leaf is read without a split and written without a
    concatenate. Copying the state in and out of one long row per dtype made XLA:CPU run those
    copies as parallel tasks on every step (a one-stage step of gpt-tiny took 15% longer than
    the plain step on 8 host devices); matched leaves waste no memory, since every row is full."""
    every = frozenset(range(n_stages))
    names = {leaf: f"{base[leaf]}#{leaf}" for leaf in leaves if residence[leaf] == every}
    own: list[dict[tuple[str, int], list[int]]] = [{} for _ in range(n_stages)]
    for leaf in leaves:
        if len(residence[leaf]) == 1 and residence[leaf] != every:
            (stage,) = residence[leaf]
            own[stage].setdefault((base[leaf], sizes[leaf]), []).append(leaf)
    for key in own[0]:
        matched = min(len(by_key.get(key, ())) for by_key in own)
        for k in range(matched):
            for by_key in own:
                names[by_key[key][k]] = f"{key[0]}#{key[1]}.{k}"
    return {leaf: names.get(leaf, base[leaf]) for leaf in leaves}


@dataclass(frozen=True)
class FlatLayout:
    """Leaves (by key) packed into flat buffers, one per buffer name (by default the dtype), in
    the given order. A buffer may have leading dims (`leads`): every leaf then has them too."""

    keys: tuple[Any, ...]
    slots: tuple[Slot, ...]

    @classmethod
    def of(cls, items: Sequence[tuple[Any, Any]], buffers: Mapping[Any, str] | None = None) -> FlatLayout:
        """Layout of (key, aval) items, end to end in each buffer; `buffers` names each key's
        buffer (default: its dtype)."""
        offsets: dict[str, int] = {}
        slots = []
        for key, aval in items:
            buffer = (buffers or {}).get(key) or np.dtype(aval.dtype).name
            size = math.prod(aval.shape)
            slots.append(Slot(buffer, offsets.get(buffer, 0), size, tuple(aval.shape)))
            offsets[buffer] = offsets.get(buffer, 0) + size
        return cls(tuple(k for k, _ in items), tuple(slots))

    @property
    def lengths(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for slot in self.slots:
            out[slot.buffer] = max(out.get(slot.buffer, 0), slot.offset + slot.size)
        return out

    def slot(self, key: Any) -> Slot:
        return self.slots[self.keys.index(key)]

    def pack(self, values: Mapping[Any, Any], lengths: Mapping[str, int],
             leads: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
        """buffer -> `lead + (lengths[buffer],)` array (zeros where no leaf sits); `values[key]`
        has the buffer's lead dims first."""
        leads = leads or {}
        parts: dict[str, list[tuple[int, Any]]] = {b: [] for b in lengths}
        for key, slot in zip(self.keys, self.slots):
            lead = leads.get(slot.buffer, ())
            value = jnp.reshape(values[key], lead + (slot.size,)).astype(buffer_dtype(slot.buffer))
            parts[slot.buffer].append((slot.offset, value))
        return {b: _assemble(parts[b], n, buffer_dtype(b), leads.get(b, ())) for b, n in lengths.items()}

    def unpack(self, buffers: Mapping[str, Any], leads: Mapping[str, tuple[int, ...]] | None = None) -> dict[Any, Any]:
        leads = leads or {}
        pieces = _split_slots(buffers, self.keys, self.slots)
        return {key: pieces[key].reshape(leads.get(slot.buffer, ()) + slot.shape)
                for key, slot in zip(self.keys, self.slots)}


def _split_slots(buffers: Mapping[Any, Any], keys: Sequence[Any], slots: Sequence[Slot],
                 buffer_key: Any = None) -> dict[Any, Any]:
    """key -> its slot's elements (on the last axis), cut from each buffer by one `split`.

    One split per buffer rather than a slice per leaf because of the gradient: a slice
    transposes to a pad of the whole buffer, and the sum of one pad per leaf costs a pass over
    the buffer per leaf; a split transposes to one concatenate."""
    by_buffer: dict[Any, list[tuple[Any, Slot]]] = {}
    for key, slot in zip(keys, slots):
        by_buffer.setdefault(slot.buffer if buffer_key is None else buffer_key(slot), []).append((key, slot))
    out: dict[Any, Any] = {}
    for name, items in by_buffer.items():
        buffer = buffers[name]
        items.sort(key=lambda item: item[1].offset)
        sizes, owners, end = [], [], 0
        for key, slot in items:
            if slot.offset < end:
                raise ValueError(f"slots of {key!r} and the leaf before it overlap in buffer {name!r}")
            if slot.offset > end:
                sizes.append(slot.offset - end)
                owners.append(None)
            sizes.append(slot.size)
            owners.append(key)
            end = slot.offset + slot.size
        if buffer.shape[-1] > end:
            sizes.append(buffer.shape[-1] - end)
            owners.append(None)
        parts = jnp.split(buffer, np.cumsum(sizes)[:-1].tolist(), axis=-1) if len(sizes) > 1 else [buffer]
        out.update({key: part for key, part in zip(owners, parts) if key is not None})
    return out


def _assemble(parts: list[tuple[int, Any]], length: int, dtype: str, lead: tuple[int, ...] = ()) -> Any:
    """Concatenate (offset, value) parts laid end to end from offset 0 on the last axis, padded
    to `length`."""
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
            parts[(slot.buffer, True)].append((slot.offset, jnp.reshape(values[key], (mb, slot.size)).astype(slot.buffer)))
        for key, slot in zip(self.unbatched.keys, self.unbatched.slots):
            parts[(slot.buffer, False)].append((slot.offset, jnp.ravel(values[key]).astype(slot.buffer)))
        return {(dtype, batched): _assemble(parts[(dtype, batched)], length, dtype, (mb,) if batched else ())
                for (dtype, batched), length in lengths.items()}

    def unpack(self, buffers: Mapping[tuple[str, bool], Any]) -> list[Any]:
        mb = self.microbatch
        batched = _split_slots(buffers, self.batched.keys, self.batched.slots, lambda slot: (slot.buffer, True))
        unbatched = _split_slots(buffers, self.unbatched.keys, self.unbatched.slots, lambda slot: (slot.buffer, False))
        out = {key: batched[key].reshape((mb,) + slot.shape) for key, slot in zip(self.batched.keys, self.batched.slots)}
        out.update({key: unbatched[key].reshape(slot.shape)
                    for key, slot in zip(self.unbatched.keys, self.unbatched.slots)})
        return [out[i] for i in range(len(out))]
