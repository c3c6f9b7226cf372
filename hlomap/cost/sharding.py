"""What one plan array means for every tensor and instruction of a factor graph, per device.

The cost model needs, for a plan over a `FactorGraph`'s groups: into how many pieces each tensor
is split (its bytes per device), how many ways each instruction's work is split, which mesh axes
each sharded reduction factor sums over (an all-reduce of the partial result), and how often each
instruction runs (instructions in a while body run once per trip; instructions inside a fusion are
costed as part of the fusion, not on their own). `ShardedGraph` computes all of it once with numpy
and is then read by `hlomap.cost.estimate` and `hlomap.cost.memory`.

An instruction's work is split over the mesh axes that shard any dim of its result or any of its
sharded reduction factors. Operand dims need not be looked at: in a conflict-free plan every
operand dim that is not a reduction factor shares a factor (hence a group, hence a sharding) with
a result dim. Constant-derived operands are the exception (they are not linked, see
`hlomap.propagation.graph`) and cost nothing to materialize in whatever sharding is wanted.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from hlomap.cost.compute import (MATRIX_OPCODES, MatrixSides, curve_kind, folds_into_product, matrix_sides,
                                 narrow_factor, while_trip_count)
from hlomap.cost.devices import DeviceSpec
from hlomap.hlo.capture import Phase, Role, instruction_phase
from hlomap.hlo.ir import Instruction
from hlomap.hlo.opcodes import CallContext, opcode_names
from hlomap.propagation.conflicts import MeshAxes
from hlomap.propagation.graph import FactorGraph

log = logging.getLogger(__name__)

#: Opcodes whose work is that of the computations they call; those computations' instructions are
#: nodes of the graph (instantiated per call site) and are costed there.
CONTAINER_OPCODES = opcode_names(lambda op: op.calls is CallContext.CONTROL_FLOW)


class PartialResult(NamedTuple):
    """A node whose sharded reduction factors leave partial results (summed, maxed...) over the
    mesh axes in `axes` (major to minor, mesh order); `groups` are the reduced factor groups.
    `gradient_sync`: a backward instruction summing over a dim of a data input (the batch): the
    data-parallel gradient all-reduce."""

    node: int
    axes: tuple[str, ...]
    groups: tuple[int, ...]
    gradient_sync: bool


@dataclass(frozen=True, eq=False)
class GraphFacts:
    """What the cost model reads off a graph independently of any plan, computed once per graph
    (`GraphFacts.of(graph)`) and shared by every `ShardedGraph` built on it."""

    node_count: np.ndarray  # executions per step (0 inside fusions), see `node_run_counts`
    phases: tuple[Phase, ...]  # per node, see `node_phases`
    data_groups: frozenset[int]  # groups holding a dim of a DATA entry parameter
    tensor_full_bytes: np.ndarray  # unsharded bytes of every tensor
    tensor_full_elements: np.ndarray  # unsharded elements of every tensor
    instance_index: tuple[Mapping[str, int], ...]  # per instance: instruction name -> node id
    # plan-independent results memoized by their readers (`cost.memory.fused_nodes` per fusion mode)
    memo: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, graph: FactorGraph) -> GraphFacts:
        """The graph's facts, computed once per graph (kept while the graph lives): every caller
        building plans on one graph shares them and what their `memo` keeps."""
        found = _FACTS.get(graph)
        if found is None:
            found = _FACTS[graph] = cls._of(graph)
        return found

    @classmethod
    def _of(cls, graph: FactorGraph) -> GraphFacts:
        full = np.zeros(graph.num_tensors, dtype=np.float64)
        elements = np.zeros(graph.num_tensors, dtype=np.float64)
        index: list[dict[str, int]] = [{} for _ in graph.instances]
        for n, node in enumerate(graph.nodes):
            index[node.instance][node.instruction.name] = n
            first, count = graph.node_tensors[n]
            for k, leaf in enumerate(node.instruction.shape.leaves()):
                if k < count:
                    full[first + k] = leaf.byte_size
                    elements[first + k] = leaf.num_elements
        return cls(node_run_counts(graph), node_phases(graph), frozenset(_data_groups(graph)), full, elements,
                   tuple(index))

    def operand_edges(self, graph: FactorGraph) -> tuple[np.ndarray, np.ndarray]:
        """(node, operand node) of every distinct operand read within one instance, by node then
        operand order (memoized). An operand named twice (`multiply(x, x)`) is one edge: the
        kernel reads it once."""
        key = ("operand edges",)
        if key not in self.memo:
            source: list[int] = []
            operand: list[int] = []
            for n, node in enumerate(graph.nodes):
                index = self.instance_index[node.instance]
                for name in dict.fromkeys(node.instruction.operands):
                    o = index.get(name)
                    if o is not None:
                        source.append(n)
                        operand.append(o)
            self.memo[key] = (np.asarray(source, dtype=np.int64), np.asarray(operand, dtype=np.int64))
        return self.memo[key]


_FACTS: weakref.WeakKeyDictionary[FactorGraph, GraphFacts] = weakref.WeakKeyDictionary()


@dataclass(frozen=True, eq=False)
class ShardedGraph:
    """A plan array applied to a factor graph. Build with `ShardedGraph.build(graph, plan, axes)`.

    Arrays (numpy, read-only by convention):
    - `dim_option[d]`: option index of dim d, or -1;
    - `tensor_degree[t]`: number of pieces tensor t is split into (1 = replicated);
    - `node_degree[n]`: number of ways instruction n's work is split;
    - `node_count[n]`: how many times node n runs per step (while trip counts multiplied up its
      call chain), 0 for nodes costed as part of an enclosing fusion;
    - `node_axes[n]`: the mesh axes splitting node n's work (a tuple of names, mesh order).
    """

    graph: FactorGraph
    axes: MeshAxes
    plan: np.ndarray
    dim_option: np.ndarray
    tensor_degree: np.ndarray
    node_degree: np.ndarray
    node_count: np.ndarray
    split_pairs: np.ndarray  # [k, 2]: (node, option) pairs splitting a node's work
    partials: tuple[PartialResult, ...]
    facts: GraphFacts

    @classmethod
    def build(cls, graph: FactorGraph, plan: np.ndarray, axes: MeshAxes,
              facts: GraphFacts | None = None) -> ShardedGraph:
        """Apply `plan` to `graph`. `facts`: the graph's `GraphFacts` (default `GraphFacts.of(graph)`,
        kept per graph, so plans built on one graph share them either way)."""
        facts = facts if facts is not None else GraphFacts.of(graph)
        plan = np.asarray(plan).astype(np.int64)
        if plan.shape != (graph.num_groups,):
            raise ValueError(f"plan array has shape {plan.shape}; the graph of {graph.module.name} has "
                             f"{graph.num_groups} groups")
        if plan.size and (plan.max() >= len(axes.options) or plan.min() < -1):
            raise ValueError(f"plan array holds option {int(plan.max())} but the mesh has only "
                             f"{len(axes.options)} options {axes.options}")
        sizes = np.concatenate([[1], axes.option_sizes]).astype(np.int64)  # index option + 1
        # constant-derived dims take their consumer's sharding (XLA materializes them that way)
        dim_option = plan[getattr(graph, "sharding_group_of_dim", graph.group_of_dim)]
        dim_div = sizes[dim_option + 1]
        tensor_degree = np.ones(graph.num_tensors, dtype=np.int64)
        np.multiply.at(tensor_degree, graph.dim_tensor, dim_div)

        # (node, option) pairs that split a node's work: sharded result dims, sharded reductions
        n_nodes = len(graph.nodes)
        dim_node = graph.tensor_node[graph.dim_tensor].astype(np.int64)
        sharded = dim_option >= 0
        pair_node = [dim_node[sharded]]
        pair_opt = [dim_option[sharded]]
        red = graph.reductions
        red_opt = plan[red.group] if len(red.group) else np.zeros(0, dtype=np.int64)
        hit = red_opt >= 0
        pair_node.append(red.node[hit].astype(np.int64))
        pair_opt.append(red_opt[hit])
        pairs = np.unique(np.stack([np.concatenate(pair_node), np.concatenate(pair_opt)], axis=1), axis=0) \
            if sum(len(p) for p in pair_node) else np.zeros((0, 2), dtype=np.int64)
        node_degree = np.ones(n_nodes, dtype=np.int64)
        np.multiply.at(node_degree, pairs[:, 0], sizes[pairs[:, 1] + 1])
        by_node: dict[int, tuple[set[str], set[int]]] = {}
        for i in np.flatnonzero(hit):
            node = int(red.node[i])
            entry = by_node.setdefault(node, (set(), set()))
            entry[0].update(axes.options[int(red_opt[i])])
            entry[1].add(int(red.group[i]))
        partials = tuple(
            PartialResult(n, _in_mesh_order(a, axes), tuple(sorted(gs)),
                          bool(gs & facts.data_groups) and facts.phases[n] is Phase.BACKWARD)
            for n, (a, gs) in sorted(by_node.items()))
        return cls(graph, axes, plan, dim_option, tensor_degree, node_degree, facts.node_count, pairs, partials,
                   facts)

    @cached_property
    def node_axes(self) -> tuple[tuple[str, ...], ...]:
        """Per node, the mesh axes splitting its work (mesh order)."""
        sets: list[set[str]] = [set() for _ in self.graph.nodes]
        for node, opt in self.split_pairs.tolist():
            sets[node].update(self.axes.options[opt])
        return tuple(_in_mesh_order(s, self.axes) for s in sets)

    # -- per tensor and node ----------------------------------------------------------------------
    @cached_property
    def tensor_bytes_all(self) -> np.ndarray:
        """Per-device bytes of every tensor (float64 [T])."""
        return self.facts.tensor_full_bytes / self.tensor_degree

    @cached_property
    def node_bytes_all(self) -> np.ndarray:
        """Per-device bytes of all result leaves of every node (float64 [N])."""
        return np.bincount(self.graph.tensor_node, weights=self.tensor_bytes_all, minlength=len(self.graph.nodes))

    @cached_property
    def node_elements_all(self) -> np.ndarray:
        """Per-device elements of all result leaves of every node (float64 [N])."""
        return np.bincount(self.graph.tensor_node, weights=self.facts.tensor_full_elements / self.tensor_degree,
                           minlength=len(self.graph.nodes))

    def node_result_bytes(self, node: int) -> float:
        """Per-device bytes of all result leaves of `node`."""
        first, count = self.graph.node_tensors[node]
        return float(self.tensor_bytes_all[first: first + count].sum())

    def node_operand_nodes(self, node: int) -> tuple[int, ...]:
        """Node ids of the operands of `node` (same instance), in operand order."""
        n = self.graph.nodes[node]
        index = self.facts.instance_index[n.instance]
        return tuple(index[name] for name in n.instruction.operands if name in index)

    def transposed_product(self, node: int) -> int:
        """The dot whose product `node` transposes where XLA folds the transpose into the dot
        (`compute.folds_into_product`), when `node` executes; else -1. Such a transpose runs only
        where a plan all-reduces that dot's result first (`hlomap.cost.estimate`)."""
        n = self.graph.nodes[node]
        comp = self.graph.module.computation(n.computation)
        if int(self.node_count[node]) == 0 or not folds_into_product(n.instruction, comp):
            return -1
        return self.facts.instance_index[n.instance][n.instruction.operands[0]]

    def node_block_dims(self, node: int) -> np.ndarray:
        """The dims of one device's block of `node`'s (first) result."""
        dims = self.graph.tensor_dims(self.graph.node_tensors[node][0])
        sizes = np.concatenate([[1], self.axes.option_sizes]).astype(np.int64)
        return self.graph.dim_size[dims] // sizes[self.dim_option[dims] + 1]

    def groups_split(self, groups: np.ndarray) -> int:
        """How many ways the plan splits the product of `groups` (each mesh option once)."""
        options = {int(o) for o in self.plan[groups] if o >= 0}
        return int(np.prod([self.axes.option_sizes[o] for o in options])) if options else 1

    def narrow_slowdown(self, node: int, device: DeviceSpec, cache: dict[Any, Any]) -> float:
        """How much slower than its whole-result price per split way `node` (a dot or convolution)
        runs on each device, its block being a narrower matrix product (`DeviceSpec.narrow`,
        read at the block's sides and the contraction's split); 1 for other nodes and on devices
        without a narrow curve. `cache` keeps what does not depend on the plan, per node."""
        inst = self.graph.nodes[node].instruction
        if inst.opcode not in MATRIX_OPCODES or not device.narrow:
            return 1.0
        key = ("narrow", node, inst.name, device)  # node ids are per graph; names guard a shared cache
        if key not in cache:
            cache[key] = _matrix_facts(self.graph, node, device)
        facts = cache[key]
        if facts is None:
            return 1.0
        kind, sides, whole, reduced = facts
        block = device.narrow_factor(kind, sides.width(self.node_block_dims(node), self.groups_split(reduced)))
        return whole / block

    def instance_index(self, instance: int) -> Mapping[str, int]:
        """Instruction name -> node id within one computation instance."""
        return self.facts.instance_index[instance]

    def parameter_bytes(self, index: int) -> float:
        """Per-device bytes of entry parameter `index`."""
        return float(self.tensor_bytes_all[self.graph.entry_parameter_tensors[index]])


def _matrix_facts(graph: FactorGraph, node: int,
                  device: DeviceSpec) -> tuple[str, MatrixSides, float, np.ndarray] | None:
    """A matrix node's curve on `device` (`compute.curve_kind`), its sides, its whole result's
    narrow factor and the groups of its contracted dims (`ShardedGraph.narrow_slowdown`); None
    for a product without a curve or known sides."""
    inst = graph.nodes[node].instruction
    comp = graph.module.computation(graph.nodes[node].computation)
    kind = curve_kind(inst, comp, device)
    sides = matrix_sides(inst, comp) if kind is not None else None
    if kind is None or sides is None:
        return None
    # the factor the whole result's price already carries (`compute.narrow_factor`)
    return kind, sides, narrow_factor(inst, comp, device), graph.reductions.group[graph.reductions.node == node]


def node_phases(graph: FactorGraph) -> tuple[Phase, ...]:
    """The phase (forward, backward, update) of every node. JAX names the ops inside a nested jit
    relative to that jit, so a node in a called computation takes the phase of its entry-level
    call site unless that says nothing (then its own)."""
    site_phase: list[Phase] = []
    for instance in graph.instances:
        if instance.parent < 0:
            site_phase.append(Phase.UNKNOWN)
        elif instance.parent == 0:
            caller = graph.module.computation(graph.instances[0].computation)[instance.call_site]
            site_phase.append(instruction_phase(caller))
        else:
            site_phase.append(site_phase[instance.parent])
    out = []
    for n in graph.nodes:
        site = site_phase[n.instance]
        out.append(site if site in (Phase.FORWARD, Phase.BACKWARD) else instruction_phase(n.instruction))
    return tuple(out)


def _data_groups(graph: FactorGraph) -> set[int]:
    """Groups holding a dim of a DATA entry parameter."""
    out: set[int] = set()
    for p in graph.with_role(Role.DATA):
        if p.index < len(graph.entry_parameter_tensors):
            out.update(graph.parameter_groups(p.index))
    return out


def _in_mesh_order(names: set[str] | Sequence[str], axes: MeshAxes) -> tuple[str, ...]:
    wanted = set(names)
    return tuple(a for a in axes.names if a in wanted)


def node_run_counts(graph: FactorGraph) -> np.ndarray:
    """How many times each node runs per step: the product of the trip counts of the while loops
    up its call chain; 0 inside a fusion (the fusion instruction is the kernel that is costed)."""
    module = graph.module
    per_instance: list[int] = []
    for instance in graph.instances:
        if instance.parent < 0:
            per_instance.append(1)
            continue
        parent = graph.instances[instance.parent]
        parent_count = per_instance[instance.parent]
        comp = module.computation(parent.computation)
        caller: Instruction = comp[instance.call_site]
        if caller.opcode == "fusion" or parent_count == 0:
            per_instance.append(0)
        elif caller.opcode == "while":
            per_instance.append(parent_count * while_trip_count(caller, comp, module))
        else:
            per_instance.append(parent_count)
    counts = np.asarray([per_instance[n.instance] for n in graph.nodes], dtype=np.int64)
    return counts
