"""Summary statistics of a module: opcode counts, parameter bytes, FLOPs of dots and convolutions.

These are what `hlomap inspect` prints; the cost model has the full per-instruction roofline.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Mapping

from hlomap.hlo.ir import ArrayShape, Computation, Instruction, Module


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
    dot_flops: float
    convolution_flops: float

    @property
    def matmul_flops(self) -> float:
        return self.dot_flops + self.convolution_flops


def _operand_shape(comp: Computation, inst: Instruction, index: int) -> ArrayShape:
    shape = comp[inst.operands[index]].shape
    if not isinstance(shape, ArrayShape):
        raise ValueError(f"{inst.opcode} {inst.name}: operand {index} has tuple shape {shape}")
    return shape


def dot_flops(comp: Computation, inst: Instruction) -> float:
    """2 x (result elements) x (product of contracting dim sizes): one multiply and one add each."""
    lhs = _operand_shape(comp, inst, 0)
    contracting = math.prod(lhs.dims[d] for d in inst.dot_dimension_numbers.lhs_contracting)
    result = inst.shape
    assert isinstance(result, ArrayShape)
    return 2.0 * result.num_elements * contracting


def convolution_flops(comp: Computation, inst: Instruction) -> float:
    """2 x (output elements) x (kernel input features x kernel window): each output element is a
    dot over one group's input features and the window. The kernel's input-feature dim already
    holds features / feature_group_count."""
    kernel = _operand_shape(comp, inst, 1)
    dims = inst.conv_dimension_numbers
    if dims is None:
        raise ValueError(f"convolution {inst.name} has no dim_labels")
    per_output = kernel.dims[dims.kernel_input_feature] * math.prod(kernel.dims[d] for d in dims.kernel_spatial)
    result = inst.shape
    assert isinstance(result, ArrayShape)
    return 2.0 * result.num_elements * per_output


def summarize(module: Module) -> ModuleSummary:
    """Counts over every computation; a while body's dots count once (trip counts are unknown)."""
    opcodes: Counter[str] = Counter()
    dots = convs = 0.0
    for comp, inst in module.instructions():
        opcodes[inst.opcode] += 1
        if inst.opcode == "dot":
            dots += dot_flops(comp, inst)
        elif inst.opcode == "convolution":
            convs += convolution_flops(comp, inst)
    return ModuleSummary(
        name=module.name,
        instruction_count=module.instruction_count,
        opcode_counts=dict(sorted(opcodes.items(), key=lambda kv: (-kv[1], kv[0]))),
        computations=tuple(
            ComputationSummary(c.name, len(c.instructions), c.name == module.entry_name) for c in module.computations
        ),
        dot_flops=dots,
        convolution_flops=convs,
    )
