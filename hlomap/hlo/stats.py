"""Summary statistics of a module: instruction counts by opcode and by computation.

These are what `hlomap inspect` prints besides the FLOPs, which come from the cost model
(`hlomap.cost.compute`, the one FLOP count) so that `inspect` and `simulate` agree.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping

from hlomap.hlo.ir import Module


@dataclass(frozen=True)
class ComputationSummary:
    name: str
    instruction_count: int
    is_entry: bool


@dataclass(frozen=True)
class ModuleSummary:
    name: str
    instruction_count: int
    opcode_counts: Mapping[str, int]
    computations: tuple[ComputationSummary, ...]


def summarize(module: Module) -> ModuleSummary:
    """Counts over every computation, each counted once (a while body's instructions too)."""
    opcodes: Counter[str] = Counter(inst.opcode for _, inst in module.instructions())
    return ModuleSummary(
        name=module.name,
        instruction_count=module.instruction_count,
        opcode_counts=dict(sorted(opcodes.items(), key=lambda kv: (-kv[1], kv[0]))),
        computations=tuple(
            ComputationSummary(c.name, len(c.instructions), c.name == module.entry_name) for c in module.computations
        ),
    )
