"""Conformance with XLA's own C++ HLO parser (`jaxlib._hlo.hlo_module_from_text`), the oracle.

For every corpus module (and each zoo model's HLO) the two parsers must agree on the set of
computations and, per computation, on instruction names, opcodes, operand lists and result
shapes (element types, dimensions, and layouts wherever the text gives one).

What XLA changes, found by running it on the corpus (so the comparison allows for it):
- Instruction names must be unique in an XLA module, so XLA renames repeats across computations
  (`p` in four fused computations becomes `p`, `p.1`, `p.2`, `p.3`). Names are matched exactly
  where XLA kept them and otherwise by base name, opcode and already-matched operands.
- XLA lists a computation's instructions in post order, not text order: compared as maps.
- A file without a `HloModule` header gets the module name `module_<entry computation>`; the
  last computation is the entry unless one is marked ENTRY (hlomap does the same).
- XLA adds default layouts (`{1,0}`) where the text has none, so layouts are compared only where
  hlomap's text has one.
- XLA renumbers the stack-frame tables; hlomap keeps them verbatim.
XLA accepts every split of every corpus file (the test would name any it rejected).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import pytest

from hlomap.hlo import Computation, Module, Shape, TupleShape, parse_all, print_module

_hlo = pytest.importorskip("jaxlib._hlo")


class XlaInstruction(NamedTuple):
    opcode: str
    operands: tuple[str, ...]
    skeleton: str  # the shape without layouts or spaces: `(f32[2],s32[])`
    leaves: tuple[tuple[str, str, str | None], ...]  # (dtype, dims, layout) per array leaf
    key: str  # parameter number or tuple index: tells apart otherwise identical instructions


_LEAF_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](?:\{([^{}]*)\})?")
_COMMENT_RE = re.compile(r"/\*.*?\*/")


def _split_xla_instruction(text: str) -> tuple[str, str]:
    """(shape text, opcode) from XLA's `%name = SHAPE opcode(...)...`, scanned independently of
    hlomap's parser so that it can serve as an oracle."""
    rest = text.split(" = ", 1)[1]
    if rest.startswith("("):
        depth = 0
        for i, char in enumerate(rest):  # noqa: B007 - i is the end of the shape, read below
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                break
        shape_text = rest[: i + 1]
    else:
        shape_text = rest.split(" ", 1)[0]
    after = rest[len(shape_text) :].lstrip()
    return shape_text, after[: after.index("(")]


def _skeleton_of_text(shape_text: str) -> str:
    text = _COMMENT_RE.sub("", shape_text)
    return re.sub(r"\{[^{}]*\}", "", text).replace(" ", "")


def _skeleton(shape: Shape) -> str:
    if isinstance(shape, TupleShape):
        return "(" + ",".join(_skeleton(e) for e in shape.elements) + ")"
    dims = ",".join("?" if d < 0 else ("<=" if shape.dynamic and shape.dynamic[i] else "") + str(d)
                    for i, d in enumerate(shape.dims))
    return f"{shape.dtype}[{dims}]"


def xla_view(text: str) -> tuple[object, dict[str, dict[str, XlaInstruction]]]:
    module = _hlo.hlo_module_from_text(text)
    view: dict[str, dict[str, XlaInstruction]] = {}
    for computation in module.computations():
        instructions = {}
        for inst in computation.instructions():
            shape_text, opcode = _split_xla_instruction(inst.to_string())
            leaves = tuple(
                (m.group(1), m.group(2).replace(" ", ""), m.group(3))
                for m in _LEAF_RE.finditer(_COMMENT_RE.sub("", shape_text))
            )
            key = re.search(r"parameter\(([0-9]+)\)|, index=([0-9]+)", inst.to_string())
            instructions[inst.name] = XlaInstruction(
                opcode, tuple(o.name for o in inst.operands()), _skeleton_of_text(shape_text),
                leaves, (key.group(1) or key.group(2)) if key and opcode in _KEYED else "",
            )
        view[computation.name] = instructions
    return module, view


def _base(name: str) -> str:
    return re.sub(r"\.[0-9]+$", "", name)


_KEYED = ("parameter", "get-tuple-element")


def _key(inst) -> str:
    if inst.opcode == "parameter":
        return inst.payload
    return inst.attr("index", "") if inst.opcode == "get-tuple-element" else ""


def match_names(ours: Computation, xla: dict[str, XlaInstruction]) -> dict[str, str]:
    """Our instruction name -> XLA's, allowing for XLA's renaming of repeated names.

    XLA may shift a whole family of names (`get-tuple-element.0/.1/.2` became `.1/.2/.3` in one
    corpus file), so names are matched structurally: an instruction matches the XLA instruction
    with the same base name, opcode, shape, parameter number or tuple index and (already
    matched) operands. Among structurally identical candidates the same name wins, else the
    first; they are interchangeable for what is compared.
    """
    index: dict[tuple, list[str]] = {}
    for name in sorted(xla):
        other = xla[name]
        signature = (_base(name), other.opcode, other.operands, other.skeleton, other.key)
        index.setdefault(signature, []).append(name)
    mapping: dict[str, str] = {}
    progress = True
    while progress and len(mapping) < len(ours.instructions):
        progress = False
        for inst in ours.instructions:
            if inst.name in mapping or any(o not in mapping for o in inst.operands):
                continue
            operands = tuple(mapping[o] for o in inst.operands)
            signature = (_base(inst.name), inst.opcode, operands, _skeleton(inst.shape), _key(inst))
            candidates = index.get(signature)
            if candidates:
                chosen = inst.name if inst.name in candidates else candidates[0]
                mapping[inst.name] = chosen
                candidates.remove(chosen)
                progress = True
    return mapping


def assert_conforms(module: Module, xla: dict[str, dict[str, XlaInstruction]], where: str) -> int:
    """Compares one parsed module with XLA's view of the same text; returns instructions seen."""
    assert sorted(xla) == sorted(c.name for c in module.computations), where
    checked = 0
    for computation in module.computations:
        theirs = xla[computation.name]
        assert len(theirs) == len(computation.instructions), (where, computation.name)
        mapping = match_names(computation, theirs)
        unmatched = [i.name for i in computation.instructions if i.name not in mapping]
        assert not unmatched, (where, computation.name, unmatched)
        for inst in computation.instructions:
            other = theirs[mapping[inst.name]]
            context = (where, computation.name, inst.name)
            assert inst.opcode == other.opcode, context
            assert tuple(mapping[o] for o in inst.operands) == other.operands, context
            assert _skeleton(inst.shape) == other.skeleton, context
            leaves = list(inst.shape.leaves())
            assert len(leaves) == len(other.leaves), context
            for leaf, (dtype, _dims, layout) in zip(leaves, other.leaves):
                assert leaf.dtype == dtype, context
                if leaf.layout is not None and leaf.dims:
                    assert leaf.layout.replace(" ", "") == layout, context
            checked += 1
    return checked


# ---------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------


def corpus_splits(corpus_dir: Path) -> list[tuple[str, str]]:
    splits = []
    for path in sorted((corpus_dir / "hlo").glob("*/*.hlo")):
        text = path.read_text()
        parts = re.split(r"^// -----[ \t]*\n", text, flags=re.M)
        splits += [(f"{path.name}#{i}", part) for i, part in enumerate(parts)]
    assert len(splits) >= 70
    return splits


def test_corpus_matches_xla(corpus_dir: Path) -> None:
    rejected = []
    total = 0
    for where, text in corpus_splits(corpus_dir):
        try:
            xla_module, view = xla_view(text)
        except Exception as error:  # noqa: BLE001 - XLA raises its own status errors
            rejected.append((where, str(error).splitlines()[0]))
            continue
        (module,) = parse_all(text, where)
        total += assert_conforms(module, view, where)
        if "HloModule" not in _COMMENT_RE.sub("", re.sub(r"//[^\n]*", "", text)):
            assert module.name == xla_module.name == f"module_{module.entry_name}", where
        else:
            assert module.name == xla_module.name, where
    assert not rejected, f"XLA rejected corpus splits: {rejected}"
    assert total > 3000


def test_xla_printed_text_parses_to_xla_structure(corpus_dir: Path) -> None:
    """XLA's own `to_string()` (classic style, XLA's names): names match exactly."""
    for where, text in corpus_splits(corpus_dir):
        xla_module = _hlo.hlo_module_from_text(text)
        printed = xla_module.to_string()
        (module,) = parse_all(printed, f"xla:{where}")
        _, view = xla_view(printed)
        assert_conforms(module, view, where)
        for computation in module.computations:
            assert {i.name for i in computation.instructions} == set(view[computation.name])


def test_xla_accepts_our_printed_text(corpus_dir: Path) -> None:
    for where, text in corpus_splits(corpus_dir):
        (module,) = parse_all(text, where)
        printed = print_module(module)
        try:
            _, view = xla_view(printed)
        except Exception as error:  # noqa: BLE001
            pytest.fail(f"XLA rejects hlomap's printing of {where}: {error}")
        assert_conforms(module, view, f"printed {where}")


def test_name_matching_catches_a_wrong_operand() -> None:
    """The comparison itself must be able to fail: swap two operands in our module."""
    text = "ENTRY e {\n  a = f32[2] parameter(0)\n  b = f32[2] parameter(1)\n  ROOT c = f32[2] subtract(a, b)\n}\n"
    (module,) = parse_all(text)
    _, view = xla_view(text)
    assert_conforms(module, view, "ok")
    swapped = text.replace("subtract(a, b)", "subtract(b, a)")
    (other,) = parse_all(swapped)
    with pytest.raises(AssertionError):
        assert_conforms(other, view, "swapped")
    retyped = text.replace("f32[2] parameter(1)", "s32[2] parameter(1)")
    (third,) = parse_all(retyped)
    with pytest.raises(AssertionError):
        assert_conforms(third, view, "retyped")


# ---------------------------------------------------------------------------------------------
# Zoo models (hlomap.zoo lowers JAX training steps)
# ---------------------------------------------------------------------------------------------

#: Lowered in the default run (each well under a few seconds); the rest are marked slow.
SMALL_ZOO = ("haiku-mlp", "gpt-tiny", "bert-tiny", "t5-tiny", "moe-tiny", "vgg19-tiny")


def _zoo_names() -> list:
    try:
        from hlomap import zoo
    except ImportError:
        return [pytest.param("-", marks=pytest.mark.skip(reason="hlomap.zoo not importable"))]
    if not hasattr(zoo, "names"):
        return [pytest.param("-", marks=pytest.mark.skip(reason="hlomap.zoo has no names() yet"))]
    return [
        pytest.param(name, marks=() if name in SMALL_ZOO else pytest.mark.slow)
        for name in zoo.names()
    ]


@pytest.mark.parametrize("name", _zoo_names())
def test_zoo_model_matches_xla(name: str) -> None:
    from hlomap import zoo

    text = zoo.get(name).hlo_text()
    (module,) = parse_all(text, f"zoo:{name}")
    xla_module, view = xla_view(text)
    assert module.name == xla_module.name
    assert assert_conforms(module, view, f"zoo:{name}") == module.instruction_count
