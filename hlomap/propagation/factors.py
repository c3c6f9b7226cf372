"""Factor rules: how the dimensions of one instruction's operands and results correspond.

A rule (`OpRule`) describes an instruction as an einsum over *factors*. Every operand and result
dimension maps to one factor, or to several for a reshape that merges or splits dimensions (a
compound dimension; factors listed major to minor). A factor that appears in several tensors ties
their dimensions together: sharding one of them along a mesh axis is only communication-free when
the others are sharded the same way. This is the idea of openxla/shardy's sharding rules, used
here to compute Auto-MAP's linkage groups once instead of propagating per plan.

Factor kinds say what happens when a factor is sharded:

- PASS_THROUGH: every tensor holding the factor is split the same way; no communication.
- REDUCTION: the factor is summed over (dot contracting dims, reduced dims, the indexed dim of a
  vocabulary-parallel gather, the scatter dims of an additive scatter). It appears in operands
  only; sharding it leaves a partial result that needs an all-reduce. Allowed, but costs
  communication, which the cost model reads off the plan.
- NEED_REPLICATION: the factor cannot be split without communication (the sort dimension, sliced
  or padded dimensions, windowed dimensions, dynamic offsets...). Sharding it is a conflict.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Sequence

from hlomap.hlo.ir import ArrayShape, Shape


class FactorKind(enum.Enum):
    PASS_THROUGH = "pass_through"
    REDUCTION = "reduction"
    NEED_REPLICATION = "need_replication"


#: The factors of one tensor: for each dimension, its factors from major to minor.
TensorFactors = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class OpRule:
    """The factor rule of one instruction.

    `operands[i]` maps the dims of the i-th operand *leaf* (tuple-shaped operands are flattened in
    order) to factors; `results[j]` does the same for the j-th leaf of the result shape.
    `independent_leaves` is True for structural ops (tuple, get-tuple-element, while, call...)
    whose result leaves are separate tensors: two of their factors sharded on one mesh axis is
    fine, whereas for a computing op (dot, add...) it means a device holds mismatched blocks.
    `fallback` names why a conservative all-need-replication rule was used (unknown opcode or
    custom-call target), or is None.
    """

    factor_sizes: tuple[int, ...]
    factor_kinds: tuple[FactorKind, ...]
    operands: tuple[TensorFactors, ...]
    results: tuple[TensorFactors, ...]
    independent_leaves: bool = False
    fallback: str | None = None

    @property
    def num_factors(self) -> int:
        return len(self.factor_sizes)

    def factors_of_kind(self, kind: FactorKind) -> tuple[int, ...]:
        return tuple(f for f, k in enumerate(self.factor_kinds) if k is kind)

    def __str__(self) -> str:
        return format_rule(self)


# ---------------------------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------------------------

_LETTERS = "ijklmnopqrstuvwxyzabcdefgh"


def factor_name(index: int) -> str:
    """`i, j, k, ... z, a, ... h`, then `f26, f27...` (shardy's convention starts at i)."""
    return _LETTERS[index] if index < len(_LETTERS) else f"f{index}"


def _format_dim(factors: tuple[int, ...]) -> str:
    names = [factor_name(f) for f in factors]
    if len(names) == 1:
        return names[0]
    # Compound dims print their factors juxtaposed (`ij`), as shardy does; multi-letter names
    # would be ambiguous that way, so they are joined with `*`.
    return "".join(names) if all(len(n) == 1 for n in names) else "*".join(names)


def _format_tensors(tensors: tuple[TensorFactors, ...]) -> str:
    return ",".join("[" + ",".join(_format_dim(d) for d in t) + "]" for t in tensors)


def format_rule(rule: OpRule) -> str:
    """Einsum-style text: `([i,k],[k,j])->([i,j]) {i=8,j=16,k=8} reduction={k}`."""
    text = f"({_format_tensors(rule.operands)})->({_format_tensors(rule.results)})"
    if rule.factor_sizes:
        sizes = ",".join(f"{factor_name(f)}={s}" for f, s in enumerate(rule.factor_sizes))
        text += " {" + sizes + "}"
    for kind in (FactorKind.REDUCTION, FactorKind.NEED_REPLICATION):
        chosen = rule.factors_of_kind(kind)
        if chosen:
            text += f" {kind.value}={{" + ",".join(factor_name(f) for f in chosen) + "}"
    if rule.independent_leaves:
        text += " independent"
    return text


# ---------------------------------------------------------------------------------------------
# Building rules
# ---------------------------------------------------------------------------------------------


def leaf_shapes(shapes: Sequence[Shape]) -> tuple[ArrayShape, ...]:
    """The array leaves of a sequence of (possibly tuple) shapes, flattened in order."""
    return tuple(leaf for shape in shapes for leaf in shape.leaves())


@dataclass
class RuleBuilder:
    """Mutable scratchpad for one rule function; `build()` returns the frozen `OpRule`.

    Dims not mapped by the rule function get their own factor when built (pass-through by
    default, or `unmapped_kind`), so every dim of every tensor ends up with at least one factor.
    """

    operand_shapes: tuple[ArrayShape, ...]
    result_shapes: tuple[ArrayShape, ...]
    unmapped_kind: FactorKind = FactorKind.PASS_THROUGH
    sizes: list[int] = field(default_factory=list)
    kinds: list[FactorKind] = field(default_factory=list)
    _operands: list[list[list[int]]] = field(default_factory=list)
    _results: list[list[list[int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._operands = [[[] for _ in s.dims] for s in self.operand_shapes]
        self._results = [[[] for _ in s.dims] for s in self.result_shapes]

    @classmethod
    def for_shapes(cls, operands: Sequence[Shape], result: Shape, **kw: object) -> RuleBuilder:
        return cls(leaf_shapes(operands), tuple(result.leaves()), **kw)  # type: ignore[arg-type]

    def factor(
        self,
        size: int,
        kind: FactorKind = FactorKind.PASS_THROUGH,
        *,
        operands: Sequence[tuple[int, int]] = (),
        results: Sequence[tuple[int, int]] = (),
    ) -> int:
        """Add a factor mapped to `(leaf, dim)` pairs of operands and results; returns its index.

        Calling it several times for one dim makes that dim compound, factors in call order
        (major first).
        """
        index = len(self.sizes)
        self.sizes.append(int(size))
        self.kinds.append(kind)
        for leaf, dim in operands:
            self._operands[leaf][dim].append(index)
        for leaf, dim in results:
            self._results[leaf][dim].append(index)
        return index

    def operand_rank(self, leaf: int) -> int:
        return self.operand_shapes[leaf].rank

    def result_rank(self, leaf: int) -> int:
        return self.result_shapes[leaf].rank

    def build(self, *, independent_leaves: bool = False, fallback: str | None = None) -> OpRule:
        for tensors, shapes in ((self._operands, self.operand_shapes), (self._results, self.result_shapes)):
            for tensor, shape in zip(tensors, shapes):
                for dim, factors in enumerate(tensor):
                    if not factors:
                        factors.append(len(self.sizes))
                        self.sizes.append(shape.dims[dim])
                        self.kinds.append(self.unmapped_kind)
        return OpRule(
            factor_sizes=tuple(self.sizes),
            factor_kinds=tuple(self.kinds),
            operands=tuple(tuple(tuple(d) for d in t) for t in self._operands),
            results=tuple(tuple(tuple(d) for d in t) for t in self._results),
            independent_leaves=independent_leaves,
            fallback=fallback,
        )


def reshape_factorization(
    in_dims: Sequence[int], out_dims: Sequence[int]
) -> tuple[list[int], list[list[int]], list[list[int]], list[bool]]:
    """Common factors of a reshape from `in_dims` to `out_dims` (row-major).

    Returns `(sizes, in_map, out_map, shared)`: factor sizes; for each input and output dim its
    factors, major to minor; and whether each factor appears on both sides. Walking both shapes
    from the major end, the next common factor is the gcd of what is left of the current input
    and output dims. Where the gcd is 1 the two sides are out of step (e.g. [6,4]->[4,6] after
    the common 2): every dim portion up to the point where the running products meet again gets a
    factor of its own, which the caller marks need-replication. Size-1 dims get a size-1 factor.
    Shapes with zero elements get one unshared factor per dim (nothing is worth linking).
    """
    sizes: list[int] = []
    shared: list[bool] = []
    in_map: list[list[int]] = [[] for _ in in_dims]
    out_map: list[list[int]] = [[] for _ in out_dims]

    def new(size: int, is_shared: bool) -> int:
        sizes.append(size)
        shared.append(is_shared)
        return len(sizes) - 1

    if 0 in in_dims or 0 in out_dims:
        for i, d in enumerate(in_dims):
            in_map[i].append(new(d, False))
        for o, d in enumerate(out_dims):
            out_map[o].append(new(d, False))
        return sizes, in_map, out_map, shared

    i = o = 0
    rem_in = in_dims[0] if in_dims else 1
    rem_out = out_dims[0] if out_dims else 1
    while i < len(in_dims) or o < len(out_dims):
        # size-1 dims: their own factor, never linked
        if i < len(in_dims) and in_dims[i] == 1:
            in_map[i].append(new(1, False))
            i += 1
            rem_in = in_dims[i] if i < len(in_dims) else 1
            continue
        if o < len(out_dims) and out_dims[o] == 1:
            out_map[o].append(new(1, False))
            o += 1
            rem_out = out_dims[o] if o < len(out_dims) else 1
            continue
        if i >= len(in_dims) or o >= len(out_dims):  # cannot happen for equal element counts
            break
        g = _gcd(rem_in, rem_out)
        if g > 1:
            f = new(g, True)
            in_map[i].append(f)
            out_map[o].append(f)
            rem_in //= g
            rem_out //= g
        else:
            # Out of step: give each remaining portion its own factor until the products meet.
            prod_in, prod_out = rem_in, rem_out
            in_map[i].append(new(rem_in, False))
            out_map[o].append(new(rem_out, False))
            rem_in = rem_out = 1
            while prod_in != prod_out:
                if prod_in < prod_out:
                    i += 1
                    in_map[i].append(new(in_dims[i], False))
                    prod_in *= in_dims[i]
                else:
                    o += 1
                    out_map[o].append(new(out_dims[o], False))
                    prod_out *= out_dims[o]
        if rem_in == 1:
            i += 1
            rem_in = in_dims[i] if i < len(in_dims) else 1
        if rem_out == 1:
            o += 1
            rem_out = out_dims[o] if o < len(out_dims) else 1
    return sizes, in_map, out_map, shared


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
