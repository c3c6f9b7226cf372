"""Optimizer state, and optionally the parameters, sharded over the data replicas (ZeRO stage 1,
and stage 3 / FSDP), chosen on a plan applied to a graph.

A data-parallel (or hybrid) plan keeps every replica's copy of Adam's moments: 8 of the 16 bytes a
float32 parameter costs. ZeRO-1 splits each optimizer-state leaf over the mesh axes that split the
batch and no trainable parameter (`state_axes`), along one of its dims (`state_shards`). Inside one
jitted step XLA then updates each parameter's slice on the replica that holds the slice's moments
and all-gathers the updated parameter, so what the plan changes is:

- memory: each sharded leaf keeps 1 / n of its bytes per device (n: the product of the axes' sizes);
- communication: one all-gather of every parameter whose moments are sharded (its per-device bytes,
  over the state axes) after the update. The gradient sync is what it was: XLA:CPU all-reduces the
  gradients and each replica slices its part (what `hlomap.verify.xla` compiles); a backend that
  fuses the two into a reduce-scatter (ZeRO-2) would move half the sync's bytes, which is not
  priced here.

A leaf is split along a dim whose per-device extent (after the plan's own sharding) divides by n,
one the plan already splits if there is one (then the leaf is split on one dim, over the plan's
axes and the state axes), else the first; and a leaf's trainable parameter is the one it is linked to dim for dim (Adam's
moments share every linkage group with their parameter); leaves with no such dim (Adam's step
count) stay replicated.

ZeRO-3 / FSDP (`parameter_shards`) stores those trainable parameters split too, along their
moments' dim. Inside one jitted step XLA then all-gathers each parameter before its first use and
keeps the gathered copy for the backward pass; the update runs on the slice and nothing is
gathered after it. Against ZeRO-1 that moves the same bytes (one all-gather of every such
parameter, now before the forward pass) and keeps 1 / n of the parameters' bytes between steps:
on XLA:CPU the arguments and the peak drop by exactly the parameters' (1 - 1 / n) share. The
gradient sync stays an all-reduce there too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from hlomap.cost.sharding import ShardedGraph
from hlomap.hlo.capture import EntryParameter, Role

__all__ = ["StateShard", "gathered_parameters", "parameter_shards", "state_axes", "state_shards"]


@dataclass(frozen=True)
class StateShard:
    """One optimizer-state leaf (entry parameter `parameter`) split along `dim`."""

    parameter: int
    dim: int


def _parameter_axes(sg: ShardedGraph, index: int) -> list[tuple[str, ...]]:
    """The mesh axes splitting each dim of entry parameter `index` under the plan of `sg`."""
    out = []
    for g in sg.graph.parameter_groups(index):
        option = int(sg.plan[g])
        out.append(() if option < 0 else tuple(sg.axes.options[option]))
    return out


def state_axes(sg: ShardedGraph) -> tuple[str, ...]:
    """Mesh axes (mesh order) that split a data input and no trainable parameter: the plan's
    data-parallel axes, over which every parameter and its optimizer state are replicated."""
    graph = sg.graph
    batch: set[str] = set()
    for p in graph.with_role(Role.DATA):
        if p.index < len(graph.entry_parameter_tensors):
            batch.update(a for axes in _parameter_axes(sg, p.index) for a in axes)
    for p in graph.with_role(Role.TRAINABLE):
        if p.index < len(graph.entry_parameter_tensors):
            batch.difference_update(a for axes in _parameter_axes(sg, p.index) for a in axes)
    mesh = sg.axes.mesh_shape
    return tuple(a for a in sg.axes.names if a in batch and mesh[a] > 1)


def state_shards(sg: ShardedGraph, axes: Sequence[str]) -> tuple[StateShard, ...]:
    """Each optimizer-state leaf of `sg`'s graph that can be split over `axes`, with its dim."""
    mesh = sg.axes.mesh_shape
    ways = 1
    for a in axes:
        ways *= mesh[a]
    if ways <= 1:
        return ()
    graph = sg.graph
    out = []
    for p in graph.with_role(Role.OPTIMIZER_STATE):
        if p.index >= len(graph.entry_parameter_tensors):
            continue
        split = _parameter_axes(sg, p.index)
        # a dim the plan already splits first: the leaf stays split on one dim (the pipeline's
        # spmd executor stores leaves so), each device's slice inside its parameter's slice
        order = sorted(range(len(p.shape.dims)), key=lambda d: (not split[d], d))
        for d in order:
            per_device = p.shape.dims[d] // math.prod(mesh[a] for a in split[d])
            if per_device % ways == 0 and per_device >= ways and not set(split[d]) & set(axes):
                out.append(StateShard(p.index, d))
                break
    return tuple(out)


def gathered_parameters(sg: ShardedGraph, shards: Sequence[StateShard]) -> tuple[int, ...]:
    """The trainable entry parameters whose update runs split (their optimizer state is), once
    each: each sharded leaf's parameter, one of the same shape and linkage groups, the one whose
    pytree path ends the leaf's when there are several (a layer's query, key and value share
    their groups; optax's `mu/layers_0/attn/query/bias` is `params/layers_0/attn/query/bias`'s)."""
    graph = sg.graph
    candidates: dict[tuple[tuple[int, ...], tuple[int, ...]], list[EntryParameter]] = {}
    for p in graph.with_role(Role.TRAINABLE):
        if p.index < len(graph.entry_parameter_tensors):
            candidates.setdefault((tuple(p.shape.dims), graph.parameter_groups(p.index)), []).append(p)
    by_index = {p.index: p for p in graph.parameters}
    out: list[int] = []
    for shard in shards:
        leaf = by_index[shard.parameter]
        same = candidates.get((tuple(leaf.shape.dims), graph.parameter_groups(leaf.index)), [])
        if not same:
            continue
        named = [p for p in same if _path_tail(p.path) and leaf.path.endswith(_path_tail(p.path))]
        partner = (named or same)[0].index
        if partner not in out:
            out.append(partner)
    return tuple(out)


def parameter_shards(sg: ShardedGraph, shards: Sequence[StateShard]) -> tuple[StateShard, ...]:
    """The trainable parameters of `shards` (`gathered_parameters`), each split along its optimizer
    state's dim (FSDP): a moment is linked to its parameter dim for dim, so that dim divides the
    same way. Shards that are already trainable parameters are kept as they are."""
    trainable = {p.index for p in sg.graph.with_role(Role.TRAINABLE)}
    dims: dict[int, int] = {s.parameter: s.dim for s in shards if s.parameter in trainable}
    for shard in shards:
        if shard.parameter in trainable:
            continue
        for index in gathered_parameters(sg, (shard,)):
            dims.setdefault(index, shard.dim)
    return tuple(StateShard(index, dim) for index, dim in sorted(dims.items()))


def _path_tail(path: str) -> str:
    """A parameter's pytree path without its argument's name (`params/a/b` -> `/a/b`)."""
    head, sep, rest = path.partition("/")
    return sep + rest if sep else ""
