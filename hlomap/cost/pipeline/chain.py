"""The pipeline model of a captured train step: forward chain, candidate pivots, C / A / W arrays.

`step_chain(cap, device)` turns the HLO of a JAX train step (forward + backward +
optimizer update in one entry computation) into a `PipelineProfile` whose layers are the
segments between candidate pivots, plus the names of those pivots.

How the step is read (JAX tags ops with `jvp(` / `transpose(jvp(` in metadata op_name; see
`hlomap.hlo.capture.instruction_phase`):

- Forward chain. The FORWARD instructions of the entry computation that the loss depends on, in
  topological order. The loss is the forward sink with the most forward ancestors. FORWARD ops
  the loss does not depend on ("side" ops) are residual preparations JAX's linearization emits
  for the backward pass (e.g. 1 - tanh^2); they run in the forward pass of the layer they belong
  to, so their time is counted there, but they never decide where a cut may go.
- Pivots. Position p of the chain cuts after chain instruction p. The bytes crossing it (A) are
  the values defined at positions <= p that a chain or side op at a later position uses; each
  value counts once however many users it has beyond the cut. Parameters, constants and other
  phase-less values never cross: every stage loads or rebuilds its own.
  A candidate pivot is a position where one live tensor crosses, or where few bytes cross (at
  most the `bytes_quantile` quantile of all positions). Runs of candidates with no compute
  between them keep their cheapest member, and if more than `max_pivots` remain, the chain is
  split into `max_pivots` bins of equal compute and each bin keeps its cheapest candidate.
- C, forward. Each chain instruction's roofline time (`hlomap.cost.instruction_cost`) at its
  position; a side op's time at its anchor (below).
- Fixed part of C. The share of each instruction's time that a split batch does not shrink
  (its weight reads and weight-gradient writes: `hlomap.cost.pipeline.batch_split`), summed per
  position like C (`PipelineProfile.forward_fixed`).
- In-pass all-reduces. The reductions over the batch a split batch all-reduces inside a pass
  (batch norm's statistics: `batch_split.Syncs`): one combined all-reduce per dependency level
  and direction, at the last position one of its reductions is at, with their bytes where
  they are (`PipelineProfile.forward_syncs`).
- C, backward. Each BACKWARD instruction is attributed to the forward position it
  differentiates, its anchor: the latest forward position among its direct forward operands
  (residuals: a chain value at its position or, later, where a chain op of the same layer scope
  reads it, as the forward op this one transposes does; side values at their anchor; trainable
  parameters, and data inputs, at their first chain use). A backward op with no forward
  operand (pure cotangent arithmetic) takes the latest anchor of its backward operands, so the
  cotangent chain stays with the layer that produced it. This is the approximation: an op that
  reads residuals of two layers is charged to the later one.
- W. The bytes of each TRAINABLE entry parameter, at its first use by the chain (a parameter
  shared by two stages, like tied embeddings, is charged to the first only).
- Stash. The bytes of every chain or side value some backward op reads (what a stage keeps per
  in-flight microbatch).
- Not per layer: optimizer-update instructions run once per batch, not per microbatch, and are
  elementwise over the parameters, so the profile prices them per parameter byte
  (`PipelineProfile.update_seconds_per_byte`: `StepChain.update_seconds` over the parameters'
  bytes): a stage pays them once per step on every replica. Not counted: phase-less constants
  and broadcasts of constants (free after fusion), reported in `unattributed_seconds`.

All values are for the batch the step was captured with; `explore_pipeline` scales them to a
microbatch.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from hlomap.cost.compute import CostCache, kept_instruction_cost, transposed_product_cost
from hlomap.cost.devices import DeviceSpec, device_preset
from hlomap.cost.estimate import pass_buffers, state_leaves
from hlomap.hlo.capture import Capture, Phase, Role, instruction_phase
from hlomap.hlo.graph import topological_order
from hlomap.hlo.ir import Computation, Instruction
from hlomap.cost.pipeline.batch_split import batch_split
from hlomap.cost.pipeline.profile import PipelineProfile, merge_layers
from hlomap.hlo.source_info import layer_name, nearest_scopes, scope_of, source_location, source_tables

if TYPE_CHECKING:
    from hlomap.propagation.graph import FactorGraph

__all__ = [
    "kept_bytes",
    "ChainArrays",
    "ChainAttribution",
    "ChainValue",
    "attribute",
    "crossing_bytes",
    "StepChain",
    "Pivot",
    "PivotOptions",
    "forward_chain",
    "step_chain",
    "select_pivots",
    "thin_pivots",
]

log = logging.getLogger(__name__)

#: Device used when none is given: the V100 of Auto-MAP's clusters A, B and C.
DEFAULT_DEVICE = "V100-16GB"


@dataclass(frozen=True)
class PivotOptions:
    """How candidate pivots are chosen and thinned (see the module docstring).

    max_pivots: at most this many pivots reach the search (the issue asks for 128-512).
    bytes_quantile: a position whose crossing bytes are at most this quantile of all positions'
      crossing bytes is a candidate, besides single-tensor positions; 1.0 keeps every position.
    """

    max_pivots: int = 256
    bytes_quantile: float = 0.5

    def __post_init__(self) -> None:
        if self.max_pivots < 1:
            raise ValueError(f"PivotOptions.max_pivots = {self.max_pivots} must be >= 1")
        if not 0.0 <= self.bytes_quantile <= 1.0:
            raise ValueError(
                f"PivotOptions.bytes_quantile = {self.bytes_quantile} must lie in [0, 1]"
            )


@dataclass(frozen=True)
class Pivot:
    """A candidate cut, after chain instruction `instruction` (chain position `position`).

    layer: the instruction's scope path from metadata (`layers_0/add`), or its bare op name when
      the op was traced outside any named scope (a final layer norm: `mul`).
    scope: the nearest layer scope: the instruction's own, else `after <scope>` of the closest
      scoped chain instruction before it (or `before <scope>` after it), so that every cut
      names a layer, as Auto-MAP's Table 7 does.
    source: `file:line` of the op from metadata (None when the dump carries none).
    """

    position: int
    instruction: str
    layer: str
    crossing_bytes: float
    live_tensors: int
    scope: str = ""
    source: str | None = None

    def __str__(self) -> str:
        return f"{self.instruction} ({self.layer})"


class ChainValue(NamedTuple):
    """A chain value read at later positions: where it is defined, every later chain position
    that reads it (a side op reads at its anchor), and its bytes. The data edges of the forward
    chain, from which `tasks.pipeline.step_dag` builds the layer DAG a downset DP cuts."""

    position: int
    readers: tuple[int, ...]
    nbytes: float


@dataclass(frozen=True, eq=False)
class ChainArrays:
    """Per-instruction arrays of the whole forward chain, before pivots are chosen.

    `profile` has one layer per chain instruction; `live_tensors[p]` counts the values crossing
    position p; `layers[i]` is chain instruction i's layer name and `sources[i]` its `file:line`
    (None when unknown); `values` the chain values read at later positions (`ChainValue`).
    """

    profile: PipelineProfile
    live_tensors: np.ndarray
    layers: tuple[str, ...]
    update_seconds: float
    unattributed_seconds: float
    sources: tuple[str | None, ...] = ()
    values: tuple[ChainValue, ...] = ()


@dataclass(frozen=True, eq=False)
class StepChain:
    """A train step's pipeline model: the profile over candidate pivots and what they are.

    profile: layers = segments between consecutive pivots; `profile.n_pivots == len(pivots)`,
      and pivot k of the profile is `pivots[k]`.
    chain: the per-instruction arrays the profile was merged from.
    """

    profile: PipelineProfile
    pivots: tuple[Pivot, ...]
    chain: ChainArrays

    @property
    def source(self) -> str:
        return self.profile.source

    @property
    def update_seconds(self) -> float:
        return self.chain.update_seconds

    def describe_cuts(self, cuts: Sequence[int]) -> tuple[str, ...]:
        """`instruction (layer)` for each profile pivot index in `cuts`."""
        return tuple(str(self.pivots[c]) for c in cuts)


# ---------------------------------------------------------------------------------------------
# The forward chain and attribution
# ---------------------------------------------------------------------------------------------


def _byte_size(inst: Instruction) -> float:
    return float(inst.shape.byte_size)


def _scope(inst: Instruction) -> str:
    """The layer scope of an op (its layer name without the op itself); forward ops and the
    backward ops that transpose them share it."""
    return scope_of(layer_name(inst.metadata))


def forward_chain(entry: Computation) -> tuple[Instruction, ...]:
    """The FORWARD instructions the loss depends on, in topological order (module docstring)."""
    order = topological_order(entry)
    forward = [inst for inst in order if instruction_phase(inst) is Phase.FORWARD]
    if not forward:
        raise ValueError(
            f"computation {entry.name!r} has no forward instructions: pipeline profiles need "
            "JAX metadata (op_name with 'jvp(') to tell the forward pass from the backward"
        )
    names = {inst.name for inst in forward}
    by_name = {inst.name: inst for inst in forward}
    users: dict[str, list[str]] = {}
    for inst in forward:
        for operand in inst.operands:
            if operand in names:
                users.setdefault(operand, []).append(inst.name)
    sinks = [inst.name for inst in forward if inst.name not in users]
    # The loss reads (almost) the whole forward pass; residual side ops read one layer. The
    # first sink (in order) with the most ancestors wins. A large step has a thousand sinks
    # near its end, each with most of the graph behind it: one walk per sink is quadratic, so
    # every instruction gets the set of sinks it reaches (a bit per sink, from the users back)
    # and a sink's ancestors are the instructions whose set holds its bit.
    bit = {sink: 1 << k for k, sink in enumerate(sinks)}
    reaches: dict[str, int] = {}
    for inst in reversed(forward):  # topological order: users first
        found = bit.get(inst.name, 0)
        for user in users.get(inst.name, ()):
            found |= reaches[user]
        reaches[inst.name] = found
    width = (len(sinks) + 7) // 8
    packed = np.frombuffer(b"".join(r.to_bytes(width, "little") for r in reaches.values()), dtype=np.uint8)
    counts = np.unpackbits(packed.reshape(len(reaches), width), axis=1, bitorder="little")[:, :len(sinks)].sum(axis=0)
    best_sink = sinks[int(np.argmax(counts))]  # the first of the most
    best, stack = {best_sink}, [best_sink]
    while stack:
        for operand in by_name[stack.pop()].operands:
            if operand in names and operand not in best:
                best.add(operand)
                stack.append(operand)
    return tuple(inst for inst in forward if inst.name in best)


def _first_uses(chain: Sequence[Instruction], params: Iterable[str]) -> dict[str, int]:
    """Chain position of the first use of each named parameter (absent: unused by the chain)."""
    wanted = set(params)
    first: dict[str, int] = {}
    for position, inst in enumerate(chain):
        for operand in inst.operands:
            if operand in wanted and operand not in first:
                first[operand] = position
    return first


@dataclass(frozen=True, eq=False)
class ChainAttribution:
    """Where every instruction of a train step's entry computation belongs in its forward chain
    (module docstring), independent of what anything costs.

    anchor: the chain position of every forward, side and backward instruction (a chain
      instruction's own position); forward: which of them run in the forward pass.
    spans: (value, defined at, last read at) for every chain value read at a later position:
      what crosses the pivots in between.
    readers: each value of `spans` -> every later position that reads it (its data edges).
    stashed: forward values some backward op reads -> the position their stash is charged to.
    parameters: each trainable parameter (HLO name) -> the position that owns its bytes.
    update, unattributed: the optimizer update's instructions and the phase-less ones.
    """

    chain: tuple[Instruction, ...]
    anchor: Mapping[str, int]
    forward: frozenset[str]
    spans: tuple[tuple[str, int, int], ...]
    stashed: Mapping[str, int]
    parameters: Mapping[str, int]
    update: tuple[str, ...]
    unattributed: tuple[str, ...]
    readers: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return len(self.chain)

    @cached_property
    def span_bounds(self) -> np.ndarray:
        """[2 * spans]: each span's start and end position, in span order."""
        return np.asarray([(start, end) for _, start, end in self.spans], dtype=np.int64).reshape(-1)


def attribute(cap: Capture) -> ChainAttribution:
    """Attribute the entry computation's instructions to forward-chain positions (module
    docstring: forward chain, side ops, backward anchors, stash, W)."""
    module = cap.module
    entry = module.entry
    chain = forward_chain(entry)
    position = {inst.name: p for p, inst in enumerate(chain)}
    n = len(chain)
    trainable = {p.name for p in cap.parameters if p.role is Role.TRAINABLE}
    if not trainable:
        log.warning(
            "%s: no TRAINABLE entry parameters; parameter bytes (W) are all zero", cap.source
        )
    # Every entry parameter (weights, and data read by weight-gradient ops such as x^T g of a
    # first layer) anchors a backward op at the parameter's first chain use.
    first_use = _first_uses(chain, (inst.name for inst in entry.parameters))
    anchor: dict[str, int] = dict(position)
    forward: set[str] = set(position)
    side: set[str] = set()
    stashed: dict[str, int] = {}  # forward value -> position its stash is charged to
    # last chain/side position that reads each chain value, for the crossing bytes.
    last_read = {inst.name: p for p, inst in enumerate(chain)}
    read_at: dict[str, set[int]] = {inst.name: set() for inst in chain}  # later positions reading each value
    # Where each chain value is read in the chain, by the reader's scope: a backward op reading
    # v transposes the reader of v in its own scope, which may sit later than v itself.
    readers: dict[tuple[str, str], int] = {}
    for p, inst in enumerate(chain):
        scope = _scope(inst)
        for operand in inst.operands:
            if operand in position:
                readers[(operand, scope)] = p
    update: list[str] = []
    unattributed: list[str] = []

    for inst in topological_order(entry):
        phase = instruction_phase(inst)
        if inst.name in position:
            p = position[inst.name]
            for operand in inst.operands:
                if operand in position:
                    last_read[operand] = max(last_read[operand], p)
                    read_at[operand].add(p)
            continue
        if phase is Phase.UPDATE:
            update.append(inst.name)
            continue
        if phase is not Phase.FORWARD and phase is not Phase.BACKWARD:
            unattributed.append(inst.name)
            continue
        forward_anchors, backward_anchors = [], []
        scope = _scope(inst)
        for operand in inst.operands:
            if operand in position:
                forward_anchors.append(max(position[operand],
                                           readers.get((operand, scope), -1)))
            elif operand in side:
                forward_anchors.append(anchor[operand])
            elif operand in first_use:
                forward_anchors.append(first_use[operand])
            elif operand in anchor:
                backward_anchors.append(anchor[operand])
        if phase is Phase.FORWARD:  # a side op: forward work of the layer it reads
            a = max(forward_anchors, default=0)
            anchor[inst.name] = a
            side.add(inst.name)
            forward.add(inst.name)
            for operand in inst.operands:
                if operand in position:
                    last_read[operand] = max(last_read[operand], a)
                    read_at[operand].add(a)
            continue
        if forward_anchors:
            a = max(forward_anchors)
        else:
            a = max(backward_anchors, default=n - 1)
        anchor[inst.name] = a
        for operand in inst.operands:
            if operand in position:
                stashed.setdefault(operand, position[operand])
            elif operand in side:
                stashed.setdefault(operand, anchor[operand])

    owner: dict[str, int] = {}
    for name in sorted(trainable):
        p = first_use.get(name)
        if p is None:
            # Only side or backward ops read it (or nothing): charge it where they are.
            users = [anchor[i.name] for i in entry.instructions
                     if i.name in anchor and i.name not in position and name in i.operands]
            p = min(users, default=0)
        owner[name] = p
    spans = tuple((inst.name, p, last_read[inst.name]) for p, inst in enumerate(chain) if last_read[inst.name] > p)
    readers = {name: tuple(sorted(r for r in read_at[name] if r > start)) for name, start, _ in spans}
    return ChainAttribution(tuple(chain), anchor, frozenset(forward), spans, stashed, owner,
                            tuple(update), tuple(unattributed), readers)


def chain_arrays(cap: Capture, device: DeviceSpec | str | None = None, *,
                 attribution: ChainAttribution | None = None, graph: FactorGraph | None = None) -> ChainArrays:
    """Per-chain-instruction forward/backward seconds, crossing bytes, W and stash
    (`attribution`: `attribute(cap)`, `graph`: the step's factor graph, when the caller has them
    already)."""
    spec = _device(device)
    module = cap.module
    entry = module.entry
    found = attribution if attribution is not None else attribute(cap)
    chain = found.chain
    n = found.length
    cache: CostCache = {}
    by_name = {inst.name: inst for inst in entry.instructions}

    def seconds(name: str) -> float:
        return kept_instruction_cost(by_name[name], entry, module, spec, cache).seconds

    forward_time = np.zeros(n)
    backward_time = np.zeros(n)
    forward_fixed = np.zeros(n)
    backward_fixed = np.zeros(n)
    split = batch_split(cap, spec, cache, graph=graph)
    # forward, backward: dependency level -> the last position one of its reductions is at
    sync_levels: tuple[dict[int, int], dict[int, int]] = ({}, {})
    sync_bytes = (np.zeros(n), np.zeros(n))
    replica_transposes = np.zeros(n)
    for name, p in found.anchor.items():
        forward = name in found.forward
        if name in split.replica_transposes:  # folded (free) on one replica, a copy on several
            replica_transposes[p] += transposed_product_cost(by_name[name], entry, spec).seconds
        t = seconds(name)
        (forward_time if forward else backward_time)[p] += t
        (forward_fixed if forward else backward_fixed)[p] += t * split.fixed.get(name, 0.0)
        if name in split.syncs.level:
            at = sync_levels[0 if forward else 1]
            level = split.syncs.level[name]
            at[level] = max(at.get(level, p), p)
            sync_bytes[0 if forward else 1][p] += split.syncs.nbytes[name]
    sync_counts = (np.zeros(n), np.zeros(n))
    for counts, at in zip(sync_counts, sync_levels):
        for p in at.values():  # the reductions of one level are one combined all-reduce
            counts[p] += 1
    update_seconds = fused_update_seconds(cap, spec)
    unattributed = sum(seconds(name) for name in found.unattributed)
    kept = kept_bytes(cap)
    stash_bytes = np.zeros(n)
    for name, p in found.stashed.items():
        stash_bytes[p] += kept.get(name, 0.0)
    parameter_bytes = np.zeros(n)
    gradient_buffers = np.zeros(n)  # one array per parameter: a buffer of the stage's gradient all-reduce
    for name, p in found.parameters.items():
        parameter_bytes[p] += float(by_name[name].shape.byte_size)
        gradient_buffers[p] += 1
    crossing, live = crossing_bytes(found, {name: kept.get(name, 0.0) for name, _, _ in found.spans})
    layers = []
    previous = ""
    for inst in chain:
        name = layer_name(inst.metadata, fallback=previous or inst.opcode)
        layers.append(name)
        previous = name
    profile = PipelineProfile(
        names=tuple(inst.name for inst in chain),
        forward_time=forward_time,
        backward_time=backward_time,
        activation_bytes=crossing,
        parameter_bytes=parameter_bytes,
        stash_bytes=stash_bytes,
        source=cap.source,
        # the update is elementwise over the parameters (Adam): priced per parameter byte, once per step
        update_seconds_per_byte=update_seconds / parameter_bytes.sum() if parameter_bytes.sum() > 0 else 0.0,
        forward_fixed=forward_fixed,
        backward_fixed=backward_fixed,
        forward_syncs=sync_counts[0],
        backward_syncs=sync_counts[1],
        forward_sync_bytes=sync_bytes[0],
        backward_sync_bytes=sync_bytes[1],
        gradient_buffers=gradient_buffers,
        replica_transposes=replica_transposes,
        pass_buffers=float(pass_buffers(cap)),
        state_leaves=float(state_leaves(cap)),
    )
    live.setflags(write=False)
    tables = source_tables(module)
    sources = tuple(source_location(inst, tables) for inst in chain)
    values = tuple(ChainValue(start, found.readers[name], kept.get(name, 0.0)) for name, start, _ in found.spans)
    return ChainArrays(profile, live, tuple(layers), update_seconds, unattributed, sources, values)


def fused_update_seconds(cap: Capture, device: DeviceSpec) -> float:
    """The optimizer update's seconds per step on `device`, as the one fused elementwise pass XLA
    makes of it: it reads every parameter, its gradient and its optimizer state and writes the
    parameter and the state back (Adam: 7 bytes moved per parameter byte, SGD 3), at the device's
    memory bandwidth. Pricing its instructions one by one, as the chain does the layers' work,
    counts each intermediate's round trip through memory: on haiku-mlp that was 5x the fused
    pass the SPMD estimate prices (`hlomap.cost.memory.Fusion`)."""
    trainable = sum(p.shape.byte_size for p in cap.with_role(Role.TRAINABLE))
    state = sum(p.shape.byte_size for p in cap.with_role(Role.OPTIMIZER_STATE))
    moved = 2.0 * (trainable + state) + trainable  # parameters and state read and written, gradients read
    return moved / device.hbm_bandwidth if moved else 0.0


def kept_bytes(cap: Capture) -> dict[str, float]:
    """Bytes of each entry instruction's result that a stage keeps or sends: its size, or 0 for a
    value computed from constants only (`propagation.graph.constant_derived`, calls read as
    inlined): XLA rebuilds such a value where it is read (a causal mask, the broadcast fill value
    `jnp.where`'s derivative reads), so it is neither stashed nor sent. Without this a GPT's
    stash counted a [batch, heads, seq, seq] constant per layer: 2,304 GiB of its 2,642 GiB per
    device for GPT-1.7B on 32 data replicas."""
    from hlomap.propagation.graph import constant_derived

    free = constant_derived(cap.module)
    return {inst.name: 0.0 if free.get(inst.name) and all(free[inst.name]) else _byte_size(inst)
            for inst in cap.module.entry.instructions}


def crossing_bytes(found: ChainAttribution, nbytes: Mapping[str, float]) -> tuple[np.ndarray, np.ndarray]:
    """([n - 1] bytes crossing each pivot, [n - 1] values crossing it) when value v weighs
    `nbytes[v]` (its full size, or its shard on one device under a sharding plan)."""
    return crossing_of(found, np.asarray([nbytes[name] for name, _, _ in found.spans], dtype=np.float64))


def crossing_of(found: ChainAttribution, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`crossing_bytes` with each span's bytes as an array in `found.spans` order."""
    n = found.length
    # each span adds at its start and takes away at its end; np.add.at is unbuffered and goes in
    # order, so the sums are those of a loop over the spans
    signed = np.stack([weights, -weights], axis=1).reshape(-1)
    delta = np.zeros(n + 1)
    np.add.at(delta, found.span_bounds, signed)
    count = np.zeros(n + 1)
    np.add.at(count, found.span_bounds, np.tile([1.0, -1.0], len(found.spans)))
    crossing = np.maximum(np.cumsum(delta)[: n - 1], 0.0)
    live = np.rint(np.cumsum(count)[: n - 1]).astype(np.int64)
    return crossing, live


def _device(device: DeviceSpec | str | None) -> DeviceSpec:
    if device is None:
        return device_preset(DEFAULT_DEVICE)
    if isinstance(device, str):
        return device_preset(device)
    return device


# ---------------------------------------------------------------------------------------------
# Pivots
# ---------------------------------------------------------------------------------------------


def thin_pivots(profile: PipelineProfile, candidates: Sequence[int], max_pivots: int) -> list[int]:
    """At most `max_pivots` of the candidate pivots: runs with no compute between them keep
    their cheapest member; then, if still too many, one pivot (the cheapest) per bin of equal
    compute, so that resolution follows where the time is."""
    prefix = profile.prefix().compute
    cost = profile.activation_bytes
    kept: list[int] = []
    for p in sorted(set(int(c) for c in candidates)):
        if kept and prefix[p + 1] <= prefix[kept[-1] + 1]:
            if cost[p] < cost[kept[-1]]:
                kept[-1] = p
            continue
        kept.append(p)
    if len(kept) <= max_pivots:
        return kept
    total = prefix[-1]
    if total <= 0:
        step = len(kept) / max_pivots
        return [kept[int(i * step)] for i in range(max_pivots)]
    where = np.array([prefix[p + 1] / total for p in kept])

    def binned(bins: int) -> list[int]:
        best: dict[int, int] = {}
        for p, x in zip(kept, where):
            b = min(int(x * bins), bins - 1)
            if b not in best or cost[p] < cost[best[b]]:
                best[b] = p
        return sorted(best.values())

    # One big op (an LM head) can leave most equal-compute bins empty, so use as many bins as
    # keep at most `max_pivots` non-empty ones (the count grows with the bins; bisect on it).
    low, high = max_pivots, max_pivots
    while len(binned(high * 2)) <= max_pivots and high < 1 << 24:
        high *= 2
    high *= 2
    while high - low > 1:
        mid = (low + high) // 2
        if len(binned(mid)) <= max_pivots:
            low = mid
        else:
            high = mid
    return binned(low)


def select_pivots(chain: ChainArrays, options: PivotOptions = PivotOptions()) -> list[int]:
    """Chain positions of the candidate pivots (module docstring)."""
    crossing = chain.profile.activation_bytes
    if crossing.size == 0:
        return []
    limit = float(np.quantile(crossing, options.bytes_quantile))
    candidates = np.flatnonzero((chain.live_tensors <= 1) | (crossing <= limit))
    return thin_pivots(chain.profile, candidates.tolist(), options.max_pivots)


def step_chain(
    cap: Capture,
    device: DeviceSpec | str | None = None,
    *,
    options: PivotOptions = PivotOptions(),
    attribution: ChainAttribution | None = None,
    graph: FactorGraph | None = None,
) -> StepChain:
    """The pipeline model of a captured train step on `device` (default: a V100-16GB);
    `attribution`: `attribute(cap)`, `graph`: the step's factor graph, when the caller has them
    already."""
    chain = chain_arrays(cap, device, attribution=attribution, graph=graph)
    kept = select_pivots(chain, options)
    profile = merge_layers(chain.profile, kept)
    scopes = nearest_scopes(chain.layers)
    pivots = tuple(
        Pivot(
            position=p,
            instruction=chain.profile.names[p],
            layer=chain.layers[p],
            crossing_bytes=float(chain.profile.activation_bytes[p]),
            live_tensors=int(chain.live_tensors[p]),
            scope=scopes[p],
            source=chain.sources[p] if chain.sources else None,
        )
        for p in kept
    )
    total = float(chain.profile.compute_time.sum())
    log.info(
        "%s: %d forward instructions, %d candidate pivots; forward %.4g s, backward %.4g s, "
        "update %.4g s (once per step), unattributed %.4g s",
        cap.source, chain.profile.n_layers, len(kept),
        float(chain.profile.forward_time.sum()), float(chain.profile.backward_time.sum()),
        chain.update_seconds, chain.unattributed_seconds,
    )
    if not math.isfinite(total):
        raise ValueError(f"{cap.source}: compute time is not finite")
    return StepChain(profile=profile, pivots=pivots, chain=chain)
