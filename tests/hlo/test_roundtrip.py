"""`parse(print_module(m)) == m`: on every corpus module, and on random modules built directly
as IR (so the printer and the parser are checked against each other, not against themselves)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hlomap.hlo.ir import NAME_VALUED_KEYS
from hlomap.hlo import (
    ELEMENT_BITS,
    ArrayShape,
    Computation,
    Instruction,
    Module,
    TupleShape,
    parse,
    parse_file,
    print_module,
)


def test_corpus_round_trips(corpus_dir: Path) -> None:
    count = 0
    for path in sorted((corpus_dir / "hlo").glob("*/*.hlo")):
        for module in parse_file(path):
            printed = print_module(module)
            again = parse(printed, f"printed:{path.name}")
            assert again == module, path
            assert print_module(again) == printed, path  # printing is a fixed point
            count += 1
    assert count >= 70


def test_printed_text_uses_classic_style() -> None:
    module = parse(
        "ENTRY e {\n  a = f32[2]{0} parameter(0)\n  ROOT b = f32[2]{0} negate(a), "
        "metadata={op_name=\"n\"}\n}\n"
    )
    assert print_module(module) == (
        "HloModule module_e\n\n"
        "ENTRY %e (a: f32[2]) -> f32[2] {\n"
        "  %a = f32[2]{0} parameter(0)\n"
        "  ROOT %b = f32[2]{0} negate(%a), metadata={op_name=\"n\"}\n"
        "}\n"
    )


# ---------------------------------------------------------------------------------------------
# Random IR modules
# ---------------------------------------------------------------------------------------------

NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,6}", fullmatch=True)
LAYOUTS = st.sampled_from([None, "0", "1,0", "1, 0", "1,0:T(8,128)(2,1)", "0:E(4)", ":T(128)S(1)"])
OPCODES = st.sampled_from(
    ["add", "negate", "tuple", "get-tuple-element", "dot", "all-reduce-start", "all-reduce-done",
     "custom-call", "fusion", "copy-start", "opt-barrier", "rng-bit-generator", "after-all"]
)
VALUES = st.sampled_from(
    [
        "{0,1}", "{}", "true", "kLoop", "LT", "0_1x2_3_1", "b01f_01io->b01f", "[2,4]<=[8]",
        "[2,4]<=[4,2]T(1,0)", "{{0,1},{2,3}}", "{devices=[2,1,4]<=[8] last_tile_dim_replicate}",
        "{size=3x3 stride=2x2 pad=0_1x0_1}", "{[0:8], [2:10:2]}", '"__cublas$gemm"',
        '{op_type="dot" op_name="jit(f)/a\\"b" source_line=3}', '{_xla_compute_type="host"}',
        '{"is_sync":false,"a":[{"b":{"c":[1,2]}}]}', '{\n  "sizes": [16, 16],\n  "k": "v"\n}',
        '"{\\"x\\": 1}"', "{maximal device=0}", "'single quoted, with comma'",
    ]
)
LITERALS = st.sampled_from(["0", "-1.5", "inf", "{1, 2}", "{ {1, 2}, {3, 4} }", "(1, 0)", "{...}"])


@st.composite
def shapes(draw, depth: int = 0):
    if depth < 2 and draw(st.integers(0, 5)) == 0:
        return TupleShape(tuple(draw(st.lists(shapes(depth + 1), max_size=3))))
    dtype = draw(st.sampled_from(sorted(ELEMENT_BITS)))
    dims = tuple(draw(st.lists(st.integers(0, 12), max_size=3)))
    dynamic = tuple(draw(st.booleans()) for _ in dims) if draw(st.booleans()) else ()
    if not any(dynamic):
        dynamic = ()
    return ArrayShape(dtype, dims, dynamic, draw(LAYOUTS))


@st.composite
def computations(draw, name: str, callable_names: list[str]):
    count = draw(st.integers(1, 6))
    names = draw(st.lists(NAMES, min_size=count, max_size=count, unique=True))
    root = draw(st.integers(0, count - 1))
    instructions = []
    for i, inst_name in enumerate(names):
        kind = draw(st.sampled_from(["parameter", "constant", "op"]))
        operands: tuple[str, ...] = ()
        payload = None
        if kind == "parameter":
            opcode, payload = "parameter", str(i)
        elif kind == "constant":
            opcode, payload = "constant", draw(LITERALS)
        else:
            opcode = draw(OPCODES)
            if i:
                operands = tuple(draw(st.lists(st.sampled_from(names[:i]), max_size=4)))
        keys = draw(st.lists(NAMES.filter(lambda k: k not in NAME_VALUED_KEYS), max_size=3,
                             unique=True))
        attributes = [(key, draw(VALUES)) for key in keys]
        if i and draw(st.booleans()):
            predecessors = draw(st.lists(st.sampled_from(names[:i]), max_size=2, unique=True))
            attributes.append(("control-predecessors", "{" + ", ".join(predecessors) + "}"))
        if callable_names and draw(st.booleans()):
            callee = draw(st.sampled_from(callable_names))
            attributes.append(draw(st.sampled_from([("to_apply", callee), ("calls", callee),
                                                    ("branch_computations", "{" + callee + "}")])))
        instructions.append(Instruction(inst_name, opcode, draw(shapes()), operands,
                                        tuple(attributes), payload, i == root))
    attributes = (("execution_thread", '"host"'),) if draw(st.booleans()) else ()
    return Computation(name, tuple(instructions), attributes=attributes)


@st.composite
def modules(draw):
    names = draw(st.lists(NAMES, min_size=1, max_size=4, unique=True))
    comps = [draw(computations(name, names[:i])) for i, name in enumerate(names)]
    trailer = draw(st.sampled_from([
        "",
        'FileNames\n1 "a.py"\n\nFunctionNames\n1 "f"\n\nFileLocations\n'
        "1 {file_name_id=1 function_name_id=1 line=1 end_line=1 column=0 end_column=2}\n\n"
        "StackFrames\n1 {file_location_id=1 parent_frame_id=1}",
    ]))
    attributes = draw(st.lists(st.tuples(NAMES, VALUES), max_size=2))
    return Module(draw(NAMES), tuple(comps), draw(st.sampled_from(names)), tuple(attributes), trailer)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(modules())
def test_random_modules_round_trip(module: Module) -> None:
    printed = print_module(module)
    assert parse(printed, "<random>") == module, printed
