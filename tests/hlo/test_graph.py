"""Graph helpers: users (XLA's `users()` is the oracle on the corpus), topological order, call
graph, post order, entry parameters and root."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlomap.hlo import (
    HloGraphError,
    ModuleGraph,
    call_graph,
    callers,
    computations_postorder,
    entry_parameters,
    entry_root,
    parse,
    parse_file,
    topological_order,
    users,
)

TEXT = """\
HloModule m

add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}

cond {
  c = (s32[], f32[4]) parameter(0)
  i = s32[] get-tuple-element(c), index=0
  n = s32[] constant(8)
  ROOT lt = pred[] compare(i, n), direction=LT
}

body {
  b = (s32[], f32[4]) parameter(0)
  i = s32[] get-tuple-element(b), index=0
  v = f32[4] get-tuple-element(b), index=1
  z = f32[] constant(0)
  r = f32[] reduce(v, z), dimensions={0}, to_apply=add
  w = f32[4] broadcast(r), dimensions={}
  one = s32[] constant(1)
  j = s32[] add(i, one)
  ROOT t = (s32[], f32[4]) tuple(j, w)
}

ENTRY main {
  p1 = f32[4] parameter(1)
  p0 = s32[] parameter(0)
  t = (s32[], f32[4]) tuple(p0, p1)
  loop = (s32[], f32[4]) while(t), condition=cond, body=body
  ROOT out = f32[4] get-tuple-element(loop), index=1
}
"""


def test_users_hand_computed() -> None:
    module = parse(TEXT)
    body = users(module.computation("body"))
    assert body["b"] == ("i", "v")
    assert body["i"] == ("j",)
    assert body["r"] == ("w",)
    assert body["t"] == ()
    square = parse("ENTRY e {\n  a = f32[] parameter(0)\n  ROOT m = f32[] multiply(a, a)\n}\n")
    assert users(square.entry) == {"a": ("m",), "m": ()}  # one use, as XLA counts


def test_call_graph_callers_postorder() -> None:
    module = parse(TEXT)
    assert call_graph(module) == {"add": (), "cond": (), "body": ("add",), "main": ("cond", "body")}
    assert callers(module) == {"add": ("body",), "cond": ("main",), "body": ("main",), "main": ()}
    order = [c.name for c in computations_postorder(module)]
    assert order == ["add", "cond", "body", "main"]


def test_postorder_puts_callees_first_even_when_printed_after() -> None:
    head, entry = TEXT.split("ENTRY main", 1)
    module = parse("HloModule m\n\nENTRY main" + entry + head.removeprefix("HloModule m\n"))
    assert [c.name for c in module.computations][0] == "main"
    order = [c.name for c in computations_postorder(module)]
    assert order.index("add") < order.index("body") < order.index("main")
    assert order.index("cond") < order.index("main")
    assert order[-1] == "main"


def test_entry_parameters_and_root() -> None:
    module = parse(TEXT)
    assert [p.name for p in entry_parameters(module)] == ["p0", "p1"]  # by number, not text
    assert entry_root(module).name == "out"


def test_topological_order_reorders_forward_references() -> None:
    text = (
        "ENTRY e {\n  ROOT c = f32[2] add(a, b)\n  b = f32[2] negate(a)\n"
        "  a = f32[2] parameter(0)\n}\n"
    )
    computation = parse(text).entry
    assert [i.name for i in topological_order(computation)] == ["a", "b", "c"]


def test_topological_order_keeps_valid_program_order_and_control_edges() -> None:
    text = (
        "ENTRY e {\n  a = f32[2] parameter(0)\n  x = f32[2] negate(a)\n"
        "  y = f32[2] abs(a), control-predecessors={%z}\n  z = f32[2] exponential(a)\n"
        "  ROOT t = (f32[2], f32[2], f32[2]) tuple(x, y, z)\n}\n"
    )
    computation = parse(text).entry
    assert computation["y"].control_predecessors == ("z",)
    assert [i.name for i in topological_order(computation)] == ["a", "x", "z", "y", "t"]
    straight = parse(TEXT).computation("body")
    assert topological_order(straight) == straight.instructions


def test_cycles_are_reported() -> None:
    computation = parse(
        "ENTRY e {\n  a = f32[] negate(b)\n  ROOT b = f32[] negate(a)\n}\n"
    ).entry
    with pytest.raises(HloGraphError, match="cycle"):
        topological_order(computation)
    module = parse(
        "f {\n  a = f32[] parameter(0)\n  ROOT b = f32[] call(a), to_apply=g\n}\n"
        "g {\n  a = f32[] parameter(0)\n  ROOT b = f32[] call(a), to_apply=f\n}\n"
    )
    with pytest.raises(HloGraphError, match="calls itself"):
        computations_postorder(module)


def test_module_graph_conveniences() -> None:
    graph = ModuleGraph(parse(TEXT))
    assert [i.name for i in graph.users_of("body", "b")] == ["i", "v"]
    assert [i.name for i in graph.operands_of("main", "loop")] == ["t"]
    assert graph.call_graph["main"] == ("cond", "body")
    assert graph.callers["add"] == ("body",)
    assert graph.postorder[-1].name == "main"
    assert graph.entry_root.name == "out"
    assert [p.parameter_number for p in graph.entry_parameters] == [0, 1]
    assert graph.topological_order("main") is graph.topological_order("main")


def _modules_with_unique_names(corpus_dir: Path):
    """Corpus modules whose instruction names are unique module-wide (XLA keeps them as is)."""
    for path in sorted((corpus_dir / "hlo").glob("*/*.hlo")):
        text = path.read_text()
        parts = text.split("\n// -----\n")
        for module, part in zip(parse_file(path), parts):
            names = [i.name for _, i in module.instructions()]
            if len(names) == len(set(names)):
                yield path, module, part


def test_users_match_xla(corpus_dir: Path) -> None:
    _hlo = pytest.importorskip("jaxlib._hlo")
    compared = 0
    for path, module, text in _modules_with_unique_names(corpus_dir):
        xla = _hlo.hlo_module_from_text(text)
        theirs = {
            (c.name, i.name): sorted(u.name for u in i.users())
            for c in xla.computations() for i in c.instructions()
        }
        for computation in module.computations:
            for name, used_by in users(computation).items():
                assert sorted(used_by) == theirs[(computation.name, name)], (path, name)
                compared += 1
    assert compared > 2000


def test_orders_on_corpus(corpus_dir: Path) -> None:
    for path in sorted((corpus_dir / "hlo").glob("*/*.hlo")):
        for module in parse_file(path):
            order = computations_postorder(module)
            assert sorted(c.name for c in order) == sorted(module.by_name), path
            position = {c.name: i for i, c in enumerate(order)}
            for caller, callees in call_graph(module).items():
                for callee in callees:
                    assert position[callee] < position[caller], (path, caller, callee)
            for computation in module.computations:
                seen: set[str] = set()
                for inst in topological_order(computation):
                    assert all(o in seen for o in inst.operands), (path, inst.name)
                    seen.add(inst.name)
                assert len(seen) == len(computation.instructions)
