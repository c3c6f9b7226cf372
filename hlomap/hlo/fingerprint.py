"""What identifies a module for a saved plan: its entry signature and its instruction graph,
without what differs between two forms of the same step.

The same train step reaches hlomap as `jax.jit(...).lower(...).as_text()` or as an HLO text file
(hlomap's own dump, or another tool's); the two texts differ in instruction and module names,
metadata, debug tables and formatting, never in the computation. `structure_fingerprint` hashes
the parsed module with names replaced by positions (operands by their index in the computation,
called computations by their index in the module) and metadata dropped, so both forms hash alike
while a changed shape, dtype, opcode, operand or attribute changes the hash.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

from hlomap.hlo.ir import CALLED_COMPUTATION_KEYS, NAME_VALUED_KEYS, Module

__all__ = ["ModuleSignature", "describe_signature_difference", "module_signature", "structure_fingerprint"]

#: Attributes that record where an instruction came from, not what it computes.
_PROVENANCE_KEYS = frozenset({"metadata"})


def structure_fingerprint(module: Module) -> str:
    """sha256 of the module's computations with names replaced by positions and metadata
    dropped (module docstring)."""
    computation_index = {c.name: i for i, c in enumerate(module.computations)}
    digest = hashlib.sha256()
    for comp in module.computations:
        local = {inst.name: i for i, inst in enumerate(comp.instructions)}
        entry = "entry" if comp.name == module.entry_name else ""
        digest.update(f"computation {computation_index[comp.name]} {entry}\n".encode())
        for inst in comp.instructions:
            operands = tuple(local.get(name, -1) for name in inst.operands)
            attributes = tuple((key, _positions(key, value, computation_index, local))
                               for key, value in inst.attributes if key not in _PROVENANCE_KEYS)
            digest.update(repr((inst.opcode, str(inst.shape), operands, attributes, inst.payload,
                                inst.is_root)).encode() + b"\n")
    return digest.hexdigest()


def _positions(key: str, value: str, computation_index: dict[str, int], local: dict[str, int]) -> str:
    """An attribute's value with the computation or instruction names it holds replaced by their
    positions; any other value verbatim."""
    if key in CALLED_COMPUTATION_KEYS:
        index = computation_index
    elif key in NAME_VALUED_KEYS:
        index = local
    else:
        return value
    names = [n.strip().lstrip("%") for n in value.strip("{}").split(",") if n.strip()]
    return ",".join(str(index.get(n, -1)) for n in names)


@dataclass(frozen=True)
class ModuleSignature:
    """What a saved plan records of its module to say how another module differs: the entry
    parameters' shapes as HLO prints them (`f32[64,128]`) and the instruction count."""

    entry_parameters: tuple[str, ...]
    instructions: int


def module_signature(module: Module) -> ModuleSignature:
    params = sorted((inst for inst in module.entry.instructions if inst.opcode == "parameter"),
                    key=lambda inst: inst.parameter_number or 0)
    return ModuleSignature(tuple(_shape_text(str(inst.shape)) for inst in params), module.instruction_count)


def _shape_text(shape: str) -> str:
    """`f32[64,128]{1,0}` -> `f32[64,128]`: the layout is not part of what a user compares."""
    return shape.split("{", 1)[0] if shape.endswith("}") and "(" not in shape else shape


def describe_signature_difference(recorded: ModuleSignature, found: ModuleSignature, *, limit: int = 3) -> str:
    """`parameter 3: f32[64,128] vs f32[64,256]; 1786 vs 1790 instructions`: how `found` differs
    from `recorded` (the plan's module first), or that only the instruction graph does."""
    parts = _parameter_differences(recorded.entry_parameters, found.entry_parameters, limit)
    if recorded.instructions != found.instructions:
        parts.append(f"{recorded.instructions} vs {found.instructions} instructions")
    return "; ".join(parts) if parts else ("the same entry parameters and instruction count, but a different "
                                           "instruction graph")


def _parameter_differences(recorded: Sequence[str], found: Sequence[str], limit: int) -> list[str]:
    if len(recorded) != len(found):
        return [f"{len(recorded)} vs {len(found)} entry parameters"]
    changed = [f"parameter {i}: {a} vs {b}" for i, (a, b) in enumerate(zip(recorded, found)) if a != b]
    if len(changed) > limit:
        changed = changed[:limit] + [f"and {len(changed) - limit} more parameters"]
    return changed
