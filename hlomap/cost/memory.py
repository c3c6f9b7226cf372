"""Per-device memory of a plan: persistent state plus the peak of live temporaries.

    total = parameters + optimizer state + other inputs (batch...)            (entry parameters)
          + peak over program order of the live temporaries               (gradients, activations)
          + outputs that do not reuse a donated input buffer                (the loss...)

Every tensor's bytes are its per-device shard (`ShardedGraph.tensor_bytes_all`). Temporaries are
simulated in the module's program order (the HLO text's order, a topological order that places
each value close to its uses), except that the forward ops only the outputs read (the loss) run
with the forward pass (`outputs_early`): a buffer is allocated when its instruction runs and freed
after its last use; each top-level element of a tuple-shaped result is its own buffer; tuple,
get-tuple-element, bitcast and reshape alias their operands instead of allocating, and so does a
transpose whose layout keeps its operand's byte order (XLA makes it a bitcast). A `call` (or
while, conditional) adds its callee's own peak while it runs; a call is read as XLA's call inliner
leaves it: a result element the callee builds from constants only is no buffer, and an operand the
callee never reads is not a use (JAX's nested jits, such as `jnp.where`, return and take such
residuals).

Assumptions, each what a training loop does and what `hlomap.verify.xla` compiles:
- donation: the trainable parameters and optimizer state are donated, so their updated values are
  written in place (an output leaf reuses a donated input of the same shape and type);
- fusion (`Fusion.ELEMENTWISE`, the default): an elementwise, broadcast or convert result whose
  users are all elementwise ops or reductions is fused into them and never materialized, as XLA's
  loop and input fusion do; its consumers then read its operands, which live until they run.
  `Fusion.NONE` materializes every result;
- collectives: the all-reduce of a partial result writes a new buffer next to the partial one, as
  XLA:CPU's synchronous all-reduce does; gradient sync is bucketed (one combined all-reduce once
  the last gradient is ready, as XLA's all-reduce combiner and DDP's buckets do), so every synced
  gradient lives until then, next to its reduced copy.

At the peak, live temporaries are split into *gradients* (backward values the optimizer update
reads, and the synced gradients) and *activations* (everything else). Under data parallelism the
peak is the bucketed sync, where the gradients are twice the synced bytes: the local gradient of
each use of a leaf (a leaf read twice, like a tied embedding, has two until they are summed after
the sync) and its all-reduced copy; the forward activations are all dead by then. So the split at
the peak is not each category's own footprint: `max_gradients` and `max_activations` are those
(the activations peak at the end of the forward pass). A plan fits when the total is at most the
device's memory.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

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
    """Bytes per device. `gradients`, `activations` and `outputs` are what is live at the peak of
    the temporaries (they add up to the total); `max_gradients` and `max_activations` are each
    category's own high point over the step, wherever it falls."""

    parameters: int
    optimizer: int
    inputs: int  # data and other non-trained inputs
    gradients: int
    activations: int
    outputs: int  # outputs that do not reuse a donated buffer
    capacity: int
    peak_instruction: str = ""  # where the temporaries peak
    max_gradients: int = 0  # the most gradient bytes live at once, wherever that is
    max_activations: int = 0  # the most activation bytes live at once (around the end of the forward pass)

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
                "shortfall": self.shortfall, "peak_instruction": self.peak_instruction,
                "max_gradients": self.max_gradients, "max_activations": self.max_activations}


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
    by_category: Mapping[Category, float]  # what is live at the peak
    instruction: str
    most: Mapping[Category, float]  # each category's own high point over the computation


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
    key = ("fused_nodes", fusion)
    found = sg.facts.memo.get(key)
    if found is not None:  # the graph's structure decides, not the plan: once per graph
        return found
    g = sg.graph
    out: set[int] = set()
    for instance, info in enumerate(g.instances):
        instructions = g.module.computation(info.computation).instructions
        users = _users(instructions)
        index = sg.instance_index(instance)
        out.update(index[i.name] for i in instructions if _fused_away(i, users[i.name], fusion))
    sg.facts.memo[key] = frozenset(out)
    return sg.facts.memo[key]


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


def outputs_early(instructions: Sequence[Instruction], root: str,
                  phase_of: Callable[[Instruction], Phase] = instruction_phase) -> tuple[Instruction, ...]:
    """Program order with the forward ops that only the step's outputs read (the loss, metrics)
    moved up to run as soon as their operands exist.

    Post-order HLO text emits the loss last, next to the root, so the log-softmax and one-hot of
    the logits it reads would stay alive through the whole backward pass and the gradient sync;
    XLA's scheduler reduces them to the loss during the forward pass and frees them. Parameters and
    constants, which allocate nothing, go first; every other instruction keeps its place: the
    forward values the backward pass reads are computed where the text computes them, which is how
    XLA's fusion recomputes cheap ones next to their use. The result is a topological order.
    `phase_of` reads an instruction's phase (default: its own metadata)."""
    names = {inst.name for inst in instructions}
    free = {inst.name for inst in instructions if not inst.operands and inst.opcode in NO_BUFFER_OPCODES}
    needed: set[str] = set()  # read, directly or not, by the backward pass or the update
    for inst in reversed(instructions):  # every operand is visited after its users
        if inst.name in needed or (inst.name != root and phase_of(inst) is not Phase.FORWARD):
            needed.add(inst.name)
            needed.update(o for o in (*inst.operands, *inst.control_predecessors) if o in names)
    position = {inst.name: k for k, inst in enumerate(instructions)}
    anchor: dict[str, int] = {}  # an output-only op runs right after its last operand that stays put
    for inst in instructions:
        if inst.name not in needed and inst.name not in free and inst.name != root:
            anchor[inst.name] = max((anchor.get(o, position[o]) for o in (*inst.operands, *inst.control_predecessors)
                                     if o in names and o not in free), default=-1)
    after: dict[int, list[Instruction]] = {}
    for inst in instructions:
        if inst.name in anchor:
            after.setdefault(anchor[inst.name], []).append(inst)
    order = [inst for inst in instructions if inst.name in free] + after.get(-1, [])
    for k, inst in enumerate(instructions):
        if inst.name not in anchor and inst.name not in free:
            order.append(inst)
            order.extend(after.get(k, ()))
    return tuple(order)


def _simulate(ctx: _Context, instance: int, cache: dict[int, float]) -> _Peak:
    """Peak live bytes of one computation instance in program order (the entry's in
    `outputs_early` order). Its parameters cost nothing here: they are the caller's buffers, or
    entry inputs counted apart."""
    sg = ctx.sg
    g = sg.graph
    index = sg.instance_index(instance)
    comp = g.module.computation(g.instances[instance].computation)
    phases = sg.facts.phases

    def phase_of(inst: Instruction) -> Phase:
        return phases[index[inst.name]]

    instructions = (outputs_early(comp.instructions, comp.root.name, phase_of) if instance == 0
                    else comp.instructions)
    users = _users(instructions)
    by_name = {inst.name: inst for inst in instructions}

    # Each top-level element of a tuple-shaped result is its own buffer, freed after the last
    # read of that element, as XLA's buffer assignment does: a call's residual for the backward
    # pass does not keep its siblings alive.
    elements: dict[str, tuple[tuple[str, ...], ...]] = {}  # instruction -> buffers per element
    own: dict[str, tuple[str, ...]] = {}  # instruction -> the buffers it allocates
    size: dict[str, float] = {}
    category: dict[str, Category] = {}
    phase: dict[str, Phase] = {}
    last_use: dict[str, int] = {}

    flat: dict[str, tuple[str, ...]] = {}  # instruction -> all its buffers

    def owners(name: str) -> tuple[str, ...]:
        if name not in flat:
            flat[name] = tuple(dict.fromkeys(b for element in elements.get(name, ()) for b in element))
        return flat[name]

    for i, inst in enumerate(instructions):
        inlined = _inlined_call(ctx, instance, inst) if inst.opcode == "call" else None
        if inst.opcode == "get-tuple-element":
            parts = elements.get(inst.operands[0], ())
            k = inst.tuple_index
            elements[inst.name] = (parts[k],) if k is not None and k < len(parts) else (owners(inst.operands[0]),)
        elif inst.opcode == "tuple":
            elements[inst.name] = tuple(owners(o) for o in inst.operands)
        elif (inst.opcode in ALIASING_OPCODES or _fused_away(inst, users[inst.name], ctx.fusion)
              or is_layout_bitcast(inst, by_name.get(inst.operands[0]) if inst.operands else None)):
            # views alias their operands (a one-operand view keeps its operand's elements); a fused
            # producer is recomputed where its consumers run, so its operands live until then
            elements[inst.name] = (elements.get(inst.operands[0], ()) if len(inst.operands) == 1
                                   and (inst.opcode in ALIASING_OPCODES or inst.opcode == "transpose")
                                   else (tuple(dict.fromkeys(b for o in inst.operands for b in owners(o))),))
        elif inst.opcode in NO_BUFFER_OPCODES:
            elements[inst.name] = ()
        else:
            parts = _element_bytes(sg, index[inst.name], inst)
            names = (inst.name,) if len(parts) == 1 else tuple(f"{inst.name}{{{k}}}" for k in range(len(parts)))
            constant = inlined.constant_elements if inlined is not None else frozenset()
            elements[inst.name] = tuple(() if k in constant else (b,) for k, b in enumerate(names))
            names = tuple(b for k, b in enumerate(names) if k not in constant)
            parts = tuple(nbytes for k, nbytes in enumerate(parts) if k not in constant)
            own[inst.name] = names
            kind = Category.GRADIENT if (instance, inst.name) in ctx.sync_bytes else Category.ACTIVATION
            for b, nbytes in zip(names, parts):
                size[b], category[b], phase[b], last_use[b] = nbytes, kind, phase_of(inst), i
        reader = phase_of(inst)
        unread = inlined.unread_operands if inlined is not None else frozenset()
        for k, o in enumerate(inst.operands):
            if k in unread:
                continue
            for b in owners(o):
                last_use[b] = max(last_use.get(b, -1), i)
                # a backward value the optimizer update reads (through views and fusions) is a gradient
                if reader is Phase.UPDATE and phase.get(b) is Phase.BACKWARD:
                    category[b] = Category.GRADIENT
    end = len(instructions)
    root = comp.root
    outputs: set[str] = set()
    in_place: set[str] = set()
    for k, operand in enumerate(_root_leaves(root)):
        bufs = owners(operand)
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
                for b in owners(inst.name):
                    last_use[b] = max(last_use[b], sync_at)

    frees: dict[int, list[str]] = {}
    for b, i in last_use.items():
        if b in size:
            frees.setdefault(i, []).append(b)
    kinds = tuple(Category)  # running sums are plain lists indexed like this: the loop is hot
    grad, act = kinds.index(Category.GRADIENT), kinds.index(Category.ACTIVATION)
    kind_of = {b: kinds.index(Category.OUTPUT if b in outputs else category[b]) for b in size}
    live: set[str] = set()
    live_by_kind = [0.0] * len(kinds)
    most = [0.0] * len(kinds)
    best: tuple[float, list[float], str] = (0.0, [0.0] * len(kinds), "")
    for i, inst in enumerate(instructions):
        for b in own.get(inst.name, ()):
            if b not in in_place:
                live.add(b)
                live_by_kind[kind_of[b]] += size[b]
        # buffers that exist only while this instruction runs: an all-reduce's output, the synced
        # gradients' reduced copies, a callee's own temporaries
        now = list(live_by_kind)
        now[act] += ctx.partial_bytes.get(index[inst.name], 0.0)
        if i == sync_at:
            now[grad] += sync_total
        if inst.opcode in _CALLERS:
            peaks = [cache[k] if k in cache else cache.setdefault(k, _simulate(ctx, k, cache).bytes)
                     for k in ctx.children.get((instance, inst.name), ())]
            # the callee's own peak includes its result, which the caller already holds
            held = sum(size[b] for b in own.get(inst.name, ()))
            now[act] += max(0.0, max(peaks, default=0.0) - held)
        for k, value in enumerate(now):
            if value > most[k]:
                most[k] = value
        total = sum(now)
        if total > best[0]:
            best = (total, now, inst.name)
        for b in frees.get(i, ()):
            if b in live:
                live.remove(b)
                live_by_kind[kind_of[b]] -= size[b]
    return _Peak(best[0], dict(zip(kinds, best[1])), best[2], dict(zip(kinds, most)))


def is_layout_bitcast(inst: Instruction, operand: Instruction | None) -> bool:
    """A transpose whose result layout lists its operand's bytes in the same order (the layouts
    permute with the dims): XLA's simplifier makes it a bitcast, a view of the operand. JAX emits
    one for a tied embedding read as `x @ E.T`."""
    if inst.opcode != "transpose" or operand is None or inst.shape.is_tuple or operand.shape.is_tuple:
        return False
    result_order, operand_order = inst.shape.minor_to_major, operand.shape.minor_to_major
    permutation = inst.dimensions
    if not result_order or operand_order is None or len(permutation) != len(result_order):
        return False
    return tuple(permutation[d] for d in result_order) == tuple(operand_order)


@dataclass(frozen=True)
class _InlinedCall:
    """What a `call` is once XLA has inlined it (its call inliner runs before buffer assignment):
    result elements the callee computes from constants only (a zero broadcast JAX's nested jits
    return as a residual) are never buffers (rematerialized where read, or dead), and operands the
    callee never reads are not uses (they do not keep a value alive until the call runs)."""

    constant_elements: frozenset[int]
    unread_operands: frozenset[int]


def _inlined_call(ctx: _Context, instance: int, inst: Instruction) -> _InlinedCall | None:
    children = ctx.children.get((instance, inst.name), ())
    if len(children) != 1:
        return None
    g = ctx.sg.graph
    child = children[0]
    callee = g.module.computation(g.instances[child].computation)
    index = ctx.sg.instance_index(child)
    root = callee.root
    constant: set[int] = set()
    if root.opcode == "tuple" and inst.shape.is_tuple:
        for k, operand in enumerate(root.operands):
            tensors = g.result_tensors(index[operand])
            if tensors and all(bool(g.tensor_free[t]) for t in tensors):
                constant.add(k)
    read = {o for i in callee.instructions for o in i.operands}
    unread = {k for k, p in enumerate(callee.parameters) if p.name not in read and not p.is_root}
    return _InlinedCall(frozenset(constant), frozenset(unread))


def _element_bytes(sg: ShardedGraph, node: int, inst: Instruction) -> tuple[float, ...]:
    """Per-device bytes of each top-level element of `inst`'s result (one entry for an array)."""
    first, count = sg.graph.node_tensors[node]
    per_leaf = sg.tensor_bytes_all[first: first + count]
    if not inst.shape.is_tuple:
        return (float(per_leaf.sum()),)
    out: list[float] = []
    lo = 0
    for element in inst.shape.elements:  # type: ignore[union-attr]
        n = sum(1 for _ in element.leaves()) if element.is_tuple else 1
        out.append(float(per_leaf[lo: lo + n].sum()))
        lo += n
    return tuple(out)


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
        max_gradients=int(round(peak.most[Category.GRADIENT])),
        max_activations=int(round(peak.most[Category.ACTIVATION])),
    )
