"""The factor graph: every tensor dimension of a module, unioned through the factor rules into
linkage groups (Auto-MAP's linkage groups, computed once with connected components).

A *group* is a set of tensor dims that share one sharding in any conflict-free plan. Two dims are
linked when one factor of one instruction is the major factor of both. Links cross called
computations: a call / fusion links its operands to the callee's parameters and the callee's root
to its result; a while links its operand, the body and condition parameters, the body root and
its result (the loop-carried tuple); a conditional links each branch operand to its branch.

Called computations are *instantiated per call site*: a helper computation called from two places
(JAX emits `call`s for nested jits such as `_where`) gets two copies of its dims, exactly as if
it were inlined, which is what XLA does before partitioning. Without this, two unrelated call
sites would be unioned through the shared callee.

Constant-derived tensors (constant, iota, and whatever is computed from them only: the broadcast
zeros JAX shares between unrelated users, causal masks) cost nothing to produce in any sharding,
so they do not link their users: a zero broadcast shared by two layers would otherwise merge the
two layers' groups. When shardings are derived, such a tensor follows its first consumer
(`FactorGraph.followed`), which is what XLA does.

Besides groups the graph records, mesh-independently, what can make sharding a group a conflict
(`GroupConstraints`): a need-replication factor in the group, two factors of one instruction in
the group, the group being the minor factor of a compound (reshaped) dim, the gcd of its dims'
sizes; and the pairs of groups that meet in one instruction (they may not share a mesh axis).
`hlomap.propagation.conflicts` turns these into vectorized checks for many plans at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from hlomap.hlo.capture import Capture, EntryParameter, Role
from hlomap.hlo.ir import Computation, Instruction, Module, Shape
from hlomap.hlo.opcodes import CallContext, opcode_names
from hlomap.propagation.factors import FactorKind, OpRule
from hlomap.propagation.rules import ELEMENTWISE_OPCODES as _ELEMENTWISE_OPCODES
from hlomap.propagation.rules import rule_for
from hlomap.hlo.source_info import SourceTables, source_location, source_tables

log = logging.getLogger(__name__)

#: Attribute keys of computations that are instantiated per call site, by opcode. Scalar
#: combiners (reduce's to_apply...) are not: they have no dims.
_INSTANTIATED_KEYS: Mapping[str, tuple[str, ...]] = {
    "call": ("to_apply",),
    "fusion": ("calls",),
    "async-start": ("calls",),
    "while": ("condition", "body"),
    "conditional": ("true_computation", "false_computation", "branch_computations"),
}


class Node(NamedTuple):
    """One instruction in one instance of its computation (instances are per call site)."""

    instance: int
    computation: str
    instruction: Instruction


class Instance(NamedTuple):
    """One instantiation of a computation: where it was called from (-1 for the entry)."""

    computation: str
    parent: int
    call_site: str  # name of the calling instruction in the parent instance ("" for the entry)


class DimRef(NamedTuple):
    """A human-readable handle on one tensor dim, for messages and reports."""

    dim_id: int
    computation: str
    instruction: str
    leaf: int
    dim: int
    size: int
    instance: int

    def __str__(self) -> str:
        leaf = f"{{{self.leaf}}}" if self.leaf else ""
        return f"{self.instruction}{leaf}[dim {self.dim}] (size {self.size}) in {self.computation}"


class TrainableDim(NamedTuple):
    """A dim of a trainable entry parameter, its group and the other trainable dims in it."""

    parameter: int
    path: str
    dim: int
    size: int
    group: int
    group_size: int
    others: tuple[tuple[str, int], ...]  # (path, dim) of the other trainable dims in the group


@dataclass(frozen=True)
class GroupConstraints:
    """Mesh-independent facts about each group; arrays indexed by group id.

    `*_node` arrays hold the index (into `FactorGraph.nodes`) of the first instruction that gives
    the group that property, or -1: a need-replication factor; two distinct factors of one
    instruction in the group (self-conflict); the group being a non-major factor of a compound
    dim. `gcd_effective` is the gcd of the sizes of the group's dims, counting a compound dim as
    the size of its major factor; `gcd_full` counts whole dim sizes (they differ only for compound
    dims, which is how a compound-factor divisibility violation is told apart). `pairs[k]` is two
    distinct groups that meet in instruction `pair_node[k]` and so may not share a mesh axis.
    """

    gcd_effective: np.ndarray
    gcd_full: np.ndarray
    need_replication_node: np.ndarray
    self_conflict_node: np.ndarray
    compound_node: np.ndarray
    compound_dim: np.ndarray  # the dim id where the group is a minor factor, or -1
    pairs: np.ndarray  # int32 [P, 2], pairs[:, 0] < pairs[:, 1]
    pair_node: np.ndarray  # int32 [P]


@dataclass(frozen=True)
class ReductionFactors:
    """Every sharded-able reduction factor: in which node, its group and size (for all-reduces)."""

    node: np.ndarray  # int32 [R]
    group: np.ndarray  # int32 [R]
    size: np.ndarray  # int64 [R]


class FactorGraph:
    """Linkage groups of one module. Build with `FactorGraph.build(module)` or `from_capture(cap)`.

    Plain arrays, indexed by dim id: `dim_tensor`, `dim_index`, `dim_size`, `dim_effective_size`,
    `group_of_dim`. Tensors (one per array leaf of every instruction instance): `tensor_node`,
    `tensor_leaf`, `tensor_first_dim`, `tensor_rank`.
    """

    def __init__(
        self,
        module: Module,
        parameters: Sequence[EntryParameter],
        nodes: list[Node],
        instances: list[Instance],
        tensor_node: np.ndarray,
        tensor_leaf: np.ndarray,
        tensor_first_dim: np.ndarray,
        tensor_rank: np.ndarray,
        dim_size: np.ndarray,
        dim_effective_size: np.ndarray,
        group_of_dim: np.ndarray,
        constraints: GroupConstraints,
        reductions: ReductionFactors,
        node_tensors: list[tuple[int, int]],
        unknown: Mapping[str, int],
        tensor_free: np.ndarray | None = None,
        followed: np.ndarray | None = None,
        links: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> None:
        self.module = module
        self.parameters = tuple(parameters)
        self.nodes = nodes
        self.instances = instances
        self.tensor_node = tensor_node
        self.tensor_leaf = tensor_leaf
        self.tensor_first_dim = tensor_first_dim
        self.tensor_rank = tensor_rank
        self.dim_size = dim_size
        self.dim_effective_size = dim_effective_size
        self.group_of_dim = group_of_dim
        self.constraints = constraints
        self.reductions = reductions
        self.node_tensors = node_tensors  # node -> (first tensor id, number of leaves)
        self.unknown = dict(unknown)  # fallback reason -> count
        # constant-derived tensors (free to materialize in any sharding; never link their users)
        self.tensor_free = tensor_free if tensor_free is not None else np.zeros(len(tensor_rank), dtype=bool)
        self.num_groups = int(group_of_dim.max()) + 1 if len(group_of_dim) else 0
        #: group -> group whose sharding it takes when deriving shardings (see followed_groups)
        self.followed = followed if followed is not None else np.arange(self.num_groups, dtype=np.int32)
        #: (dim a, dim b, node): every pair of dims an instruction tied together, and which
        empty = np.zeros(0, dtype=np.int64)
        self.links = links if links is not None else (empty, empty, empty)
        self.dim_tensor = np.repeat(np.arange(len(tensor_rank), dtype=np.int32), tensor_rank)
        self.dim_index = (np.arange(len(dim_size)) - np.repeat(tensor_first_dim, tensor_rank)).astype(np.int32)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def build(cls, module: Module, parameters: Sequence[EntryParameter] = ()) -> FactorGraph:
        """Union every tensor dim of `module` through the factor rules. `parameters` (roles and
        pytree paths of the entry parameters, from `hlomap.capture`) are optional."""
        return _Builder(module).run(cls, parameters)

    @classmethod
    def from_capture(cls, cap: Capture) -> FactorGraph:
        return cls.build(cap.module, cap.parameters)

    # -- tensors and dims -----------------------------------------------------------------------
    @property
    def num_dims(self) -> int:
        return len(self.dim_size)

    @property
    def num_tensors(self) -> int:
        return len(self.tensor_rank)

    def tensor_dims(self, tensor: int) -> np.ndarray:
        start = self.tensor_first_dim[tensor]
        return np.arange(start, start + self.tensor_rank[tensor])

    def node_of(self, computation: str, instruction: str, instance: int | None = None) -> int:
        """Node index of an instruction (in its first instance unless `instance` is given)."""
        for i in self._node_index.get((computation, instruction), ()):
            if instance is None or self.nodes[i].instance == instance:
                return i
        raise KeyError(f"no instruction {instruction!r} in computation {computation!r} of {self.module.name}")

    def result_tensors(self, node: int) -> range:
        first, count = self.node_tensors[node]
        return range(first, first + count)

    @cached_property
    def _node_index(self) -> Mapping[tuple[str, str], tuple[int, ...]]:
        index: dict[tuple[str, str], list[int]] = {}
        for i, n in enumerate(self.nodes):
            index.setdefault((n.computation, n.instruction.name), []).append(i)
        return {k: tuple(v) for k, v in index.items()}

    def dim_ref(self, dim_id: int) -> DimRef:
        t = int(self.dim_tensor[dim_id])
        node = self.nodes[int(self.tensor_node[t])]
        return DimRef(dim_id, node.computation, node.instruction.name, int(self.tensor_leaf[t]),
                      int(self.dim_index[dim_id]), int(self.dim_size[dim_id]), node.instance)

    @cached_property
    def source_tables(self) -> SourceTables:
        return source_tables(self.module)

    def source_of(self, inst: Instruction) -> str | None:
        """`file:line` of an instruction when its metadata says."""
        return source_location(inst, self.source_tables)

    def tensor_name(self, tensor: int) -> str:
        """The entry parameter's pytree path for entry parameters, else `instruction{leaf}`."""
        node = self.nodes[int(self.tensor_node[tensor])]
        inst = node.instruction
        if node.instance == 0 and inst.opcode == "parameter":
            p = self.parameter_by_number.get(inst.parameter_number or 0)
            if p is not None and p.path:
                return p.path
        leaf = int(self.tensor_leaf[tensor])
        return inst.name + (f"{{{leaf}}}" if leaf or inst.shape.is_tuple else "")

    # -- entry parameters -----------------------------------------------------------------------
    @cached_property
    def parameter_by_number(self) -> Mapping[int, EntryParameter]:
        return {p.index: p for p in self.parameters}

    @cached_property
    def entry_parameter_tensors(self) -> tuple[int, ...]:
        """Tensor id of each entry parameter, by parameter number (array parameters only)."""
        out: dict[int, int] = {}
        for i, n in enumerate(self.nodes):
            if n.instance == 0 and n.instruction.opcode == "parameter":
                first, count = self.node_tensors[i]
                if count == 1:
                    out[n.instruction.parameter_number or 0] = first
        return tuple(out[k] for k in sorted(out))

    def parameter_dims(self, index: int) -> np.ndarray:
        """Dim ids of entry parameter `index`."""
        return self.tensor_dims(self.entry_parameter_tensors[index])

    @cached_property
    def sharding_group_of_dim(self) -> np.ndarray:
        """The group each dim takes its sharding from: its own, or for a constant-derived dim the
        group of the consumer it follows (XLA shards such a broadcast like its user)."""
        return self.followed[self.group_of_dim]

    @cached_property
    def parameter_dim_groups(self) -> tuple[np.ndarray, np.ndarray]:
        """(groups, offsets): the group of every entry-parameter dim, concatenated in parameter
        order; parameter i's dims are `groups[offsets[i]:offsets[i + 1]]`."""
        dims = [self.tensor_dims(t) for t in self.entry_parameter_tensors]
        offsets = np.cumsum([0] + [len(d) for d in dims])
        flat = np.concatenate(dims) if dims else np.zeros(0, dtype=np.int64)
        return self.group_of_dim[flat], offsets

    def parameter_groups(self, index: int) -> tuple[int, ...]:
        return tuple(int(g) for g in self.group_of_dim[self.parameter_dims(index)])

    @cached_property
    def output_tensors(self) -> tuple[int, ...]:
        """Tensor ids of the entry root's leaves (the step's outputs)."""
        root = self.module.entry.root
        return tuple(self.result_tensors(self.node_of(self.module.entry_name, root.name, 0)))

    def with_role(self, role: Role) -> tuple[EntryParameter, ...]:
        return tuple(p for p in self.parameters if p.role is role)

    # -- groups ---------------------------------------------------------------------------------
    @cached_property
    def group_sizes(self) -> np.ndarray:
        """Number of tensor dims in each group (the paper's group size)."""
        return np.bincount(self.group_of_dim, minlength=self.num_groups)

    @cached_property
    def _group_members(self) -> tuple[np.ndarray, np.ndarray]:
        order = np.argsort(self.group_of_dim, kind="stable")
        starts = np.searchsorted(self.group_of_dim[order], np.arange(self.num_groups + 1))
        return order, starts

    def group_dims(self, group: int) -> np.ndarray:
        order, starts = self._group_members
        return order[starts[group]: starts[group + 1]]

    def link_path(self, dim_a: int, dim_b: int) -> tuple[int, ...]:
        """The nodes (instructions) along a chain of links from dim `dim_a` to dim `dim_b` of one
        group: why the two must share a sharding. Links made by forward-pass instructions are
        preferred (a user recognizes the attention product, not its transpose). Empty when they
        are the same dim or not linked."""
        from scipy.sparse import coo_matrix
        from scipy.sparse.csgraph import dijkstra

        from hlomap.hlo.capture import Phase, instruction_phase

        a, b, nodes = self.links
        if dim_a == dim_b or not len(a):
            return ()
        n = self.num_dims
        forward = np.asarray([instruction_phase(self.nodes[int(x)].instruction) is Phase.FORWARD
                              if x >= 0 else False for x in nodes])
        cost = np.where(forward, 1.0, 10.0)
        # one entry per pair of dims (a sparse matrix would add up duplicates), both directions
        u, v = np.concatenate([a, b]), np.concatenate([b, a])
        index = np.concatenate([np.arange(len(a)), np.arange(len(a))])
        order = np.lexsort((cost[index], u * n + v))  # the cheapest link of each pair first
        _, first = np.unique((u * n + v)[order], return_index=True)
        keep = order[first]
        weights = coo_matrix((cost[index[keep]], (u[keep], v[keep])), shape=(n, n)).tocsr()
        which = coo_matrix((index[keep] + 1, (u[keep], v[keep])), shape=(n, n)).tocsr()
        _, parent = dijkstra(weights, indices=dim_a, return_predecessors=True)
        if parent[dim_b] < 0:
            return ()
        path, here = [], dim_b
        while here != dim_a:
            previous = int(parent[here])
            path.append(int(nodes[int(which[previous, here]) - 1]))
            here = previous
        return tuple(dict.fromkeys(x for x in reversed(path) if x >= 0))

    def group_members(self, group: int) -> list[DimRef]:
        return [self.dim_ref(int(d)) for d in self.group_dims(group)]

    @cached_property
    def trainable_dims(self) -> tuple[TrainableDim, ...]:
        """Every dim of every trainable entry parameter with its group and its group-mates."""
        entries = [(p, d, int(g)) for p in self.with_role(Role.TRAINABLE)
                   for d, g in enumerate(self.parameter_groups(p.index))]
        by_group: dict[int, list[tuple[str, int]]] = {}
        for p, d, g in entries:
            by_group.setdefault(g, []).append((p.path, d))
        return tuple(
            TrainableDim(p.index, p.path, d, p.shape.dims[d], g, int(self.group_sizes[g]),
                         tuple(x for x in by_group[g] if x != (p.path, d)))
            for p, d, g in entries
        )

    @cached_property
    def trainable_groups(self) -> tuple[int, ...]:
        """Groups holding at least one trainable dim of size > 1, in first-appearance order."""
        seen: dict[int, None] = {}
        for t in self.trainable_dims:
            if t.size > 1:
                seen.setdefault(t.group, None)
        return tuple(seen)

    def decision_order(self) -> tuple[int, ...]:
        """Auto-MAP's order of decisions: groups with trainable dims, largest group first (ties:
        more trainable dims, then first appearance)."""
        count: dict[int, int] = {}
        for t in self.trainable_dims:
            count[t.group] = count.get(t.group, 0) + 1
        groups = self.trainable_groups
        return tuple(sorted(groups, key=lambda g: (-int(self.group_sizes[g]), -count[g], groups.index(g))))

    def parameter_groups_all(self) -> tuple[int, ...]:
        """Groups holding a dim of size > 1 of any entry parameter: the groups a plan expressed
        as `in_shardings` can decide."""
        seen: dict[int, None] = {}
        for t in self.entry_parameter_tensors:
            for d in self.tensor_dims(t):
                if self.dim_size[d] > 1:
                    seen.setdefault(int(self.group_of_dim[d]), None)
        return tuple(seen)

    def summary(self) -> str:
        c = self.constraints
        return (
            f"{self.module.name}: {len(self.nodes)} instructions, {self.num_tensors} tensors, "
            f"{self.num_dims} dims, {self.num_groups} groups ({len(self.trainable_groups)} with trainable dims), "
            f"{int((c.need_replication_node >= 0).sum())} need-replication, "
            f"{int((c.self_conflict_node >= 0).sum())} self-conflicting, {len(c.pairs)} exclusive pairs"
        )


# ---------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------


class _Builder:
    """Imperative shell that walks the module once; all per-instruction logic is in the rules."""

    def __init__(self, module: Module) -> None:
        self.module = module
        self.nodes: list[Node] = []
        self.instances: list[Instance] = []
        self.node_tensors: list[tuple[int, int]] = []
        self.tensor_node: list[int] = []
        self.tensor_leaf: list[int] = []
        self.tensor_first_dim: list[int] = []
        self.tensor_rank: list[int] = []
        self.dim_size: list[int] = []
        self.dim_eff: list[int] = []
        self.tensor_free: list[bool] = []
        self.dim_free = bytearray()
        self.soft: list[tuple[int, int]] = []  # (constant-derived dim, the consumer dim it follows)
        self.edges_a: list[int] = []
        self.edges_b: list[int] = []
        self.edges_node: list[int] = []  # the instruction (node) that links each pair of dims
        self.current_node = -1
        # (node, rep dim) records, resolved to groups after the union
        self.units: list[tuple[int, list[int]]] = []
        self.nr: list[tuple[int, int]] = []
        self.compound: list[tuple[int, int, int]] = []  # (node, rep dim of minor factor, dim where minor)
        self.reduction: list[tuple[int, int, int]] = []  # (node, rep dim, size)
        self.rule_cache: dict[tuple[object, ...], OpRule] = {}
        self.constant_memo: dict[str, dict[str, list[bool]]] = {}  # `constant_derived` per computation
        self.unknown: dict[str, int] = {}

    def run(self, cls: type[FactorGraph], parameters: Sequence[EntryParameter]) -> FactorGraph:
        from scipy.sparse import coo_matrix
        from scipy.sparse.csgraph import connected_components

        self.instantiate(self.module.entry, parent=-1, call_site="")
        n = len(self.dim_size)
        a = np.asarray(self.edges_a, dtype=np.int64)
        b = np.asarray(self.edges_b, dtype=np.int64)
        adjacency = coo_matrix((np.ones(len(a), dtype=np.int8), (a, b)), shape=(n, n))
        _, labels = connected_components(adjacency, directed=False)
        labels = _first_appearance_labels(labels)
        for reason, count in sorted(self.unknown.items()):
            log.warning("no sharding rule for %s (%d instruction(s) in %s): treated as need-replication",
                        reason, count, self.module.name)
        return cls(
            module=self.module,
            parameters=parameters,
            nodes=self.nodes,
            instances=self.instances,
            tensor_node=np.asarray(self.tensor_node, dtype=np.int32),
            tensor_leaf=np.asarray(self.tensor_leaf, dtype=np.int32),
            tensor_first_dim=np.asarray(self.tensor_first_dim, dtype=np.int64),
            tensor_rank=np.asarray(self.tensor_rank, dtype=np.int64),
            dim_size=np.asarray(self.dim_size, dtype=np.int64),
            dim_effective_size=np.asarray(self.dim_eff, dtype=np.int64),
            group_of_dim=labels.astype(np.int32),
            constraints=self.constraints(labels),
            reductions=ReductionFactors(
                node=np.asarray([r[0] for r in self.reduction], dtype=np.int32),
                group=labels[np.asarray([r[1] for r in self.reduction], dtype=np.int64)].astype(np.int32),
                size=np.asarray([r[2] for r in self.reduction], dtype=np.int64),
            ),
            node_tensors=self.node_tensors,
            unknown=self.unknown,
            tensor_free=np.asarray(self.tensor_free, dtype=bool),
            followed=self.followed_groups(labels),
            links=(a, b, np.asarray(self.edges_node, dtype=np.int64)),
        )

    def followed_groups(self, labels: np.ndarray) -> np.ndarray:
        """For each group, the group whose sharding it takes when shardings are derived: itself,
        except for groups of constant-derived dims, which follow their first consumer's group."""
        n_groups = int(labels.max()) + 1 if len(labels) else 0
        follow = np.arange(n_groups, dtype=np.int32)
        free = np.frombuffer(bytes(self.dim_free), dtype=np.uint8).astype(bool)
        # a group follows only if all its dims are constant-derived
        all_free = np.ones(n_groups, dtype=bool)
        np.logical_and.at(all_free, labels, free)
        done = np.zeros(n_groups, dtype=bool)
        for fd, nd in self.soft:
            g = labels[fd]
            if all_free[g] and not done[g]:
                follow[g] = labels[nd]
                done[g] = True
        return follow

    # -- walking --------------------------------------------------------------------------------
    def new_tensors(self, node: int, shape: Shape, free: Sequence[bool]) -> list[list[int]]:
        leaves: list[list[int]] = []
        first_tensor = len(self.tensor_rank)
        for leaf, arr in enumerate(shape.leaves()):
            start = len(self.dim_size)
            is_free = free[leaf] if leaf < len(free) else False
            self.tensor_free.append(is_free)
            self.dim_free.extend(b"\x01" * arr.rank if is_free else b"\x00" * arr.rank)
            self.tensor_node.append(node)
            self.tensor_leaf.append(leaf)
            self.tensor_first_dim.append(start)
            self.tensor_rank.append(arr.rank)
            self.dim_size.extend(arr.dims)
            self.dim_eff.extend(arr.dims)
            leaves.append(list(range(start, start + arr.rank)))
        self.node_tensors.append((first_tensor, len(leaves)))
        return leaves

    def instantiate(self, comp: Computation, parent: int, call_site: str) -> dict[str, list[list[int]]]:
        """Create dims for every instruction of one instance of `comp` and apply the rules.
        Returns instruction name -> dim ids of each result leaf."""
        instance = len(self.instances)
        self.instances.append(Instance(comp.name, parent, call_site))
        dims: dict[str, list[list[int]]] = {}
        node_of: dict[str, int] = {}
        free: dict[str, list[bool]] = {}
        for inst in comp.instructions:
            node = len(self.nodes)
            self.nodes.append(Node(instance, comp.name, inst))
            node_of[inst.name] = node
            free[inst.name] = self._call_free_leaves(inst) if inst.opcode == "call" else _free_leaves(inst, free)
            dims[inst.name] = self.new_tensors(node, inst.shape, free[inst.name])
        for inst in comp.instructions:
            self.apply(comp, inst, node_of[inst.name], dims)
        return dims

    def _call_free_leaves(self, inst: Instruction) -> list[bool]:
        """A `call`'s result leaves read as inlined, as XLA inlines it (`constant_derived`): a
        leaf its callee builds from constants alone (the broadcast fill value a nested
        `jnp.where` returns for its derivative) is free, whatever else the call reads."""
        callee = inst.called_computations[0] if inst.called_computations else None
        if callee is None or callee not in self.module.by_name:
            return _free_leaves(inst, {})
        comp = self.module.computation(callee)
        return list(constant_derived(self.module, comp, self.constant_memo)[comp.root.name])

    def apply(self, comp: Computation, inst: Instruction, node: int, dims: dict[str, list[list[int]]]) -> None:
        self.current_node = node
        per_operand: list[list[list[int]]] = []
        operand_shapes: list[Shape] = []
        for name in inst.operands:
            if name not in dims:
                log.warning("%s in %s uses undefined operand %s; ignored", inst.name, comp.name, name)
                continue
            per_operand.append(dims[name])
            operand_shapes.append(comp[name].shape)
        operand_leaves = [leaf for leaves in per_operand for leaf in leaves]
        if inst.opcode in _ELEMENTWISE_OPCODES:
            # elementwise rules depend on shapes only: share them across instructions
            key: tuple[object, ...] = (inst.opcode, inst.shape, tuple(operand_shapes))
        else:
            key = (id(inst), tuple(operand_shapes))
        rule = self.rule_cache.get(key)
        if rule is None:
            rule = rule_for(inst, operand_shapes, self.module)
            self.rule_cache[key] = rule
            if rule.fallback:
                self.unknown[rule.fallback] = self.unknown.get(rule.fallback, 0) + 1
        consumer_free = bool(self.tensor_free[self.node_tensors[node][0]]) if self.node_tensors[node][1] else False
        self.apply_rule(rule, node, operand_leaves, dims[inst.name], consumer_free)
        if inst.opcode in _INSTANTIATED_KEYS:
            self.link_called(inst, self.nodes[node].instance, per_operand, dims[inst.name])

    def apply_rule(self, rule: OpRule, node: int, operands: list[list[int]], results: list[list[int]],
                   consumer_free: bool = False) -> None:
        nf = rule.num_factors
        major: list[list[int]] = [[] for _ in range(nf)]
        minor: list[list[int]] = [[] for _ in range(nf)]
        sizes = rule.factor_sizes
        free = self.dim_free
        deferred: list[tuple[int, int]] = []
        for tensors, leaves, is_operand in ((rule.operands, operands, True), (rule.results, results, False)):
            for tfactors, tdims in zip(tensors, leaves):
                if is_operand and not consumer_free and tdims and free[tdims[0]]:
                    # A constant-derived operand can be materialized in whatever sharding this
                    # consumer wants; linking it would tie together all its (unrelated) users.
                    # It only *follows* this consumer when shardings are derived (`soft`).
                    for factors, dim in zip(tfactors, tdims):
                        if factors:
                            deferred.append((dim, factors[0]))
                    continue
                for factors, dim in zip(tfactors, tdims):
                    # the major factor is the first of size > 1 (size-1 factors carry nothing)
                    m = next((f for f in factors if sizes[f] > 1), factors[0] if factors else None)
                    if m is None:
                        continue
                    major[m].append(dim)
                    if len(factors) > 1:
                        self.dim_eff[dim] = sizes[m]
                        for f in factors:
                            if f != m and sizes[f] > 1:
                                minor[f].append(dim)
        for dim, f in deferred:
            if major[f]:
                self.soft.append((dim, major[f][0]))
        rep: list[int] = [-1] * nf
        for f in range(nf):
            ds = major[f] or minor[f]
            if not ds or sizes[f] <= 1:
                continue
            rep[f] = ds[0]
            if len(major[f]) > 1:
                first = major[f][0]
                for d in major[f][1:]:
                    self.edges_a.append(first)
                    self.edges_b.append(d)
                    self.edges_node.append(node)
            kind = rule.factor_kinds[f]
            if kind is FactorKind.NEED_REPLICATION:
                self.nr.append((node, ds[0]))
            elif kind is FactorKind.REDUCTION:
                self.reduction.append((node, ds[0], sizes[f]))
            if major[f]:
                for d in minor[f]:
                    self.compound.append((node, major[f][0], d))
        if rule.independent_leaves:
            for leaf in results:
                if len(leaf) > 1:
                    self.units.append((node, leaf))
        else:
            reps = [r for r in rep if r >= 0]
            if len(reps) > 1:
                self.units.append((node, reps))

    def link(self, a: list[list[int]], b: list[list[int]]) -> None:
        """Link two sequences of leaves dim by dim (mismatched and constant-derived leaves are
        skipped)."""
        free = self.dim_free
        for la, lb in zip(a, b):
            if len(la) != len(lb) or (la and (free[la[0]] or free[lb[0]])):
                continue
            for da, db in zip(la, lb):
                if self.dim_size[da] == self.dim_size[db] and self.dim_size[da] > 1:
                    self.edges_a.append(da)
                    self.edges_b.append(db)
                    self.edges_node.append(self.current_node)

    def link_called(self, inst: Instruction, instance: int, per_operand: list[list[list[int]]],
                    result_leaves: list[list[int]]) -> None:
        """Instantiate the computations `inst` calls and link them to its operands and results
        (the links are recorded as the call site's, `current_node`)."""
        names = [(key, n) for key in _INSTANTIATED_KEYS[inst.opcode] if key in inst.attrs for n in _names(inst.attrs[key])]
        operand_leaves = [leaf for leaves in per_operand for leaf in leaves]
        for branch, (key, name) in enumerate(names):
            callee = self.module.by_name.get(name)
            if callee is None:
                log.warning("%s calls unknown computation %s; ignored", inst.name, name)
                continue
            call_node = self.current_node
            cdims = self.instantiate(callee, parent=instance, call_site=inst.name)
            self.current_node = call_node
            params = [cdims[p.name] for p in callee.parameters]
            root = cdims[callee.root.name]
            if inst.opcode == "conditional":
                # operand 0 is the predicate / branch index; operand k+1 feeds branch k
                if branch + 1 < len(per_operand) and params:
                    self.link(per_operand[branch + 1], params[0])
                self.link(root, result_leaves)
            elif inst.opcode == "while":
                if params:
                    self.link(operand_leaves, params[0])
                if key == "body":
                    self.link(root, result_leaves)
            else:
                for ops, par in zip(per_operand, params):
                    self.link(ops, par)
                if inst.opcode != "async-start":
                    self.link(root, result_leaves)

    # -- constraints ----------------------------------------------------------------------------
    def constraints(self, labels: np.ndarray) -> GroupConstraints:
        n_groups = int(labels.max()) + 1 if len(labels) else 0
        sizes = np.asarray(self.dim_size, dtype=np.int64)
        eff = np.asarray(self.dim_eff, dtype=np.int64)
        gcd_eff = np.zeros(n_groups, dtype=np.int64)
        gcd_full = np.zeros(n_groups, dtype=np.int64)
        np.gcd.at(gcd_eff, labels, eff)
        np.gcd.at(gcd_full, labels, sizes)

        def first_node(records: Iterable[tuple[int, int]]) -> np.ndarray:
            out = np.full(n_groups, -1, dtype=np.int32)
            for node, dim in records:
                g = labels[dim]
                if out[g] < 0:
                    out[g] = node
            return out

        nr_node = first_node(self.nr)
        compound_node = np.full(n_groups, -1, dtype=np.int32)
        compound_dim = np.full(n_groups, -1, dtype=np.int64)
        for node, rep, dim in self.compound:
            g = labels[rep]
            if compound_node[g] < 0:
                compound_node[g] = node
                compound_dim[g] = dim
        self_node = np.full(n_groups, -1, dtype=np.int32)
        pair_node: dict[tuple[int, int], int] = {}
        seen_units: set[tuple[int, ...]] = set()
        for node, reps in self.units:
            groups = tuple(sorted(int(labels[d]) for d in reps))
            if groups in seen_units:
                continue
            seen_units.add(groups)
            for i in range(len(groups)):
                for j in range(i + 1, len(groups)):
                    gi, gj = groups[i], groups[j]
                    if gi == gj:
                        if self_node[gi] < 0:
                            self_node[gi] = node
                    elif (gi, gj) not in pair_node:
                        pair_node[(gi, gj)] = node
        pairs = np.asarray(list(pair_node), dtype=np.int32).reshape(-1, 2)
        return GroupConstraints(
            gcd_effective=gcd_eff,
            gcd_full=gcd_full,
            need_replication_node=nr_node,
            self_conflict_node=self_node,
            compound_node=compound_node,
            compound_dim=compound_dim,
            pairs=pairs,
            pair_node=np.asarray(list(pair_node.values()), dtype=np.int32),
        )


#: Sources whose value the program itself defines: free in any sharding.
_FREE_SOURCES = frozenset({"constant", "iota"})

#: Opcodes whose result is never constant-derived: inputs, randomness and device ids (the
#: table's other sources, but for get-dimension-size, which follows its operand), values from
#: other devices (collectives, received data), and opaque calls.
_NEVER_FREE = opcode_names(
    lambda op: (op.source and op.name not in _FREE_SOURCES | {"get-dimension-size"})
    or op.collective
    or op.calls is CallContext.CONTROL_FLOW
) | {"fusion", "custom-call", "recv-done"}


def _free_leaves(inst: Instruction, free: Mapping[str, list[bool]]) -> list[bool]:
    """Per result leaf: is it computed from constants only (constant, iota and anything built
    from them: the broadcast zeros JAX shares between users, causal masks...)? Such a tensor
    costs nothing to produce in any sharding, so it is not a reason to link its users."""
    shape = inst.shape
    n_leaves = sum(1 for _ in shape.leaves()) if shape.is_tuple else 1
    if inst.opcode in _FREE_SOURCES:
        return [True] * n_leaves
    if inst.opcode in _NEVER_FREE or not inst.operands:
        return [False] * n_leaves
    operand_flags = [free.get(o) for o in inst.operands]
    if None in operand_flags:
        return [False] * n_leaves
    if inst.opcode == "tuple":
        return [x for f in operand_flags for x in f]  # type: ignore[union-attr]
    if inst.opcode == "get-tuple-element":
        flags = operand_flags[0] or []
        index = inst.tuple_index or 0
        return flags[index: index + n_leaves] if n_leaves == 1 else [all(flags)] * n_leaves
    return [all(all(f) for f in operand_flags)] * n_leaves  # type: ignore[union-attr]


def constant_derived(module: Module, computation: Computation | None = None,
                     memo: dict[str, dict[str, list[bool]]] | None = None) -> dict[str, list[bool]]:
    """Per instruction of `computation` (default the entry), per result leaf: is it computed from
    constants only (`_free_leaves`)? A `call` is read as inlined, as XLA inlines it: its leaves
    are its callee root's (a nested jit such as `jnp.where` returns, besides its result, the
    broadcast constants its derivative reads; they cost nothing to rebuild, so a cost model must
    not count them as activations kept for the backward pass). The callee's parameters count as
    not constant, whatever the call passes: a conservative answer that does not depend on the
    call site."""
    memo = {} if memo is None else memo
    comp = computation if computation is not None else module.entry
    if comp.name in memo:
        return memo[comp.name]
    free: dict[str, list[bool]] = {}
    for inst in comp.instructions:
        callee = inst.called_computations[0] if inst.opcode == "call" and inst.called_computations else None
        if callee is not None and callee in module.by_name:
            inner_comp = module.computation(callee)
            inner = constant_derived(module, inner_comp, memo)
            free[inst.name] = list(inner[inner_comp.root.name])
        else:
            free[inst.name] = _free_leaves(inst, free)
    memo[comp.name] = free
    return free


def _first_appearance_labels(labels: np.ndarray) -> np.ndarray:
    """Renumber component labels in order of their first dim, so group ids are deterministic."""
    if len(labels) == 0:
        return labels
    _, first = np.unique(labels, return_index=True)
    order = np.argsort(first)
    remap = np.empty_like(order)
    remap[order] = np.arange(len(order))
    return remap[labels]


def _names(text: str) -> list[str]:
    text = text.strip()
    if text.startswith("{"):
        text = text[1:-1]
    return [p.strip().lstrip("%") for p in text.split(",") if p.strip()]


