"""Plan arrays over linkage groups: reference plans, random plans, and derived shardings.

A plan array is `int8[num_groups]` (or `[num_plans, num_groups]`): for each group an index into
`MeshAxes.options`, or -1 (replicated). See conflicts.py for checking them.

Reference plans are derived from the factor graph and the parameters' roles, never hand-listed:

- `data_parallel_plan`: shard the group(s) holding the leading (batch) dim of every DATA input.
- `megatron_plan`: Megatron-LM's tensor parallelism, stated on groups. The *backbone* is the
  group with the most trainable dims: in a transformer, the residual stream's hidden dim
  (embedding width, layer norms, the input dim of Q/K/V and MLP-in, the output dim of
  attention-out and MLP-out). Build the *weight graph* whose nodes are groups and where every
  trainable tensor links the groups of its dims; Megatron shards the groups one step away from
  the backbone: for Q/K/V that is the heads dim (column parallel), for attention-out the same
  group (row parallel), for MLP-in/out the hidden dim, for the embedding the vocabulary
  (vocabulary parallel), while the backbone itself (layer norms, biases of row-parallel layers)
  stays replicated. Candidates are taken at odd distance from the backbone in breadth-first
  order, a tensor's more major dims first (a kernel [d_model, heads, head_dim] shards heads, not
  head_dim), and each is kept only if the plan stays conflict-free. For a CNN chain this
  alternates column- and row-parallel layers, as Megatron does for an MLP.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from hlomap.hlo.capture import Role
from hlomap.propagation.conflicts import REPLICATED, ConflictChecker, MeshAxes
from hlomap.propagation.graph import FactorGraph

log = logging.getLogger(__name__)

PLAN_DTYPE = np.int8


def as_axes(axes: MeshAxes | Mapping[str, int] | Any) -> MeshAxes:
    return axes if isinstance(axes, MeshAxes) else MeshAxes.from_mesh(axes)


def empty_plan(graph: FactorGraph, num_plans: int | None = None) -> np.ndarray:
    shape = (graph.num_groups,) if num_plans is None else (num_plans, graph.num_groups)
    return np.full(shape, REPLICATED, dtype=PLAN_DTYPE)


def combine(*plans: np.ndarray) -> np.ndarray:
    """Overlay plans: each group takes the first non-replicated choice (DP on one axis + Megatron
    on another gives the 2-D hybrid)."""
    out = np.array(plans[0], copy=True)
    for p in plans[1:]:
        out = np.where(out >= 0, out, p).astype(PLAN_DTYPE)
    return out


def _greedy(checker: ConflictChecker, plan: np.ndarray, candidates: Iterable[int], option: int,
            what: str) -> np.ndarray:
    """Shard each candidate group on `option` in turn, keeping it only if still conflict-free."""
    for g in candidates:
        if plan[g] >= 0:
            continue
        trial = plan.copy()
        trial[g] = option
        if checker.ok(trial)[0]:
            plan = trial
        elif log.isEnabledFor(logging.INFO):  # explaining a conflict costs more than finding it
            reasons = "; ".join(str(c) for c in checker.explain(trial, limit=2))
            log.info("%s: group %d left replicated: %s", what, g, reasons)
    return plan


def data_parallel_plan(graph: FactorGraph, mesh_axis: str | Sequence[str],
                       axes: MeshAxes | Mapping[str, int] | Any) -> np.ndarray:
    """Shard the groups of the leading dim of every DATA input on `mesh_axis`.

    Raises ValueError when the graph knows no DATA parameter (a bare dump: name them with
    `hlomap.hlo.capture.from_module(..., data=...)`).
    """
    axes = as_axes(axes)
    option = axes.index(mesh_axis)
    data = [p for p in graph.parameters if p.role is Role.DATA and p.shape.rank > 0]
    if not data:
        raise ValueError(f"no DATA entry parameter in {graph.module.name}; cannot find the batch dim "
                         f"(roles: {sorted({p.role.value for p in graph.parameters})})")
    groups = list(dict.fromkeys(graph.parameter_groups(p.index)[0] for p in data if p.shape.dims[0] > 1))
    plan = _greedy(ConflictChecker(graph, axes), empty_plan(graph), groups, option, "data-parallel plan")
    # Not an error (the plan is valid), but a "data-parallel" plan that splits no batch is not
    # what the caller asked for: say so, instead of silently estimating a replicated step.
    left = [p.path or p.name for p in data if p.shape.dims[0] > 1 and plan[graph.parameter_groups(p.index)[0]] < 0]
    if left:
        log.warning("data-parallel plan: the batch dim of %s stays replicated on mesh axis %r (batch not divisible "
                    "by the axis, or linked to a dim that cannot split; -v says why)", ", ".join(left[:4])
                    + (f" and {len(left) - 4} more" if len(left) > 4 else ""), mesh_axis)
    return plan


def weight_graph(graph: FactorGraph) -> dict[int, set[int]]:
    """Groups linked by trainable tensors: an edge between the groups of two dims of one weight."""
    adj: dict[int, set[int]] = {}
    for p in graph.with_role(Role.TRAINABLE):
        groups = [g for g, size in zip(graph.parameter_groups(p.index), p.shape.dims) if size > 1]
        for g in groups:
            adj.setdefault(g, set()).update(x for x in groups if x != g)
    return adj


def backbone_group(graph: FactorGraph) -> int:
    """The group with the most trainable dims (ties: the larger group, then the first)."""
    count: dict[int, int] = {}
    for t in graph.trainable_dims:
        if t.size > 1:
            count[t.group] = count.get(t.group, 0) + 1
    if not count:
        raise ValueError(f"no trainable dims in {graph.module.name}; capture roles are needed for Megatron")
    order = graph.trainable_groups
    return max(count, key=lambda g: (count[g], int(graph.group_sizes[g]), -order.index(g)))


def megatron_plan(graph: FactorGraph, mesh_axis: str | Sequence[str],
                  axes: MeshAxes | Mapping[str, int] | Any) -> np.ndarray:
    """Megatron-style tensor parallelism on `mesh_axis` (see the module docstring for the rule)."""
    axes = as_axes(axes)
    option = axes.index(mesh_axis)
    adj = weight_graph(graph)
    root = backbone_group(graph)
    dist = {root: 0}
    queue = deque([root])
    while queue:
        g = queue.popleft()
        for h in sorted(adj.get(g, ())):
            if h not in dist:
                dist[h] = dist[g] + 1
                queue.append(h)
    # a group's rank: its dims' smallest position among the non-backbone dims of its tensors
    rank: dict[int, int] = {}
    count: dict[int, int] = {}
    for p in graph.with_role(Role.TRAINABLE):
        others = [g for g, size in zip(graph.parameter_groups(p.index), p.shape.dims) if size > 1 and g != root]
        for i, g in enumerate(others):
            rank[g] = min(rank.get(g, i), i)
            count[g] = count.get(g, 0) + 1
    candidates = sorted((g for g, d in dist.items() if d % 2 == 1),
                        key=lambda g: (dist[g], rank.get(g, 0), -count.get(g, 0), g))
    return _greedy(ConflictChecker(graph, axes), empty_plan(graph), candidates, option, "megatron plan")


def random_plans(graph: FactorGraph, axes: MeshAxes | Mapping[str, int] | Any, num_plans: int,
                 rng: np.random.Generator, *, groups: Sequence[int] | None = None,
                 p_shard: float = 0.5) -> np.ndarray:
    """`num_plans` random conflict-free plans over `groups` (default: the groups of entry
    parameters' dims, which is what `in_shardings` can express).

    Groups are visited in a random order per plan; each is sharded with probability `p_shard` on
    a random option that keeps the plan conflict-free given the choices made so far. All plans
    advance together, one group at a time, checking only that group's constraints.
    """
    axes = as_axes(axes)
    checker = ConflictChecker(graph, axes)
    candidates = np.asarray([g for g in (groups if groups is not None else graph.parameter_groups_all())
                             if checker.shardable[g]], dtype=np.int64)
    plans = empty_plan(graph, num_plans)
    if len(candidates) == 0:
        return plans
    partners: dict[int, list[int]] = {}
    for a, b in checker.pairs:
        partners.setdefault(int(a), []).append(int(b))
        partners.setdefault(int(b), []).append(int(a))
    n_opts = len(axes.options)
    overlap = axes.overlap
    # a random visiting order per plan: position k of plan i visits candidates[order[i, k]]
    order = np.argsort(rng.random((num_plans, len(candidates))), axis=1)
    for k in range(len(candidates)):
        g = candidates[order[:, k]]
        propose = rng.integers(0, n_opts, size=num_plans)
        take = rng.random(num_plans) < p_shard
        take &= checker.divisible[g, propose + 1]
        for i in np.flatnonzero(take):
            gi = int(g[i])
            others = partners.get(gi)
            if others:
                assigned = plans[i, others].astype(np.int64) + 1
                if overlap[propose[i] + 1, assigned].any():
                    continue
            plans[i, gi] = propose[i]
    return plans


# ---------------------------------------------------------------------------------------------
# Derived shardings
# ---------------------------------------------------------------------------------------------


def parameter_options(graph: FactorGraph, plans: np.ndarray) -> np.ndarray:
    """Axis option (or -1) of every entry-parameter dim for each plan: `[N, total_param_dims]`.
    This is the vectorized spec derivation; `partition_spec_of` turns one row into specs."""
    groups, _ = graph.parameter_dim_groups
    return np.atleast_2d(plans)[:, groups]


def tensor_options(graph: FactorGraph, plan: np.ndarray) -> np.ndarray:
    """Axis option (or -1) of every tensor dim of the module under one plan (constant-derived
    dims take their consumer's choice)."""
    return np.asarray(plan)[graph.sharding_group_of_dim]


def partial_reductions(graph: FactorGraph, plan: np.ndarray) -> list[tuple[int, int, int]]:
    """(node, option, factor size) for every sharded reduction factor: the instruction leaves a
    partial result that needs an all-reduce over that axis option."""
    r = graph.reductions
    chosen = np.asarray(plan)[r.group]
    hit = np.flatnonzero(chosen >= 0)
    return [(int(r.node[i]), int(chosen[i]), int(r.size[i])) for i in hit]


def dims_spec(options: Sequence[int], axes: MeshAxes) -> tuple[tuple[str, ...] | None, ...]:
    """Per-dim axis names (None = not split) for a row of option indices."""
    return tuple(None if o < 0 else axes.options[int(o)] for o in options)


def instruction_shardings(graph: FactorGraph, plan: np.ndarray, axes: MeshAxes | Mapping[str, int] | Any,
                          ) -> dict[tuple[int, str, str], tuple[tuple[tuple[str, ...] | None, ...], ...]]:
    """Every instruction's sharding under one plan: `(instance, computation, instruction)` ->
    per result leaf, per dim, the mesh axes splitting it (None = not split). Instances separate
    the copies of a computation called from several places (instance 0 is the entry)."""
    axes = as_axes(axes)
    options = tensor_options(graph, plan)
    out: dict[tuple[int, str, str], tuple[tuple[tuple[str, ...] | None, ...], ...]] = {}
    for node_id, node in enumerate(graph.nodes):
        leaves = []
        for t in graph.result_tensors(node_id):
            leaves.append(dims_spec(options[graph.tensor_dims(t)], axes))
        out[(node.instance, node.computation, node.instruction.name)] = tuple(leaves)
    return out
