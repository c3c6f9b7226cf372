"""Per-device memory of a plan: persistent state plus the peak of live temporaries.

    total = parameters + optimizer state + other inputs (batch...)            (entry parameters)
          + peak over program order of the live temporaries               (gradients, activations)
          + outputs that do not reuse a donated input buffer                (the loss...)

Every tensor's bytes are its per-device shard (`ShardedGraph.tensor_bytes_all`). Temporaries are
simulated in the module's program order (the HLO text's order, a topological order that places
each value close to its uses): a buffer is allocated when its instruction runs and freed after its
last use; tuple, get-tuple-element, bitcast and reshape alias their operands instead of
allocating. A `call` (or while, conditional) adds its callee's own peak while it runs.

Assumptions, each what a training loop does and what `hlomap.verify.xla` compiles:
- donation: the trainable parameters and optimizer state are donated, so their updated values are
  written in place (an output leaf reuses a donated input of the same shape and type);
- fusion (`Fusion.ELEMENTWISE`, the default): an elementwise, broadcast or convert result whose
  users are all elementwise ops or reductions is fused into them and never materialized, as XLA's
  loop and input fusion do; its consumers then read its operands, which live until they run.
  `Fusion.NONE` materializes every result;
- collectives: the all-reduce of a partial result writes a new buffer next to the partial one;
  gradient sync is bucketed (one combined all-reduce once the last gradient is ready, as XLA's
  all-reduce combiner and DDP's buckets do), so every synced gradient lives until then, next to
  its reduced copy.

At the peak, live temporaries are split into *gradients* (backward values the optimizer update
reads, and the synced gradients) and *activations* (everything else). A plan fits when the total
is at most the device's memory.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from hlomap.cost.compute import ELEMENTWISE_OPCODES, TRANSCENDENTAL_OPCODES
from hlomap.cost.sharding import ShardedGraph
from hlomap.hlo.capture import Capture, Phase, Role, instruction_phase
from hlomap.hlo.ir import Instruction
from hlomap.hlo.opcodes import CallContext, Storage, opcode_names

log = logging.getLogger(__name__)


class Fusion(enum.Enum):
    """Which intermediate results the memory model assumes are never materialized."""

    NONE = "none"
    ELEMENTWISE = "elementwise"


#: Results that are views of their operands' buffers (no allocation).
ALIASING_OPCODES = opcode_names(lambda op: op.storage is Storage.VIEW)
#: Results that live in read-only program memory or nowhere.
NO_BUFFER_OPCODES = opcode_names(lambda op: op.storage is Storage.NONE)
#: Producers XLA fuses into their consumers (loop fusion).
FUSIBLE_PRODUCERS = ELEMENTWISE_OPCODES | TRANSCENDENTAL_OPCODES | frozenset(
    {"broadcast", "iota", "reshape", "bitcast"})
#: Consumers that absorb a fused producer (elementwise loops and reductions).
FUSING_CONSUMERS = FUSIBLE_PRODUCERS | frozenset({"reduce", "transpose", "copy"})
#: Instructions whose called computations run while they do.
_CALLERS = opcode_names(lambda op: op.calls is CallContext.CONTROL_FLOW)


class Category(enum.Enum):
    GRADIENT = "gradients"
    ACTIVATION = "activations"
    OUTPUT = "outputs"


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device. `gradients` and `activations` are what is live at the peak."""

    parameters: int
    optimizer: int
    inputs: int  # data and other non-trained inputs
    gradients: int
    activations: int
    outputs: int  # outputs that do not reuse a donated buffer
    capacity: int
    peak_instruction: str = ""  # where the temporaries peak

    @property
    def temporaries(self) -> int:
        return self.gradients + self.activations + self.outputs

    @property
    def total(self) -> int:
        return self.parameters + self.optimizer + self.inputs + self.temporaries

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    @property
    def shortfall(self) -> int:
        """Bytes over capacity (0 when it fits)."""
        return max(0, self.total - self.capacity)

    def to_json(self) -> dict[str, Any]:
        return {"parameters": self.parameters, "optimizer": self.optimizer, "inputs": self.inputs,
                "gradients": self.gradients, "activations": self.activations, "outputs": self.outputs,
                "total": self.total, "capacity": self.capacity, "fits": self.fits,
                "shortfall": self.shortfall, "peak_instruction": self.peak_instruction}


# ---------------------------------------------------------------------------------------------
# Donation
# ---------------------------------------------------------------------------------------------


def donated_parameters(cap: Capture) -> frozenset[int]:
    """Entry parameters a training loop donates: every leaf of an argument that holds trainable
    parameters or optimizer state (a bare dump: the TRAINABLE and OPTIMIZER_STATE parameters)."""
    state = {Role.TRAINABLE, Role.OPTIMIZER_STATE}
    if cap.in_tree is None:
        return frozenset(p.index for p in cap.parameters if p.role in state)
    out: set[int] = set()
    offset = 0
    for child in cap.in_tree.children():  # the treedef of the argument tuple: one child per argument
        chunk = cap.parameters[offset: offset + child.num_leaves]
        if any(p.role in state for p in chunk):
            out.update(p.index for p in chunk)
        offset += child.num_leaves
    return frozenset(out)


def aliased_outputs(sg: ShardedGraph, donated: frozenset[int]) -> frozenset[int]:
    """Output tensor ids that reuse a donated input buffer: in order, each output leaf takes the
    first unused donated parameter of the same element type and per-device size, as JAX does."""
    g = sg.graph
    pool: dict[tuple[str, tuple[int, ...], float], list[int]] = {}
    for p in sorted(g.parameters, key=lambda p: p.index):
        if p.index in donated and p.index < len(g.entry_parameter_tensors):
            key = (p.shape.dtype, tuple(p.shape.dims), sg.parameter_bytes(p.index))
            pool.setdefault(key, []).append(p.index)
    out: set[int] = set()
    for t in g.output_tensors:
        node = g.nodes[int(g.tensor_node[t])]
        leaf = list(node.instruction.shape.leaves())[int(g.tensor_leaf[t])]
        key = (leaf.dtype, tuple(leaf.dims), float(sg.tensor_bytes_all[t]))
        if pool.get(key):
            pool[key].pop(0)
            out.add(int(t))
    return frozenset(out)


# ---------------------------------------------------------------------------------------------
# Liveness
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Peak:
    bytes: float
    by_category: Mapping[Category, float]
    instruction: str


def _users(instructions: Sequence[Instruction]) -> dict[str, list[Instruction]]:
    users: dict[str, list[Instruction]] = {i.name: [] for i in instructions}
    for inst in instructions:
        for o in dict.fromkeys(inst.operands):
            if o in users:
                users[o].append(inst)
    return users


def _fused_away(inst: Instruction, users: Sequence[Instruction], fusion: Fusion) -> bool:
    if fusion is Fusion.NONE or inst.is_root or not users:
        return False
    return inst.opcode in FUSIBLE_PRODUCERS and all(u.opcode in FUSING_CONSUMERS for u in users)


def fused_nodes(sg: ShardedGraph, fusion: Fusion) -> frozenset[int]:
    """Nodes whose results are fused into their consumers and never written to memory."""
    if fusion is Fusion.NONE:
        return frozenset()
    g = sg.graph
    out: set[int] = set()
    for instance, info in enumerate(g.instances):
        instructions = g.module.computation(info.computation).instructions
        users = _users(instructions)
        index = sg.instance_index(instance)
        out.update(index[i.name] for i in instructions if _fused_away(i, users[i.name], fusion))
    return frozenset(out)


@dataclass(frozen=True)
class _Context:
    sg: ShardedGraph
    fusion: Fusion
    children: Mapping[tuple[int, str], tuple[int, ...]]  # (instance, call site) -> child instances
    partial_bytes: Mapping[int, float]  # node -> all-reduced bytes (not gradient sync)
    sync_bytes: Mapping[tuple[int, str], float]  # (entry) instruction -> gradient-sync bytes under it
    aliased_outputs: frozenset[int]  # output tensor ids written into donated inputs


def _context(sg: ShardedGraph, fusion: Fusion, aliased: frozenset[int]) -> _Context:
    g = sg.graph
    children: dict[tuple[int, str], list[int]] = {}
    for k, inst in enumerate(g.instances):
        if inst.parent >= 0:
            children.setdefault((inst.parent, inst.call_site), []).append(k)
    partial: dict[int, float] = {}
    sync: dict[tuple[int, str], float] = {}
    for pr in sg.partials:
        nbytes = sg.node_result_bytes(pr.node)
        if not pr.gradient_sync:
            partial[pr.node] = nbytes
            continue
        # the entry-level instruction under which the gradient is computed
        node = g.nodes[pr.node]
        instance, name = node.instance, node.instruction.name
        while instance > 0:
            parent = g.instances[instance]
            instance, name = parent.parent, parent.call_site
        sync[(0, name)] = sync.get((0, name), 0.0) + nbytes
    return _Context(sg, fusion, {k: tuple(v) for k, v in children.items()}, partial, sync, aliased)


def _simulate(ctx: _Context, instance: int, cache: dict[int, float]) -> _Peak:
    """Peak live bytes of one computation instance in program order. Its parameters cost nothing
    here: they are the caller's buffers, or entry inputs counted apart."""
    sg = ctx.sg
    g = sg.graph
    index = sg.instance_index(instance)
    comp = g.module.computation(g.instances[instance].computation)
    instructions = comp.instructions
    users = _users(instructions)

    owners: dict[str, tuple[str, ...]] = {}  # instruction -> the buffers its value lives in
    size: dict[str, float] = {}
    category: dict[str, Category] = {}
    phase: dict[str, Phase] = {}
    last_use: dict[str, int] = {}
    for i, inst in enumerate(instructions):
        if inst.opcode in ALIASING_OPCODES or _fused_away(inst, users[inst.name], ctx.fusion):
            # views alias their operands; a fused producer is recomputed where its consumers run,
            # so its operands live until then
            owners[inst.name] = tuple(dict.fromkeys(b for o in inst.operands for b in owners.get(o, ())))
        elif inst.opcode in NO_BUFFER_OPCODES:
            owners[inst.name] = ()
        else:
            owners[inst.name] = (inst.name,)
            size[inst.name] = sg.node_result_bytes(index[inst.name])
            category[inst.name] = (Category.GRADIENT if (instance, inst.name) in ctx.sync_bytes
                                   else Category.ACTIVATION)
            phase[inst.name] = instruction_phase(inst)
            last_use[inst.name] = i
        reader = instruction_phase(inst)
        for o in inst.operands:
            for b in owners.get(o, ()):
                last_use[b] = max(last_use.get(b, -1), i)
                # a backward value the optimizer update reads (through views and fusions) is a gradient
                if reader is Phase.UPDATE and phase.get(b) is Phase.BACKWARD:
                    category[b] = Category.GRADIENT
    end = len(instructions)
    root = comp.root
    outputs: set[str] = set()
    in_place: set[str] = set()
    for k, operand in enumerate(_root_leaves(root)):
        bufs = owners.get(operand, ())
        for b in bufs:
            last_use[b] = end
        if instance == 0:
            tensor = g.output_tensors[k] if k < len(g.output_tensors) else -1
            (in_place if tensor in ctx.aliased_outputs else outputs).update(bufs)
    outputs -= in_place

    # Gradient sync is bucketed: one combined all-reduce after the last gradient is computed, so
    # every synced gradient lives until then, next to its reduced copy.
    sync_at = max((i for i, inst in enumerate(instructions) if (instance, inst.name) in ctx.sync_bytes),
                  default=-1)
    sync_total = sum(ctx.sync_bytes.get((instance, inst.name), 0.0) for inst in instructions)
    if sync_at >= 0:
        for inst in instructions:
            if (instance, inst.name) in ctx.sync_bytes:
                for b in owners[inst.name]:
                    last_use[b] = max(last_use[b], sync_at)

    frees: dict[int, list[str]] = {}
    for b, i in last_use.items():
        if b in size:
            frees.setdefault(i, []).append(b)
    live: dict[str, float] = {}
    best = _Peak(0.0, {c: 0.0 for c in Category}, "")
    for i, inst in enumerate(instructions):
        if inst.name in size and inst.name not in in_place:
            live[inst.name] = size[inst.name]
        transient = ctx.partial_bytes.get(index[inst.name], 0.0)  # the all-reduce's output
        if i == sync_at:
            transient += sync_total
        if inst.opcode in _CALLERS:
            peaks = [cache[k] if k in cache else cache.setdefault(k, _simulate(ctx, k, cache).bytes)
                     for k in ctx.children.get((instance, inst.name), ())]
            # the callee's own peak includes its result, which the caller already holds
            transient += max(0.0, max(peaks, default=0.0) - size.get(inst.name, 0.0))
        total = sum(live.values()) + transient
        if total > best.bytes:
            by_cat = {c: 0.0 for c in Category}
            for b, v in live.items():
                by_cat[Category.OUTPUT if b in outputs else category[b]] += v
            by_cat[Category.GRADIENT if i == sync_at else Category.ACTIVATION] += transient
            best = _Peak(total, by_cat, inst.name)
        for b in frees.get(i, ()):
            live.pop(b, None)
    return best


def _root_leaves(root: Instruction) -> tuple[str, ...]:
    """The instructions whose values are the root's leaves (a tuple root's operands)."""
    return root.operands if root.opcode == "tuple" else (root.name,)


def estimate_memory(sg: ShardedGraph, capacity: int, *, donated: frozenset[int] | None = None,
                    fusion: Fusion = Fusion.ELEMENTWISE) -> MemoryEstimate:
    """Per-device memory of the plan in `sg` (see the module docstring). `donated`: entry
    parameter indices whose buffers outputs may reuse (default: TRAINABLE and OPTIMIZER_STATE)."""
    g = sg.graph
    if donated is None:
        donated = frozenset(p.index for p in g.parameters if p.role in (Role.TRAINABLE, Role.OPTIMIZER_STATE))
    persistent = {Role.TRAINABLE: 0.0, Role.OPTIMIZER_STATE: 0.0, Role.DATA: 0.0}
    roles = {p.index: p.role for p in g.parameters}
    for index in range(len(g.entry_parameter_tensors)):
        role = roles.get(index, Role.UNKNOWN)
        persistent[role if role in persistent else Role.DATA] += sg.parameter_bytes(index)
    ctx = _context(sg, fusion, aliased_outputs(sg, donated))
    peak = _simulate(ctx, 0, {})
    return MemoryEstimate(
        parameters=int(round(persistent[Role.TRAINABLE])),
        optimizer=int(round(persistent[Role.OPTIMIZER_STATE])),
        inputs=int(round(persistent[Role.DATA])),
        gradients=int(round(peak.by_category[Category.GRADIENT])),
        activations=int(round(peak.by_category[Category.ACTIVATION])),
        outputs=int(round(peak.by_category[Category.OUTPUT])),
        capacity=int(capacity),
        peak_instruction=peak.instruction,
    )
