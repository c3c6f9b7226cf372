"""Unit tests of the HLO text parser: each syntax feature on a small hand-written input whose
expected parse is written out by hand, and each kind of bad input with its error position."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from hlomap.hlo import (
    ELEMENT_BITS,
    ArrayShape,
    DotDimensionNumbers,
    HloParseError,
    Module,
    PaddingDimension,
    SliceDimension,
    TupleShape,
    WindowDimension,
    parse,
    parse_all,
    parse_file,
)
from hlomap.hlo.parser import _parse_all

CLASSIC = """\
HloModule m, is_scheduled=true, entry_computation_layout={(f32[2,3]{1,0})->f32[]}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(f32[] %x, f32[] %y)
}

ENTRY %main (p: f32[2,3]) -> f32[] {
  %p = f32[2,3]{1,0} parameter(0)
  %zero = f32[] constant(0)
  ROOT %r = f32[] reduce(%p, %zero), dimensions={0,1}, to_apply=%add
}
"""

JAX_STYLE = """\
HloModule m, is_scheduled=true, entry_computation_layout={(f32[2,3]{1,0})->f32[]}

add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT sum = f32[] add(x, y)
}

ENTRY main {
  p = f32[2,3]{1,0} parameter(0)
  zero = f32[] constant(0)
  ROOT r = f32[] reduce(p, zero), dimensions={0,1}, to_apply=add
}
"""


def one_instruction(line: str, extra: str = "") -> Module:
    """A module whose entry holds `line` (and an f32[2,3] parameter `p`, a scalar `s`)."""
    return parse(
        f"HloModule t\n{extra}\nENTRY e {{\n  p = f32[2,3] parameter(0)\n"
        f"  s = f32[] parameter(1)\n  ROOT {line}\n}}\n"
    )


def root_of(line: str, extra: str = ""):
    return one_instruction(line, extra).entry.root


# ---------------------------------------------------------------------------------------------
# Module structure
# ---------------------------------------------------------------------------------------------


def test_classic_style_fields() -> None:
    module = parse(CLASSIC, "classic.hlo")
    assert module.name == "m"
    assert module.attributes == (
        ("is_scheduled", "true"),
        ("entry_computation_layout", "{(f32[2,3]{1,0})->f32[]}"),
    )
    assert [c.name for c in module.computations] == ["add", "main"]
    assert module.entry_name == "main"
    reduce = module.entry.root
    assert (reduce.name, reduce.opcode, reduce.operands) == ("r", "reduce", ("p", "zero"))
    assert reduce.shape == ArrayShape("f32", ())
    # Values naming computations are stored without the sigil, so both styles compare equal.
    assert reduce.attributes == (("dimensions", "{0,1}"), ("to_apply", "add"))
    assert reduce.dimensions == (0, 1)
    assert reduce.called_computations == ("add",)
    assert reduce.is_root
    # Typed operands keep only the name; the type is the operand's own shape.
    assert module.computation("add").root.operands == ("x", "y")
    assert module.entry["zero"].payload == "0"
    assert module.entry["p"].parameter_number == 0


def test_jax_style_equals_classic_style() -> None:
    assert parse(JAX_STYLE) == parse(CLASSIC)


def test_locations_point_at_each_instruction() -> None:
    module = parse(CLASSIC, "classic.hlo")
    sum_ = module.computation("add").root
    assert (sum_.location.filename, sum_.location.line, sum_.location.column) == (
        "classic.hlo", 6, 3,
    )
    assert module.computation("add").location.line == 3
    assert module.entry["zero"].location.line == 11
    assert module.location.line == 1
    for _, inst in module.instructions():
        assert inst.location is not None


def test_root_defaults_to_last_instruction() -> None:
    module = parse("c {\n  a = f32[] parameter(0)\n  b = f32[] negate(a)\n}\n")
    assert [i.is_root for i in module.entry.instructions] == [False, True]
    assert module.entry.root.name == "b"


def test_bare_computations_last_is_entry_and_module_named_after_it() -> None:
    text = "f {\n  a = f32[] parameter(0)\n}\n\nentry {\n  b = f32[] parameter(0)\n}\n"
    module = parse(text)
    assert module.entry_name == "entry"
    assert module.name == "module_entry"


def test_entry_marker_wins_over_position() -> None:
    text = "ENTRY main {\n  a = f32[] parameter(0)\n}\n\nlater {\n  b = f32[] parameter(0)\n}\n"
    assert parse(text).entry_name == "main"


def test_computation_attributes_after_brace() -> None:
    text = 'ENTRY e {\n  a = f32[] parameter(0)\n}, execution_thread="host"\n'
    assert parse(text).entry.attributes == (("execution_thread", '"host"'),)


def test_comments_anywhere() -> None:
    text = """\
// RUN: hlo-opt %s | FileCheck %s
/* leading
   block comment */ HloModule m // trailing
ENTRY /* here */ e {
  // CHECK: something
  a = f32[2] parameter(0) // after an instruction
  b = f32[2] add(a, /*index=1*/a), /* between attributes */ metadata={op_name="x"}
  ROOT c = f32[2] /* between shape and opcode */ negate(b)
}
// CHECK-LABEL: trailing checks
"""
    module = parse(text)
    assert [i.name for i in module.entry.instructions] == ["a", "b", "c"]
    assert module.entry["b"].operands == ("a", "a")
    assert module.entry["b"].metadata.op_name == "x"


def test_multiline_instruction_with_typed_operands() -> None:
    text = """\
add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
ENTRY e {
  %operand = f32[10,5]  parameter(0)
  %indices = s32[24,1] parameter(1)
  %update = f32[24,2,3] parameter(2)
  ROOT %scatter = f32[10,5] scatter(
      f32[10,5] %operand,
      s32[24,1] %indices,
      f32[24,2,3] %update
    ),
    update_window_dims={1,2},
    inserted_window_dims={},
    scatter_dims_to_operand_dims={0},
    index_vector_dim=1,
    unique_indices=false,
    to_apply=add
}
"""
    root = parse(text).entry.root
    assert root.operands == ("operand", "indices", "update")
    numbers = root.scatter_dimension_numbers
    assert numbers.update_window_dims == (1, 2)
    assert numbers.inserted_window_dims == ()
    assert numbers.scatter_dims_to_operand_dims == (0,)
    assert numbers.index_vector_dim == 1
    assert root.called_computations == ("add",)


def test_stack_frame_tables_kept_verbatim() -> None:
    tables = (
        'FileNames\n1 "a.py"\n\nFunctionNames\n1 "f"\n\nFileLocations\n'
        "1 {file_name_id=1 function_name_id=1 line=3 end_line=3 column=0 end_column=9}\n\n"
        "StackFrames\n1 {file_location_id=1 parent_frame_id=1}"
    )
    body = "ENTRY e {\n  ROOT a = f32[] parameter(0), metadata={stack_frame_id=1}\n}\n"
    after_header = parse(f"HloModule m\n\n{tables}\n\n\n{body}")
    assert after_header.trailer == tables
    at_end = parse(f"HloModule m\n\n{body}\n{tables}\n")
    assert at_end == after_header
    assert after_header.entry.root.metadata.stack_frame_id == 1


def test_split_files(tmp_path: Path) -> None:
    one = "HloModule a\nENTRY e {\n  ROOT x = f32[] parameter(0)\n}\n"
    two = "HloModule b\nENTRY e {\n  ROOT y = s32[] parameter(0)\n}\n"
    text = f"// RUN: x\n{one}\n// -----\n\n{two}// -----\n// only a comment\n"
    modules = parse_all(text, "split.hlo")
    assert [m.name for m in modules] == ["a", "b"]
    # Line numbers count from the start of the file, not of the split.
    assert modules[1].entry.root.location.line == text.splitlines().index("  ROOT y = s32[] parameter(0)") + 1
    with pytest.raises(HloParseError, match="parse_all") as info:
        parse(text, "split.hlo")
    assert info.value.line == 7  # the first '// -----' line
    assert parse(f"{one}// -----\n// CHECK: only comments here\n", "one.hlo") == modules[0]
    path = tmp_path / "split.hlo"
    path.write_text(text)
    assert parse_file(path) == modules


def test_dashes_banner_is_not_a_split() -> None:
    text = "// ----------\n// banner\n// ----------\nENTRY e {\n  ROOT a = f32[] parameter(0)\n}\n"
    assert len(parse_all(text)) == 1


# ---------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", sorted(ELEMENT_BITS))
def test_every_element_type(dtype: str) -> None:
    module = parse(f"ENTRY e {{\n  ROOT a = {dtype}[2,0] parameter(0)\n}}\n")
    assert module.entry.root.shape == ArrayShape(dtype, (2, 0))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("f32[]", ArrayShape("f32", ())),
        ("f32[0]", ArrayShape("f32", (0,))),
        ("f32[128, 32]", ArrayShape("f32", (128, 32))),
        ("bf16[8,16]{1,0}", ArrayShape("bf16", (8, 16), (), "1,0")),
        ("f32[8,128]{1,0:T(8,128)(2,1)}", ArrayShape("f32", (8, 128), (), "1,0:T(8,128)(2,1)")),
        ("f32[8,128]{1,0:T(8,128)S(1)}", ArrayShape("f32", (8, 128), (), "1,0:T(8,128)S(1)")),
        ("s4[128,256]{1,0:E(4)}", ArrayShape("s4", (128, 256), (), "1,0:E(4)")),
        ("f32[1024]{:T(128)}", ArrayShape("f32", (1024,), (), ":T(128)")),
        ("s32[2,<=2,2]", ArrayShape("s32", (2, 2, 2), (False, True, False))),
        ("f32[?,3]", ArrayShape("f32", (-1, 3), (True, False))),
        ("token[]", ArrayShape("token", ())),
        ("()", TupleShape(())),
        (
            "(f32[2]{0}, (s32[], pred[]), ())",
            TupleShape(
                (
                    ArrayShape("f32", (2,), (), "0"),
                    TupleShape((ArrayShape("s32", ()), ArrayShape("pred", ()))),
                    TupleShape(()),
                )
            ),
        ),
        (
            "(f32[], f32[], f32[], f32[], f32[], /*index=5*/s8[3])",
            TupleShape((ArrayShape("f32", ()),) * 5 + (ArrayShape("s8", (3,)),)),
        ),
    ],
)
def test_shapes(text: str, expected) -> None:
    module = parse(f"ENTRY e {{\n  ROOT a = {text} parameter(0)\n}}\n")
    assert module.entry.root.shape == expected


def test_shapes_are_shared_between_equal_texts() -> None:
    module = parse("ENTRY e {\n  a = f32[4] parameter(0)\n  ROOT b = f32[4] negate(a)\n}\n")
    assert module.entry["a"].shape is module.entry["b"].shape


def test_omitted_shapes_are_inferred() -> None:
    module = parse(
        "ENTRY e {\n  p = f32[2,3]{1,0} parameter(0)\n  n = negate(p)\n"
        "  c = compare(p, n), direction=LT\n  t = tuple(n, c)\n"
        "  ROOT g = get-tuple-element(t), index=1\n}\n"
    )
    entry = module.entry
    assert entry["n"].shape == ArrayShape("f32", (2, 3), (), "1,0")
    assert entry["c"].shape == ArrayShape("pred", (2, 3), (), "1,0")
    assert entry["t"].shape == TupleShape((entry["n"].shape, entry["c"].shape))
    assert entry["g"].shape == entry["c"].shape


# ---------------------------------------------------------------------------------------------
# Attributes and their typed views
# ---------------------------------------------------------------------------------------------


def test_slice_window_padding_dim_labels() -> None:
    sliced = root_of("r = f32[2,2] slice(p), slice={[0:2], [1:3:1]}")
    assert sliced.slice == (SliceDimension(0, 2), SliceDimension(1, 3, 1))
    padded = root_of("r = f32[5,4] pad(p, s), padding=1_2x0_1_0")
    assert padded.padding == (PaddingDimension(1, 2), PaddingDimension(0, 1, 0))
    conv = root_of(
        "r = f32[1,8,8,16] convolution(p, p), window={size=3x3 stride=2x2 pad=0_1x0_1 "
        "rhs_dilate=1x2}, dim_labels=b01f_01io->b01f, feature_group_count=2"
    )
    assert conv.window == (
        WindowDimension(3, 2, 0, 1, 1, 1),
        WindowDimension(3, 2, 0, 1, 2, 1),
    )
    numbers = conv.conv_dimension_numbers
    assert (numbers.input_batch, numbers.input_feature, numbers.input_spatial) == (0, 3, (1, 2))
    assert (numbers.kernel_input_feature, numbers.kernel_output_feature) == (2, 3)
    assert conv.feature_group_count == 2


def test_dot_gather_scatter_numbers() -> None:
    dot = root_of(
        "r = f32[2,2] dot(p, p), lhs_batch_dims={}, lhs_contracting_dims={1}, "
        "rhs_contracting_dims={1}, algorithm=dot_f32_f32_f32"
    )
    assert dot.dot_dimension_numbers == DotDimensionNumbers((), (), (1,), (1,))
    gather = root_of(
        "r = f32[4,3] gather(p, p), offset_dims={1}, collapsed_slice_dims={0}, "
        "start_index_map={0}, index_vector_dim=1, slice_sizes={1,3}"
    )
    numbers = gather.gather_dimension_numbers
    assert (numbers.offset_dims, numbers.collapsed_slice_dims) == ((1,), (0,))
    assert (numbers.start_index_map, numbers.index_vector_dim) == ((0,), 1)
    assert gather.slice_sizes == (1, 3)


def test_replica_groups_both_formats() -> None:
    explicit = root_of(
        "r = f32[2,3] all-reduce(p), replica_groups={{0,1},{2,3}}, to_apply=add",
        extra="add {\n  a = f32[] parameter(0)\n  b = f32[] parameter(1)\n  ROOT c = f32[] add(a, b)\n}\n",
    )
    assert explicit.replica_groups == ((0, 1), (2, 3))
    iota = root_of("r = f32[8,3] all-gather(p), replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}")
    # ids 0..7 laid out as [4,2], transposed to [2,4]: rows are the groups.
    assert iota.replica_groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert iota.attr("replica_groups") == "[2,4]<=[4,2]T(1,0)"


def test_sharding_metadata_frontend_attributes_backend_config_verbatim() -> None:
    sharding = "{devices=[2,1,4]<=[8] last_tile_dim_replicate}"
    metadata = '{op_type="dot" op_name="jit(f)/dot_general" source_file="/a b/c.py" source_line=12}'
    frontend = '{_xla_compute_type="host",grad_x="true"}'
    config = '{"operation_queue_id":"0","wait_on_operation_queues":[],"force_earliest_schedule":false}'
    root = root_of(
        f"r = f32[2,3] copy(p), sharding={sharding}, metadata={metadata}, "
        f"frontend_attributes={frontend}, backend_config={config}"
    )
    assert root.attrs == {
        "sharding": sharding, "metadata": metadata,
        "frontend_attributes": frontend, "backend_config": config,
    }
    assert root.sharding == sharding
    assert root.metadata.op_name == "jit(f)/dot_general"
    assert root.metadata.source_file == "/a b/c.py"
    assert root.metadata.source_line == 12


def test_multiline_json_and_quoted_backend_config() -> None:
    json_config = '{\n      "fusion_backend_config": {\n        "kind": "__triton",\n' \
        '        "output_tiles": [{sizes: [16,16]}]\n      }\n    }'
    fused = "f {\n  a = f32[2,3] parameter(0)\n  ROOT b = f32[2,3] negate(a)\n}\n"
    root = root_of(f"r = f32[2,3] fusion(p),\n    kind=kCustom, calls=f,\n    backend_config={json_config}", fused)
    assert root.attr("backend_config") == json_config
    assert root.fusion_kind == "kCustom"
    quoted = r'"{\"alpha_real\":1,\"beta\":0}"'
    call = root_of(f'r = f32[2,3] custom-call(p), custom_call_target="__cublas$gemm", backend_config={quoted}')
    assert call.attr("backend_config") == quoted
    assert call.custom_call_target == "__cublas$gemm"


@pytest.mark.parametrize(
    "literal",
    [
        "0", "-1.5e-12", "inf", "-inf", "nan", "true", "{...}", "{1, 2, 3}",
        "{ { 1, 2 }, { 3, 4 } }", "(2, 0)", "{(2.0, 0.0), (0.0, 2.0)}", "{\n  1,\n  2\n}",
    ],
)
def test_constant_literals(literal: str) -> None:
    assert root_of(f"r = f32[2] constant({literal})").payload == literal.strip()


def test_called_computation_attributes() -> None:
    extra = "".join(
        f"{name} {{\n  a = f32[] parameter(0)\n  ROOT b = f32[] copy(a)\n}}\n"
        for name in ("c1", "c2", "c3", "c4")
    )
    cases = {
        "r = f32[] call(s), to_apply=c1": ("c1",),
        "r = f32[] while(s), condition=c1, body=c2": ("c1", "c2"),
        "r = f32[] conditional(s, s, s), true_computation=c1, false_computation=%c2": ("c1", "c2"),
        "r = f32[] conditional(s, s, s, s), branch_computations={c1, %c2, c3}": ("c1", "c2", "c3"),
        "r = f32[] fusion(s), kind=kLoop, calls=c4": ("c4",),
        "r = f32[2,3] select-and-scatter(p, p, s), window={size=1x1}, select=c1, scatter=c2": ("c1", "c2"),
        "r = f32[] custom-call(s), custom_call_target=\"x\", called_computations={c3}": ("c3",),
    }
    for line, expected in cases.items():
        assert root_of(line, extra).called_computations == expected, line


def test_async_and_collective_ops() -> None:
    text = """\
HloModule m, replica_count=2, num_partitions=4
add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT c = f32[] add(a, b)
}
wrapped {
  x = f32[8] parameter(0)
  ROOT y = f32[8] all-reduce(x), replica_groups={}, to_apply=add
}
ENTRY e {
  p = f32[8]{0} parameter(0)
  ars = f32[8]{0} all-reduce-start(p), channel_id=1, replica_groups={{0,1}}, to_apply=add
  ard = f32[8]{0} all-reduce-done(ars)
  cps = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(ard), source_target_pairs={{0,1},{1,0}}
  cpd = f32[8]{0} collective-permute-done(cps)
  ags = ((f32[8]{0}), f32[32]{0}) all-gather-start(cpd), dimensions={0}, replica_groups=[1,4]<=[4]
  agd = f32[32]{0} all-gather-done(ags)
  a2a = f32[32]{0} all-to-all(agd), dimensions={0}, replica_groups={{0,1,2,3}}
  rs = f32[8]{0} reduce-scatter(a2a), dimensions={0}, replica_groups={{0,1,2,3}}, to_apply=add
  st = ((f32[8]{0}), f32[8]{0}, u32[]) async-start(rs), calls=wrapped
  ROOT dn = f32[8]{0} async-done(st), calls=wrapped
}
"""
    entry = parse(text).entry
    assert [i.base_opcode for i in entry.instructions[1:]] == [
        "all-reduce", "all-reduce", "collective-permute", "collective-permute",
        "all-gather", "all-gather", "all-to-all", "reduce-scatter", "async", "async",
    ]
    assert entry["ags"].replica_groups == ((0, 1, 2, 3),)
    assert entry["st"].called_computations == ("wrapped",)
    assert entry["cps"].shape.elements[2] == ArrayShape("u32", ())


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

GOOD = "HloModule m\n\nENTRY e {\n  a = f32[2] parameter(0)\n  ROOT b = f32[2] negate(a)\n}\n"


@pytest.mark.parametrize(
    ("text", "line", "column", "expected"),
    [
        (GOOD.replace("b = f32", "b f32"), 5, 10, "'=' after instruction name 'b'"),
        (GOOD.replace("f32[2] negate", "f99[2] negate"), 5, 12, "a known element type"),
        (GOOD.replace("negate(a)", "negate(a"), 6, 1, "',' or ')' in the operand list"),
        (GOOD.replace("negate(a)", "negate(q)"), 5, 26, "operands of 'b' to be instructions"),  # the caret at q
        (GOOD.replace("ROOT b = f32[2] negate(a)", "ROOT b = (f32[2], f32[2]) tuple(%a, %q)"), 5, 40,
         "operands of 'b' to be instructions"),
        (GOOD.replace("f32[2] negate", "f32[2 negate"), 5, 18, "',' or ']' in the dimensions"),
        (GOOD.replace("parameter(0)", "parameter(x)"), 4, 24, "a parameter number"),
        (GOOD.replace("negate(a)", "negate(a), metadata={op_name=\"x\""), 7, 1, "'}' to close"),
        (GOOD.replace("negate(a)", 'negate(a), metadata={op_name="x}'), 5, 48, "a closing quote"),
        (GOOD.replace("  a = ", "  ROOT a = "), 5, 3, "one ROOT"),
        (GOOD.replace("b = f32", "a = f32"), 5, 3, "a new instruction name"),
        (GOOD.replace("}\n", ""), 6, 1, "'}' to close computation 'e'"),
        (GOOD + "ENTRY f {\n  ROOT z = f32[] parameter(0)\n}\n", 7, 1, "only one ENTRY"),
        (GOOD + "HloModule again\n", 7, 1, "separate modules with a line '// -----'"),
        (GOOD.replace("negate(a)", "negate(a), to_apply=nowhere"), 5, 3, "a computation of this module"),
        (GOOD.replace("{\n  a", "{\n/* never closed\n  a"), 4, 1, "an instruction"),
        (GOOD.replace("ENTRY e {", "ENTRY e (a: f32[2]) f32[2] {"), 3, 21, "'->'"),
        ("HloModule m\n", 2, 1, "a computation"),
        ("", 1, 1, "an HLO module"),
        ("   \n// nothing\n", 3, 1, "an HLO module"),
        ("HloModule m\nFileNames\n1 \"a\"\nStackFrames\n", 4, 1, "'FunctionNames' section"),
        ("ENTRY e {\n  ROOT d = dot(a, b)\n}\n", 2, 12, "a result shape"),
        ("ENTRY e {\n}\n", 2, 1, "at least one instruction"),
        ("ENTRY e {\n  ROOT a = token parameter(0)\n}\n", 2, 18, "'[' after element type 'token'"),
    ],
)
def test_errors_name_position_and_expectation(text: str, line: int, column: int, expected: str) -> None:
    with pytest.raises(HloParseError) as info:
        parse(text, "bad.hlo")
    error = info.value
    assert expected in error.expected, error
    assert (error.filename, error.line, error.column) == ("bad.hlo", line, column), error
    message = str(error)
    assert message.startswith(f"bad.hlo:{line}:{column}: expected ")
    assert f", found {error.found}" in message


def test_error_message_shows_source_line_and_caret() -> None:
    with pytest.raises(HloParseError) as info:
        parse(GOOD.replace("f32[2] negate", "f99[2] negate"), "bad.hlo")
    lines = str(info.value).splitlines()
    assert lines[0] == (
        "bad.hlo:5:12: expected a shape with a known element type, or an opcode, found 'f99'"
    )
    source, caret = lines[1], lines[2]
    assert source == "  ROOT b = f99[2] negate(a)"
    assert caret == " " * source.index("f99") + "^"


def test_error_is_a_value_error_and_pickles() -> None:
    with pytest.raises(ValueError) as info:
        parse("ENTRY e {\n  ROOT a = f32[2] parameter(0)\n", "x.hlo")
    copy = pickle.loads(pickle.dumps(info.value))
    assert isinstance(copy, HloParseError)
    assert (copy.line, copy.column, copy.expected) == (info.value.line, info.value.column, info.value.expected)
    assert str(copy) == str(info.value)


def test_nul_character_is_an_error() -> None:
    with pytest.raises(HloParseError) as info:
        parse(GOOD.replace("negate", "neg\0ate"))
    assert info.value.line == 5


# ---------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------


def corpus_files(corpus_dir: Path) -> list[Path]:
    files = sorted((corpus_dir / "hlo").glob("*/*.hlo"))
    assert len(files) >= 60, files  # the corpus holds 53 xla/ and 14 jax/ files
    return files


def test_every_corpus_file_parses(corpus_dir: Path) -> None:
    for path in corpus_files(corpus_dir):
        modules = parse_file(path)
        text = path.read_text()
        splits = text.count("\n// -----\n") + 1
        assert len(modules) == splits, path
        for module in modules:
            assert module.instruction_count > 0
            assert module.entry_name in module.by_name


def test_fast_path_agrees_with_slow_path(corpus_dir: Path) -> None:
    """The regex fast path must never change the result: parse every corpus file both ways."""
    for path in corpus_files(corpus_dir):
        text = path.read_text()
        fast = _parse_all(text, str(path), fast=True)
        slow = _parse_all(text, str(path), fast=False)
        assert fast == slow, path
        for fast_module, slow_module in zip(fast, slow):  # locations are not part of equality
            for (_, a), (_, b) in zip(fast_module.instructions(), slow_module.instructions()):
                assert a.location == b.location, (path, a.name)


def test_crlf_line_endings() -> None:
    assert parse(CLASSIC.replace("\n", "\r\n")) == parse(CLASSIC)


def test_root_keyword_is_not_a_name() -> None:
    with pytest.raises(HloParseError) as info:
        parse("ENTRY e {\n  ROOT = f32[] parameter(0)\n}\n")
    assert (info.value.line, info.value.column) == (2, 8)
    assert parse("ENTRY e {\n  ROOT %ROOT = f32[] parameter(0)\n}\n").entry.root.name == "ROOT"


def test_jax_compiled_file_details(corpus_dir: Path) -> None:
    module = parse_file(corpus_dir / "hlo/jax/control_flow.compiled.hlo")[0]
    assert module.name == "jit_control"
    assert module.trailer.startswith("FileNames\n1 \"gen_corpus.py\"")
    assert module.trailer.splitlines()[-1].startswith("27 {file_location_id=13")
    whiles = [i for _, i in module.instructions() if i.opcode == "while"]
    assert len(whiles) == 2
    for inst in whiles:
        assert len(inst.called_computations) == 2
        assert "known_trip_count" in inst.attr("backend_config")


def test_typed_views_on_corpus(corpus_dir: Path) -> None:
    """Every typed view works on every corpus instruction, with consistent results."""
    seen: set[str] = set()
    for path in corpus_files(corpus_dir):
        for module in parse_file(path):
            for _, inst in module.instructions():
                assert all(c in module.by_name for c in inst.called_computations), inst.name
                if inst.opcode == "dot":
                    numbers = inst.dot_dimension_numbers
                    assert len(numbers.lhs_contracting) == len(numbers.rhs_contracting)
                    assert len(numbers.lhs_batch) == len(numbers.rhs_batch)
                    seen.add("dot")
                if inst.opcode == "convolution":
                    conv = inst.conv_dimension_numbers
                    assert len(conv.input_spatial) == len(conv.kernel_spatial) == len(inst.window)
                    seen.add("convolution")
                if inst.opcode in ("reduce-window", "select-and-scatter"):
                    assert len(inst.window) == next(inst.shape.leaves()).rank
                    seen.add("window")
                if inst.opcode == "slice":
                    assert len(inst.slice) == inst.shape.rank
                    seen.add("slice")
                if inst.opcode == "pad":
                    assert len(inst.padding) == inst.shape.rank
                    seen.add("pad")
                if inst.opcode == "gather":
                    assert len(inst.slice_sizes) >= len(inst.gather_dimension_numbers.offset_dims)
                    seen.add("gather")
                if inst.opcode == "scatter":
                    assert inst.scatter_dimension_numbers.update_window_dims is not None
                    seen.add("scatter")
                groups = inst.replica_groups
                if groups:
                    assert len({len(g) for g in groups}) == 1, (path, inst.name, groups)
                    seen.add("replica_groups")
                if inst.attr("metadata") is not None:
                    assert inst.metadata is not None
                    seen.add("metadata")
    assert seen >= {"dot", "convolution", "window", "slice", "pad", "gather", "scatter",
                    "replica_groups", "metadata"}, seen


def test_mesh_replica_groups_of_newer_xla_keep_their_device_ids_group():
    from hlomap.hlo import parse, print_module

    text = """HloModule m

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT c = f32[] add(a, b)
}

ENTRY e {
  p = f32[8]{0} parameter(0)
  ROOT ar = f32[8]{0} all-reduce(p), channel_id=1, replica_groups=mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}, use_global_device_ids=true, to_apply=add
}
"""
    module = parse(text)
    root = module.entry.root
    assert root.attr("device_ids") == "([2,4]T(1,0)) {'a'}"
    assert root.attr("replica_groups") == "mesh['a'=4,'b'=2]"
    assert root.attr("to_apply") == "add"
    assert parse(print_module(module)) == module
