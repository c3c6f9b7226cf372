"""Per-instruction compute cost: FLOPs, bytes and a roofline time for one device.

FLOPs follow XLA's HloCostAnalysis conventions, so that `module_flops` of a compiled module
equals `compiled.cost_analysis()["flops"]` and the two can be checked against each other:
- dot: 2 x result elements x product of the contracting dims (batch dims are in the result);
- convolution: 2 x (input features / feature_group_count) x output features x
  (batch / batch_group_count) x, per spatial dim, the number of (output, kernel) position pairs
  that land on real input (padding and dilation holes do no work);
- elementwise ops (arithmetic, compare, select, clamp, convert): 1 flop per result element;
  transcendental ops (exp, log, tanh, ...) are counted separately, as XLA does;
- reduce: (input elements - result elements) x the reducer's flops; reduce-window: (window
  size - 1) x result elements x the reducer's flops;
- data movement (copy, transpose, broadcast, slice, gather, pad, ...) does no flops.
Shape-only ops (parameter, constant, tuple, get-tuple-element, bitcast, reshape) cost nothing,
bytes included. Other ops move `operands + result` bytes. Which of these classes prices an
opcode (`cost_class`) is read from the opcode table, `hlomap.hlo.opcodes`.

Time is a roofline: max(compute, memory), compute = flops / (peak(dtype) x efficiency) plus
transcendentals at `TRANSCENDENTAL_FLOPS` f32 flops each, memory = bytes / HBM bandwidth. Dots
and convolutions use the peak of their operand type (tensor cores); everything else the lower of
its type's rate and the f32 rate (vector units; see `flop_rate`).
A fusion is one kernel: its flops are those of its fused instructions, its bytes only its own
operands and result (intermediates stay on chip), and its time the roofline of both. A call,
while or conditional costs what its computations cost (a while: trip count x (body + condition)).
A while loop's trip count comes from XLA's `known_trip_count` backend config when present, else
from the counted-loop pattern JAX emits (`i < N` over `i = c0; i += step`), else 1 with a
warning. XLA's own cost analysis counts every while loop once, so `module_flops` and XLA agree
only on modules without loops of more than one trip.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import re
from collections import Counter
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Callable, Mapping, MutableMapping, NamedTuple

import numpy as np

from hlomap.cost.devices import FALLBACK_DTYPE, OVERSIZED_CONVOLUTION, DeviceSpec
from hlomap.hlo.ir import ArrayShape, Computation, Instruction, Module, Shape
from hlomap.hlo.opcodes import OPCODES, AsyncPart, Elementwise, OpcodeInfo, opcode_names

_LOG = logging.getLogger(__name__)

#: f32 flops charged per transcendental: GPUs evaluate them on special-function units with a
#: quarter of the FP32 throughput (16 SFUs vs 64 FP32 lanes per SM on V100, A100 and H100).
TRANSCENDENTAL_FLOPS = 4.0

#: Ops that only rename or regroup buffers, or bring values in; XLA emits no kernel for them.
FREE_OPCODES = opcode_names(lambda op: op.free)

#: Elementwise ops counted as transcendentals rather than flops (XLA's list).
TRANSCENDENTAL_OPCODES = opcode_names(lambda op: op.elementwise is Elementwise.TRANSCENDENTAL)

#: Ops worth one flop per result element: elementwise arithmetic and predicates, and
#: bitcast-convert, which XLA's cost analysis counts alike although its result may have an extra
#: dim (a narrower element type).
ELEMENTWISE_OPCODES = opcode_names(
    lambda op: op.elementwise in (Elementwise.ARITHMETIC, Elementwise.PREDICATE)
) | {"bitcast-convert"}

#: Ops that move data and do no arithmetic: their operand and result bytes, no flops. The
#: communication of the collectives among them is priced by `hlomap.cost.collectives`.
DATA_MOVEMENT_OPCODES = opcode_names(lambda op: op.elementwise is Elementwise.COPY) | {
    "all-gather", "all-to-all", "broadcast", "collective-broadcast", "collective-permute",
    "concatenate", "dynamic-reshape", "dynamic-slice", "dynamic-update-slice", "gather", "infeed",
    "iota", "outfeed", "pad", "ragged-all-to-all", "recv", "reverse", "rng-get-and-update-state",
    "send", "shuffle", "slice", "transpose",
}

#: Ops that do arithmetic the model does not count, and why: they are priced by their bytes.
FLOPS_NOT_MODELED: Mapping[str, str] = MappingProxyType({
    "batch-norm-grad": "JAX lowers batch norm to reductions and elementwise ops",
    "batch-norm-inference": "JAX lowers batch norm to reductions and elementwise ops",
    "batch-norm-training": "JAX lowers batch norm to reductions and elementwise ops",
    "collective-reduce": "a collective written by hand; its reduction is not counted",
    "custom-call": "what a custom-call target computes is unknown",
    "ragged-dot": "its groups' sizes are known only at run time",
    "reduce-scatter": "its local reduction is not counted (all-reduce's is, as XLA counts it)",
    "scaled-dot": "block-scaled dots are not modeled",
    "scan": "JAX lowers scans to while loops; this loop form is not modeled",
    "topk": "selection work is not modeled",
})


class CostClass(enum.Enum):
    """How `instruction_cost` prices an opcode (see `cost_class`)."""

    FREE = "no kernel"
    AT_START = "priced at the start of its async pair"
    FLOP_PER_ELEMENT = "one flop per result element"
    TRANSCENDENTAL_PER_ELEMENT = "one transcendental per result element"
    FORMULA = "a formula of its own (dot, convolution, reduce, fusion, while, ...)"
    BYTES_ONLY = "its operand and result bytes, no flops"


@dataclass(frozen=True)
class InstructionCost:
    """Work and roofline time of an instruction (or a sum of them) on one device.

    `seconds` is max(compute_seconds, memory_seconds) for one kernel, and the sum of its parts'
    `seconds` for a sequence of kernels (a computation, a loop). Times are 0 when no device was
    given.
    """

    flops: float = 0.0
    transcendentals: float = 0.0
    bytes_accessed: float = 0.0
    compute_seconds: float = 0.0
    memory_seconds: float = 0.0
    seconds: float = 0.0

    def __add__(self, other: InstructionCost) -> InstructionCost:
        return InstructionCost(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def scaled(self, factor: float) -> InstructionCost:
        return InstructionCost(*(getattr(self, f.name) * factor for f in fields(self)))

    def maximum(self, other: InstructionCost) -> InstructionCost:
        return InstructionCost(*(max(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)))


ZERO = InstructionCost()

#: Explicit memo of computation costs for one (module, device): (computation name, timed) ->
#: cost. `timed` is False for costs computed without a device (scalar reducers, map functions,
#: whose flops are all that matters).
CostCache = MutableMapping[tuple[str, bool], InstructionCost]


# ---------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------


def _elements(shape: Shape) -> int:
    """Elements of an array, or of a tuple's first leaf (variadic ops: one result per input)."""
    leaf = shape if isinstance(shape, ArrayShape) else next(shape.leaves(), ArrayShape("f32", ()))
    return leaf.num_elements


def _array(shape: Shape, what: str) -> ArrayShape:
    if not isinstance(shape, ArrayShape):
        raise ValueError(f"{what}: expected an array shape, got {shape}")
    return shape


def _first_dtype(shape: Shape) -> str:
    leaf = shape if isinstance(shape, ArrayShape) else next(shape.leaves(), ArrayShape(FALLBACK_DTYPE))
    return leaf.dtype


def _operand(inst: Instruction, comp: Computation, i: int) -> Instruction:
    try:
        return comp[inst.operands[i]]
    except (IndexError, KeyError):
        raise ValueError(f"instruction {inst.name!r} ({inst.opcode}) in computation {comp.name!r}: "
                         f"operand {i} not found (operands {inst.operands})") from None


def _operand_bytes(inst: Instruction, comp: Computation) -> int:
    return sum(_operand(inst, comp, i).shape.byte_size for i in range(len(inst.operands)))


def folds_into_product(inst: Instruction, comp: Computation) -> bool:
    """Whether `inst` transposes the matrix a dot without batch dims computed: XLA computes the
    product transposed instead ((AB)^T = B^T A^T, its algebraic simplifier swapping the dot's
    operands), so the transpose emits no kernel and moves nothing. JAX's weight gradients are
    such transposes; on 8 CPU devices pricing them as copies put 249 us of 3.7 ms on haiku-mlp's
    one-device step that its profile does not show."""
    if inst.opcode != "transpose" or inst.shape.is_tuple or inst.shape.rank != 2 or not inst.operands:
        return False
    producer = comp.by_name.get(inst.operands[0])
    return (producer is not None and producer.opcode == "dot"
            and not producer.dot_dimension_numbers.lhs_batch)


def transposed_product_cost(inst: Instruction, comp: Computation, device: DeviceSpec | None) -> InstructionCost:
    """What a transpose that `folds_into_product` costs when the plan all-reduces the product
    before it: XLA then all-reduces the product as the dot computed it and transposes after, so
    the transpose runs as a kernel. Priced as a copy (its operand read, its result written): a
    lower bound, since XLA fuses it into each reader, which reads at a slower rate that depends on
    the stride (docs/benchmarks.md). On 8 CPU devices a data-parallel step of an MLP the size of
    haiku-mlp (Adam) ran 24.2 ms with its weight gradients all-reduced transposed and transposed
    back, against 13.0 ms with them all-reduced in their own layout."""
    nbytes = _operand_bytes(inst, comp) + inst.shape.byte_size
    return _kernel(0.0, 0.0, nbytes, _first_dtype(inst.shape), device)


def emits_no_kernel(inst: Instruction, comp: Computation) -> bool:
    """Whether XLA runs nothing for `inst`: a shape-only op (`FREE_OPCODES`) or a transpose that
    folds into the product it transposes (`folds_into_product`)."""
    return inst.opcode in FREE_OPCODES or folds_into_product(inst, comp)


# ---------------------------------------------------------------------------------------------
# FLOP counts (pure functions of shapes and attributes)
# ---------------------------------------------------------------------------------------------


def dot_flops(inst: Instruction, lhs: ArrayShape) -> float:
    """2 x result elements x contracting size; batch dims are part of the result."""
    contracting = math.prod(lhs.dims[d] for d in inst.dot_dimension_numbers.lhs_contracting)
    return 2.0 * _elements(inst.shape) * contracting


def _valid_positions(in_size: int, kernel_size: int, out_size: int, stride: int, pad_low: int,
                     window_dilation: int, base_dilation: int) -> int:
    """(output, kernel) index pairs of one spatial dim that read a real input element."""
    out_idx = np.arange(out_size)[:, None]
    ker_idx = np.arange(kernel_size)[None, :]
    undilated = out_idx * stride - pad_low + ker_idx * window_dilation
    on_input = undilated % base_dilation == 0
    index = undilated // base_dilation
    return int(np.count_nonzero(on_input & (index >= 0) & (index < in_size)))


def convolution_flops(inst: Instruction, lhs: ArrayShape, rhs: ArrayShape) -> float:
    dn = inst.conv_dimension_numbers
    if dn is None:
        raise ValueError(f"convolution {inst.name!r} has no dim_labels")
    out = _array(inst.shape, f"convolution {inst.name!r} result")
    window = inst.window
    if len(window) != len(dn.input_spatial):
        raise ValueError(f"convolution {inst.name!r}: window has {len(window)} dims for "
                         f"{len(dn.input_spatial)} spatial dims")
    valid = 1
    for s, w in enumerate(window):
        valid *= _valid_positions(lhs.dims[dn.input_spatial[s]], rhs.dims[dn.kernel_spatial[s]],
                                  out.dims[dn.output_spatial[s]], w.stride, w.pad_low,
                                  w.window_dilation, w.base_dilation)
    in_features = lhs.dims[dn.input_feature] // inst.feature_group_count
    batch = lhs.dims[dn.input_batch] // inst.batch_group_count
    return 2.0 * in_features * out.dims[dn.output_feature] * batch * valid


class MatrixSides(NamedTuple):
    """A dot or convolution as the product of an m x k and a k x n matrix: the result dims whose
    product is m (`rows`: a dot's left free dims; a convolution's batch and spatial dims) and n
    (`columns`: a dot's right free dims; a convolution's output features), and k (`inner`: the
    contracted size; a convolution's input features per group times its window). A dot's batch
    dims are neither: they count separate products."""

    rows: tuple[int, ...]
    columns: tuple[int, ...]
    inner: int

    def width(self, result_dims: tuple[int, ...] | np.ndarray, inner_split: int = 1) -> float:
        """min(m, k, n) for a result of dims `result_dims` (the whole result or one device's
        block of it) and the contraction split `inner_split` ways."""
        rows = math.prod(int(result_dims[d]) for d in self.rows)
        columns = math.prod(int(result_dims[d]) for d in self.columns)
        return float(min(rows, columns, self.inner / max(inner_split, 1)))


def matrix_sides(inst: Instruction, comp: Computation) -> MatrixSides | None:
    """The matrix product a dot or convolution computes (`MatrixSides`); None for other ops."""
    if inst.opcode == "dot":
        dn = inst.dot_dimension_numbers
        lhs = _array(_operand(inst, comp, 0).shape, f"dot {inst.name!r} lhs")
        batch = len(dn.lhs_batch)
        left = lhs.rank - batch - len(dn.lhs_contracting)
        rank = _array(inst.shape, f"dot {inst.name!r} result").rank
        return MatrixSides(tuple(range(batch, batch + left)), tuple(range(batch + left, rank)),
                           math.prod(lhs.dims[d] for d in dn.lhs_contracting))
    if inst.opcode == "convolution":
        dn = inst.conv_dimension_numbers
        if dn is None:
            return None
        lhs = _array(_operand(inst, comp, 0).shape, f"convolution {inst.name!r} input")
        rhs = _array(_operand(inst, comp, 1).shape, f"convolution {inst.name!r} kernel")
        window = math.prod(rhs.dims[d] for d in dn.kernel_spatial)
        return MatrixSides((dn.output_batch, *dn.output_spatial), (dn.output_feature,),
                           lhs.dims[dn.input_feature] // max(inst.feature_group_count, 1) * window)
    return None


def reduce_window_count(inst: Instruction) -> int:
    """How many times the reducer runs. XLA counts a reduce-window that is really a full reduce
    followed by a broadcast along one dim (JAX's cumulative ops) as such; so do we."""
    window = inst.window
    window_size = math.prod(w.size for w in window)
    out = _elements(inst.shape)
    count = (window_size - 1) * out
    reduced = [(i, w) for i, w in enumerate(window) if w.size != 1]
    padded = [w for w in window if w.pad_low or w.pad_high]
    if len(reduced) == 1 and len(padded) == 1 and isinstance(inst.shape, ArrayShape):
        i, w = reduced[0]
        if (w.pad_low and w.pad_low == w.pad_high and w.size == 2 * w.pad_low + 1
                and w.pad_low == inst.shape.dims[i] - 1):
            span = inst.shape.dims[i]
            count = out // span + (span - 1)
    return count


# ---------------------------------------------------------------------------------------------
# While-loop trip counts
# ---------------------------------------------------------------------------------------------


def _through_copies(comp: Computation, name: str) -> Instruction:
    inst = comp[name]
    while inst.opcode in ("copy", "convert", "bitcast", "reshape") and inst.operands:
        inst = comp[inst.operands[0]]
    return inst


def _scalar_constant(comp: Computation, name: str) -> int | None:
    inst = _through_copies(comp, name)
    if inst.opcode != "constant" or inst.payload is None or not isinstance(inst.shape, ArrayShape):
        return None
    if inst.shape.dims:
        return None
    try:
        return int(inst.payload.strip())
    except ValueError:
        return None


def _loop_variable(comp: Computation, name: str) -> int | None:
    """Tuple index i when `name` is get-tuple-element(parameter, i)."""
    inst = _through_copies(comp, name)
    if inst.opcode != "get-tuple-element" or not inst.operands:
        return None
    if comp[inst.operands[0]].opcode != "parameter":
        return None
    return inst.tuple_index


def known_trip_count(inst: Instruction) -> int | None:
    """XLA's `known_trip_count` from the while's backend_config (compiled modules)."""
    text = inst.attr("backend_config")
    if not text:
        return None
    try:
        config = json.loads(text)
        return int(config["known_trip_count"]["n"])
    except (ValueError, KeyError, TypeError):
        return None


_FLIPPED = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE", "NE": "NE"}


def inferred_trip_count(inst: Instruction, comp: Computation, module: Module) -> int | None:
    """Trip count of a counted loop `for (i = c0; i < N; i += step)` as JAX lowers fori_loop and
    scan: condition `compare(gte(p, i), constant N)`, body `tuple(..., add(gte(p, i), constant
    step), ...)`, init `tuple(..., constant c0, ...)`. None when the loop has another form."""
    try:
        cond = module.computation((inst.attr("condition") or "").lstrip("%"))
        body = module.computation((inst.attr("body") or "").lstrip("%"))
    except KeyError:
        return None
    root = cond.root
    if root.opcode != "compare" or len(root.operands) != 2:
        return None
    direction = root.comparison_direction
    index, limit = _loop_variable(cond, root.operands[0]), _scalar_constant(cond, root.operands[1])
    if index is None:  # `N > i` is `i < N`
        index, limit = _loop_variable(cond, root.operands[1]), _scalar_constant(cond, root.operands[0])
        direction = _FLIPPED.get(direction or "")
    if index is None or limit is None or direction not in ("LT", "LE", "NE"):
        return None
    init = _through_copies(comp, inst.operands[0]) if inst.operands else None
    if init is None or init.opcode != "tuple" or index >= len(init.operands):
        return None
    start = _scalar_constant(comp, init.operands[index])
    body_root = body.root
    if start is None or body_root.opcode != "tuple" or index >= len(body_root.operands):
        return None
    update = _through_copies(body, body_root.operands[index])
    if update.opcode != "add" or len(update.operands) != 2:
        return None
    a, b = update.operands
    step = _scalar_constant(body, b) if _loop_variable(body, a) == index else (
        _scalar_constant(body, a) if _loop_variable(body, b) == index else None)
    if step is None or step <= 0:
        return None
    span = limit - start
    if direction == "LT":
        return max(0, -(-span // step))
    if direction == "LE":
        return max(0, span // step + 1)
    return span // step if span >= 0 and span % step == 0 else None


def while_trip_count(inst: Instruction, comp: Computation, module: Module) -> int:
    known = known_trip_count(inst)
    if known is not None:
        return known
    inferred = inferred_trip_count(inst, comp, module)
    if inferred is not None:
        return inferred
    _LOG.warning("while loop %r in computation %r: trip count unknown (no known_trip_count "
                 "backend config, not a counted loop); costing one iteration", inst.name, comp.name)
    return 1


# ---------------------------------------------------------------------------------------------
# Instruction and computation costs
# ---------------------------------------------------------------------------------------------


def flop_rate(device: DeviceSpec, dtype: str, matrix: bool) -> float:
    """Peak FLOP/s for an op on `dtype`: matrix units (dot, convolution) run at the type's own
    (tensor-core) rate; vector units at the lower of that and the f32 rate, since 16-bit tensor
    core figures do not apply to elementwise work while f64 is slower than f32."""
    rate = device.flops_for(dtype)
    return rate if matrix else min(rate, device.flops_for(FALLBACK_DTYPE))


def _kernel(flops: float, transcendentals: float, nbytes: float, dtype: str,
            device: DeviceSpec | None, *, matrix: bool = False,
            compute_seconds: float | None = None) -> InstructionCost:
    """The roofline of one kernel. `compute_seconds` overrides the flops-derived time (fusions
    add up the times of their parts, which may run at different rates)."""
    if device is None:
        return InstructionCost(flops, transcendentals, nbytes)
    if compute_seconds is None:
        compute_seconds = (flops / (flop_rate(device, dtype, matrix) * device.efficiency)
                           + transcendentals * TRANSCENDENTAL_FLOPS
                           / (device.flops_for(FALLBACK_DTYPE) * device.efficiency))
    memory_seconds = nbytes / device.hbm_bandwidth
    return InstructionCost(flops, transcendentals, nbytes, compute_seconds, memory_seconds,
                           max(compute_seconds, memory_seconds))


def _computation(module: Module, name: str) -> Computation:
    try:
        return module.computation(name)
    except KeyError:
        raise ValueError(f"module {module.name!r} has no computation {name!r}") from None


def computation_cost(module: Module, name: str, device: DeviceSpec | None = None,
                     cache: CostCache | None = None) -> InstructionCost:
    """Sum of the costs of a computation's instructions (each one kernel), memoized in `cache`."""
    cache = {} if cache is None else cache
    key = (name, device is not None)
    cached = cache.get(key)
    if cached is not None:
        return cached
    comp = _computation(module, name)
    total = ZERO
    for inst in comp.instructions:
        total = total + instruction_cost(inst, comp, module, device, cache)
    cache[key] = total
    return total


def _called(inst: Instruction, key: str) -> str:
    value = inst.attr(key)
    if value is None:
        raise ValueError(f"instruction {inst.name!r} ({inst.opcode}) has no {key}= attribute")
    return value.strip().lstrip("%")


def _per_application(module: Module, inst: Instruction, key: str, cache: CostCache) -> InstructionCost:
    """Work of one application of a scalar computation (a reducer, a map function)."""
    return computation_cost(module, _called(inst, key), None, cache)


def instruction_cost(inst: Instruction, comp: Computation, module: Module,
                     device: DeviceSpec | None = None, cache: CostCache | None = None) -> InstructionCost:
    """Cost of `inst` (in computation `comp` of `module`) on `device`; see the module docstring.

    `cache` memoizes called computations across calls; pass the same dict for one module and
    device. Without a device only flops, transcendentals and bytes are computed.
    """
    cache = {} if cache is None else cache
    op = _PRICED_AS.get(inst.opcode, inst.opcode)
    kind = _COST_CLASSES.get(op)
    if kind is CostClass.FREE or kind is CostClass.AT_START or folds_into_product(inst, comp):
        return ZERO  # an async pair is costed once, at its start
    handler = _HANDLERS.get(op)
    if handler is not None:
        return handler(inst, comp, module, device, cache)
    nbytes = _operand_bytes(inst, comp) + inst.shape.byte_size
    dtype = _first_dtype(inst.shape)
    if kind is CostClass.TRANSCENDENTAL_PER_ELEMENT:
        return _kernel(0.0, _elements(inst.shape), nbytes, dtype, device)
    if kind is CostClass.FLOP_PER_ELEMENT:
        return _kernel(_elements(inst.shape), 0.0, nbytes, dtype, device)
    if kind is None:
        _LOG.debug("%r (%s) is not an opcode of XLA's text format: costing its memory traffic "
                   "only", inst.name, inst.opcode)
    elif op in FLOPS_NOT_MODELED:
        _LOG.debug("%r (%s): flops not modeled (%s); costing its memory traffic only",
                   inst.name, op, FLOPS_NOT_MODELED[op])
    return _kernel(0.0, 0.0, nbytes, dtype, device)


def kept_instruction_cost(inst: Instruction, comp: Computation, module: Module, device: DeviceSpec,
                          cache: CostCache) -> InstructionCost:
    """`instruction_cost`, kept in `cache` per instruction and device: for callers that price one
    module's instructions more than once (each plan of a planner, a step's chain and its batch
    split). Keyed by the device itself, not its name: a sped-up copy of a measured device
    (`hlomap.cost.cluster.sped_up`) keeps the name."""
    key = ("node", inst.name, comp.name, device)
    found = cache.get(key)  # type: ignore[call-overload]
    if found is None:
        found = instruction_cost(inst, comp, module, device, cache)
        cache[key] = found  # type: ignore[index]
    return found


Handler = Callable[[Instruction, Computation, Module, DeviceSpec | None, CostCache], InstructionCost]


#: The opcodes that compute a matrix product (`matrix_sides`, `matrix_kind`).
MATRIX_OPCODES = frozenset({"convolution", "dot"})


def _oversized_window(inst: Instruction, comp: Computation) -> bool:
    """Whether a convolution's window (dilated) is larger than its input in some spatial dim."""
    dn = inst.conv_dimension_numbers
    if dn is None or len(inst.window) != len(dn.input_spatial):
        return False
    lhs = _array(_operand(inst, comp, 0).shape, f"convolution {inst.name!r} input")
    return any((w.size - 1) * w.window_dilation + 1 > lhs.dims[dn.input_spatial[s]]
               for s, w in enumerate(inst.window))


def matrix_kind(inst: Instruction, comp: Computation) -> str | None:
    """The matrix kind (`MATRIX_KINDS`) whose narrow curve prices `inst`: "dot" for a dot,
    `OVERSIZED_CONVOLUTION` for a convolution whose window reaches past its input, "convolution"
    for any other; None for other ops."""
    if inst.opcode == "dot":
        return "dot"
    if inst.opcode != "convolution":
        return None
    return OVERSIZED_CONVOLUTION if _oversized_window(inst, comp) else "convolution"


def curve_kind(inst: Instruction, comp: Computation, device: DeviceSpec) -> str | None:
    """The key of `device`'s narrow curve that prices `inst` (`matrix_kind`); None when no curve
    applies (a kind without a curve runs at the full matrix rate: a calibration fits none where
    every width did). An oversized convolution on a device calibrated before that kind was
    measured takes the convolution curve, as it did then."""
    kind = matrix_kind(inst, comp)
    if kind is None or kind in device.narrow:
        return kind
    return "convolution" if kind == OVERSIZED_CONVOLUTION and "convolution" in device.narrow else None


def narrow_factor(inst: Instruction, comp: Computation, device: DeviceSpec | None) -> float:
    """The share of its matrix rate `inst` (a dot or convolution, whole) achieves on `device`
    given its narrowest side and kind (`curve_kind`); 1 for other ops and devices without a curve."""
    if device is None:
        return 1.0
    kind = curve_kind(inst, comp, device)
    sides = matrix_sides(inst, comp) if kind is not None else None
    if kind is None or sides is None:
        return 1.0
    return device.narrow_factor(kind, sides.width(_array(inst.shape, f"{inst.opcode} {inst.name!r}").dims))


def _matrix_kernel(flops: float, nbytes: float, dtype: str, device: DeviceSpec | None,
                   narrow: float) -> InstructionCost:
    """The roofline of a dot or convolution at `narrow` of the matrix rate (`narrow_factor`)."""
    if device is None:
        return _kernel(flops, 0.0, nbytes, dtype, device, matrix=True)
    return _kernel(flops, 0.0, nbytes, dtype, device, matrix=True,
                   compute_seconds=flops / (flop_rate(device, dtype, True) * device.efficiency * narrow))


def _dot(inst: Instruction, comp: Computation, module: Module, device: DeviceSpec | None,
         cache: CostCache) -> InstructionCost:
    lhs = _array(_operand(inst, comp, 0).shape, f"dot {inst.name!r} lhs")
    nbytes = _operand_bytes(inst, comp) + inst.shape.byte_size
    return _matrix_kernel(dot_flops(inst, lhs), nbytes, lhs.dtype, device, narrow_factor(inst, comp, device))


def _convolution(inst: Instruction, comp: Computation, module: Module, device: DeviceSpec | None,
                 cache: CostCache) -> InstructionCost:
    lhs = _array(_operand(inst, comp, 0).shape, f"convolution {inst.name!r} input")
    rhs = _array(_operand(inst, comp, 1).shape, f"convolution {inst.name!r} kernel")
    nbytes = _operand_bytes(inst, comp) + inst.shape.byte_size
    return _matrix_kernel(convolution_flops(inst, lhs, rhs), nbytes, lhs.dtype, device,
                          narrow_factor(inst, comp, device))


def _applied(inst: Instruction, comp: Computation, module: Module, device: DeviceSpec | None,
             cache: CostCache, key: str, count: float) -> InstructionCost:
    """An op that applies a scalar computation `count` times (reduce, map, scatter...)."""
    per = _per_application(module, inst, key, cache)
    nbytes = _operand_bytes(inst, comp) + inst.shape.byte_size
    return _kernel(per.flops * count, per.transcendentals * count, nbytes, _first_dtype(inst.shape), device)


def _reduce(inst: Instruction, comp: Computation, module: Module, device: DeviceSpec | None,
            cache: CostCache) -> InstructionCost:
    count = _elements(_operand(inst, comp, 0).shape) - _elements(inst.shape)
    return _applied(inst, comp, module, device, cache, "to_apply", count)


def _reduce_window(inst: Instruction, comp: Computation, module: Module, device: DeviceSpec | None,
                   cache: CostCache) -> InstructionCost:
    return _applied(inst, comp, module, device, cache, "to_apply", reduce_window_count(inst))


def _map(inst: Instruction, comp: Computation, module: Module, device: DeviceSpec | None,
         cache: CostCache) -> InstructionCost:
    return _applied(inst, comp, module, device, cache, "to_apply", _elements(inst.shape))


def _scatter(inst: Instruction, comp: Computation, module: Module, device: DeviceSpec | None,
             cache: CostCache) -> InstructionCost:
    n_inputs = (len(inst.operands) - 1) // 2  # inputs..., indices, updates...
    updates = _elements(_operand(inst, comp, n_inputs + 1).shape)
    return _applied(inst, comp, module, device, cache, "to_apply", updates)


def _select_and_scatter(inst: Instruction, comp: Computation, module: Module, device: DeviceSpec | None,
                        cache: CostCache) -> InstructionCost:
    source = _elements(_operand(inst, comp, 1).shape)
    window = math.prod(w.size for w in inst.window)
    select = _per_application(module, inst, "select", cache)
    scatter = _per_application(module, inst, "scatter", cache)
    flops = select.flops * source * (window - 1) + scatter.flops * source
    trans = select.transcendentals * source * (window - 1) + scatter.transcendentals * source
    nbytes = _operand_bytes(inst, comp) + inst.shape.byte_size
    return _kernel(flops, trans, nbytes, _first_dtype(inst.shape), device)


def _sort(inst: Instruction, comp: Computation, module: Module, device: DeviceSpec | None,
          cache: CostCache) -> InstructionCost:
    n = _elements(_operand(inst, comp, 0).shape)
    flops = n * math.ceil(math.log2(n)) if n > 1 else 0
    nbytes = _operand_bytes(inst, comp) + inst.shape.byte_size
    return _kernel(flops, 0.0, nbytes, _first_dtype(inst.shape), device)


def _fft(inst: Instruction, comp: Computation, module: Module, device: DeviceSpec | None,
         cache: CostCache) -> InstructionCost:
    lengths = [int(x) for x in re.findall(r"\d+", inst.attr("fft_length", "") or "")]
    log_factors = math.prod(int(math.floor(math.log2(n))) for n in lengths if n > 0)
    flops = 2 * 4 * log_factors * _elements(_operand(inst, comp, 0).shape)
    nbytes = _operand_bytes(inst, comp) + inst.shape.byte_size
    return _kernel(flops, 0.0, nbytes, _first_dtype(inst.shape), device)


def _triangular_solve(inst: Instruction, comp: Computation, module: Module, device: DeviceSpec | None,
                      cache: CostCache) -> InstructionCost:
    a = _array(_operand(inst, comp, 0).shape, f"triangular-solve {inst.name!r} a")
    flops = 2 * a.dims[-1] * _elements(_operand(inst, comp, 1).shape)
    nbytes = _operand_bytes(inst, comp) + inst.shape.byte_size
    return _kernel(flops, 0.0, nbytes, a.dtype, device)


def _cholesky(inst: Instruction, comp: Computation, module: Module, device: DeviceSpec | None,
              cache: CostCache) -> InstructionCost:
    a = _array(_operand(inst, comp, 0).shape, f"cholesky {inst.name!r} operand")
    flops = a.dims[-1] * a.num_elements // 3
    return _kernel(flops, 0.0, _operand_bytes(inst, comp) + inst.shape.byte_size, a.dtype, device)


def _rng(inst: Instruction, comp: Computation, module: Module, device: DeviceSpec | None,
         cache: CostCache) -> InstructionCost:
    # XLA prices a random number like a transcendental.
    count = sum(leaf.num_elements for leaf in inst.shape.leaves())
    return _kernel(0.0, count, _operand_bytes(inst, comp) + inst.shape.byte_size,
                   _first_dtype(inst.shape), device)


def _all_reduce(inst: Instruction, comp: Computation, module: Module, device: DeviceSpec | None,
                cache: CostCache) -> InstructionCost:
    # The local reduction work only (XLA counts one flop per element); the communication is
    # priced by hlomap.cost.collectives.
    count = sum(leaf.num_elements for leaf in inst.shape.leaves())
    return _kernel(count, 0.0, _operand_bytes(inst, comp) + inst.shape.byte_size,
                   _first_dtype(inst.shape), device)


def _fusion(inst: Instruction, comp: Computation, module: Module, device: DeviceSpec | None,
            cache: CostCache) -> InstructionCost:
    inner = computation_cost(module, _called(inst, "calls"), device, cache)
    nbytes = _operand_bytes(inst, comp) + inst.shape.byte_size
    return _kernel(inner.flops, inner.transcendentals, nbytes, _first_dtype(inst.shape), device,
                   compute_seconds=inner.compute_seconds)


def _call(inst: Instruction, comp: Computation, module: Module, device: DeviceSpec | None,
          cache: CostCache) -> InstructionCost:
    total = ZERO
    for name in inst.called_computations:
        total = total + computation_cost(module, name, device, cache)
    return total


def _while(inst: Instruction, comp: Computation, module: Module, device: DeviceSpec | None,
           cache: CostCache) -> InstructionCost:
    once = (computation_cost(module, _called(inst, "body"), device, cache)
            + computation_cost(module, _called(inst, "condition"), device, cache))
    return once.scaled(while_trip_count(inst, comp, module))


def _conditional(inst: Instruction, comp: Computation, module: Module, device: DeviceSpec | None,
                 cache: CostCache) -> InstructionCost:
    worst = ZERO
    for name in inst.called_computations:
        worst = worst.maximum(computation_cost(module, name, device, cache))
    return worst


_HANDLERS: Mapping[str, Handler] = {
    "all-reduce": _all_reduce,
    "async-start": _call,
    "call": _call,
    "cholesky": _cholesky,
    "conditional": _conditional,
    "convolution": _convolution,
    "dot": _dot,
    "fft": _fft,
    "fusion": _fusion,
    "map": _map,
    "reduce": _reduce,
    "reduce-window": _reduce_window,
    "rng": _rng,
    "rng-bit-generator": _rng,
    "scatter": _scatter,
    "select-and-scatter": _select_and_scatter,
    "sort": _sort,
    "triangular-solve": _triangular_solve,
    "while": _while,
}


def _priced_as(info: OpcodeInfo) -> str:
    """The opcode whose price an opcode takes: an async start without a formula of its own is
    priced as its synchronous form (all-reduce-start as all-reduce, copy-start as copy)."""
    base = info.name.removesuffix("-start")
    if info.async_part is AsyncPart.START and info.name not in _HANDLERS and base in OPCODES:
        return base
    return info.name


def _classify(info: OpcodeInfo) -> CostClass | None:
    if info.free:
        return CostClass.FREE
    if info.async_part in (AsyncPart.UPDATE, AsyncPart.DONE):
        return CostClass.AT_START
    op = _priced_as(info)
    if op in _HANDLERS:
        return CostClass.FORMULA
    if op in TRANSCENDENTAL_OPCODES:
        return CostClass.TRANSCENDENTAL_PER_ELEMENT
    if op in ELEMENTWISE_OPCODES:
        return CostClass.FLOP_PER_ELEMENT
    if op in DATA_MOVEMENT_OPCODES or op in FLOPS_NOT_MODELED:
        return CostClass.BYTES_ONLY
    return None


_PRICED_AS: Mapping[str, str] = {name: _priced_as(info) for name, info in OPCODES.items()}
_COST_CLASSES: Mapping[str, CostClass] = {
    name: kind for name, info in OPCODES.items() if (kind := _classify(info)) is not None
}


def cost_class(opcode: str) -> CostClass | None:
    """How the cost model prices `opcode`; None for a name that is not an opcode of the table or
    that the model has no class for (such an instruction is priced by its bytes, and the opcode
    table's coverage test fails)."""
    return _COST_CLASSES.get(opcode)


# ---------------------------------------------------------------------------------------------
# Whole modules
# ---------------------------------------------------------------------------------------------


def module_cost(module: Module, device: DeviceSpec | None = None) -> InstructionCost:
    """Cost of running the entry computation once on one device (no sharding)."""
    return computation_cost(module, module.entry_name, device, {})


def module_flops(module: Module) -> float:
    """FLOPs of one run of the module (XLA's conventions; loops times their trip counts)."""
    return module_cost(module).flops


def flops_by_opcode(module: Module) -> dict[str, float]:
    """`module_flops` split by the opcode of the instruction doing the work (they sum to it).

    Instructions inside fusions, calls and while loops (times the trip count) count under their
    own opcode; a conditional counts its costliest branch, as its cost does; the flops of a
    reducer or map function count under the instruction applying it (reduce, scatter, map...).
    Opcodes doing no flops are left out.
    """
    cache: CostCache = {}
    memo: dict[str, Counter[str]] = {}

    def walk(name: str) -> Counter[str]:
        if name in memo:
            return memo[name]
        comp = _computation(module, name)
        out: Counter[str] = Counter()
        for inst in comp.instructions:
            handler = _HANDLERS.get(_PRICED_AS.get(inst.opcode, inst.opcode))
            if handler is _fusion:
                out.update(walk(_called(inst, "calls")))
            elif handler is _call:
                for callee in inst.called_computations:
                    out.update(walk(callee))
            elif handler is _while:
                trips = while_trip_count(inst, comp, module)
                once = walk(_called(inst, "body")) + walk(_called(inst, "condition"))
                out.update({opcode: flops * trips for opcode, flops in once.items()})
            elif handler is _conditional and inst.called_computations:
                costliest = max(inst.called_computations,
                                key=lambda callee: computation_cost(module, callee, None, cache).flops)
                out.update(walk(costliest))
            else:
                flops = instruction_cost(inst, comp, module, None, cache).flops
                if flops:
                    out[inst.opcode] += flops
        memo[name] = out
        return out

    return dict(walk(module.entry_name))
