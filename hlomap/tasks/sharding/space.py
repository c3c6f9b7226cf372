"""The search space of an explorer: which linkage groups are decided, in which order, with which
choices, and how to tell cheaply whether one more decision makes a conflict.

Auto-MAP decides tensor dims one *position* at a time. Here a position is a linkage group of the
factor graph (`hlomap.propagation.graph`): a decision applies to every dim of the group, so a
group is the natural unit, and the dims it decides (its *candidate dims*: trainable dims for OPP,
data-input dims for ADP) give the paper's per-dim state and reward.

- OPP (§3.2, §4.2): positions are the groups holding trainable dims, largest group first.
- ADP (§3.3, §4.3): positions are the groups holding dims of data inputs; for a bare HLO dump
  without named data inputs, of the non-trainable, non-scalar parameters.
- HYBRID (our extension): both sets at once on a data x model mesh.

A *choice* for a position is -1 (replicated) or an index into `MeshAxes.options`. An action of the
environments is `choice + 1`, so action 0 is "replicate" and, on a 1-D mesh, action 1 "partition".
A choice vector (`int8[P]`) turns into a plan array over all groups with `ShardingSpace.plan_of`.

Conflicts are exactly what `ConflictChecker` counts: per-group facts (a need-replication factor, a
self-conflict, a compound factor, divisibility by the axis size) and pairs of groups that may not
share a mesh axis. The space precomputes the first as a static legality table and the second as
per-position partner lists, so checking one decision costs a handful of array reads.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from hlomap.hlo.capture import EntryParameter, Role
from hlomap.propagation.conflicts import REPLICATED, ConflictChecker, MeshAxes
from hlomap.propagation.graph import FactorGraph
from hlomap.propagation.plans import PLAN_DTYPE, backbone_group
from hlomap.tasks import Task, sharding_task

log = logging.getLogger(__name__)

__all__ = [
    "CandidateDim",
    "tie_layers",
    "ShardingSpace",
    "adp_space",
    "data_candidates",
    "hybrid_space",
    "make_space",
    "mesh_shape",
    "opp_space",
]


def mesh_shape(mesh: Mapping[str, int] | int | str, task: Task | str = Task.OPP) -> dict[str, int]:
    """`{"model": 8}`, `8` or `"8"` (one axis, named `model`, or `data` for ADP) or
    `"data=2,model=4"` as a checked mesh shape; the hybrid task needs two axes."""
    from hlomap.plan import parse_mesh_text

    task = sharding_task(task)
    if isinstance(mesh, str):
        mesh = parse_mesh_text(mesh)
    if isinstance(mesh, int):
        if task is Task.HYBRID:
            raise ValueError(f"the hybrid task needs a data x model mesh such as data=2,model=8, not {mesh}")
        mesh = {"data" if task is Task.ADP else "model": mesh}
    shape = {str(k): int(v) for k, v in dict(mesh).items()}
    if not shape:
        raise ValueError("a mesh needs at least one axis")
    if any(v < 1 for v in shape.values()):
        raise ValueError(f"every mesh axis needs a size >= 1, got {shape}")
    if task is Task.HYBRID and len(shape) < 2:
        raise ValueError(f"the hybrid task needs two mesh axes (data x model), got {shape}")
    return shape


class CandidateDim(NamedTuple):
    """One entry-parameter dim the search decides, and the position (group) deciding it."""

    parameter: int
    path: str
    dim: int
    size: int
    position: int


@dataclass(frozen=True, eq=False)
class ShardingSpace:
    """Positions (groups in decision order), their statically legal choices, and conflict tables.

    Arrays: `members[p]` the groups position p decides (one group, or several tied groups, see
    `tie_layers`); `groups[p]` its first member; `legal[p, a]` whether action a (0 = replicate,
    k = option k-1) is possible at all for those groups (divisible, no need-replication factor, no
    two members that may not share an axis, not pruned); `weights[p]` the number of candidate dims
    position p decides; `base` the plan array of decisions fixed outside the search (-1
    everywhere unless a task fixes some groups).
    """

    graph: FactorGraph
    axes: MeshAxes
    task: Task
    members: tuple[np.ndarray, ...]  # int64 group ids per position
    legal: np.ndarray  # bool [P, K + 1]
    weights: np.ndarray  # float64 [P]
    candidates: tuple[CandidateDim, ...]
    base: np.ndarray  # int8 [G]
    pruned: tuple[int, ...] = ()  # groups kept replicated by a pruning rule

    def __post_init__(self) -> None:
        if self.legal.shape != (len(self.members), len(self.axes.options) + 1):
            raise ValueError(f"legal table has shape {self.legal.shape}; expected "
                             f"({len(self.members)}, {len(self.axes.options) + 1})")

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def num_positions(self) -> int:
        return len(self.members)

    @cached_property
    def groups(self) -> np.ndarray:
        """The first member group of each position."""
        return np.asarray([int(m[0]) for m in self.members], dtype=np.int64)

    @cached_property
    def member_groups(self) -> np.ndarray:
        return np.concatenate(self.members).astype(np.int64) if self.members else np.zeros(0, np.int64)

    @cached_property
    def member_position(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.members)), [len(m) for m in self.members]).astype(np.int64)

    @property
    def num_actions(self) -> int:
        return len(self.axes.options) + 1

    @property
    def total_weight(self) -> float:
        return float(self.weights.sum())

    @cached_property
    def checker(self) -> ConflictChecker:
        return ConflictChecker(self.graph, self.axes)

    @cached_property
    def group_sizes(self) -> np.ndarray:
        """Tensor dims in each position's groups (the paper's ordering key; our tie-break)."""
        return np.bincount(self.member_position, weights=self.graph.group_sizes[self.member_groups],
                           minlength=self.num_positions).astype(np.float64)

    @cached_property
    def position_of_group(self) -> dict[int, int]:
        return {int(g): int(p) for g, p in zip(self.member_groups, self.member_position)}

    # -- conflicts ------------------------------------------------------------------------------
    @cached_property
    def partners(self) -> tuple[np.ndarray, ...]:
        """For each position, the groups (any group of the graph, none of its own members) it may
        not share an axis with."""
        pos = self.position_of_group
        out: list[set[int]] = [set() for _ in self.members]
        for a, b in self.checker.pairs:
            a, b = int(a), int(b)
            pa, pb = pos.get(a), pos.get(b)
            if pa is not None and pa != pb:
                out[pa].add(b)
            if pb is not None and pb != pa:
                out[pb].add(a)
        return tuple(np.asarray(sorted(o), dtype=np.int64) for o in out)

    @cached_property
    def position_pairs(self) -> np.ndarray:
        """`[Q, 2]` pairs of positions (p < q) that may not share an axis."""
        pos = self.position_of_group
        pairs = {(min(pos[int(a)], pos[int(b)]), max(pos[int(a)], pos[int(b)]))
                 for a, b in self.checker.pairs
                 if int(a) in pos and int(b) in pos and pos[int(a)] != pos[int(b)]}
        return np.asarray(sorted(pairs), dtype=np.int64).reshape(-1, 2)

    @cached_property
    def base_blocked(self) -> np.ndarray:
        """`[P, K + 1]`: action a at position p clashes with a group fixed by `base`."""
        blocked = np.zeros_like(self.legal)
        overlap = self.axes.overlap
        for p, partners in enumerate(self.partners):
            fixed = self.base[partners].astype(np.int64)
            fixed = fixed[fixed >= 0]
            for o in np.unique(fixed):
                blocked[p, 1:] |= overlap[1:, int(o) + 1]
        return blocked

    def conflicts(self, plan: np.ndarray, position: int, choice: int) -> bool:
        """Whether setting `position` to `choice` in `plan` (an array over groups holding the
        decisions so far and `base`) makes a conflict. The position itself must still be
        undecided (replicated) in `plan`."""
        if not self.legal[position, choice + 1]:
            return True
        if choice < 0:
            return False
        others = plan[self.partners[position]]
        others = others[others >= 0].astype(np.int64)
        return bool(others.size and self.axes.overlap[choice + 1, others + 1].any())

    def legal_now(self, plan: np.ndarray, position: int) -> np.ndarray:
        """Actions at `position` that make no conflict given `plan` (a bool mask over actions)."""
        mask = self.legal[position].copy()
        others = plan[self.partners[position]]
        others = np.unique(others[others >= 0]).astype(np.int64)
        if others.size:
            mask[1:] &= ~self.axes.overlap[1:, others + 1].any(axis=1)
        return mask

    # -- plans ----------------------------------------------------------------------------------
    def empty_choices(self, num: int | None = None) -> np.ndarray:
        shape = (self.num_positions,) if num is None else (num, self.num_positions)
        return np.full(shape, REPLICATED, dtype=PLAN_DTYPE)

    def plan_of(self, choices: np.ndarray) -> np.ndarray:
        """Plan array(s) over all groups from choice vector(s) `[P]` or `[N, P]`."""
        choices = np.asarray(choices)
        plans = np.broadcast_to(self.base, choices.shape[:-1] + self.base.shape).copy()
        spread = choices[..., self.member_position]
        plans[..., self.member_groups] = np.where(spread >= 0, spread, plans[..., self.member_groups])
        return plans.astype(PLAN_DTYPE)

    def choices_of(self, plan: np.ndarray) -> np.ndarray:
        """The choice vector a plan array makes at this space's positions (the choice of each
        position's first member; see `represents`)."""
        return np.asarray(plan)[..., self.groups].astype(PLAN_DTYPE)

    def represents(self, plan: np.ndarray) -> bool:
        """Whether `plan` is `plan_of` some choice vector over the positions: tied members agree
        and every group outside the positions is as in `base`."""
        return bool(np.array_equal(self.plan_of(self.choices_of(plan)), np.asarray(plan)))

    def set_choice(self, plan: np.ndarray, position: int, choice: int) -> None:
        """Apply one decision to a plan array in place."""
        plan[self.members[position]] = choice if choice >= 0 else self.base[self.members[position]]

    def first_conflict(self, choices: np.ndarray) -> np.ndarray:
        """For choice vectors `[N, P]`, the first position (in decision order) whose decision
        conflicts with the decisions before it or with `base`; P when there is none. This is
        where an episode taking these decisions in order would end."""
        choices = np.atleast_2d(np.asarray(choices)).astype(np.int64)
        n, p = choices.shape
        first = np.full(n, p, dtype=np.int64)
        cols = np.arange(p)[None, :]
        bad = ~self.legal[cols, choices + 1] | self.base_blocked[cols, choices + 1]
        if bad.any():
            first = np.where(bad.any(axis=1), bad.argmax(axis=1), first)
        pairs = self.position_pairs
        if len(pairs):
            a = choices[:, pairs[:, 0]] + 1
            b = choices[:, pairs[:, 1]] + 1
            clash = self.axes.overlap[a, b]  # [N, Q]; replicated (0) never overlaps
            at = np.where(clash, pairs[None, :, 1], p)
            first = np.minimum(first, at.min(axis=1))
        return first

    def ok(self, choices: np.ndarray) -> np.ndarray:
        """Conflict-free, per choice vector."""
        return self.first_conflict(choices) == self.num_positions

    # -- reporting ------------------------------------------------------------------------------
    def describe(self, position: int) -> str:
        ids = [int(g) for g in self.members[position]]
        dims = [f"{c.path}:{c.dim}" for c in self.candidates if c.position == position]
        more = f" +{len(dims) - 3}" if len(dims) > 3 else ""
        head = f"group {ids[0]}" if len(ids) == 1 else f"groups {ids[:4]}{'...' if len(ids) > 4 else ''}"
        return f"{head} (size {int(self.group_sizes[position])}): {', '.join(dims[:3])}{more}"


# ---------------------------------------------------------------------------------------------
# Building spaces
# ---------------------------------------------------------------------------------------------


def data_candidates(graph: FactorGraph) -> tuple[EntryParameter, ...]:
    """The parameters ADP decides: DATA inputs; for a dump that names none, the parameters that
    are neither trainable nor optimizer state and are not scalars (Auto-MAP's "non-trainable,
    non-constant" parameters)."""
    data = tuple(p for p in graph.parameters if p.role is Role.DATA and p.shape.rank > 0)
    if data:
        return data
    return tuple(p for p in graph.parameters
                 if p.role not in (Role.TRAINABLE, Role.OPTIMIZER_STATE) and p.shape.rank > 0)


def _candidates(graph: FactorGraph, params: Iterable[EntryParameter]) -> list[tuple[EntryParameter, int, int]]:
    """(parameter, dim, group) for every dim of size > 1."""
    return [(p, d, int(g)) for p in params for d, g in enumerate(graph.parameter_groups(p.index))
            if p.shape.dims[d] > 1]


def _order(graph: FactorGraph, entries: Sequence[tuple[EntryParameter, int, int]]) -> list[int]:
    """Groups of `entries`, largest group first (ties: more candidate dims, first appearance)."""
    count: dict[int, int] = {}
    for _, _, g in entries:
        count[g] = count.get(g, 0) + 1
    first = list(count)
    return sorted(first, key=lambda g: (-int(graph.group_sizes[g]), -count[g], first.index(g)))


#: A path component that numbers a repeated layer: `layers_3`, `h_11`, `block_2`.
_LAYER_INDEX = re.compile(r"(?<![^/])([A-Za-z]+)_\d+(?![^/])")


def _signature(entries: Sequence[tuple[EntryParameter, int, int]]) -> tuple[tuple[str, int, int], ...]:
    """The candidate dims of one group with layer numbers erased: equal for the same group of
    every repeated layer (the heads of layer 3 and of layer 7)."""
    return tuple(sorted((_LAYER_INDEX.sub(r"\1_#", p.path), d, int(p.shape.dims[d])) for p, d, _ in entries))


def tie_layers(graph: FactorGraph, checker: ConflictChecker, entries: Sequence[tuple[EntryParameter, int, int]],
               order: Sequence[int]) -> list[list[int]]:
    """Positions as lists of groups: the groups of `order` whose candidate dims differ only in
    layer numbers become one position (decided together), unless two of them may not share an
    axis. In decision order of their first member."""
    by_group: dict[int, list[tuple[EntryParameter, int, int]]] = {}
    for e in entries:
        by_group.setdefault(e[2], []).append(e)
    classes: dict[tuple[tuple[str, int, int], ...], list[int]] = {}
    for g in order:
        classes.setdefault(_signature(by_group.get(g, [])), []).append(int(g))
    clashing = {(int(a), int(b)) for a, b in checker.pairs}
    positions: list[list[int]] = []
    placed: set[int] = set()
    for g in order:
        if g in placed:
            continue
        cls = classes[_signature(by_group.get(g, []))]
        members = set(cls)
        if len(cls) > 1 and any((a, b) in clashing for a in members for b in members):
            cls = [g]
        positions.append(list(cls))
        placed.update(cls)
    return positions


def _build(graph: FactorGraph, axes: MeshAxes, task: Task, entries: Sequence[tuple[EntryParameter, int, int]],
           order: Sequence[int], *, base: np.ndarray | None, prune: Iterable[int], tie: bool) -> ShardingSpace:
    checker = ConflictChecker(graph, axes)
    pruned = tuple(int(g) for g in prune if int(g) in set(order))
    untied = [g for g in order if g in pruned]
    rest = [g for g in order if g not in pruned]
    groups = tie_layers(graph, checker, entries, rest) if tie else [[g] for g in rest]
    positions = sorted([[g] for g in untied] + groups, key=lambda m: list(order).index(m[0]))
    members = tuple(np.asarray(m, dtype=np.int64) for m in positions)
    k = len(axes.options)
    legal = np.zeros((len(members), k + 1), dtype=bool)
    legal[:, 0] = True
    for p, m in enumerate(members):
        legal[p, 1:] = (checker.divisible[m, 1:] & ~checker.never[m, None]).all(axis=0)
        if int(m[0]) in pruned:
            legal[p, 1:] = False
    pos = {int(g): p for p, m in enumerate(members) for g in m}
    candidates = tuple(CandidateDim(p.index, p.path, d, int(p.shape.dims[d]), pos[g])
                       for p, d, g in entries if g in pos)
    weights = np.bincount([c.position for c in candidates], minlength=len(members)).astype(np.float64)
    base_arr = np.full(graph.num_groups, REPLICATED, dtype=PLAN_DTYPE) if base is None else np.asarray(base, PLAN_DTYPE)
    if base is not None:
        base_arr = base_arr.copy()
        base_arr[np.concatenate(members)] = REPLICATED  # decided positions are the search's, not the base's
    return ShardingSpace(graph, axes, task, members, legal, weights, candidates, base_arr, pruned)


def opp_space(graph: FactorGraph, axes: MeshAxes, *, replicate_residual: bool = False,
              base: np.ndarray | None = None, tie: bool = True) -> ShardingSpace:
    """Operator partitioning: the groups of trainable dims in `graph.decision_order()`.

    `replicate_residual=True` keeps the residual stream (the backbone group: the group with the
    most trainable dims, see `hlomap.propagation.plans.backbone_group`) replicated. Auto-MAP's
    propagation could not split a normalization's reduction, so in the paper the hidden dim of a
    transformer was never a legal partition; our factor graph can split it (XLA all-reduces the
    partial sums), and under the paper's dim-counting reward splitting it then beats Megatron.
    The pruning restores the paper's search space; the cost reward needs no such help.

    `tie=True` decides the same group of every repeated layer together (see `tie_layers`): a
    transformer's N layers then cost one position per group kind instead of N.
    """
    trainable = [p for p in graph.parameters if p.role is Role.TRAINABLE]
    if not trainable:
        raise ValueError(f"{graph.module.name} has no trainable parameters: OPP needs their roles "
                         "(capture from JAX, or name them with --trainable for an HLO dump)")
    entries = _candidates(graph, trainable)
    order = [g for g in graph.decision_order()]
    prune = [backbone_group(graph)] if replicate_residual else []
    return _build(graph, axes, Task.OPP, entries, order, base=base, prune=prune, tie=tie)


def adp_space(graph: FactorGraph, axes: MeshAxes, *, base: np.ndarray | None = None, tie: bool = True) -> ShardingSpace:
    """Auto data parallelism: the groups of data-input dims, largest group first."""
    params = data_candidates(graph)
    if not params:
        raise ValueError(f"{graph.module.name} has no data inputs (no DATA parameter and no non-trainable, "
                         "non-scalar parameter) for ADP")
    entries = _candidates(graph, params)
    return _build(graph, axes, Task.ADP, entries, _order(graph, entries), base=base, prune=(), tie=tie)


def hybrid_space(graph: FactorGraph, axes: MeshAxes, *, replicate_residual: bool = False,
                 tie: bool = True) -> ShardingSpace:
    """Data-input groups and trainable groups decided together, on every axis of the mesh.

    Candidate dims are the trainable dims and the data-input dims; positions are their groups,
    largest first (a data group that also holds trainable dims appears once).
    """
    trainable = [p for p in graph.parameters if p.role is Role.TRAINABLE]
    entries = _candidates(graph, trainable) + _candidates(graph, data_candidates(graph))
    if not entries:
        raise ValueError(f"{graph.module.name} has neither trainable nor data parameters to decide")
    prune = [backbone_group(graph)] if replicate_residual and trainable else []
    return _build(graph, axes, Task.HYBRID, entries, _order(graph, entries), base=None, prune=prune, tie=tie)


def make_space(graph: FactorGraph, axes: MeshAxes, task: Task | str, *, replicate_residual: bool = False,
               tie: bool = True) -> ShardingSpace:
    task = sharding_task(task)
    if task is Task.OPP:
        return opp_space(graph, axes, replicate_residual=replicate_residual, tie=tie)
    if task is Task.ADP:
        return adp_space(graph, axes, tie=tie)
    return hybrid_space(graph, axes, replicate_residual=replicate_residual, tie=tie)
