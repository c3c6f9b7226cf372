"""Prints the IR back to HLO text in XLA's classic style (`%` sigils, computation signatures,
`ROOT`), which both XLA's parser and hlomap's parser read back.

Attribute values, constant literals and the stack-frame tables are printed verbatim, so
`parse(print_module(m)) == m` for every module the parser produces.
"""

from __future__ import annotations

from hlomap.hlo.ir import ArrayShape, Computation, Instruction, Module, Shape, TupleShape
from hlomap.hlo.parser import NAME_VALUED_KEYS, split_name_value

__all__ = ["print_module", "print_computation", "print_instruction", "shape_without_layout"]


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


def _attributes(pairs: tuple[tuple[str, str], ...]) -> str:
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
    return f"{root}%{inst.name} = {inst.shape} {inst.opcode}({inside}){_attributes(inst.attributes)}"


def print_computation(computation: Computation, *, is_entry: bool = False) -> str:
    """A computation with its signature: parameters by number, then the root's shape."""
    params = ", ".join(
        f"{p.name}: {shape_without_layout(p.shape)}" for p in computation.parameters
    )
    result = shape_without_layout(computation.root.shape)
    head = f"{'ENTRY ' if is_entry else ''}%{computation.name} ({params}) -> {result} {{"
    body = "\n".join("  " + print_instruction(inst) for inst in computation.instructions)
    return f"{head}\n{body}\n}}{_attributes(computation.attributes)}"


def print_module(module: Module) -> str:
    """The whole module: header, stack-frame tables (if any), computations in stored order."""
    parts = [f"HloModule {module.name}{_attributes(module.attributes)}"]
    if module.trailer:
        # XLA prints the tables right after the header and reads them only there.
        parts.append(module.trailer)
    for computation in module.computations:
        parts.append(print_computation(computation, is_entry=computation.name == module.entry_name))
    return "\n\n".join(parts) + "\n"
