"""The HLO intermediate representation: frozen dataclasses for modules, computations,
instructions and shapes.

Design:
- Every attribute XLA prints is kept verbatim, in order, in `Instruction.attributes`, so printing
  a parsed module gives text that parses back to an equal module.
- What later stages need (dimensions, dot/conv/gather/scatter dimension numbers, windows,
  slices, called computations, metadata...) is exposed as typed, lazily parsed properties. Parsing
  them eagerly for every instruction would make the parser several times slower, and most
  instructions (elementwise ops) have none of them.
- Source positions (`SourceLocation`) are excluded from equality: two modules are equal when
  they mean the same thing, wherever their text came from.
- The IR prints itself back to XLA's classic text (`print_module`, `str(module)`), and the
  canonical form of name-valued attributes lives here too, so that the parser imports the IR and
  nothing in the IR imports the parser.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterator, Mapping, Union

# ---------------------------------------------------------------------------------------------
# Element types
# ---------------------------------------------------------------------------------------------

#: Bits per element for every primitive type XLA prints. `token` and `opaque` take no storage.
ELEMENT_BITS: Mapping[str, int] = {
    "pred": 8,
    "s1": 1, "s2": 2, "s4": 4, "s8": 8, "s16": 16, "s32": 32, "s64": 64,
    "u1": 1, "u2": 2, "u4": 4, "u8": 8, "u16": 16, "u32": 32, "u64": 64,
    "f4e2m1fn": 4, "f6e2m3fn": 6, "f6e3m2fn": 6,
    "f8e3m4": 8, "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3b11fnuz": 8, "f8e4m3fnuz": 8,
    "f8e5m2": 8, "f8e5m2fnuz": 8, "f8e8m0fnu": 8,
    "bf16": 16, "f16": 16, "f32": 32, "f64": 64,
    "c64": 64, "c128": 128,
    "token": 0, "opaque": 0,
}


class ElementKind(enum.Enum):
    """Coarse class of an element type; the cost model and rules care about this, not the name."""

    PRED = "pred"
    SIGNED = "signed"
    UNSIGNED = "unsigned"
    FLOAT = "float"
    COMPLEX = "complex"
    TOKEN = "token"
    OPAQUE = "opaque"


def element_kind(dtype: str) -> ElementKind:
    if dtype == "pred":
        return ElementKind.PRED
    if dtype == "token":
        return ElementKind.TOKEN
    if dtype == "opaque":
        return ElementKind.OPAQUE
    if dtype.startswith("c"):
        return ElementKind.COMPLEX
    if dtype.startswith("s"):
        return ElementKind.SIGNED
    if dtype.startswith("u"):
        return ElementKind.UNSIGNED
    return ElementKind.FLOAT


# ---------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArrayShape:
    """An array (or token) shape: `f32[8,<=16]{1,0:T(8,128)}`.

    `dynamic[i]` is True for a bounded dynamic dimension (`<=16`); `dims[i]` is then the bound.
    `layout` is the verbatim text between the braces (None when the text had no layout); its
    minor-to-major order is `minor_to_major`. `dynamic` is `()` when no dimension is dynamic (the
    parser's canonical form), else one flag per dimension. An unbounded dynamic dimension (`?`)
    has `dims[i] == -1`.
    """

    dtype: str
    dims: tuple[int, ...] = ()
    dynamic: tuple[bool, ...] = ()
    layout: str | None = None

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def is_tuple(self) -> bool:
        return False

    @property
    def num_elements(self) -> int:
        return math.prod(self.dims)

    @property
    def byte_size(self) -> int:
        """Bytes of a dense buffer (sub-byte types rounded up to whole bytes)."""
        return (self.num_elements * ELEMENT_BITS[self.dtype] + 7) // 8

    @property
    def minor_to_major(self) -> tuple[int, ...] | None:
        if self.layout is None:
            return None
        head = self.layout.split(":", 1)[0].strip()
        return tuple(int(d) for d in head.split(",") if d.strip()) if head else ()

    def leaves(self) -> Iterator[ArrayShape]:
        yield self

    def __str__(self) -> str:
        # XLA prints every array shape with brackets, `token[]` included, and rejects a bare
        # `token`; an unbounded dynamic dimension (stored as -1) prints as `?`.
        dims = ",".join(
            "?" if d < 0 else ("<=" if dyn else "") + str(d)
            for d, dyn in zip(self.dims, self.dynamic or (False,) * self.rank)
        )
        text = f"{self.dtype}[{dims}]"
        return text if self.layout is None else f"{text}{{{self.layout}}}"


@dataclass(frozen=True)
class TupleShape:
    """A tuple of shapes, possibly nested, possibly empty: `(f32[2], (s32[], pred[]))`."""

    elements: tuple[Shape, ...] = ()

    @property
    def is_tuple(self) -> bool:
        return True

    @property
    def byte_size(self) -> int:
        return sum(leaf.byte_size for leaf in self.leaves())

    def leaves(self) -> Iterator[ArrayShape]:
        for element in self.elements:
            yield from element.leaves()

    def __str__(self) -> str:
        return "(" + ", ".join(str(e) for e in self.elements) + ")"


Shape = Union[ArrayShape, TupleShape]


def shape_at(shape: Shape, index: tuple[int, ...]) -> Shape:
    """The sub-shape at a tuple index path (`()` is the shape itself)."""
    for i in index:
        if not isinstance(shape, TupleShape):
            raise IndexError(f"tuple index {index} goes into non-tuple shape {shape}")
        shape = shape.elements[i]
    return shape


# ---------------------------------------------------------------------------------------------
# Typed attribute values
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceLocation:
    """Where something was read from: 1-based line and column in `filename` (or "<string>")."""

    filename: str
    line: int
    column: int

    def __str__(self) -> str:
        return f"{self.filename}:{self.line}:{self.column}"


@dataclass(frozen=True)
class Metadata:
    """The parts of `metadata={...}` that hlomap uses; the verbatim text stays in attributes."""

    op_type: str | None = None
    op_name: str | None = None
    source_file: str | None = None
    source_line: int | None = None
    stack_frame_id: int | None = None


@dataclass(frozen=True)
class DotDimensionNumbers:
    lhs_batch: tuple[int, ...] = ()
    rhs_batch: tuple[int, ...] = ()
    lhs_contracting: tuple[int, ...] = ()
    rhs_contracting: tuple[int, ...] = ()


@dataclass(frozen=True)
class ConvDimensionNumbers:
    """Parsed `dim_labels=b01f_01io->b01f`: positions of batch/feature/spatial dims.

    Input: batch `b`, feature `f`; kernel: input feature `i`, output feature `o`; output: batch
    `b`, feature `f`. Spatial dims are listed in spatial order (the digits 0, 1, 2...).
    """

    input_batch: int
    input_feature: int
    input_spatial: tuple[int, ...]
    kernel_input_feature: int
    kernel_output_feature: int
    kernel_spatial: tuple[int, ...]
    output_batch: int
    output_feature: int
    output_spatial: tuple[int, ...]


@dataclass(frozen=True)
class WindowDimension:
    size: int = 1
    stride: int = 1
    pad_low: int = 0
    pad_high: int = 0
    window_dilation: int = 1
    base_dilation: int = 1
    reversal: bool = False


@dataclass(frozen=True)
class SliceDimension:
    start: int
    limit: int
    stride: int = 1


@dataclass(frozen=True)
class PaddingDimension:
    low: int
    high: int
    interior: int = 0


@dataclass(frozen=True)
class GatherDimensionNumbers:
    offset_dims: tuple[int, ...] = ()
    collapsed_slice_dims: tuple[int, ...] = ()
    start_index_map: tuple[int, ...] = ()
    index_vector_dim: int = 0
    operand_batching_dims: tuple[int, ...] = ()
    start_indices_batching_dims: tuple[int, ...] = ()


@dataclass(frozen=True)
class ScatterDimensionNumbers:
    update_window_dims: tuple[int, ...] = ()
    inserted_window_dims: tuple[int, ...] = ()
    scatter_dims_to_operand_dims: tuple[int, ...] = ()
    index_vector_dim: int = 0
    input_batching_dims: tuple[int, ...] = ()
    scatter_indices_batching_dims: tuple[int, ...] = ()


#: Attribute keys whose value names one called computation, or a `{a, b}` list of them.
CALLED_COMPUTATION_KEYS: tuple[str, ...] = (
    "to_apply", "calls", "body", "condition", "select", "scatter",
    "true_computation", "false_computation", "branch_computations", "called_computations",
    "async_execution_thread_computations",
)

#: XLA's identifier, `[a-zA-Z_][a-zA-Z0-9_.-]*` (hlo_lexer.cc): instruction and computation names.
NAME_PATTERN = r"[A-Za-z_][A-Za-z0-9_.\-]*"

#: Attributes whose value names computations or instructions. Their values are stored in one
#: canonical form, without `%` sigils (`to_apply=add`, `calls={a, b}`), so that the classic and
#: the JAX style of the same module compare equal; the printer adds the sigils back.
NAME_VALUED_KEYS = frozenset(CALLED_COMPUTATION_KEYS) | {"control-predecessors"}
_NAME_FULL_RE = re.compile(r"%?" + NAME_PATTERN)


def split_name_value(value: str) -> tuple[tuple[str, ...], bool] | None:
    """`%add` -> (("add",), False); `{%a, b}` -> (("a", "b"), True); None when `value` is not
    a name or a braced list of names."""
    stripped = value.strip()
    braced = stripped.startswith("{") and stripped.endswith("}")
    inner = stripped[1:-1].strip() if braced else stripped
    if braced and not inner:
        return (), True
    parts = [p.strip() for p in inner.split(",")]
    if (len(parts) > 1 and not braced) or not all(_NAME_FULL_RE.fullmatch(p) for p in parts):
        return None
    return tuple(p[1:] if p.startswith("%") else p for p in parts), braced


def canonical_names(value: str) -> str:
    """`%add` -> `add`; `{%a,%b}` -> `{a, b}`. Values that are not names stay verbatim."""
    split = split_name_value(value)
    if split is None:
        return value
    names, braced = split
    return "{" + ", ".join(names) + "}" if braced else names[0]


# ---------------------------------------------------------------------------------------------
# Instructions, computations, modules
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    """One HLO instruction.

    `operands` are instruction names in the same computation. `payload` is the non-operand text
    inside the parentheses (a constant's literal, a parameter's number), verbatim. `attributes`
    is every `key=value` after the operands, in printed order, value verbatim. Typed views of the
    attributes are properties below; each returns a neutral default when the attribute is absent.
    """

    name: str
    opcode: str
    shape: Shape
    operands: tuple[str, ...] = ()
    attributes: tuple[tuple[str, str], ...] = ()
    payload: str | None = None
    is_root: bool = False
    location: SourceLocation | None = field(default=None, compare=False, repr=False)

    # -- raw access -----------------------------------------------------------------------------
    @cached_property
    def attrs(self) -> Mapping[str, str]:
        return dict(self.attributes)

    def attr(self, key: str, default: str | None = None) -> str | None:
        return self.attrs.get(key, default)

    # -- typed views ----------------------------------------------------------------------------
    @cached_property
    def dimensions(self) -> tuple[int, ...]:
        return _int_list(self.attrs.get("dimensions", "{}"))

    @cached_property
    def parameter_number(self) -> int | None:
        return int(self.payload) if self.opcode == "parameter" and self.payload is not None else None

    @cached_property
    def tuple_index(self) -> int | None:
        value = self.attrs.get("index")
        return int(value) if value is not None else None

    @cached_property
    def called_computations(self) -> tuple[str, ...]:
        names: list[str] = []
        for key, value in self.attributes:
            if key in CALLED_COMPUTATION_KEYS:
                names.extend(_name_list(value))
        return tuple(names)

    @cached_property
    def dot_dimension_numbers(self) -> DotDimensionNumbers:
        a = self.attrs
        return DotDimensionNumbers(
            lhs_batch=_int_list(a.get("lhs_batch_dims", "{}")),
            rhs_batch=_int_list(a.get("rhs_batch_dims", "{}")),
            lhs_contracting=_int_list(a.get("lhs_contracting_dims", "{}")),
            rhs_contracting=_int_list(a.get("rhs_contracting_dims", "{}")),
        )

    @cached_property
    def conv_dimension_numbers(self) -> ConvDimensionNumbers | None:
        labels = self.attrs.get("dim_labels")
        return parse_dim_labels(labels) if labels is not None else None

    @cached_property
    def feature_group_count(self) -> int:
        return int(self.attrs.get("feature_group_count", "1"))

    @cached_property
    def batch_group_count(self) -> int:
        return int(self.attrs.get("batch_group_count", "1"))

    @cached_property
    def window(self) -> tuple[WindowDimension, ...]:
        text = self.attrs.get("window")
        return parse_window(text) if text is not None else ()

    @cached_property
    def slice(self) -> tuple[SliceDimension, ...]:
        text = self.attrs.get("slice")
        return parse_slice(text) if text is not None else ()

    @cached_property
    def padding(self) -> tuple[PaddingDimension, ...]:
        text = self.attrs.get("padding")
        return parse_padding(text) if text is not None else ()

    @cached_property
    def gather_dimension_numbers(self) -> GatherDimensionNumbers:
        a = self.attrs
        return GatherDimensionNumbers(
            offset_dims=_int_list(a.get("offset_dims", "{}")),
            collapsed_slice_dims=_int_list(a.get("collapsed_slice_dims", "{}")),
            start_index_map=_int_list(a.get("start_index_map", "{}")),
            index_vector_dim=int(a.get("index_vector_dim", "0")),
            operand_batching_dims=_int_list(a.get("operand_batching_dims", "{}")),
            start_indices_batching_dims=_int_list(a.get("start_indices_batching_dims", "{}")),
        )

    @cached_property
    def slice_sizes(self) -> tuple[int, ...]:
        return _int_list(self.attrs.get("slice_sizes", "{}"))

    @cached_property
    def dynamic_slice_sizes(self) -> tuple[int, ...]:
        return _int_list(self.attrs.get("dynamic_slice_sizes", "{}"))

    @cached_property
    def scatter_dimension_numbers(self) -> ScatterDimensionNumbers:
        a = self.attrs
        return ScatterDimensionNumbers(
            update_window_dims=_int_list(a.get("update_window_dims", "{}")),
            inserted_window_dims=_int_list(a.get("inserted_window_dims", "{}")),
            scatter_dims_to_operand_dims=_int_list(a.get("scatter_dims_to_operand_dims", "{}")),
            index_vector_dim=int(a.get("index_vector_dim", "0")),
            input_batching_dims=_int_list(a.get("input_batching_dims", "{}")),
            scatter_indices_batching_dims=_int_list(a.get("scatter_indices_batching_dims", "{}")),
        )

    @cached_property
    def replica_groups(self) -> tuple[tuple[int, ...], ...] | None:
        """Explicit groups for both printed formats (`{{0,1},{2,3}}` and iota `[2,4]<=[8]`)."""
        text = self.attrs.get("replica_groups")
        return parse_replica_groups(text) if text is not None else None

    @cached_property
    def sharding(self) -> str | None:
        return self.attrs.get("sharding")

    @cached_property
    def metadata(self) -> Metadata | None:
        text = self.attrs.get("metadata")
        return parse_metadata(text) if text is not None else None

    @property
    def is_backward(self) -> bool:
        """JAX marks ops of the backward pass with `transpose(jvp(` in their op_name."""
        md = self.metadata
        return md is not None and md.op_name is not None and "transpose(jvp(" in md.op_name

    @cached_property
    def custom_call_target(self) -> str | None:
        value = self.attrs.get("custom_call_target")
        return _unquote(value) if value is not None else None

    @cached_property
    def fusion_kind(self) -> str | None:
        return self.attrs.get("kind")

    @cached_property
    def comparison_direction(self) -> str | None:
        return self.attrs.get("direction")

    @cached_property
    def iota_dimension(self) -> int | None:
        value = self.attrs.get("iota_dimension")
        return int(value) if value is not None else None

    @cached_property
    def control_predecessors(self) -> tuple[str, ...]:
        """Names from `control-predecessors={%a, %b}`: ordering edges that are not data edges."""
        value = self.attrs.get("control-predecessors")
        return tuple(_name_list(value)) if value is not None else ()

    @cached_property
    def base_opcode(self) -> str:
        """`all-reduce` for `all-reduce-start`/`-done`; the opcode itself otherwise."""
        for suffix in ("-start", "-done", "-update"):
            if self.opcode.endswith(suffix) and self.opcode not in ("copy-start", "copy-done"):
                return self.opcode[: -len(suffix)]
        return self.opcode


@dataclass(frozen=True)
class Computation:
    """A named list of instructions in program order; `root` is the ROOT (or last) instruction.

    `attributes` are the `key=value` pairs printed after the closing brace (XLA prints
    `execution_thread="..."` there), verbatim.
    """

    name: str
    instructions: tuple[Instruction, ...]
    location: SourceLocation | None = field(default=None, compare=False, repr=False)
    attributes: tuple[tuple[str, str], ...] = ()

    @cached_property
    def by_name(self) -> Mapping[str, Instruction]:
        return {inst.name: inst for inst in self.instructions}

    def __getitem__(self, name: str) -> Instruction:
        return self.by_name[name]

    @cached_property
    def root(self) -> Instruction:
        for inst in self.instructions:
            if inst.is_root:
                return inst
        return self.instructions[-1]

    @cached_property
    def parameters(self) -> tuple[Instruction, ...]:
        """Parameter instructions ordered by parameter number."""
        params = [i for i in self.instructions if i.opcode == "parameter"]
        return tuple(sorted(params, key=lambda i: i.parameter_number or 0))


@dataclass(frozen=True)
class Module:
    """An HLO module: computations in printed order; `entry_name` names the entry computation.

    `attributes` are the header's `key=value` pairs verbatim. `trailer` is any text after the
    computations that is not HLO proper (the FileNames/StackFrames tables JAX prints), verbatim.
    """

    name: str
    computations: tuple[Computation, ...]
    entry_name: str
    attributes: tuple[tuple[str, str], ...] = ()
    trailer: str = ""
    location: SourceLocation | None = field(default=None, compare=False, repr=False)

    @cached_property
    def by_name(self) -> Mapping[str, Computation]:
        return {c.name: c for c in self.computations}

    def computation(self, name: str) -> Computation:
        return self.by_name[name]

    @property
    def entry(self) -> Computation:
        return self.by_name[self.entry_name]

    def instructions(self) -> Iterator[tuple[Computation, Instruction]]:
        for comp in self.computations:
            for inst in comp.instructions:
                yield comp, inst

    @property
    def instruction_count(self) -> int:
        return sum(len(c.instructions) for c in self.computations)

    def __str__(self) -> str:
        return print_module(self)


# ---------------------------------------------------------------------------------------------
# Attribute value parsers (pure; used by the typed views above and by rules)
# ---------------------------------------------------------------------------------------------

_INT_RE = re.compile(r"-?\d+")


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in _INT_RE.findall(text))


def _name_list(text: str) -> list[str]:
    text = text.strip()
    if text.startswith("{"):
        text = text[1:-1]
    return [part.strip().lstrip("%") for part in text.split(",") if part.strip()]


def _unquote(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] == '"':
        return bytes(text[1:-1], "utf-8").decode("unicode_escape")
    return text


def parse_dim_labels(text: str) -> ConvDimensionNumbers:
    """`b01f_01io->b01f` -> positions. Raises ValueError on malformed labels."""
    try:
        lhs, out = text.split("->")
        inp, ker = lhs.split("_")
    except ValueError:
        raise ValueError(f"malformed dim_labels {text!r}; expected like b01f_01io->b01f") from None

    def spatial(labels: str) -> tuple[int, ...]:
        digits = sorted((c, i) for i, c in enumerate(labels) if c.isdigit())
        return tuple(i for _, i in digits)

    return ConvDimensionNumbers(
        input_batch=inp.index("b"),
        input_feature=inp.index("f"),
        input_spatial=spatial(inp),
        kernel_input_feature=ker.index("i"),
        kernel_output_feature=ker.index("o"),
        kernel_spatial=spatial(ker),
        output_batch=out.index("b"),
        output_feature=out.index("f"),
        output_spatial=spatial(out),
    )


def parse_window(text: str) -> tuple[WindowDimension, ...]:
    """`{size=3x3 stride=2x2 pad=0_1x0_1 lhs_dilate=1x1 rhs_dilate=1x1 rhs_reversal=0x1}`."""
    fields: dict[str, list[str]] = {}
    for item in text.strip().strip("{}").split():
        key, _, value = item.partition("=")
        fields[key] = value.split("x")
    rank = max((len(v) for v in fields.values()), default=0)

    def ints(key: str, default: int) -> list[int]:
        return [int(v) for v in fields[key]] if key in fields else [default] * rank

    pads = [tuple(int(x) for x in p.split("_")) for p in fields["pad"]] if "pad" in fields else [(0, 0)] * rank
    sizes, strides = ints("size", 1), ints("stride", 1)
    lhs, rhs = ints("lhs_dilate", 1), ints("rhs_dilate", 1)
    rev = ints("rhs_reversal", 0)
    return tuple(
        WindowDimension(sizes[i], strides[i], pads[i][0], pads[i][1], rhs[i], lhs[i], bool(rev[i]))
        for i in range(rank)
    )


def parse_slice(text: str) -> tuple[SliceDimension, ...]:
    """`{[0:8], [2:10:2]}`."""
    out = []
    for part in re.findall(r"\[([^\]]*)\]", text):
        nums = [int(x) for x in part.split(":")]
        out.append(SliceDimension(nums[0], nums[1], nums[2] if len(nums) > 2 else 1))
    return tuple(out)


def parse_padding(text: str) -> tuple[PaddingDimension, ...]:
    """`0_0x1_2_1` (low_high[_interior] per dim)."""
    out = []
    for part in text.strip().split("x"):
        nums = [int(x) for x in part.split("_")]
        out.append(PaddingDimension(nums[0], nums[1], nums[2] if len(nums) > 2 else 0))
    return tuple(out)


_IOTA_GROUPS_RE = re.compile(r"^\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?$")


def parse_replica_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """Both formats: explicit `{{0,1},{2,3}}` (or `{}` meaning all) and iota `[2,4]<=[4,2]T(1,0)`."""
    text = text.strip()
    match = _IOTA_GROUPS_RE.match(text)
    if match:
        import numpy as np

        group_shape = _int_list(match.group(1))
        reshape = _int_list(match.group(2))
        ids = np.arange(math.prod(reshape)).reshape(reshape)
        if match.group(3):
            ids = ids.transpose(_int_list(match.group(3)))
        ids = ids.reshape(group_shape[0], -1) if group_shape else ids.reshape(1, -1)
        return tuple(tuple(int(x) for x in row) for row in ids)
    return tuple(_int_list(group) for group in re.findall(r"\{([^{}]*)\}", text[1:-1] if text.startswith("{") else text))


_MD_STR_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_MD_INT_RE = re.compile(r"(\w+)=(-?\d+)\b")


def parse_metadata(text: str) -> Metadata:
    strings = {k: v for k, v in _MD_STR_RE.findall(text)}
    unquoted = _MD_STR_RE.sub("", text)
    ints = {k: int(v) for k, v in _MD_INT_RE.findall(unquoted)}
    return Metadata(
        op_type=strings.get("op_type"),
        op_name=strings.get("op_name"),
        source_file=strings.get("source_file"),
        source_line=ints.get("source_line"),
        stack_frame_id=ints.get("stack_frame_id"),
    )


# ---------------------------------------------------------------------------------------------
# Text form
# ---------------------------------------------------------------------------------------------
# The printer lives with the IR it prints, so that `str(module)` imports nothing: the imports of
# the hlo layer stay a DAG (parser -> ir).


def shape_without_layout(shape: Shape) -> str:
    """`f32[2,3]`, `(f32[2], s32[])`: how XLA prints shapes in computation signatures."""
    if isinstance(shape, TupleShape):
        return "(" + ", ".join(shape_without_layout(e) for e in shape.elements) + ")"
    if shape.layout is None:
        return str(shape)
    return str(ArrayShape(shape.dtype, shape.dims, shape.dynamic))


def _with_sigils(value: str) -> str:
    """`add` -> `%add`, `{a, b}` -> `{%a, %b}` for values that name computations/instructions;
    anything else verbatim."""
    split = split_name_value(value)
    if split is None:
        return value
    names, braced = split
    sigiled = ", ".join("%" + name for name in names)
    return "{" + sigiled + "}" if braced else sigiled


def _print_attributes(pairs: tuple[tuple[str, str], ...]) -> str:
    return "".join(
        f", {key}={_with_sigils(value) if key in NAME_VALUED_KEYS else value}"
        for key, value in pairs
    )


def print_instruction(inst: Instruction) -> str:
    """One instruction, without indentation: `ROOT %add.1 = f32[2]{0} add(%a, %b), k=v`."""
    if inst.payload is not None:
        inside = inst.payload
    else:
        inside = ", ".join("%" + operand for operand in inst.operands)
    root = "ROOT " if inst.is_root else ""
    return f"{root}%{inst.name} = {inst.shape} {inst.opcode}({inside}){_print_attributes(inst.attributes)}"


def print_computation(computation: Computation, *, is_entry: bool = False) -> str:
    """A computation with its signature: parameters by number, then the root's shape."""
    params = ", ".join(
        f"{p.name}: {shape_without_layout(p.shape)}" for p in computation.parameters
    )
    result = shape_without_layout(computation.root.shape)
    head = f"{'ENTRY ' if is_entry else ''}%{computation.name} ({params}) -> {result} {{"
    body = "\n".join("  " + print_instruction(inst) for inst in computation.instructions)
    return f"{head}\n{body}\n}}{_print_attributes(computation.attributes)}"


def print_module(module: Module) -> str:
    """The whole module in XLA's classic style (`%` sigils, signatures, `ROOT`), which both XLA's
    parser and hlomap's read back: header, stack-frame tables (if any), computations in stored
    order. Attribute values, literals and tables print verbatim, so `parse(str(m)) == m`."""
    parts = [f"HloModule {module.name}{_print_attributes(module.attributes)}"]
    if module.trailer:
        # XLA prints the tables right after the header and reads them only there.
        parts.append(module.trailer)
    for computation in module.computations:
        parts.append(print_computation(computation, is_entry=computation.name == module.entry_name))
    return "\n\n".join(parts) + "\n"
