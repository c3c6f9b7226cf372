"""The one table of HLO opcodes: every opcode of XLA's HLO text format, with the facts about it
that the parser, the factor rules and the cost model need.

Names and arities are those of XLA's `HLO_OPCODE_LIST` (xla/hlo/ir/hlo_opcode.h, openxla/xla at
0725a3a), i.e. what `HloModule::ToString` and JAX's `as_text(dialect="hlo")` print: `cosine`
not `cos`, `count-leading-zeros` not `clz`, `opt-barrier` not `optimization-barrier`. The other
layers derive their opcode sets from this table instead of spelling names again, so that a name
can only be wrong in one place. Where a fact follows an XLA convention its field says which:
elementwise kinds follow `HloCostAnalysis::HandleElementwiseOp`, call contexts
`GetInstructionCallContext` (xla/service/call_graph.cc).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

__all__ = [
    "OPCODES",
    "AsyncPart",
    "CallContext",
    "Elementwise",
    "InferredShape",
    "OpcodeInfo",
    "Storage",
    "opcode_names",
]


class Elementwise(enum.Enum):
    """What an elementwise opcode (result element i depends on operand elements i only) does
    per element; the cost model prices each kind, the factor rules link all dims alike."""

    #: One flop per result element. XLA's cost analysis counts every elementwise op that is not
    #: on its short transcendental list as a flop, including the inverse trigonometric and
    #: hyperbolic functions (acos, sinh, ...) and conversions.
    ARITHMETIC = "arithmetic"
    #: One transcendental per result element (XLA's list: exp, log, tanh, sine, power, ...).
    TRANSCENDENTAL = "transcendental"
    #: One flop per element with a `pred` result (compare, is-finite).
    PREDICATE = "predicate"
    #: Copies elements: bytes, no flops (XLA's `HandleCopy`).
    COPY = "copy"
    #: Applies a called scalar computation to each element (map): that computation's cost.
    MAPPED = "mapped"


class InferredShape(enum.Enum):
    """How the result shape follows from the operands where the text omits it (XLA's parser
    accepts `add(a, b)` without a result shape)."""

    SAME_AS_FIRST = "operand 0's shape"
    PREDICATE_OF_FIRST = "operand 0's dims with element type pred"
    #: select(pred, on_true, on_false) and clamp(min, operand, max).
    SAME_AS_SECOND = "operand 1's shape"
    TUPLE_OF_OPERANDS = "a tuple of the operands' shapes"
    #: get-tuple-element: element `index` of operand 0.
    TUPLE_ELEMENT = "element `index` of operand 0's tuple"
    TOKEN = "token[]"
    U32_SCALAR = "u32[]"


class Storage(enum.Enum):
    """Where the result lives on the device (the memory model's view)."""

    OWN = "a buffer of its own"
    #: tuple, get-tuple-element, bitcast, reshape, opt-barrier...: aliases its operands' buffers.
    VIEW = "a view of its operands' buffers"
    #: parameters (the caller's buffers), constants (program memory), tokens and device ids.
    NONE = "no allocation"


class CallContext(enum.Enum):
    """How an opcode runs the computations it names (XLA's `CallContext`, call_graph.h)."""

    #: Whole computations run as part of the program: call, while, conditional, async wrappers.
    CONTROL_FLOW = "control flow"
    #: Applied inside one kernel: reducers, comparators, scatter combiners, fusion bodies.
    EMBEDDED = "embedded"


class AsyncPart(enum.Enum):
    """Which part of an asynchronous pair an opcode is (`all-reduce-start` ... `-done`)."""

    START = "start"
    UPDATE = "update"
    DONE = "done"


@dataclass(frozen=True)
class OpcodeInfo:
    """One opcode of the HLO text format.

    name: the text name XLA prints.
    arity: the operand count when XLA fixes it, None when variadic.
    elementwise: the kind, for elementwise opcodes.
    inferred_shape: how the parser infers an omitted result shape; None where it cannot.
    free: no kernel runs (an input, a constant, or a renaming/regrouping of buffers).
    storage: where the result lives.
    source: the result is created, not computed from operand elements, so none of its dims
      corresponds to an operand dim (parameters, constants, iota, random numbers, ids, infeed).
    calls: how the computations named in its attributes run, if it names any.
    collective: exchanges data between devices.
    async_part: its part of an asynchronous start/update/done pair.
    """

    name: str
    arity: int | None
    elementwise: Elementwise | None = None
    inferred_shape: InferredShape | None = None
    free: bool = False
    storage: Storage = Storage.OWN
    source: bool = False
    calls: CallContext | None = None
    collective: bool = False
    async_part: AsyncPart | None = None


_VARIADIC = None
_ARITH, _TRANS = Elementwise.ARITHMETIC, Elementwise.TRANSCENDENTAL
_SAME = InferredShape.SAME_AS_FIRST
_CONTROL, _EMBEDDED = CallContext.CONTROL_FLOW, CallContext.EMBEDDED
_START, _UPDATE, _DONE = AsyncPart.START, AsyncPart.UPDATE, AsyncPart.DONE


def _arithmetic(name: str, arity: int | None, shape: InferredShape | None = _SAME) -> OpcodeInfo:
    return OpcodeInfo(name, arity, _ARITH, shape)


def _transcendental(name: str, arity: int) -> OpcodeInfo:
    return OpcodeInfo(name, arity, _TRANS, _SAME)


def _collective(name: str, arity: int | None, **facts: object) -> OpcodeInfo:
    return OpcodeInfo(name, arity, collective=True, **facts)  # type: ignore[arg-type]


_ROWS: tuple[OpcodeInfo, ...] = (
    _arithmetic("abs", 1),
    _arithmetic("acos", 1),
    _arithmetic("acosh", 1),
    _arithmetic("add", 2),
    OpcodeInfo("add-dependency", 2, inferred_shape=_SAME, free=True, storage=Storage.VIEW),
    OpcodeInfo("after-all", _VARIADIC, inferred_shape=InferredShape.TOKEN, free=True,
               storage=Storage.NONE, source=True),
    _collective("all-gather", _VARIADIC),
    _collective("all-gather-done", 1, async_part=_DONE),
    _collective("all-gather-start", _VARIADIC, async_part=_START),
    _collective("all-reduce", _VARIADIC, calls=_EMBEDDED),
    _collective("all-reduce-done", 1, async_part=_DONE),
    _collective("all-reduce-start", _VARIADIC, calls=_EMBEDDED, async_part=_START),
    _collective("all-to-all", _VARIADIC),
    _arithmetic("and", 2),
    _arithmetic("asin", 1),
    _arithmetic("asinh", 1),
    OpcodeInfo("async-done", 1, calls=_CONTROL, async_part=_DONE),
    OpcodeInfo("async-start", _VARIADIC, calls=_CONTROL, async_part=_START),
    OpcodeInfo("async-update", _VARIADIC, calls=_CONTROL, async_part=_UPDATE),
    _arithmetic("atan", 1),
    _transcendental("atan2", 2),
    _arithmetic("atanh", 1),
    OpcodeInfo("batch-norm-grad", 5),
    OpcodeInfo("batch-norm-inference", 5),
    OpcodeInfo("batch-norm-training", 3),
    OpcodeInfo("bitcast", 1, free=True, storage=Storage.VIEW),
    OpcodeInfo("bitcast-convert", 1),
    OpcodeInfo("broadcast", 1),
    OpcodeInfo("call", _VARIADIC, calls=_CONTROL),
    _transcendental("cbrt", 1),
    _arithmetic("ceil", 1),
    OpcodeInfo("cholesky", 1),
    _arithmetic("clamp", 3, InferredShape.SAME_AS_SECOND),
    _collective("collective-broadcast", _VARIADIC),
    _collective("collective-permute", _VARIADIC),
    _collective("collective-permute-done", 1, async_part=_DONE),
    _collective("collective-permute-start", _VARIADIC, async_part=_START),
    _collective("collective-reduce", _VARIADIC),
    OpcodeInfo("compare", 2, Elementwise.PREDICATE, InferredShape.PREDICATE_OF_FIRST),
    _arithmetic("complex", 2, None),
    OpcodeInfo("concatenate", _VARIADIC),
    OpcodeInfo("conditional", _VARIADIC, calls=_CONTROL),
    OpcodeInfo("constant", 0, free=True, storage=Storage.NONE, source=True),
    _arithmetic("convert", 1, None),
    OpcodeInfo("convolution", _VARIADIC),
    OpcodeInfo("copy", 1, Elementwise.COPY, _SAME),
    OpcodeInfo("copy-done", 1, async_part=_DONE),
    OpcodeInfo("copy-start", 1, async_part=_START),
    _transcendental("cosine", 1),
    _arithmetic("cosh", 1),
    _arithmetic("count-leading-zeros", 1),
    OpcodeInfo("custom-call", _VARIADIC, calls=_EMBEDDED),
    _arithmetic("divide", 2),
    OpcodeInfo("domain", 1, free=True, storage=Storage.VIEW),
    OpcodeInfo("dot", 2),
    OpcodeInfo("dynamic-reshape", _VARIADIC),
    OpcodeInfo("dynamic-slice", _VARIADIC),
    OpcodeInfo("dynamic-update-slice", _VARIADIC),
    _transcendental("erf", 1),
    _transcendental("exponential", 1),
    _transcendental("exponential-minus-one", 1),
    OpcodeInfo("fft", 1),
    _arithmetic("floor", 1),
    OpcodeInfo("fusion", _VARIADIC, calls=_EMBEDDED),
    OpcodeInfo("gather", 2),
    OpcodeInfo("get-dimension-size", 1, free=True, source=True),
    OpcodeInfo("get-tuple-element", 1, inferred_shape=InferredShape.TUPLE_ELEMENT, free=True,
               storage=Storage.VIEW),
    _arithmetic("imag", 1, None),
    OpcodeInfo("infeed", 1, source=True),
    OpcodeInfo("iota", 0, source=True),
    OpcodeInfo("is-finite", 1, Elementwise.PREDICATE, InferredShape.PREDICATE_OF_FIRST),
    _transcendental("log", 1),
    _transcendental("log-plus-one", 1),
    _transcendental("logistic", 1),
    OpcodeInfo("map", _VARIADIC, Elementwise.MAPPED, calls=_EMBEDDED),
    _arithmetic("maximum", 2),
    _arithmetic("minimum", 2),
    _arithmetic("mulhi", 2),
    _arithmetic("multiply", 2),
    _arithmetic("negate", 1),
    _arithmetic("not", 1),
    OpcodeInfo("opt-barrier", 1, inferred_shape=_SAME, free=True, storage=Storage.VIEW),
    _arithmetic("or", 2),
    OpcodeInfo("outfeed", 2),
    OpcodeInfo("pad", 2),
    OpcodeInfo("parameter", 0, free=True, storage=Storage.NONE, source=True),
    OpcodeInfo("partition-id", 0, inferred_shape=InferredShape.U32_SCALAR, free=True,
               storage=Storage.NONE, source=True),
    _arithmetic("popcnt", 1),
    _transcendental("power", 2),
    _collective("ragged-all-to-all", 6),
    OpcodeInfo("ragged-dot", 3),
    _arithmetic("real", 1, None),
    OpcodeInfo("recv", 1, source=True, async_part=_START),
    OpcodeInfo("recv-done", 1, async_part=_DONE),
    OpcodeInfo("reduce", _VARIADIC, calls=_EMBEDDED),
    _arithmetic("reduce-precision", 1),
    _collective("reduce-scatter", _VARIADIC, calls=_EMBEDDED),
    OpcodeInfo("reduce-window", _VARIADIC, calls=_EMBEDDED),
    _arithmetic("remainder", 2),
    OpcodeInfo("replica-id", 0, inferred_shape=InferredShape.U32_SCALAR, free=True,
               storage=Storage.NONE, source=True),
    OpcodeInfo("reshape", 1, free=True, storage=Storage.VIEW),
    OpcodeInfo("reverse", 1),
    OpcodeInfo("rng", _VARIADIC, source=True),
    OpcodeInfo("rng-bit-generator", 1, source=True),
    OpcodeInfo("rng-get-and-update-state", 0, source=True),
    _arithmetic("round-nearest-afz", 1),
    _arithmetic("round-nearest-even", 1),
    _transcendental("rsqrt", 1),
    OpcodeInfo("scaled-dot", 4),
    OpcodeInfo("scan", _VARIADIC),
    OpcodeInfo("scatter", _VARIADIC, calls=_EMBEDDED),
    _arithmetic("select", 3, InferredShape.SAME_AS_SECOND),
    OpcodeInfo("select-and-scatter", 3, calls=_EMBEDDED),
    OpcodeInfo("send", 2, async_part=_START),
    OpcodeInfo("send-done", 1, async_part=_DONE),
    OpcodeInfo("set-dimension-size", 2, free=True),
    _arithmetic("shift-left", 2),
    _arithmetic("shift-right-arithmetic", 2),
    _arithmetic("shift-right-logical", 2),
    OpcodeInfo("shuffle", 1),
    _arithmetic("sign", 1),
    _transcendental("sine", 1),
    _arithmetic("sinh", 1),
    OpcodeInfo("slice", 1),
    OpcodeInfo("sort", _VARIADIC, calls=_EMBEDDED),
    _transcendental("sqrt", 1),
    _arithmetic("stochastic-convert", 2, None),
    _arithmetic("subtract", 2),
    _transcendental("tan", 1),
    _transcendental("tanh", 1),
    OpcodeInfo("topk", 1, calls=_EMBEDDED),
    OpcodeInfo("transpose", 1),
    OpcodeInfo("triangular-solve", 2),
    OpcodeInfo("tuple", _VARIADIC, inferred_shape=InferredShape.TUPLE_OF_OPERANDS, free=True,
               storage=Storage.VIEW),
    OpcodeInfo("while", 1, calls=_CONTROL),
    _arithmetic("xor", 2),
)

#: Every opcode of the text format by name, alphabetical.
OPCODES: Mapping[str, OpcodeInfo] = MappingProxyType(
    {row.name: row for row in sorted(_ROWS, key=lambda row: row.name)}
)


def opcode_names(where: Callable[[OpcodeInfo], bool]) -> frozenset[str]:
    """The names of the opcodes whose row satisfies `where`: how other layers build their sets,
    e.g. `opcode_names(lambda op: op.free)`."""
    return frozenset(name for name, info in OPCODES.items() if where(info))
