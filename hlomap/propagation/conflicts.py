"""Mesh axes, conflict checks for many plans at once, and explanations of one plan's conflicts.

A *plan array* assigns every group of a `FactorGraph` an axis option: an index into
`MeshAxes.options` (a tuple of mesh axis names, usually a single axis), or -1 for replicated.
Many plans are a 2-D array `[num_plans, num_groups]`. Checking them is a handful of numpy
gathers over precomputed tables (`ConflictChecker`), never a graph walk.

Conflicts (`ConflictKind`):
- SAME_AXIS: two dims of one tensor, or two factors of one instruction, on overlapping mesh axes
  (a device would hold mismatched blocks);
- NEED_REPLICATION: a group holding a need-replication factor is sharded;
- INDIVISIBLE: a dim's size is not a multiple of the axis size;
- COMPOUND: a reshape merged or split the dim and the sharding does not fit its factors (a minor
  factor is sharded, or the major factor is not a multiple of the axis size while the whole dim
  is).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property
from itertools import permutations
from typing import Any, Iterable, Sequence

import numpy as np

from hlomap.propagation.graph import FactorGraph

REPLICATED = -1


# ---------------------------------------------------------------------------------------------
# Mesh axes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeshAxes:
    """A device mesh's named axes and the axis *options* a group may be sharded on.

    Options are tuples of axis names (major to minor). By default each single axis is an option;
    `with_combinations=True` adds every ordered combination (e.g. `("data", "model")`, a group
    split over all 8 devices of a 2x4 mesh). Plans store option indices.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    options: tuple[tuple[str, ...], ...]

    @classmethod
    def from_mesh(cls, mesh: Any, *, with_combinations: bool = False,
                  extra: Iterable[tuple[str, ...]] = ()) -> MeshAxes:
        """`mesh` is a `{name: size}` mapping, a `jax.sharding.Mesh` or a `MeshAxes`."""
        if isinstance(mesh, MeshAxes):
            names, sizes = mesh.names, mesh.sizes
            base = list(mesh.options)
        else:
            shape = dict(mesh.shape) if hasattr(mesh, "axis_names") else dict(mesh)
            names = tuple(shape)
            sizes = tuple(int(shape[n]) for n in names)
            if not names:
                raise ValueError(f"mesh {mesh!r} has no axes")
            base = [(n,) for n in names]
        if with_combinations:
            for k in range(2, len(names) + 1):
                base.extend(p for p in permutations(names, k))
        for option in extra:
            option = tuple(option)
            unknown = [a for a in option if a not in names]
            if unknown:
                raise ValueError(f"axis option {option} names unknown mesh axes {unknown}; mesh axes are {names}")
            base.append(option)
        options = tuple(dict.fromkeys(base))
        return cls(names, sizes, options)

    @property
    def mesh_shape(self) -> dict[str, int]:
        return dict(zip(self.names, self.sizes))

    @cached_property
    def option_sizes(self) -> np.ndarray:
        size = self.mesh_shape
        return np.asarray([int(np.prod([size[a] for a in o])) for o in self.options], dtype=np.int64)

    @cached_property
    def overlap(self) -> np.ndarray:
        """`overlap[a + 1, b + 1]`: options a and b share a mesh axis (row/col 0 = replicated)."""
        n = len(self.options)
        table = np.zeros((n + 1, n + 1), dtype=bool)
        for i, a in enumerate(self.options):
            for j, b in enumerate(self.options):
                table[i + 1, j + 1] = bool(set(a) & set(b))
        return table

    @property
    def is_simple(self) -> bool:
        """Every option is one distinct axis: overlap is plain equality."""
        return all(len(o) == 1 for o in self.options) and len(set(self.options)) == len(self.options)

    def index(self, option: str | Sequence[str]) -> int:
        key = (option,) if isinstance(option, str) else tuple(option)
        try:
            return self.options.index(key)
        except ValueError:
            raise ValueError(f"axis option {key} is not one of {self.options}") from None

    def describe(self, index: int) -> str:
        if index < 0:
            return "replicated"
        o = self.options[index]
        return "'" + "'x'".join(o) + "'" + f" (size {int(self.option_sizes[index])})"


# ---------------------------------------------------------------------------------------------
# Conflicts
# ---------------------------------------------------------------------------------------------


class ConflictKind(enum.Enum):
    SAME_AXIS = "same_axis"
    NEED_REPLICATION = "need_replication"
    INDIVISIBLE = "indivisible"
    COMPOUND = "compound"


@dataclass(frozen=True)
class Conflict:
    """One reason a plan is not conflict-free, located as precisely as the graph allows."""

    kind: ConflictKind
    groups: tuple[int, ...]
    axis: str  # the axis option, as text
    tensor: str  # pytree path for entry parameters, `instruction{leaf}` otherwise
    dims: tuple[int, ...]
    instruction: str
    computation: str
    source: str | None  # "file:line" from metadata when known
    detail: str

    def __str__(self) -> str:
        where = f" ({self.source})" if self.source else ""
        dims = ", ".join(str(d) for d in self.dims)
        return (f"{self.kind.value}: tensor {self.tensor!r} dim(s) {dims} on {self.axis} at instruction "
                f"{self.instruction!r} in {self.computation}{where}: {self.detail}")


class PlanConflict(ValueError):
    """A plan (or a user's PartitionSpecs) that is not conflict-free; `.conflicts` lists why."""

    def __init__(self, message: str, conflicts: Sequence[Conflict] = ()) -> None:
        super().__init__(message)
        self.conflicts = tuple(conflicts)


class ConflictChecker:
    """Vectorized conflict checks of plan arrays against one graph and one set of mesh axes."""

    def __init__(self, graph: FactorGraph, axes: MeshAxes) -> None:
        self.graph = graph
        self.axes = axes
        c = graph.constraints
        G = graph.num_groups
        self.never = (c.need_replication_node >= 0) | (c.self_conflict_node >= 0) | (c.compound_node >= 0)
        sizes = axes.option_sizes
        # column 0 is "replicated"; gcd 0 (all dims of size 0) divides by anything
        self.divisible = np.ones((G, len(sizes) + 1), dtype=bool)
        self.divisible[:, 1:] = (c.gcd_effective[:, None] % sizes[None, :]) == 0
        shardable = self.divisible[:, 1:].any(axis=1) & ~self.never
        keep = shardable[c.pairs[:, 0]] & shardable[c.pairs[:, 1]] if len(c.pairs) else np.zeros(0, bool)
        self.pairs = c.pairs[keep]
        self.pair_node = c.pair_node[keep]
        self.shardable = shardable
        self._flat_overlap = axes.overlap.ravel()
        self._width = len(sizes) + 1
        # per group and option (column 0 = replicated): is this choice bad on its own?
        self._bad_single = ~self.divisible
        self._bad_single[:, 1:] |= self.never[:, None]

    # -- vectorized ------------------------------------------------------------------------------
    def ok(self, plans: np.ndarray) -> np.ndarray:
        """bool per plan: conflict-free. `plans` is `[G]` or `[N, G]` of option indices / -1."""
        return self.count(plans) == 0

    def count(self, plans: np.ndarray) -> np.ndarray:
        """Number of violated constraints per plan (0 = conflict-free).

        Only the groups some plan of the batch shards are looked at: plans from explorers shard a
        few of the thousands of groups, so this keeps the work proportional to what is decided.
        """
        plans = np.atleast_2d(np.asarray(plans))
        if plans.shape[1] != self.graph.num_groups:
            raise ValueError(f"plan arrays have {plans.shape[1]} groups; the graph of {self.graph.module.name} "
                             f"has {self.graph.num_groups}")
        active = np.flatnonzero((plans >= 0).any(axis=0))
        if len(active) == 0:
            return np.zeros(len(plans), dtype=np.int64)
        idx = plans[:, active].astype(np.intp) + 1  # 0 = replicated
        bad = self._bad_single.ravel()[active * self._width + idx].sum(axis=1, dtype=np.int64)
        if len(self.pairs):
            position = np.full(self.graph.num_groups, -1, dtype=np.intp)
            position[active] = np.arange(len(active))
            pa, pb = position[self.pairs[:, 0]], position[self.pairs[:, 1]]
            keep = (pa >= 0) & (pb >= 0)
            if keep.any():
                a = idx[:, pa[keep]]
                b = idx[:, pb[keep]]
                if self.axes.is_simple:
                    bad += ((a == b) & (a > 0)).sum(axis=1)
                else:
                    bad += self._flat_overlap[a * self._width + b].sum(axis=1)
        return bad

    # -- one plan, explained ---------------------------------------------------------------------
    def explain(self, plan: np.ndarray, limit: int | None = None) -> list[Conflict]:
        """Every conflict of one plan, each naming tensor, dims, instruction and source line."""
        plan = np.asarray(plan).astype(np.int64)
        g = self.graph
        c = g.constraints
        if plan.shape != (g.num_groups,):
            raise ValueError(f"explain takes one plan of {g.num_groups} groups, got shape {plan.shape}")
        out: list[Conflict] = []
        sharded = np.flatnonzero(plan >= 0)
        for grp in sharded:
            axis = self.axes.describe(int(plan[grp]))
            if c.need_replication_node[grp] >= 0:
                out.append(self._at_node(ConflictKind.NEED_REPLICATION, (grp,), axis, int(c.need_replication_node[grp]),
                                         "this dim cannot be split without communication (sorted, sliced, padded, "
                                         "windowed or dynamically indexed)"))
            if c.self_conflict_node[grp] >= 0:
                out.append(self._at_node(ConflictKind.SAME_AXIS, (grp,), axis, int(c.self_conflict_node[grp]),
                                         "two different dims of this instruction belong to the same group, so they "
                                         "would be split on the same axis"))
            if c.compound_node[grp] >= 0:
                dim = int(c.compound_dim[grp])
                out.append(self._conflict(ConflictKind.COMPOUND, (grp,), axis, int(g.dim_tensor[dim]),
                                          (int(g.dim_index[dim]),), int(c.compound_node[grp]),
                                          "this reshape merges the sharded dim into a more major one; only the "
                                          "major factor of a merged dim can carry its sharding"))
            if not self.divisible[grp, plan[grp] + 1]:
                out.append(self._indivisible(int(grp), int(plan[grp])))
            if limit is not None and len(out) >= limit:
                return out[:limit]
        for (ga, gb), node in zip(self.pairs, self.pair_node):
            a, b = plan[ga], plan[gb]
            if a >= 0 and b >= 0 and self.axes.overlap[a + 1, b + 1]:
                out.append(self._pair(int(ga), int(gb), int(node), self.axes.describe(int(a)), self.axes.describe(int(b))))
            if limit is not None and len(out) >= limit:
                break
        return out[:limit] if limit is not None else out

    def _indivisible(self, grp: int, option: int) -> Conflict:
        g = self.graph
        n = int(self.axes.option_sizes[option])
        dims = g.group_dims(grp)
        eff = g.dim_effective_size[dims]
        bad = dims[eff % n != 0]
        # prefer an entry parameter's dim, so the message names what the user wrote
        params = set(g.entry_parameter_tensors)
        pick = next((int(d) for d in bad if int(g.dim_tensor[d]) in params), int(bad[0]))
        size, full = int(g.dim_effective_size[pick]), int(g.dim_size[pick])
        if full % n == 0:
            return self._at_dim(ConflictKind.COMPOUND, (grp,), self.axes.describe(option), pick,
                                f"the dim (size {full}) is a merge whose major factor has size {size}, "
                                f"not a multiple of {n}")
        return self._at_dim(ConflictKind.INDIVISIBLE, (grp,), self.axes.describe(option), pick,
                            f"size {full} is not a multiple of {n}")

    def _pair(self, ga: int, gb: int, node: int, axis_a: str, axis_b: str) -> Conflict:
        g = self.graph
        axis = axis_a if axis_a == axis_b else f"{axis_a} and {axis_b}"
        # Prefer naming an entry parameter holding both groups (what the user controls), then a
        # tensor of the instruction holding both, then the instruction itself.
        for t in sorted(set(self._parameter_tensors_of.get(ga, ())) & set(self._parameter_tensors_of.get(gb, ()))):
            dims = g.tensor_dims(t)
            groups = g.group_of_dim[dims]
            if ga in groups and gb in groups:
                return self._conflict(ConflictKind.SAME_AXIS, (ga, gb), axis, t,
                                      tuple(int(i) for i in np.flatnonzero((groups == ga) | (groups == gb))), node,
                                      "two dims of this tensor would be split on the same mesh axis")
        for t, dims in self._node_tensors(node):
            groups = g.group_of_dim[dims]
            if ga in groups and gb in groups:
                return self._conflict(ConflictKind.SAME_AXIS, (ga, gb), axis, t,
                                      tuple(int(i) for i in np.flatnonzero((groups == ga) | (groups == gb))), node,
                                      "two dims of this tensor would be split on the same mesh axis")
        found = [(t, tuple(int(i) for i in np.flatnonzero(np.isin(g.group_of_dim[dims], (ga, gb)))))
                 for t, dims in self._node_tensors(node)]
        found = [f for f in found if f[1]]
        t, dims = found[0] if found else (int(g.node_tensors[node][0]), ())
        others = "; ".join(f"{g.tensor_name(tt)} dims {list(dd)}" for tt, dd in found[1:])
        return self._conflict(ConflictKind.SAME_AXIS, (ga, gb), axis, t, dims, node,
                              "two different factors of this instruction would be split on the same mesh axis"
                              + (f" (also {others})" if others else ""))

    @cached_property
    def _parameter_tensors_of(self) -> dict[int, list[int]]:
        """group -> entry parameter tensors with a dim in it."""
        out: dict[int, list[int]] = {}
        for t in self.graph.entry_parameter_tensors:
            for grp in set(int(x) for x in self.graph.group_of_dim[self.graph.tensor_dims(t)]):
                out.setdefault(grp, []).append(t)
        return out

    def _node_tensors(self, node: int) -> list[tuple[int, np.ndarray]]:
        """(tensor, dims) for the result and operand tensors of a node."""
        g = self.graph
        n = g.nodes[node]
        out = [(t, g.tensor_dims(t)) for t in g.result_tensors(node)]
        for name in n.instruction.operands:
            try:
                other = g.node_of(n.computation, name, n.instance)
            except KeyError:
                continue
            out.extend((t, g.tensor_dims(t)) for t in g.result_tensors(other))
        return out

    def _at_node(self, kind: ConflictKind, groups: tuple[int, ...], axis: str, node: int, detail: str) -> Conflict:
        g = self.graph
        grp = groups[0]
        for t, dims in self._node_tensors(node):
            hit = tuple(int(i) for i in np.flatnonzero(g.group_of_dim[dims] == grp))
            if hit:
                return self._conflict(kind, groups, axis, t, hit, node, detail)
        return self._conflict(kind, groups, axis, int(g.node_tensors[node][0]), (), node, detail)

    def _at_dim(self, kind: ConflictKind, groups: tuple[int, ...], axis: str, dim: int, detail: str) -> Conflict:
        g = self.graph
        t = int(g.dim_tensor[dim])
        return self._conflict(kind, groups, axis, t, (int(g.dim_index[dim]),), int(g.tensor_node[t]), detail)

    def _conflict(self, kind: ConflictKind, groups: tuple[int, ...], axis: str, tensor: int,
                  dims: tuple[int, ...], node: int, detail: str) -> Conflict:
        g = self.graph
        n = g.nodes[node]
        return Conflict(kind, tuple(int(x) for x in groups), axis, g.tensor_name(tensor), dims,
                        n.instruction.name, n.computation, g.source_of(n.instruction), detail)
