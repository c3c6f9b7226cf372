"""The registry of per-opcode factor rules: one small pure function per opcode family.

`rule_for(inst, operand_shapes, module)` returns the `OpRule` of an instruction. Rules never
raise on odd input: an unknown opcode or custom-call target gets a conservative rule in which
every dimension is its own need-replication factor (nothing is linked, nothing may be sharded),
with `OpRule.fallback` saying why; the factor graph logs one warning per unknown name. The
families (elementwise ops, sources) come from the opcode table, `hlomap.hlo.opcodes`; opcodes of
the table left without a rule on purpose are listed in `UNKNOWN_OPCODES` with the reason.

Choices worth knowing (see factors.py for the kinds):
- Dims whose sizes differ between operand and result (slice, pad, concatenate, dynamic-slice,
  windows with stride, all-gather...) get one need-replication factor per side, unlinked: the
  elements do not correspond one to one, and XLA's own propagation (shardy) does not propagate
  through them either.
- A gather's indexed operand dim with slice size 1 is a REDUCTION factor: a device holding part
  of the table gathers what it has and the partial rows are summed (vocabulary-parallel
  embedding). The scatter dims of an additive scatter are REDUCTION factors too; the scattered-
  into operand dims pass through (each device applies the updates that land in its block).
- Windowed dims (convolution spatial dims, reduce-window, select-and-scatter) are
  need-replication unless the window is trivial; kernel spatial dims are reductions.
"""

from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Callable, Mapping, Sequence

from hlomap.hlo.ir import ArrayShape, Instruction, Module, Shape, WindowDimension
from hlomap.hlo.opcodes import opcode_names
from hlomap.propagation.factors import (
    FactorKind,
    OpRule,
    RuleBuilder,
    leaf_shapes,
    reshape_factorization,
)

log = logging.getLogger(__name__)

PT = FactorKind.PASS_THROUGH
RED = FactorKind.REDUCTION
NR = FactorKind.NEED_REPLICATION

RuleFn = Callable[[Instruction, tuple[Shape, ...], "Module | None"], OpRule]


# ---------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------


def _builder(inst: Instruction, operands: Sequence[Shape], **kw: object) -> RuleBuilder:
    return RuleBuilder.for_shapes(operands, inst.shape, **kw)


def _pointwise(inst: Instruction, operands: Sequence[Shape], kind_of_dim: Callable[[int], FactorKind] | None = None) -> OpRule:
    """Every operand and result leaf of the result's rank shares the result's dims; scalar
    operands (clamp's bounds, select's predicate) map to nothing; a leaf of any other rank gets
    factors of its own. Built directly rather than through RuleBuilder: elementwise ops are most
    of a module, so this is the hot path of building a factor graph.
    """
    results = tuple(inst.shape.leaves())
    if not results:
        return RuleBuilder.for_shapes(operands, inst.shape).build()
    rank = results[0].rank
    sizes = list(results[0].dims)
    kinds = [kind_of_dim(d) if kind_of_dim else PT for d in range(rank)]
    shared = tuple((d,) for d in range(rank))

    def factors_of(leaf: ArrayShape, is_operand: bool) -> tuple[tuple[int, ...], ...]:
        if leaf.rank == rank:
            return shared
        if leaf.rank == 0 and is_operand:
            return ()
        own = tuple((len(sizes) + d,) for d in range(leaf.rank))
        sizes.extend(leaf.dims)
        kinds.extend([PT] * leaf.rank)
        return own

    ops = tuple(factors_of(leaf, True) for leaf in leaf_shapes(operands))
    res = tuple(factors_of(leaf, False) for leaf in results)
    return OpRule(tuple(sizes), tuple(kinds), ops, res)


def _match_dims(b: RuleBuilder, pairs: Sequence[tuple[int, int]], kind: FactorKind = PT) -> None:
    """Link operand leaf `o` and result leaf `r` dim by dim, for each `(o, r)` in pairs.

    Dims whose sizes agree share a factor of `kind`; dims whose sizes differ get one
    need-replication factor per side. All pairs must have the same rank as the first's result.
    """
    if not pairs:
        return
    o0, r0 = pairs[0]
    for d in range(b.result_rank(r0)):
        out_size = b.result_shapes[r0].dims[d]
        match = [(o, r) for o, r in pairs if d < b.operand_rank(o) and b.operand_shapes[o].dims[d] == b.result_shapes[r].dims[d]]
        if len(match) == len(pairs):
            b.factor(out_size, kind, operands=sorted({(o, d) for o, _ in pairs}), results=sorted({(r, d) for _, r in pairs}))
        else:
            for o, r in pairs:
                if d < b.operand_rank(o):
                    b.factor(b.operand_shapes[o].dims[d], NR, operands=[(o, d)])
                b.factor(b.result_shapes[r].dims[d], NR, results=[(r, d)])


def _leafwise(inst: Instruction, operands: Sequence[Shape], *, first_operand_leaf: int = 0,
              nr_dims: Sequence[int] = ()) -> OpRule:
    """Result leaf i corresponds to operand leaf `first_operand_leaf + i` (collectives, async pairs).

    Dims of equal size pass through (or need replication for `nr_dims`); dims of different size
    (the gathered or scattered dim of a collective) get unlinked need-replication factors.
    """
    b = _builder(inst, operands)
    for r, rshape in enumerate(b.result_shapes):
        o = first_operand_leaf + r
        if o >= len(b.operand_shapes) or b.operand_shapes[o].rank != rshape.rank:
            continue
        for d in range(rshape.rank):
            osz, rsz = b.operand_shapes[o].dims[d], rshape.dims[d]
            if osz == rsz:
                b.factor(rsz, NR if d in nr_dims else PT, operands=[(o, d)], results=[(r, d)])
            else:
                b.factor(osz, NR, operands=[(o, d)])
                b.factor(rsz, NR, results=[(r, d)])
    return b.build(independent_leaves=True)


def _isolated(inst: Instruction, operands: Sequence[Shape], kind: FactorKind = PT, *, fallback: str | None = None) -> OpRule:
    """Every dim its own factor of `kind`: nothing linked (sources such as iota, constant)."""
    return _builder(inst, operands, unmapped_kind=kind).build(independent_leaves=True, fallback=fallback)


def _trivial_window(w: WindowDimension) -> bool:
    return (w.size == 1 and w.stride == 1 and w.pad_low == 0 and w.pad_high == 0
            and w.window_dilation == 1 and w.base_dilation == 1)


def _window(inst: Instruction, rank: int) -> tuple[WindowDimension, ...]:
    win = inst.window
    return win if len(win) == rank else tuple(WindowDimension() for _ in range(rank))


def _is_additive(inst: Instruction, module: Module | None) -> bool:
    """True when the combiner of a scatter (its `to_apply`) is an associative reduction.

    Partial results of such a scatter can be summed (or max-ed...) by an all-reduce; an
    overwriting scatter cannot. Unknown combiners count as not additive (the safe answer).
    """
    if module is None or not inst.called_computations:
        return False
    comp = module.by_name.get(inst.called_computations[0])
    if comp is None:
        return False
    return comp.root.opcode in ("add", "multiply", "maximum", "minimum", "and", "or", "xor")


# ---------------------------------------------------------------------------------------------
# Rules, alphabetical by opcode (families share one function)
# ---------------------------------------------------------------------------------------------


def rule_bitcast(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    """A bitcast reinterprets the buffer: a reshape when the element type width is unchanged."""
    leaves = leaf_shapes(operands)
    out = inst.shape
    if (len(leaves) == 1 and isinstance(out, ArrayShape) and leaves[0].num_elements == out.num_elements
            and leaves[0].dtype == out.dtype):
        return rule_reshape(inst, operands, module)
    return rule_bitcast_convert(inst, operands, module)


def rule_bitcast_convert(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    """Same dims, except an extra minor dim on the side with the narrower element type."""
    b = _builder(inst, operands)
    if not b.operand_shapes or not b.result_shapes:
        return b.build()
    ins, outs = b.operand_shapes[0], b.result_shapes[0]
    common = min(ins.rank, outs.rank)
    for d in range(common):
        if ins.dims[d] == outs.dims[d]:
            b.factor(outs.dims[d], PT, operands=[(0, d)], results=[(0, d)])
        else:
            b.factor(ins.dims[d], NR, operands=[(0, d)])
            b.factor(outs.dims[d], NR, results=[(0, d)])
    for d in range(common, ins.rank):
        b.factor(ins.dims[d], NR, operands=[(0, d)])
    for d in range(common, outs.rank):
        b.factor(outs.dims[d], NR, results=[(0, d)])
    return b.build()


def rule_broadcast(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    """Result dims listed in `dimensions` come from the operand; the others are new factors."""
    b = _builder(inst, operands)
    out = b.result_shapes[0]
    source = {r: o for o, r in enumerate(inst.dimensions)}
    for d, size in enumerate(out.dims):
        o = source.get(d)
        if o is not None and o < b.operand_rank(0) and b.operand_shapes[0].dims[o] == size:
            b.factor(size, PT, operands=[(0, o)], results=[(0, d)])
        else:
            b.factor(size, PT, results=[(0, d)])
    return b.build()


def rule_call(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    """call / fusion / async wrappers: no local correspondence; the factor graph links operands and
    results to the called computation's parameters and root."""
    return _isolated(inst, operands)


def rule_concatenate(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    b = _builder(inst, operands)
    axis = inst.dimensions[0] if inst.dimensions else 0
    for d, size in enumerate(b.result_shapes[0].dims):
        if d == axis:
            for o in range(len(b.operand_shapes)):
                b.factor(b.operand_shapes[o].dims[d], NR, operands=[(o, d)])
            b.factor(size, NR, results=[(0, d)])
        else:
            b.factor(size, PT, operands=[(o, d) for o in range(len(b.operand_shapes))], results=[(0, d)])
    return b.build()


def rule_conditional(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    """The branch index and branch operands are linked to the branches by the factor graph."""
    return _isolated(inst, operands)


def rule_convolution(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    """Batch and output-feature dims pass through; input features are contracted (reduction);
    feature/batch groups are a shared major factor; spatial dims need replication unless the
    window is trivial; kernel spatial dims are reductions."""
    dn = inst.conv_dimension_numbers
    b = _builder(inst, operands)
    if dn is None or len(b.operand_shapes) < 2:
        return b.build()
    lhs, rhs, out = b.operand_shapes[0], b.operand_shapes[1], b.result_shapes[0]
    fgc, bgc = inst.feature_group_count, inst.batch_group_count

    if bgc > 1:
        b.factor(bgc, PT, operands=[(0, dn.input_batch), (1, dn.kernel_output_feature)], results=[(0, dn.output_feature)])
    b.factor(out.dims[dn.output_batch], PT, operands=[(0, dn.input_batch)], results=[(0, dn.output_batch)])
    if fgc > 1:
        b.factor(fgc, PT, operands=[(0, dn.input_feature), (1, dn.kernel_output_feature)], results=[(0, dn.output_feature)])
    b.factor(rhs.dims[dn.kernel_input_feature], RED, operands=[(0, dn.input_feature), (1, dn.kernel_input_feature)])
    b.factor(out.dims[dn.output_feature] // max(fgc * bgc, 1), PT, operands=[(1, dn.kernel_output_feature)],
             results=[(0, dn.output_feature)])

    window = _window(inst, len(dn.input_spatial))
    for w, li, ki, oi in zip(window, dn.input_spatial, dn.kernel_spatial, dn.output_spatial):
        if _trivial_window(w) and rhs.dims[ki] == 1 and lhs.dims[li] == out.dims[oi]:
            b.factor(out.dims[oi], PT, operands=[(0, li)], results=[(0, oi)])
            b.factor(1, RED, operands=[(1, ki)])
        else:
            b.factor(lhs.dims[li], NR, operands=[(0, li)])
            b.factor(out.dims[oi], NR, results=[(0, oi)])
            b.factor(rhs.dims[ki], RED, operands=[(1, ki)])
    return b.build()


# custom-call targets that behave like elementwise ops
_POINTWISE_TARGETS = frozenset({
    "annotate_device_placement", "LayoutConstraint", "MoveToDevice", "MoveToHost", "mhlo.erf",
    "Sharding", "X64Combine", "X64SplitLow", "X64SplitHigh", "xla.sdy.FuncResultSharding",
    "xla.sdy.ShardingGroup", "xla.sdy.PropagationBarrier",
})
# custom-call targets whose results correspond leaf-by-leaf to their operands, sizes may change
_LEAFWISE_TARGETS = frozenset({
    "SPMDFullToShardShape", "SPMDShardToFullShape", "xla.sdy.GlobalToLocalShape",
    "xla.sdy.LocalToGlobalShape", "PadToStatic", "SliceToDynamic",
})
_TOPK_TARGETS = frozenset({"TopK", "mhlo.topk", "ApproxTopK", "PartialReduce"})


def rule_custom_call(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    target = inst.custom_call_target or ""
    if target in _POINTWISE_TARGETS:
        return _pointwise(inst, operands)
    if target in _LEAFWISE_TARGETS:
        return _leafwise(inst, operands)
    if target in _TOPK_TARGETS:
        return rule_topk(inst, operands, module)
    if target in ("Cholesky", "Eigh", "Qr", "lu") or target.startswith("lapack_"):
        return _batched_linalg(inst, operands)
    return _isolated(inst, operands, NR, fallback=f"custom-call target {target!r}")


def _batched_linalg(inst: Instruction, operands: tuple[Shape, ...]) -> OpRule:
    """Leading dims are batch dims shared by every leaf; the trailing matrix dims need replication."""
    b = _builder(inst, operands)
    ranks = [s.rank for s in b.operand_shapes] + [s.rank for s in b.result_shapes]
    batch = max(min(ranks) - 2, 0) if ranks else 0
    for d in range(batch):
        size = b.result_shapes[0].dims[d] if b.result_shapes else b.operand_shapes[0].dims[d]
        ops = [(k, d) for k, s in enumerate(b.operand_shapes) if s.dims[d] == size]
        res = [(k, d) for k, s in enumerate(b.result_shapes) if s.dims[d] == size]
        b.factor(size, PT, operands=ops, results=res)
    b.unmapped_kind = NR
    return b.build()


def rule_dot(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    """Factors: batch, lhs free, rhs free (pass-through), then contracting (reduction)."""
    dn = inst.dot_dimension_numbers
    b = _builder(inst, operands)
    lhs, rhs = b.operand_shapes[0], b.operand_shapes[1]
    out_dim = 0
    for ld, rd in zip(dn.lhs_batch, dn.rhs_batch):
        b.factor(lhs.dims[ld], PT, operands=[(0, ld), (1, rd)], results=[(0, out_dim)])
        out_dim += 1
    for d in range(lhs.rank):
        if d not in dn.lhs_batch and d not in dn.lhs_contracting:
            b.factor(lhs.dims[d], PT, operands=[(0, d)], results=[(0, out_dim)])
            out_dim += 1
    for d in range(rhs.rank):
        if d not in dn.rhs_batch and d not in dn.rhs_contracting:
            b.factor(rhs.dims[d], PT, operands=[(1, d)], results=[(0, out_dim)])
            out_dim += 1
    for ld, rd in zip(dn.lhs_contracting, dn.rhs_contracting):
        b.factor(lhs.dims[ld], RED, operands=[(0, ld), (1, rd)])
    return b.build()


def rule_dynamic_slice(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    """Full-size dims pass through (their offset is clamped to 0); sliced dims need replication."""
    b = _builder(inst, operands)
    _match_dims(b, [(0, 0)])
    return b.build()


def rule_dynamic_update_slice(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    """Operand and result always correspond; the update joins them where it spans the whole dim.

    A device holding a block of the operand applies the part of a (replicated) update that lands
    in its block, so the operand dims pass through even where the update is smaller.
    """
    b = _builder(inst, operands)
    operand, update = b.operand_shapes[0], b.operand_shapes[1]
    for d, size in enumerate(operand.dims):
        if update.dims[d] == size:
            b.factor(size, PT, operands=[(0, d), (1, d)], results=[(0, d)])
        else:
            b.factor(size, PT, operands=[(0, d)], results=[(0, d)])
            b.factor(update.dims[d], NR, operands=[(1, d)])
    return b.build()


def rule_elementwise(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    return _pointwise(inst, operands)


def rule_fft(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    """The trailing `fft_length` dims are transformed (need replication); leading dims are batch."""
    b = _builder(inst, operands)
    n_fft = len(_int_attr_list(inst.attr("fft_length", "{}")))
    rank = b.result_rank(0)
    for d in range(rank):
        osz, rsz = b.operand_shapes[0].dims[d], b.result_shapes[0].dims[d]
        kind = NR if d >= rank - n_fft else PT
        if osz == rsz:
            b.factor(rsz, kind, operands=[(0, d)], results=[(0, d)])
        else:
            b.factor(osz, NR, operands=[(0, d)])
            b.factor(rsz, NR, results=[(0, d)])
    return b.build()


def rule_gather(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    """Batch dims come from the indices; offset dims from unsliced operand dims.

    An indexed operand dim with slice size 1 is a REDUCTION factor (vocabulary-parallel
    embedding: each device gathers the rows it holds, zeros elsewhere, then all-reduce).
    """
    dn = inst.gather_dimension_numbers
    b = _builder(inst, operands)
    operand, indices, out = b.operand_shapes[0], b.operand_shapes[1], b.result_shapes[0]
    slice_sizes = inst.slice_sizes or operand.dims
    ivd = dn.index_vector_dim
    index_batch_dims = [d for d in range(indices.rank) if d != ivd]
    offset_operand_dims = [d for d in range(operand.rank)
                           if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    batch_out_dims = [d for d in range(out.rank) if d not in dn.offset_dims]

    for k, od in enumerate(batch_out_dims):
        idim = index_batch_dims[k] if k < len(index_batch_dims) else None
        ops = [(1, idim)] if idim is not None else []
        if idim is not None and idim in dn.start_indices_batching_dims:
            ops.append((0, dn.operand_batching_dims[dn.start_indices_batching_dims.index(idim)]))
        b.factor(out.dims[od], PT, operands=ops, results=[(0, od)])
    for od, opd in zip(dn.offset_dims, offset_operand_dims):
        full = operand.dims[opd]
        if slice_sizes[opd] == full:
            b.factor(full, PT, operands=[(0, opd)], results=[(0, od)])
        elif opd in dn.start_index_map and slice_sizes[opd] == 1:
            b.factor(full, RED, operands=[(0, opd)])
            b.factor(out.dims[od], PT, results=[(0, od)])
        else:
            b.factor(full, NR, operands=[(0, opd)])
            b.factor(out.dims[od], NR, results=[(0, od)])
    for cd in dn.collapsed_slice_dims:
        b.factor(operand.dims[cd], RED if slice_sizes[cd] == 1 else NR, operands=[(0, cd)])
    if ivd < indices.rank:
        b.factor(indices.dims[ivd], NR, operands=[(1, ivd)])
    return b.build()


def rule_get_tuple_element(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    b = _builder(inst, operands)
    index = inst.tuple_index or 0
    source = operands[0]
    first = 0
    if source.is_tuple:
        first = sum(sum(1 for _ in e.leaves()) for e in source.elements[:index])  # type: ignore[union-attr]
    for r, rshape in enumerate(b.result_shapes):
        for d, size in enumerate(rshape.dims):
            b.factor(size, PT, operands=[(first + r, d)], results=[(r, d)])
    return b.build(independent_leaves=True)


def rule_pad(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    b = _builder(inst, operands)
    _match_dims(b, [(0, 0)])
    return b.build()


def rule_reduce(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    """Variadic: n inputs, n scalar inits, n results. Reduced dims are reductions (inputs only)."""
    b = _builder(inst, operands)
    n = max(len(b.operand_shapes) // 2, 1)
    inputs = range(n)
    kept = iter(range(b.result_rank(0) if b.result_shapes else 0))
    for d, size in enumerate(b.operand_shapes[0].dims):
        if d in inst.dimensions:
            b.factor(size, RED, operands=[(k, d) for k in inputs])
        else:
            r = next(kept)
            b.factor(size, PT, operands=[(k, d) for k in inputs], results=[(k, r) for k in range(len(b.result_shapes))])
    return b.build()


def rule_reduce_window(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    """Trivial window dims pass through; windowed dims need replication (linked when same size)."""
    b = _builder(inst, operands)
    n = max(len(b.operand_shapes) // 2, 1)
    window = _window(inst, b.operand_rank(0))
    for d, w in enumerate(window):
        isz, osz = b.operand_shapes[0].dims[d], b.result_shapes[0].dims[d]
        if isz == osz:
            b.factor(osz, PT if _trivial_window(w) else NR, operands=[(k, d) for k in range(n)],
                     results=[(k, d) for k in range(len(b.result_shapes))])
        else:
            b.factor(isz, NR, operands=[(k, d) for k in range(n)])
            b.factor(osz, NR, results=[(k, d) for k in range(len(b.result_shapes))])
    return b.build()


def rule_reshape(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    """Common factors of the two shapes; a dim with several factors is compound (major first)."""
    b = _builder(inst, operands)
    if not b.operand_shapes or not b.result_shapes:
        return b.build()
    sizes, in_map, out_map, shared = reshape_factorization(b.operand_shapes[0].dims, b.result_shapes[0].dims)
    base = len(b.sizes)
    # unshared factors cannot keep a sharding across the reshape, except when there is no data
    empty = b.operand_shapes[0].num_elements == 0
    for s, sh in zip(sizes, shared):
        b.sizes.append(s)
        b.kinds.append(PT if sh or s <= 1 or empty else NR)
    for d, fs in enumerate(in_map):
        b._operands[0][d].extend(base + f for f in fs)
    for d, fs in enumerate(out_map):
        b._results[0][d].extend(base + f for f in fs)
    return b.build()


def rule_reverse(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    reversed_dims = set(inst.dimensions)
    return _pointwise(inst, operands, lambda d: NR if d in reversed_dims else PT)


def rule_scatter(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    """Variadic: n operands, indices, n updates -> n results (tuple when n > 1).

    Operand dims always pass through to the result (a device applies the updates landing in its
    block). Update window dims spanning a whole operand dim join it. Update scatter dims are
    REDUCTION factors shared with the indices when the combiner is associative, since devices
    holding different updates produce partial results; need replication otherwise.
    """
    dn = inst.scatter_dimension_numbers
    b = _builder(inst, operands)
    n = (len(b.operand_shapes) - 1) // 2
    ops, idx, upd = list(range(n)), n, list(range(n + 1, 2 * n + 1))
    operand, indices, update = b.operand_shapes[0], b.operand_shapes[idx], b.operand_shapes[upd[0]]
    results = list(range(len(b.result_shapes)))
    ivd = dn.index_vector_dim
    window_operand_dims = [d for d in range(operand.rank) if d not in dn.inserted_window_dims and d not in dn.input_batching_dims]
    index_batch_dims = [d for d in range(indices.rank) if d != ivd]
    scatter_update_dims = [d for d in range(update.rank) if d not in dn.update_window_dims]
    scatter_kind = RED if _is_additive(inst, module) else NR

    window_of = dict(zip(window_operand_dims, dn.update_window_dims))
    batch_update_of: dict[int, tuple[int, int]] = {}
    for k, ud in enumerate(scatter_update_dims):
        idim = index_batch_dims[k] if k < len(index_batch_dims) else None
        if idim is not None and idim in dn.scatter_indices_batching_dims:
            od = dn.input_batching_dims[dn.scatter_indices_batching_dims.index(idim)]
            batch_update_of[od] = (idim, ud)
        else:
            b.factor(update.dims[ud], scatter_kind, operands=[(u, ud) for u in upd] + ([(idx, idim)] if idim is not None else []))
    for d, size in enumerate(operand.dims):
        mapped = [(o, d) for o in ops]
        res = [(r, d) for r in results]
        if d in batch_update_of:
            idim, ud = batch_update_of[d]
            b.factor(size, PT, operands=mapped + [(idx, idim)] + [(u, ud) for u in upd], results=res)
        elif d in window_of and update.dims[window_of[d]] == size:
            b.factor(size, PT, operands=mapped + [(u, window_of[d]) for u in upd], results=res)
        else:
            b.factor(size, PT, operands=mapped, results=res)
            if d in window_of:
                b.factor(update.dims[window_of[d]], NR, operands=[(u, window_of[d]) for u in upd])
    if ivd < indices.rank:
        b.factor(indices.dims[ivd], NR, operands=[(idx, ivd)])
    return b.build()


def rule_select_and_scatter(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    """operand, source (one value per window), init -> result shaped like operand."""
    b = _builder(inst, operands)
    operand, source = b.operand_shapes[0], b.operand_shapes[1]
    window = _window(inst, operand.rank)
    for d, w in enumerate(window):
        size = operand.dims[d]
        if _trivial_window(w) and source.dims[d] == size:
            b.factor(size, PT, operands=[(0, d), (1, d)], results=[(0, d)])
        else:
            b.factor(size, NR, operands=[(0, d)], results=[(0, d)])
            b.factor(source.dims[d], NR, operands=[(1, d)])
    return b.build()


def rule_slice(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    b = _builder(inst, operands)
    _match_dims(b, [(0, 0)])
    return b.build()


def rule_sort(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    """All operands and results share every dim; the sort dim needs replication."""
    sort_dims = set(inst.dimensions)
    return _pointwise(inst, operands, lambda d: NR if d in sort_dims else PT)


def rule_source(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    """Sources create their result (parameters, constants, iota, random bits, ids, infeed): no
    dim corresponds to an operand dim, and every dim is free. A sharded parameter is fed in
    pieces, a sharded iota computed locally from the device's offset."""
    return _isolated(inst, operands)


def rule_structural(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    """tuple / opt-barrier / while / domain: result leaf i is operand leaf i."""
    b = _builder(inst, operands)
    for r, rshape in enumerate(b.result_shapes):
        if r < len(b.operand_shapes) and b.operand_shapes[r].dims == rshape.dims:
            for d, size in enumerate(rshape.dims):
                b.factor(size, PT, operands=[(r, d)], results=[(r, d)])
    return b.build(independent_leaves=True)


def rule_topk(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    """values and indices share the operand's leading dims; the top-k dim needs replication."""
    b = _builder(inst, operands)
    operand = b.operand_shapes[0]
    for d, size in enumerate(operand.dims):
        res = [(r, d) for r, s in enumerate(b.result_shapes) if s.rank == operand.rank and s.dims[d] == size]
        if d < operand.rank - 1 and len(res) == len(b.result_shapes):
            b.factor(size, PT, operands=[(0, d)], results=res)
        else:
            b.factor(size, NR, operands=[(0, d)])
            for r, s in enumerate(b.result_shapes):
                if d < s.rank:
                    b.factor(s.dims[d], NR, results=[(r, d)])
    return b.build()


def rule_transpose(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    b = _builder(inst, operands)
    for out_dim, in_dim in enumerate(inst.dimensions):
        b.factor(b.operand_shapes[0].dims[in_dim], PT, operands=[(0, in_dim)], results=[(0, out_dim)])
    return b.build()


def rule_triangular_solve(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    return _batched_linalg(inst, operands)


def rule_collective(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    """Collectives written by hand (shard_map): result leaves follow operand leaves; the
    gathered / scattered / exchanged dims need replication."""
    return _leafwise(inst, operands, nr_dims=inst.dimensions)


def rule_async_done(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    """`*-done` returns the last leaves of its `*-start` tuple (or the start's only array)."""
    leaves = leaf_shapes(operands)
    n_result = sum(1 for _ in inst.shape.leaves())
    return _leafwise(inst, operands, first_operand_leaf=max(len(leaves) - n_result, 0))


def unknown_rule(inst: Instruction, operands: tuple[Shape, ...], module: Module | None) -> OpRule:
    """Every dim its own need-replication factor; the fallback says why (see `UNKNOWN_OPCODES`)."""
    reason = UNKNOWN_OPCODES.get(inst.opcode)
    detail = f" ({reason})" if reason else ""
    return _isolated(inst, operands, NR, fallback=f"opcode {inst.opcode!r}{detail}")


def _int_attr_list(text: str) -> tuple[int, ...]:
    import re

    return tuple(int(x) for x in re.findall(r"-?\d+", text))


#: The elementwise family: every opcode the table marks elementwise (and set-dimension-size, whose
#: result has its operand's dims) shares the pointwise rule.
_ELEMENTWISE = tuple(sorted(opcode_names(lambda op: op.elementwise is not None) | {"set-dimension-size"}))

#: Sources: every opcode the table marks as creating its result.
_SOURCES = tuple(sorted(opcode_names(lambda op: op.source)))

#: Opcodes of the text format left to `unknown_rule` on purpose, and why. Nothing in them may be
#: sharded, which is always correct and never fast; a test checks that every opcode of the table
#: has a rule or a line here.
UNKNOWN_OPCODES: Mapping[str, str] = MappingProxyType({
    "batch-norm-grad": "JAX lowers batch norm to reductions; other front ends' batch norms "
                       "are not modeled",
    "batch-norm-inference": "JAX lowers batch norm to reductions; other front ends' batch norms "
                            "are not modeled",
    "batch-norm-training": "JAX lowers batch norm to reductions; other front ends' batch norms "
                           "are not modeled",
    "collective-reduce": "a collective written by hand whose reduction is not modeled",
    "dynamic-reshape": "its result dims are sizes known only at run time",
    "outfeed": "sends its operand to the host whole",
    "ragged-all-to-all": "the sizes it exchanges are known only at run time",
    "ragged-dot": "its groups' sizes are known only at run time",
    "recv-done": "a point-to-point transfer written by hand; the peer's layout is unknown",
    "scaled-dot": "block-scaled dot: the scales' dims are not modeled",
    "scan": "JAX lowers scans to while loops; this loop form is not modeled",
    "send": "a point-to-point transfer written by hand; the peer's layout is unknown",
    "send-done": "a point-to-point transfer written by hand; the peer's layout is unknown",
    "shuffle": "its permutation of elements is not modeled",
})

#: opcode -> rule. The literal lists families then single opcodes alphabetically; the mapping
#: itself is sorted by opcode so that listings and docs read alphabetically.
RULES: Mapping[str, RuleFn] = MappingProxyType(dict(sorted({
    **{op: rule_elementwise for op in _ELEMENTWISE},
    **{op: rule_source for op in _SOURCES},
    "add-dependency": rule_structural,
    "all-gather": rule_collective,
    "all-gather-start": rule_collective,
    "all-gather-done": rule_async_done,
    "all-reduce": rule_collective,
    "all-reduce-start": rule_collective,
    "all-reduce-done": rule_async_done,
    "all-to-all": rule_collective,
    "async-done": rule_async_done,
    "async-start": rule_call,
    "async-update": rule_structural,
    "bitcast": rule_bitcast,
    "bitcast-convert": rule_bitcast_convert,
    "broadcast": rule_broadcast,
    "call": rule_call,
    "cholesky": rule_triangular_solve,
    "collective-broadcast": rule_collective,
    "collective-permute": rule_collective,
    "collective-permute-start": rule_collective,
    "collective-permute-done": rule_async_done,
    "concatenate": rule_concatenate,
    "conditional": rule_conditional,
    "convolution": rule_convolution,
    "copy-done": rule_async_done,
    "copy-start": rule_collective,
    "custom-call": rule_custom_call,
    "domain": rule_structural,
    "dot": rule_dot,
    "dynamic-slice": rule_dynamic_slice,
    "dynamic-update-slice": rule_dynamic_update_slice,
    "fft": rule_fft,
    "fusion": rule_call,
    "gather": rule_gather,
    "get-tuple-element": rule_get_tuple_element,
    "opt-barrier": rule_structural,
    "pad": rule_pad,
    "reduce": rule_reduce,
    "reduce-scatter": rule_collective,
    "reduce-window": rule_reduce_window,
    "reshape": rule_reshape,
    "reverse": rule_reverse,
    "scatter": rule_scatter,
    "select-and-scatter": rule_select_and_scatter,
    "slice": rule_slice,
    "sort": rule_sort,
    "topk": rule_topk,
    "transpose": rule_transpose,
    "triangular-solve": rule_triangular_solve,
    "tuple": rule_structural,
    "while": rule_structural,
}.items())))

#: Opcodes whose rule depends on operand and result shapes only (the factor graph shares one
#: rule between instructions with equal shapes).
ELEMENTWISE_OPCODES = frozenset(_ELEMENTWISE)


def rule_for(inst: Instruction, operands: Sequence[Shape], module: Module | None = None) -> OpRule:
    """The factor rule of `inst` given its operands' shapes. Never raises: a rule that fails on
    malformed attributes falls back to the all-need-replication rule, naming the error."""
    operands = tuple(operands)
    fn = RULES.get(inst.opcode, unknown_rule)
    try:
        rule = fn(inst, operands, module)
    except (IndexError, KeyError, ValueError, StopIteration, ZeroDivisionError, TypeError) as exc:
        return _isolated(inst, operands, NR, fallback=f"{inst.opcode} rule failed on {inst.name}: {exc!r}")
    problem = _inconsistency(rule, operands, inst.shape)
    if problem:
        return _isolated(inst, operands, NR, fallback=f"{inst.opcode} rule failed on {inst.name}: {problem}")
    return rule


def _inconsistency(rule: OpRule, operands: tuple[Shape, ...], result: Shape) -> str | None:
    """Why a rule does not fit the shapes (malformed HLO, e.g. a transpose whose result shape is
    not a permutation of its operand's), or None. Every dim's factors must multiply to its size."""
    sizes = rule.factor_sizes
    for tensors, leaves in ((rule.operands, leaf_shapes(operands)), (rule.results, tuple(result.leaves()))):
        if len(tensors) != len(leaves):
            return f"{len(tensors)} tensors in the rule for {len(leaves)} leaves"
        for tfactors, leaf in zip(tensors, leaves):
            if len(tfactors) != leaf.rank:
                return f"rule has {len(tfactors)} dims for {leaf}"
            for factors, size in zip(tfactors, leaf.dims):
                product = 1
                for f in factors:
                    product *= sizes[f]
                if product != size:
                    return f"factors of size {product} for a dim of size {size} in {leaf}"
    return None
