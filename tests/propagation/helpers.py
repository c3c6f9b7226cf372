"""Small helpers for writing HLO snippets in tests."""

from __future__ import annotations

from hlomap.hlo.ir import Module
from hlomap.hlo.parser import parse

ADD = """
add_f32 {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
"""
OVERWRITE = """
overwrite_f32 {
  a = f32[] parameter(0)
  ROOT b = f32[] parameter(1)
}
"""


def module(body: str, *, computations: str = ADD + OVERWRITE, name: str = "m") -> Module:
    """A module whose entry computation is `body` (instruction lines), after `computations`."""
    return parse(f"HloModule {name}\n{computations}\nENTRY main {{\n{body}\n}}\n")


def rule_text(body: str, instruction: str | None = None, **kw: str) -> str:
    """The printed rule of `instruction` (default: the entry root) in a module built from body."""
    from hlomap.propagation import rule_for

    m = module(body, **kw)
    comp = m.entry
    inst = comp[instruction] if instruction else comp.root
    return str(rule_for(inst, [comp[o].shape for o in inst.operands], m))
