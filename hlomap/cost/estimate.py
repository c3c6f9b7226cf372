"""The estimate of one plan: per-device compute, the collectives the plan implies, memory, time.

    est = estimate(cap, plan_array, axes, cluster="B", axis_order=("model", "data"))
    # hlomap.api.estimate(cap, "megatron" | Plan, mesh=..., cluster=...) resolves plans first

What is counted, per device (see hlomap.cost.sharding for how a plan splits each instruction):
- compute: every instruction of the module (instantiated per call site, while bodies times their
  trip count) costed by `hlomap.cost.compute` unsharded, then split: FLOPs and compute time are
  divided by the instruction's sharding degree, bytes are the per-device shards of the operands
  it reads from memory and of the result it writes (a result fused into its consumers, see
  `hlomap.cost.memory.Fusion`, is neither written nor read back), and its time is the roofline
  max(compute, memory) with the device preset's efficiency factor; on host CPU devices of which
  fewer than the host's cores compute, the kernels XLA:CPU splits over threads run faster
  (`hlomap.cost.threads`);
- collectives: a sharded reduction factor (dot contracting dim, reduced dim, vocabulary-parallel
  gather, additive scatter) leaves partial results that are all-reduced over the mesh axes it is
  sharded on ("partial sum of dot.12 over model"); when the summed dim is the batch of a data
  input in the backward pass that all-reduce is the data-parallel *gradient sync*, and the syncs
  over one set of axes run as one combined all-reduce (latency paid once). A reduce whose
  combiner is not one elementwise op (argmax, top-k's variadic reduces) cannot be all-reduced: its
  operands are all-gathered along the sharded dims first (a *reshard*), then it runs unsplit on
  that axis. In a conflict-free plan these are the only collectives: every pair of dims that one
  instruction ties together shares a group, hence a sharding. Times come from
  `hlomap.cost.collectives` over the device groups of each mesh axis (`hlomap.cost.mapping`);
- memory: `hlomap.cost.memory` (parameters, optimizer state, gradients, peak activations);
- optimizer state sharded over the data axes (`ShardedState`, ZeRO-1, `hlomap.cost.zero`): the
  sharded leaves' bytes divided by the axes' size, and an all-gather of each parameter whose
  update runs split; a state that lists trainable parameters too (FSDP / ZeRO-3) keeps them at
  their share as well and gathers them before their use instead of after the update.

Overlap: by default none (`Overlap.NONE`): step time = compute + all communication, which is
what XLA's single combined gradient all-reduce at the end of the backward pass gives.
`Overlap.GRADIENT_SYNC` hides gradient-sync time behind backward compute (DDP-style buckets):
exposed = other communication + max(0, gradient sync - backward compute).
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from hlomap.cost.cluster import Cluster, busy_speedup, load_cluster, sped_up
from hlomap.cost.collectives import Collective, collective_time
from hlomap.cost.compute import (MATRIX_OPCODES, CostCache, curve_kind, emits_no_kernel, kept_instruction_cost,
                                 transposed_product_cost)
from hlomap.cost.devices import DeviceSpec
from hlomap.cost.mapping import AxisMapping, axis_devices as map_axes
from hlomap.cost.measured import MeasuredCosts
from hlomap.cost.memory import Fusion, MemoryEstimate, donated_parameters, estimate_memory, fused_nodes
from hlomap.cost.sharding import CONTAINER_OPCODES, PartialResult, ShardedGraph
from hlomap.cost.threads import SPLIT_OPCODES, parallel_tasks, split_speedup
from hlomap.cost.zero import StateShard, gathered_parameters
from hlomap.hlo.capture import Capture, Phase, Role
from hlomap.hlo.ir import Computation, Instruction, Module
from hlomap.propagation.conflicts import REPLICATED, ConflictChecker, MeshAxes, PlanConflict
from hlomap.propagation.graph import FactorGraph, Node

log = logging.getLogger(__name__)


class EstimateError(ValueError):
    """A plan, mesh or axis mapping that cannot be estimated (the message says which and why)."""


class Reason(enum.Enum):
    """Why a collective is needed."""

    PARTIAL = "partial reduction"
    GRADIENT_SYNC = "gradient sync"
    RESHARD = "reshard"
    SHARDED_STATE = "sharded optimizer state"
    SHARDED_PARAMETERS = "sharded parameters"


class Overlap(enum.Enum):
    """What communication is assumed to hide behind compute."""

    NONE = "none"
    GRADIENT_SYNC = "gradient-sync"


#: Combiners an all-reduce can apply (a reduce whose to_apply root is one of these, on scalars).
ALL_REDUCIBLE = frozenset({"add", "maximum", "minimum", "multiply", "and", "or", "xor"})
_COMBINER_WORD = {"add": "sum", "maximum": "max", "minimum": "min", "multiply": "product",
                  "and": "and", "or": "or", "xor": "xor"}


@dataclass(frozen=True)
class CollectiveEstimate:
    """One collective per device: `nbytes` is its per-device result (for an all-gather the
    gathered output), `seconds` one execution, `count` executions per step."""

    kind: Collective
    axes: tuple[str, ...]
    group_size: int
    nbytes: float
    seconds: float
    instruction: str
    computation: str
    reason: Reason
    detail: str
    phase: Phase
    count: int = 1

    @property
    def total_seconds(self) -> float:
        return self.seconds * self.count

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "axes": list(self.axes), "group_size": self.group_size,
                "bytes": self.nbytes, "seconds": self.seconds, "count": self.count,
                "instruction": self.instruction, "computation": self.computation,
                "reason": self.reason.value, "detail": self.detail, "phase": self.phase.value}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, where: str = "collective") -> CollectiveEstimate:
        """Inverse of `to_json` (a plan's saved estimate); errors name `where` and the field."""
        try:
            return cls(Collective(data["kind"]), tuple(str(a) for a in data["axes"]), int(data["group_size"]),
                       float(data["bytes"]), float(data["seconds"]), str(data["instruction"]),
                       str(data["computation"]), Reason(data["reason"]), str(data["detail"]),
                       Phase(data["phase"]), int(data.get("count", 1)))
        except KeyError as err:
            raise EstimateError(f"{where}: missing field {err.args[0]!r}") from None
        except (TypeError, ValueError) as err:
            raise EstimateError(f"{where}: {err}") from None


class CommunicationTerm(NamedTuple):
    """Collective `kind` of `nbytes` run `count` times per step at once over every device group
    of the mesh `axes` (`AxisMapping.groups(axes)`)."""

    kind: Collective
    axes: tuple[str, ...]
    nbytes: float
    count: int


@dataclass(frozen=True)
class InstructionEstimate:
    """One instruction's work on one device per step (all executions summed)."""

    name: str
    computation: str
    opcode: str
    phase: Phase
    degree: int  # ways its work is split
    count: int  # executions per step
    flops: float
    transcendentals: float
    bytes_accessed: float
    compute_seconds: float
    memory_seconds: float
    seconds: float
    instance: int = 0  # the graph's instance of its computation (one per call site; 0 the entry)


class KindRow(NamedTuple):
    """Totals per opcode (compute) or per collective kind (communication)."""

    kind: str
    count: int
    flops: float
    nbytes: float
    seconds: float


@dataclass(frozen=True)
class StepEstimate:
    """The estimate of one training step under one plan; every figure is per device."""

    plan: str
    mesh: tuple[tuple[str, int], ...]
    cluster: str
    device: str
    overlap: Overlap
    compute_seconds: float
    communication_seconds: float
    exposed_communication_seconds: float
    flops: float  # instructions plus the local reductions of all-reduces (XLA counts those)
    collectives: tuple[CollectiveEstimate, ...]
    instructions: tuple[InstructionEstimate, ...]
    memory: MemoryEstimate
    dispatch_seconds: float = 0.0  # launching the step's program (a measured cluster's; else 0)

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.exposed_communication_seconds + self.dispatch_seconds

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def by_kind(self) -> tuple[KindRow, ...]:
        """Compute per opcode, then communication per collective kind, slowest first."""
        rows: dict[str, list[float]] = {}
        for i in self.instructions:
            r = rows.setdefault(i.opcode, [0, 0.0, 0.0, 0.0])
            r[0] += i.count
            r[1] += i.flops
            r[2] += i.bytes_accessed
            r[3] += i.seconds
        compute = sorted((KindRow(k, int(v[0]), v[1], v[2], v[3]) for k, v in rows.items()),
                         key=lambda r: -r.seconds)
        comm: dict[str, list[float]] = {}
        for c in self.collectives:
            r = comm.setdefault(c.kind.value, [0, 0.0, 0.0, 0.0])
            r[0] += c.count
            r[2] += c.nbytes * c.count
            r[3] += c.total_seconds
        communication = sorted((KindRow(k, int(v[0]), 0.0, v[2], v[3]) for k, v in comm.items()),
                               key=lambda r: -r.seconds)
        return tuple(compute) + tuple(communication)

    def collective_bytes(self) -> dict[Collective, float]:
        out: dict[Collective, float] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0.0) + c.nbytes * c.count
        return out

    def to_json(self) -> dict[str, Any]:
        """A summary for `Plan.estimate` (no per-instruction rows)."""
        return {
            "plan": self.plan, "mesh": dict(self.mesh), "cluster": self.cluster, "device": self.device,
            "overlap": self.overlap.value, "step_seconds": self.step_seconds,
            "compute_seconds": self.compute_seconds, "communication_seconds": self.communication_seconds,
            "exposed_communication_seconds": self.exposed_communication_seconds,
            "dispatch_seconds": self.dispatch_seconds, "flops": self.flops,
            "collectives": [c.to_json() for c in self.collectives],
            "by_kind": [r._asdict() for r in self.by_kind()],
            "memory": self.memory.to_json(),
        }


# ---------------------------------------------------------------------------------------------
# Resolving the plan, the mesh and the devices
# ---------------------------------------------------------------------------------------------


def _mapping(cluster: Cluster, axes: MeshAxes, devices: AxisMapping | None,
             order: Sequence[str] | None) -> AxisMapping:
    if devices is not None:
        if dict(devices.axes) != axes.mesh_shape:
            raise EstimateError(f"axis_devices maps mesh {dict(devices.axes)} but the plan's mesh is {axes.mesh_shape}")
        devices.check_fits(cluster)
        return devices
    return map_axes(cluster, axes.mesh_shape, order=order)


# ---------------------------------------------------------------------------------------------
# Compute
# ---------------------------------------------------------------------------------------------


def _combiner(inst: Instruction, module: Module) -> str | None:
    """The elementwise op a single-input reduce applies (None for variadic or odd reducers)."""
    name = (inst.attr("to_apply") or "").strip().lstrip("%")
    if name not in module.by_name or len(inst.operands) != 2:
        return None
    root = module.computation(name).root
    return root.opcode if root.opcode in ALL_REDUCIBLE else None


def _gathered_axes(sg: ShardedGraph) -> dict[int, tuple[str, ...]]:
    """Nodes whose partial results cannot be all-reduced (their operands are all-gathered)."""
    module = sg.graph.module
    out: dict[int, tuple[str, ...]] = {}
    for pr in sg.partials:
        inst = sg.graph.nodes[pr.node].instruction
        if inst.opcode == "reduce" and _combiner(inst, module) is None:
            out[pr.node] = pr.axes
    return out


def _runs(inst: Instruction, comp: Computation, count: int) -> bool:
    """Whether an instruction does work of its own (not a container, no kernel, executed)."""
    return count > 0 and inst.opcode not in CONTAINER_OPCODES and not emits_no_kernel(inst, comp)


def kernel_count(sg: ShardedGraph, fusion: Fusion = Fusion.ELEMENTWISE) -> int:
    """The kernels one step launches as this model counts them: every executed instruction that
    does work and is not fused into its consumer. A calibration divides a program's launch cost
    by this count (not by the kernels XLA happens to emit), so that the measured cost per kernel
    is priced back on exactly what it was fitted to."""
    fused = fused_nodes(sg, fusion)
    module = sg.graph.module
    reduced = frozenset(_all_reduced_nodes(sg, _gathered_axes(sg)).tolist())

    def launches(n: int, node: Node) -> bool:
        product = sg.transposed_product(n)
        if product >= 0:  # runs only after its product's all-reduce
            return product in reduced
        return _runs(node.instruction, module.computation(node.computation), int(sg.node_count[n]))

    return sum(int(sg.node_count[n]) for n, node in enumerate(sg.graph.nodes) if n not in fused and launches(n, node))


def launched_kernels(cap: Capture, fusion: Fusion = Fusion.ELEMENTWISE) -> int:
    """`kernel_count` of `cap`'s step run whole on one device."""
    graph = FactorGraph.from_capture(cap)
    axes = MeshAxes.from_mesh({"data": 1})
    return kernel_count(ShardedGraph.build(graph, np.full(graph.num_groups, REPLICATED, dtype=np.intp), axes), fusion)


def residual_buffers(module: Module) -> int:
    """The buffers a step's forward keeps for its backward, as the HLO shows them: every value
    made in the forward (`Phase.FORWARD`, a constant aside) that a backward instruction of the
    same computation reads, and every entry parameter a backward instruction reads (a weight the
    input gradient multiplies by). JAX's `vjp` keeps about these: 633 leaves for resnet50-tiny
    where this counts 580, 118 for bert-tiny where it counts 106."""
    from hlomap.hlo.capture import instruction_phase

    count = 0
    for computation in module.computations:
        backward_reads: set[str] = set()
        for inst in computation.instructions:
            if instruction_phase(inst) is Phase.BACKWARD:
                backward_reads.update(inst.operands)
        for inst in computation.instructions:
            if inst.name not in backward_reads or inst.opcode == "constant":
                continue
            if inst.opcode == "parameter":
                count += computation is module.entry  # a callee's parameter is its call site's operand
            elif instruction_phase(inst) is Phase.FORWARD:
                count += 1
    return count


def pass_buffers(cap: Capture) -> int:
    """Buffers the mpmd pipeline executor hands to and takes from its stage programs per
    microbatch, all stages together: each forward takes its stage's parameters and returns its
    residuals, each backward takes the residuals and returns the parameters' gradients, and
    each gradient is summed into an accumulator (two in, one out). So 5 per trainable
    parameter and 2 per residual, wherever the cuts fall (the sends and cotangents between
    stages are a handful). Every one of them costs the host time in each call
    (`MeasuredCosts.executor_buffers`): resnet50-tiny's ~2,000 per microbatch took more host
    time than its stages' compute on 8 CPU devices."""
    trainable = sum(1 for p in cap.parameters if p.role is Role.TRAINABLE)
    return 5 * trainable + 2 * residual_buffers(cap.module)


#: Roles of the entry parameters a pipeline executor keeps as the step's state (the parameters
#: and optimizer state pytrees, their integer leaves such as Adam's count included).
STATE_ROLES = frozenset({Role.TRAINABLE, Role.OPTIMIZER_STATE, Role.OTHER})


def state_leaves(cap: Capture) -> int:
    """Arrays of the step's state (its parameters and optimizer state) the spmd pipeline
    executor hands back as the user's pytrees after every step: it keeps the state packed in
    rows over its stage mesh and slices each leaf out onto its stage's devices, which costs the
    host time per leaf and device (`MeasuredCosts.executor_buffers`; gpt-tiny's 109 leaves took
    7.6 ms on two stages of four CPU devices, 3.9 ms on four stages of two)."""
    return sum(1 for p in cap.parameters if p.role in STATE_ROLES)


class InstructionArrays(NamedTuple):
    """The `InstructionEstimate`s of one plan as arrays, one entry per executed instruction in
    graph order (`node`: its graph node): what `step_arrays` returns for planners that sum
    instructions by the ten thousand, without building a row per instruction."""

    node: np.ndarray
    degree: np.ndarray
    count: np.ndarray
    flops: np.ndarray
    transcendentals: np.ndarray
    bytes_accessed: np.ndarray
    compute_seconds: np.ndarray
    memory_seconds: np.ndarray
    seconds: np.ndarray


class _Unsplit(NamedTuple):
    """Plan-independent facts of the executed nodes (graph order) on one device."""

    node: np.ndarray
    count: np.ndarray
    compute_seconds: np.ndarray
    flops: np.ndarray
    transcendentals: np.ndarray
    moves_bytes: np.ndarray  # the instruction reads or writes memory at all
    narrow: np.ndarray  # a dot or convolution the device has a narrow curve for (`curve_kind`)
    splittable: np.ndarray  # a kernel XLA:CPU may split over the host's threads (`threads.SPLIT_OPCODES`)
    matrix: np.ndarray  # a dot or convolution (`MATRIX_OPCODES`)
    # the dot a transpose of its product transposes (`ShardedGraph.transposed_product`), else -1: such a
    # transpose runs only when the plan all-reduces that dot's result (`_unfolded_transposes`)
    product: np.ndarray


def _unsplit(sg: ShardedGraph, device: DeviceSpec, cache: CostCache) -> _Unsplit:
    """Each executed node's cost unsplit on `device`, once per graph and device (`GraphFacts.memo`).
    The per-node costs also go through `cache`, as callers that estimate many plans of one module
    with one cache (and a fresh graph each time) expect."""
    key = ("unsplit", device)
    found = sg.facts.memo.get(key)
    if found is not None:
        return found
    g = sg.graph
    module = g.module
    nodes, rows = [], []
    for n, node in enumerate(g.nodes):
        inst = node.instruction
        count = int(sg.node_count[n])
        comp = module.computation(node.computation)
        product = sg.transposed_product(n)
        if product >= 0:
            full = transposed_product_cost(inst, comp, device)
        elif _runs(inst, comp, count):
            full = kept_instruction_cost(inst, comp, module, device, cache)
        else:
            continue
        nodes.append(n)
        rows.append((count, full.compute_seconds, full.flops, full.transcendentals, bool(full.bytes_accessed),
                     curve_kind(inst, comp, device) is not None, inst.opcode in SPLIT_OPCODES,
                     inst.opcode in MATRIX_OPCODES, product))
    columns = list(zip(*rows)) if rows else [()] * 9
    found = _Unsplit(np.asarray(nodes, dtype=np.int64), np.asarray(columns[0], dtype=np.int64),
                     *(np.asarray(c, dtype=np.float64) for c in columns[1:4]),
                     *(np.asarray(c, dtype=bool) for c in columns[4:8]), np.asarray(columns[8], dtype=np.int64))
    sg.facts.memo[key] = found
    return found


def _unfolded_transposes(sg: ShardedGraph, base: _Unsplit, gathered: Mapping[int, tuple[str, ...]]) -> np.ndarray:
    """Per `base` node, whether it runs in this plan: every node but a transpose of a product
    (`_Unsplit.product`) whose dot the plan does not all-reduce. XLA folds such a transpose into
    the product; once the product is all-reduced first (a weight gradient under data
    parallelism) the transpose runs after the all-reduce, a kernel of its own."""
    if not (base.product >= 0).any():
        return np.ones(len(base.node), dtype=bool)
    return (base.product < 0) | np.isin(base.product, _all_reduced_nodes(sg, gathered))


def _all_reduced_nodes(sg: ShardedGraph, gathered: Mapping[int, tuple[str, ...]]) -> np.ndarray:
    """The nodes whose partial results the plan all-reduces (split over more than one device, not
    gathered before)."""
    mesh = sg.axes.mesh_shape
    return np.asarray([pr.node for pr in sg.partials
                       if pr.node not in gathered and math.prod(mesh[a] for a in pr.axes) > 1], dtype=np.int64)


def _fused_mask(n_nodes: int, fused: frozenset[int]) -> np.ndarray:
    """Per graph node, whether it is in `fused`."""
    is_fused = np.zeros(n_nodes, dtype=bool)
    if fused:
        is_fused[np.fromiter(fused, dtype=np.int64, count=len(fused))] = True
    return is_fused


def _fused_edges(sg: ShardedGraph, fused: frozenset[int], is_fused: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (consumer, producer) operand edges whose producer is fused into its consumer (`fused`,
    as the mask `is_fused`): the edges of the kernels' trees. Once per graph."""
    key = ("fused_edges", fused)
    found = sg.facts.memo.get(key)
    if found is None:
        source, operand = sg.facts.operand_edges(sg.graph)
        keep = is_fused[operand]
        found = sg.facts.memo[key] = (source[keep], operand[keep])
    return found


def _kernel_totals(values: np.ndarray, consumer: np.ndarray, producer: np.ndarray) -> np.ndarray:
    """Per node, `values` (rows of per-node figures) summed over the kernel it ends: its own and
    those of the producers fused into it, through chains of them (a producer fused into several
    consumers counts in each, as XLA duplicates it)."""
    n_nodes = values.shape[1]
    totals = values
    for _ in range(n_nodes):  # one more level of fused producers per pass; chains are short
        grown = values + np.stack([np.bincount(consumer, weights=row[producer], minlength=n_nodes) for row in totals])
        if np.array_equal(grown, totals):
            break
        totals = grown
    return totals


def _kernel_spread(values: np.ndarray, consumer: np.ndarray, producer: np.ndarray) -> np.ndarray:
    """Per node, the largest of `values` over itself and the kernels it is fused into: a fused
    producer runs as part of its consumer's kernel."""
    spread = values
    for _ in range(len(values)):
        grown = spread.copy()
        np.maximum.at(grown, producer, spread[consumer])
        if np.array_equal(grown, spread):
            break
        spread = grown
    return spread


def _kernel_work(sg: ShardedGraph, base: _Unsplit, fused: frozenset[int], is_fused: np.ndarray, nbytes: np.ndarray,
                 degree: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per graph node, (bytes moved, flops, transcendentals) of the kernel it ends (`_kernel_totals`),
    and the fused (consumer, producer) edges. A kernel is a node not fused into its consumer with
    the producers fused into it."""
    n_nodes = len(sg.graph.nodes)
    consumer, producer = _fused_edges(sg, fused, is_fused)
    work = np.zeros((3, n_nodes))
    work[:, base.node] = (nbytes, base.flops / degree, base.transcendentals / degree)
    moved, flops, transcendentals = _kernel_totals(work, consumer, producer)
    return moved, flops, transcendentals, consumer, producer


def _split_speedups(sg: ShardedGraph, base: _Unsplit, fused: frozenset[int], is_fused: np.ndarray, nbytes: np.ndarray,
                    degree: np.ndarray, cores: int, spare_threads: float) -> np.ndarray:
    """Per executed node (`base.node` order), how much faster it runs because XLA:CPU splits its
    kernel over the host's threads and the device has `spare_threads` cores to itself
    (`hlomap.cost.threads`). A kernel splits when its root's opcode allows and by what the whole
    kernel moves and computes."""
    moved, flops, transcendentals, consumer, producer = _kernel_work(sg, base, fused, is_fused, nbytes, degree)
    roots = np.zeros(len(sg.graph.nodes), dtype=bool)
    roots[base.node] = base.splittable & ~is_fused[base.node]
    tasks = np.where(roots, parallel_tasks(moved, flops, transcendentals, cores), 1)
    return split_speedup(_kernel_spread(tasks, consumer, producer), spare_threads)[base.node]


def _alone_speedups(sg: ShardedGraph, base: _Unsplit, fused: frozenset[int], is_fused: np.ndarray, nbytes: np.ndarray,
                    degree: np.ndarray, measured: MeasuredCosts) -> np.ndarray:
    """Per executed node (`base.node` order), how much faster it runs on one device alone than
    with every device busy (`MeasuredCosts.alone_speedups`): a dot or convolution by its flops,
    any other node by the bytes its whole kernel moves (a fused producer as the kernel it runs in).
    The curves were timed as XLA runs the kernels alone, threads included."""
    moved, _, _, consumer, producer = _kernel_work(sg, base, fused, is_fused, nbytes, degree)
    by_bytes = np.ones(len(sg.graph.nodes))
    kernels = base.node[~is_fused[base.node]]
    by_bytes[kernels] = measured.alone_speedups(False, moved[kernels])
    by_bytes = _kernel_spread(by_bytes, consumer, producer)[base.node]
    by_flops = measured.alone_speedups(True, base.flops / degree)
    return np.where(base.matrix, by_flops, by_bytes)


def instruction_arrays(sg: ShardedGraph, device: DeviceSpec, gathered: Mapping[int, tuple[str, ...]],
                       fused: frozenset[int], cache: CostCache, kernel_seconds: float = 0.0, *, cores: int = 0,
                       spare_threads: float = 1.0, alone: MeasuredCosts | None = None) -> InstructionArrays:
    """Each executed instruction's cost on `device`; every kernel launched (an instruction not
    fused into its consumer) also costs `kernel_seconds`, a measured cluster's launch overhead.
    On host CPU devices (`cores` the host's) with `spare_threads` cores each to themselves, the
    kernels XLA:CPU splits over threads run that much faster (`hlomap.cost.threads`). With
    `alone` (a measured cluster whose one device computes alone, `MeasuredCosts.prices_alone`),
    `device` is the all-busy roofline and each kernel runs its own measured speedup faster
    instead (`_alone_speedups`)."""
    base = _unsplit(sg, device, cache)
    n_nodes = len(sg.graph.nodes)
    mesh = sg.axes.mesh_shape
    is_fused = _fused_mask(n_nodes, fused)
    # an instruction runs unsplit along the axes its operands were gathered on
    gather = np.ones(n_nodes, dtype=np.int64)
    for n, axes in gathered.items():
        gather[n] = math.prod(mesh[a] for a in axes)
    node = base.node
    degree = np.maximum(sg.node_degree[node] // gather[node], 1)
    # a fused kernel reads what its inputs left in memory and writes what it materializes
    result = sg.node_bytes_all
    source, operand = sg.facts.operand_edges(sg.graph)
    reads = np.bincount(source, weights=np.where(is_fused, 0.0, result)[operand], minlength=n_nodes)
    nbytes = np.where(base.moves_bytes,
                      reads[node] * gather[node] + np.where(is_fused[node], 0.0, result[node]), 0.0)
    compute = base.compute_seconds / degree
    for k in np.flatnonzero(base.narrow & (degree > 1)):  # a dot or convolution on a measured device
        compute[k] *= sg.narrow_slowdown(int(node[k]), device, cache)  # type: ignore[arg-type]
    memory = nbytes / device.hbm_bandwidth
    if alone is not None:
        faster = _alone_speedups(sg, base, fused, is_fused, nbytes, degree, alone)
        compute, memory = compute / faster, memory / faster
    elif spare_threads > 1.0 and cores > 1:
        faster = _split_speedups(sg, base, fused, is_fused, nbytes, degree, cores, spare_threads)
        compute, memory = compute / faster, memory / faster
    launch = np.where(is_fused[node], 0.0, kernel_seconds)
    count = base.count
    arrays = InstructionArrays(node, degree, count, base.flops / degree * count, base.transcendentals / degree * count,
                               nbytes * count, compute * count, memory * count,
                               (np.maximum(compute, memory) + launch) * count)
    runs = _unfolded_transposes(sg, base, gathered)
    return arrays if runs.all() else InstructionArrays(*(column[runs] for column in arrays))


def instruction_estimates(sg: ShardedGraph, arrays: InstructionArrays) -> list[InstructionEstimate]:
    """`arrays` as one `InstructionEstimate` per instruction (what reports list)."""
    nodes, phases = sg.graph.nodes, sg.facts.phases
    return [InstructionEstimate(nodes[n].instruction.name, nodes[n].computation, nodes[n].instruction.opcode,
                                phases[n], *row, nodes[n].instance)
            for n, *row in zip(arrays.node.tolist(), arrays.degree.tolist(), arrays.count.tolist(),
                               arrays.flops.tolist(), arrays.transcendentals.tolist(),
                               arrays.bytes_accessed.tolist(), arrays.compute_seconds.tolist(),
                               arrays.memory_seconds.tolist(), arrays.seconds.tolist())]


# ---------------------------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------------------------


def _collectives(sg: ShardedGraph, cluster: Cluster, mapping: AxisMapping,
                 gathered: Mapping[int, tuple[str, ...]]) -> tuple[list[CollectiveEstimate], float]:
    """The collectives of every partial result, and the flops of the all-reduces' local sums."""
    g = sg.graph
    module = g.module
    mesh = sg.axes.mesh_shape
    phases = sg.facts.phases
    out: list[CollectiveEstimate] = []
    reduce_flops = 0.0
    groups_cache: dict[tuple[str, ...], Any] = {}

    def groups(axes: tuple[str, ...]) -> Any:
        if axes not in groups_cache:
            groups_cache[axes] = mapping.groups(axes if len(axes) > 1 else axes[0])
        return groups_cache[axes]

    times: dict[tuple[Collective, tuple[str, ...], float], float] = {}

    def seconds_of(kind: Collective, axes: tuple[str, ...], nbytes: float) -> float:
        """`collective_time` of one collective, once per kind, axes and size (a layer's partial
        sums repeat in every layer)."""
        key = (kind, axes, nbytes)
        if key not in times:
            times[key] = collective_time(kind, cluster, groups(axes), nbytes)
        return times[key]

    for pr in sg.partials:
        node = g.nodes[pr.node]
        inst = node.instruction
        count = int(sg.node_count[pr.node])
        if count == 0:
            continue
        size = math.prod(mesh[a] for a in pr.axes)
        if size == 1:
            continue  # split over one device is no split: nothing to all-reduce, no local sums
        where = ",".join(pr.axes)
        phase = phases[pr.node]
        if pr.node in gathered:
            # After the gather each input is split only by the instruction's other axes (a
            # constant-derived input such as argmax's iota is materialized that way too).
            comp = module.computation(node.computation)
            remaining = max(1, int(sg.node_degree[pr.node]) // size)
            for k, operand in enumerate(inst.operands[: len(inst.operands) // 2]):
                nbytes = comp[operand].shape.byte_size / remaining
                seconds = seconds_of(Collective.ALL_GATHER, pr.axes, nbytes)
                out.append(CollectiveEstimate(
                    Collective.ALL_GATHER, pr.axes, size, nbytes, seconds, inst.name, node.computation,
                    Reason.RESHARD,
                    f"all-gather operand {k} of {inst.name} over {where}: its reducer is not one elementwise op, "
                    f"so partial results cannot be all-reduced", phase, count))
            continue
        nbytes = sg.node_result_bytes(pr.node)
        seconds = seconds_of(Collective.ALL_REDUCE, pr.axes, nbytes)
        reduce_flops += float(sg.node_elements_all[pr.node]) * count
        out.append(CollectiveEstimate(
            Collective.ALL_REDUCE, pr.axes, size, nbytes, seconds, inst.name, node.computation,
            Reason.GRADIENT_SYNC if pr.gradient_sync else Reason.PARTIAL,
            _detail(pr, inst, module, where), phase, count))
    return _combine_buckets(out, cluster, groups), reduce_flops


#: Collectives XLA combines into one per set of axes (its all-reduce and all-gather combiners,
#: DDP's buckets): the gradient sync, and the all-gathers of parameters updated in slices.
_COMBINED = {Reason.GRADIENT_SYNC: Collective.ALL_REDUCE, Reason.SHARDED_STATE: Collective.ALL_GATHER,
             Reason.SHARDED_PARAMETERS: Collective.ALL_GATHER}


def _bucketed(c: CollectiveEstimate) -> bool:
    return c.reason in _COMBINED and c.count == 1


def _buckets(collectives: Sequence[CollectiveEstimate]) -> dict[tuple[Collective, tuple[str, ...]], float]:
    """Bytes of each combined collective: (kind, axes) -> the sum of its buffers."""
    buckets: dict[tuple[Collective, tuple[str, ...]], float] = {}
    for c in collectives:
        if _bucketed(c):
            key = (c.kind, c.axes)
            buckets[key] = buckets.get(key, 0.0) + c.nbytes
    return buckets


def _combine_buckets(collectives: list[CollectiveEstimate], cluster: Cluster,
                     groups: Any) -> list[CollectiveEstimate]:
    """Collectives XLA combines (`_COMBINED`) run as one per kind and axes. Gradient-sync
    all-reduces over the same axes run as one combined all-reduce once the last gradient is ready
    (XLA's all-reduce combiner, DDP's buckets): latency is paid once, and each gradient is charged
    its byte share of the combined time. On a measured cluster each buffer after the first adds
    what the calibration measured (`MeasuredCosts.combined_operand_seconds`: host CPU devices
    reduce the buffers of a combined all-reduce one after another). The all-gathers of parameters
    updated in slices (`Reason.SHARDED_STATE`) combine the same way."""
    buckets = _buckets(collectives)
    buffers = {key: sum(1 for c in collectives if _bucketed(c) and (c.kind, c.axes) == key) for key in buckets}
    combined = {key: collective_time(key[0], cluster, groups(key[1]), total)
                + per_buffer_seconds(cluster, _group_size(groups(key[1]))) * max(0, buffers[key] - 1)
                for key, total in buckets.items()}
    return [replace(c, seconds=combined[(c.kind, c.axes)] * c.nbytes / buckets[(c.kind, c.axes)]
                    if buckets[(c.kind, c.axes)] else 0.0)
            if _bucketed(c) else c
            for c in collectives]


def _group_size(groups: Any) -> int:
    return max((len(list(g)) for g in groups), default=1)


def per_buffer_seconds(cluster: Cluster, group_size: int) -> float:
    """What each buffer after the first adds to a combined all-reduce over `group_size` devices: a
    measured cluster's per-buffer cost as timed per group size (`MeasuredCosts.per_buffer`); a
    cluster file that timed it over all its devices only scales that figure by the all-reduce
    latency of this group size against that of all devices; 0 on a datasheet cluster."""
    measured = cluster.measured
    if measured is None or group_size <= 1:
        return 0.0
    timed = measured.per_buffer(group_size)
    if timed is not None:
        return timed
    if measured.combined_operand_seconds == 0:
        return 0.0
    here, full = measured.collective("all-reduce", group_size), measured.collective("all-reduce", measured.n_devices)
    if here is None or full is None or full.latency <= 0:
        return measured.combined_operand_seconds
    return measured.combined_operand_seconds * min(1.0, here.latency / full.latency)


def communication_terms(collectives: Sequence[CollectiveEstimate]) -> tuple[CommunicationTerm, ...]:
    """The step's collectives as the estimate prices them, merged: each combined collective (the
    gradient all-reduce, the all-gather of parameters updated in slices) once, and equal
    collectives (kind, axes, bytes) as one term with their counts summed. On any device mapping,
    the estimate's communication time is the sum over these of
    `count * collective_time(kind, cluster, mapping.groups(axes), nbytes)` (up to rounding; a
    measured cluster adds `per_buffer_seconds` per extra buffer of a combined collective), which
    is what a device-placement search re-prices without re-estimating the step.
    """
    counts: dict[tuple[Collective, tuple[str, ...], float], int] = {}
    for c in collectives:
        if not _bucketed(c):
            key = (c.kind, c.axes, c.nbytes)
            counts[key] = counts.get(key, 0) + c.count
    for (kind, axes), total in _buckets(collectives).items():
        key = (kind, axes, total)
        counts[key] = counts.get(key, 0) + 1
    return tuple(CommunicationTerm(kind, axes, nbytes, count) for (kind, axes, nbytes), count in counts.items())


def _detail(pr: PartialResult, inst: Instruction, module: Module, where: str) -> str:
    word = "sum"
    if inst.opcode == "reduce":
        word = _COMBINER_WORD.get(_combiner(inst, module) or "add", "reduction")
    if pr.gradient_sync:
        return f"gradient sync: {word} of {inst.name} ({inst.opcode}) over {where}"
    return f"partial {word} of {inst.name} ({inst.opcode}) over {where}"


# ---------------------------------------------------------------------------------------------
# The estimate
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardedState:
    """Optimizer-state leaves split over the mesh `axes` (ZeRO-1), and trainable parameters where
    it lists them (FSDP / ZeRO-3): a plan's `state_sharding`."""

    axes: tuple[str, ...]
    shards: tuple[StateShard, ...]


def _split_updates(sg: ShardedGraph, instructions: list[InstructionEstimate], state: ShardedState,
                   ways: int) -> list[InstructionEstimate]:
    """`instructions` with the optimizer update of each sharded leaf split `ways` more: an
    update-phase instruction whose result is shaped and linked like a sharded leaf (Adam's moment
    and parameter arithmetic) runs on the replica's slice only."""
    g = sg.graph
    split_like = {(tuple(p.shape.dims), g.parameter_groups(p.index))
                  for p in g.parameters if p.index in {s.parameter for s in state.shards}}
    names: set[tuple[str, str]] = set()
    for n, node in enumerate(g.nodes):
        if sg.facts.phases[n] is not Phase.UPDATE or node.instruction.shape.is_tuple:
            continue
        first, count = g.node_tensors[n]
        if count == 1:
            key = (tuple(node.instruction.shape.dims), tuple(int(x) for x in g.group_of_dim[g.tensor_dims(first)]))
            if key in split_like:
                names.add((node.computation, node.instruction.name))
    return [replace(i, degree=i.degree * ways, flops=i.flops / ways, transcendentals=i.transcendentals / ways,
                    bytes_accessed=i.bytes_accessed / ways, compute_seconds=i.compute_seconds / ways,
                    memory_seconds=i.memory_seconds / ways, seconds=i.seconds / ways)
            if (i.computation, i.name) in names else i for i in instructions]


def _with_sharded_state(memory: MemoryEstimate, collectives: list[CollectiveEstimate], sg: ShardedGraph,
                        cluster: Cluster, mapping: AxisMapping, state: ShardedState, ways: int) -> MemoryEstimate:
    """`memory` with the sharded leaves at their share (`ways`: the state axes' size): optimizer
    state (ZeRO-1) and, where the state lists them, trainable parameters (FSDP); appends the
    all-gathers to `collectives`: of each parameter stored split before its use, of each other
    parameter whose update runs split after the update."""
    if ways <= 1 or not state.shards:
        return memory
    trainable = {p.index for p in sg.graph.with_role(Role.TRAINABLE)}
    stored_split = {s.parameter for s in state.shards if s.parameter in trainable}
    moments = [s for s in state.shards if s.parameter not in trainable]
    saved_parameters = sum(sg.parameter_bytes(i) for i in stored_split) * (1.0 - 1.0 / ways)
    saved_state = sum(sg.parameter_bytes(s.parameter) for s in moments) * (1.0 - 1.0 / ways)
    groups = mapping.groups(state.axes if len(state.axes) > 1 else state.axes[0])
    where = ",".join(state.axes)
    by_index = {p.index: p for p in sg.graph.parameters}
    gathered = sorted(stored_split | set(gathered_parameters(sg, moments)))
    for index in gathered:
        p = by_index[index]
        nbytes = sg.parameter_bytes(index)
        if index in stored_split:
            reason, phase = Reason.SHARDED_PARAMETERS, Phase.FORWARD
            detail = f"all-gather {p.path or p.name} over {where} before its use: it is stored split there (FSDP)"
        else:
            reason, phase = Reason.SHARDED_STATE, Phase.UPDATE
            detail = (f"all-gather the updated {p.path or p.name} over {where}: its optimizer state is split there, "
                      "so each replica updates its slice")
        collectives.append(CollectiveEstimate(
            Collective.ALL_GATHER, state.axes, ways, nbytes,
            collective_time(Collective.ALL_GATHER, cluster, groups, nbytes), p.name, sg.graph.module.entry_name,
            reason, detail, phase))
    # the all-gathers run combined, as the gradient sync does
    collectives[:] = _combine_buckets(collectives, cluster,
                                      lambda axes: mapping.groups(axes if len(axes) > 1 else axes[0]))
    return replace(memory, parameters=int(round(memory.parameters - saved_parameters)),
                   optimizer=int(round(memory.optimizer - saved_state)))


class StepWork(NamedTuple):
    """The work of one step on one device under a plan, without memory: what `estimate_sharded`
    adds up, and what a pipeline planner sums over each stage's instructions."""

    device: DeviceSpec
    instructions: list[InstructionEstimate]
    collectives: list[CollectiveEstimate]
    reduce_flops: float


class StepArrays(NamedTuple):
    """`StepWork` with its instructions as arrays (`InstructionArrays`)."""

    device: DeviceSpec
    instructions: InstructionArrays
    collectives: list[CollectiveEstimate]
    reduce_flops: float


def step_arrays(sg: ShardedGraph, cluster: Cluster, mapping: AxisMapping, *, fusion: Fusion = Fusion.ELEMENTWISE,
                cache: CostCache | None = None, busy: int | None = None) -> StepArrays:
    """Per-instruction compute and the collectives of a plan already applied to a graph, on
    `cluster` with the mesh axes mapped to devices by `mapping`. `busy`: how many of the
    cluster's devices compute at once (default the mesh's; a pipeline stage's mesh computes
    while the other stages do), which sets the speed of devices that share hardware."""
    device = cluster.devices[int(mapping.devices.flat[0])] if mapping.devices.size else cluster.devices[0]
    # a mesh on some of a measured cluster's shared-hardware devices computes faster per device
    busy_devices = int(mapping.devices.size) if busy is None else busy
    speedup = busy_speedup(cluster, busy_devices)
    measured = cluster.measured
    # one device alone: each kernel at its own measured speedup (`MeasuredCosts.alone_dot`)
    alone = measured if measured is not None and busy_devices == 1 and measured.prices_alone else None
    device = device if alone is not None else sped_up(device, speedup)
    kinds = {cluster.devices[int(d)].name for d in mapping.devices.flat}
    if len(kinds) > 1:
        log.warning("mesh spans devices of kinds %s; compute is costed on %s", sorted(kinds), device.name)
    gathered = _gathered_axes(sg)
    launch = measured.kernel_seconds / speedup if measured is not None else 0.0
    cores, spare = (0, 1.0) if measured is None else (measured.cores, measured.spare_threads(busy_devices))
    instructions = instruction_arrays(sg, device, gathered, fused_nodes(sg, fusion), {} if cache is None else cache,
                                      launch, cores=cores, spare_threads=spare, alone=alone)
    collectives, reduce_flops = _collectives(sg, cluster, mapping, gathered)
    return StepArrays(device, instructions, collectives, reduce_flops)


def step_work(sg: ShardedGraph, cluster: Cluster, mapping: AxisMapping, *, fusion: Fusion = Fusion.ELEMENTWISE,
              cache: CostCache | None = None, busy: int | None = None) -> StepWork:
    """`step_arrays` with one `InstructionEstimate` per instruction."""
    device, arrays, collectives, reduce_flops = step_arrays(sg, cluster, mapping, fusion=fusion, cache=cache, busy=busy)
    return StepWork(device, instruction_estimates(sg, arrays), collectives, reduce_flops)


def estimate_sharded(sg: ShardedGraph, cluster: Cluster, mapping: AxisMapping, *, plan_name: str = "plan",
                     overlap: Overlap = Overlap.NONE, fusion: Fusion = Fusion.ELEMENTWISE,
                     donated: frozenset[int] | None = None, cache: CostCache | None = None,
                     sharded_state: ShardedState | None = None) -> StepEstimate:
    """The estimate of a plan already applied to a graph (`ShardedGraph`), on `cluster` with the
    mesh axes mapped to devices by `mapping`. `cache` memoizes computation costs across calls for
    one module and device (explorers evaluating many plans pass the same dict). `sharded_state`:
    the optimizer-state leaves the plan splits over its data axes (ZeRO-1)."""
    device, instructions, collectives, reduce_flops = step_work(sg, cluster, mapping, fusion=fusion, cache=cache)
    memory = estimate_memory(sg, device.memory_bytes, donated=donated, fusion=fusion)
    if sharded_state is not None and sharded_state.shards:
        ways = math.prod(sg.axes.mesh_shape[a] for a in sharded_state.axes)
        memory = _with_sharded_state(memory, collectives, sg, cluster, mapping, sharded_state, ways)
        instructions = _split_updates(sg, instructions, sharded_state, ways)
    compute = sum(i.seconds for i in instructions)
    communication = sum(c.total_seconds for c in collectives)
    if overlap is Overlap.GRADIENT_SYNC:
        sync = sum(c.total_seconds for c in collectives if c.reason is Reason.GRADIENT_SYNC)
        backward = sum(i.seconds for i in instructions if i.phase is Phase.BACKWARD)
        exposed = communication - sync + max(0.0, sync - backward)
    else:
        exposed = communication
    instructions.sort(key=lambda i: -i.seconds)
    return StepEstimate(
        plan=plan_name, mesh=tuple(sg.axes.mesh_shape.items()), cluster=cluster.name, device=device.name,
        overlap=overlap, compute_seconds=compute, communication_seconds=communication,
        exposed_communication_seconds=exposed, flops=sum(i.flops for i in instructions) + reduce_flops,
        collectives=tuple(collectives), instructions=tuple(instructions), memory=memory,
        dispatch_seconds=dispatch_seconds(cluster))


def dispatch_seconds(cluster: Cluster, programs: int = 1) -> float:
    """The host's cost of launching `programs` programs on `cluster`: measured by a calibration
    (`Cluster.measured`), else 0 (a datasheet cluster knows nothing of its host)."""
    return programs * (cluster.measured.dispatch_seconds if cluster.measured is not None else 0.0)


def estimate(cap: Capture, plan: np.ndarray, axes: MeshAxes, *, cluster: str | Cluster = "A",
             axis_devices: AxisMapping | None = None, axis_order: Sequence[str] | None = None,
             graph: FactorGraph | None = None, plan_name: str = "plan", overlap: Overlap = Overlap.NONE,
             fusion: Fusion = Fusion.ELEMENTWISE, sharded_state: ShardedState | None = None) -> StepEstimate:
    """Estimate one training step of `cap` under the plan array `plan` (over the factor graph's
    groups, mesh `axes`) on `cluster` (a preset name, JSON path or Cluster). Mesh axes map onto
    devices with `axis_devices` when given, else in `axis_order` (outermost first; default the
    mesh's order, so the last axis stays inside a node). Raises PlanConflict for a plan with
    conflicts. `hlomap.api.estimate` takes a `Plan` or a built-in plan name instead.
    `sharded_state`: the optimizer-state leaves split over the data axes (ZeRO-1).
    """
    graph = graph if graph is not None else FactorGraph.from_capture(cap)
    array = np.asarray(plan)
    conflicts = ConflictChecker(graph, axes).explain(array, limit=5)
    if conflicts:
        raise PlanConflict(f"plan {plan_name!r} has conflicts:\n" + "\n".join(f"  - {c}" for c in conflicts),
                           conflicts)
    clus = load_cluster(cluster)
    mapping = _mapping(clus, axes, axis_devices, axis_order)
    sg = ShardedGraph.build(graph, array, axes)
    return estimate_sharded(sg, clus, mapping, plan_name=plan_name, overlap=overlap, fusion=fusion,
                            donated=donated_parameters(cap), sharded_state=sharded_state)
