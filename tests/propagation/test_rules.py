"""Per-opcode factor rules: golden einsum strings (derived by hand from each opcode's semantics),
structural invariants over every instruction of the corpus, and the never-crash fallback."""

from __future__ import annotations

import logging
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hlomap.hlo.ir import ArrayShape, Instruction, TupleShape
from hlomap.propagation import FactorKind, OpRule, rule_for
from hlomap.propagation.factors import reshape_factorization

from .helpers import rule_text

GOLDEN = {
    # dot: factors are batch, lhs free, rhs free, contracting (shardy's order)
    "dot": (
        "lhs = f32[8,8] parameter(0)\nrhs = f32[8,16] parameter(1)\n"
        "ROOT d = f32[8,16] dot(lhs, rhs), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
        "([i,k],[k,j])->([i,j]) {i=8,j=16,k=8} reduction={k}",
    ),
    "dot with batch dims": (
        "lhs = f32[4,8,16] parameter(0)\nrhs = f32[4,16,32] parameter(1)\n"
        "ROOT d = f32[4,8,32] dot(lhs, rhs), lhs_batch_dims={0}, rhs_batch_dims={0}, "
        "lhs_contracting_dims={2}, rhs_contracting_dims={1}",
        "([i,j,l],[i,l,k])->([i,j,k]) {i=4,j=8,k=32,l=16} reduction={l}",
    ),
    "dot of vectors (scalar result)": (
        "a = f32[8] parameter(0)\nb = f32[8] parameter(1)\n"
        "ROOT d = f32[] dot(a, b), lhs_contracting_dims={0}, rhs_contracting_dims={0}",
        "([i],[i])->([]) {i=8} reduction={i}",
    ),
    "add of scalars": ("a = f32[] parameter(0)\nROOT s = f32[] add(a, a)", "([],[])->([])"),
    "add with size-0 and size-1 dims": (
        "a = f32[0,1] parameter(0)\nROOT s = f32[0,1] add(a, a)", "([i,j],[i,j])->([i,j]) {i=0,j=1}"),
    "select with scalar predicate": (
        "p = pred[] parameter(0)\na = f32[8] parameter(1)\nROOT s = f32[8] select(p, a, a)",
        "([],[i],[i])->([i]) {i=8}",
    ),
    "clamp with scalar bounds": (
        "lo = f32[] parameter(0)\na = f32[8,2] parameter(1)\nROOT c = f32[8,2] clamp(lo, a, lo)",
        "([],[i,j],[])->([i,j]) {i=8,j=2}",
    ),
    "broadcast adds a new major dim": (
        "a = f32[16] parameter(0)\nROOT b = f32[8,16] broadcast(a), dimensions={1}",
        "([j])->([i,j]) {i=8,j=16}",
    ),
    "broadcast of a scalar": ("a = f32[] parameter(0)\nROOT b = f32[3,4] broadcast(a), dimensions={}",
                              "([])->([i,j]) {i=3,j=4}"),
    "reshape merge": ("a = f32[8,6] parameter(0)\nROOT r = f32[48] reshape(a)", "([i,j])->([ij]) {i=8,j=6}"),
    "reshape split": ("a = f32[48] parameter(0)\nROOT r = f32[8,6] reshape(a)", "([ij])->([i,j]) {i=8,j=6}"),
    "reshape dropping a size-1 dim": ("a = f32[1,8] parameter(0)\nROOT r = f32[8] reshape(a)",
                                      "([i,j])->([j]) {i=1,j=8}"),
    "reshape out of step": (  # common factor 2, then 3 vs 2 do not divide: own factors until 24
        "a = f32[6,4] parameter(0)\nROOT r = f32[4,6] reshape(a)",
        "([ij,m])->([ik,l]) {i=2,j=3,k=2,l=6,m=4} need_replication={j,k,l,m}",
    ),
    "reshape with zero elements": ("a = f32[0,4] parameter(0)\nROOT r = f32[4,0] reshape(a)",
                                   "([i,j])->([k,l]) {i=0,j=4,k=4,l=0}"),
    "transpose": ("a = f32[2,3,4] parameter(0)\nROOT t = f32[4,2,3] transpose(a), dimensions={2,0,1}",
                  "([j,k,i])->([i,j,k]) {i=4,j=2,k=3}"),
    "reduce": (
        "a = f32[8,16] parameter(0)\nz = f32[] constant(0)\n"
        "ROOT r = f32[8] reduce(a, z), dimensions={1}, to_apply=add_f32",
        "([i,j],[])->([i]) {i=8,j=16} reduction={j}",
    ),
    "reduce to a scalar": (
        "a = f32[8] parameter(0)\nz = f32[] constant(0)\nROOT r = f32[] reduce(a, z), dimensions={0}, to_apply=add_f32",
        "([i],[])->([]) {i=8} reduction={i}",
    ),
    "reduce-window cumulative sum": (
        "a = f32[8,16] parameter(0)\nz = f32[] constant(0)\n"
        "ROOT r = f32[8,16] reduce-window(a, z), window={size=1x16 pad=0_0x15_0}, to_apply=add_f32",
        "([i,j],[])->([i,j]) {i=8,j=16} need_replication={j}",
    ),
    "reduce-window pooling": (
        "a = f32[8,16] parameter(0)\nz = f32[] constant(0)\n"
        "ROOT r = f32[8,8] reduce-window(a, z), window={size=1x2 stride=1x2}, to_apply=add_f32",
        "([i,j],[])->([i,k]) {i=8,j=16,k=8} need_replication={j,k}",
    ),
    "concatenate": (
        "a = f32[8,4] parameter(0)\nb = f32[8,6] parameter(1)\nROOT c = f32[8,10] concatenate(a, b), dimensions={1}",
        "([i,j],[i,k])->([i,l]) {i=8,j=4,k=6,l=10} need_replication={j,k,l}",
    ),
    "slice": ("a = f32[8,16] parameter(0)\nROOT s = f32[8,4] slice(a), slice={[0:8], [4:8]}",
              "([i,j])->([i,k]) {i=8,j=16,k=4} need_replication={j,k}"),
    "pad": ("a = f32[8,16] parameter(0)\nz = f32[] constant(0)\nROOT p = f32[8,19] pad(a, z), padding=0_0x1_2",
            "([i,j],[])->([i,k]) {i=8,j=16,k=19} need_replication={j,k}"),
    "dynamic-slice": (
        "a = f32[8,16] parameter(0)\ni = s32[] parameter(1)\n"
        "ROOT d = f32[8,4] dynamic-slice(a, i, i), dynamic_slice_sizes={8,4}",
        "([i,j],[],[])->([i,k]) {i=8,j=16,k=4} need_replication={j,k}",
    ),
    "dynamic-update-slice": (
        "a = f32[8,16] parameter(0)\nu = f32[8,4] parameter(1)\ni = s32[] parameter(2)\n"
        "ROOT d = f32[8,16] dynamic-update-slice(a, u, i, i)",
        "([i,j],[i,k],[],[])->([i,j]) {i=8,j=16,k=4} need_replication={k}",
    ),
    "gather: vocabulary-parallel embedding": (
        "t = f32[512,64] parameter(0)\nids = s32[8,32] parameter(1)\n"
        "ROOT g = f32[8,32,64] gather(t, ids), offset_dims={2}, collapsed_slice_dims={0}, "
        "start_index_map={0}, index_vector_dim=2, slice_sizes={1,64}",
        "([l,k],[i,j])->([i,j,k]) {i=8,j=32,k=64,l=512} reduction={l}",
    ),
    "gather with explicit batching dims": (  # take_along_axis: operand dim 0 is a batch dim
        "x = f32[8,16] parameter(0)\nids = s32[8,1] parameter(1)\n"
        "ROOT g = f32[8] gather(x, ids), offset_dims={}, collapsed_slice_dims={1}, start_index_map={1}, "
        "operand_batching_dims={0}, start_indices_batching_dims={0}, index_vector_dim=1, slice_sizes={1,1}",
        "([i,j],[i,k])->([i]) {i=8,j=16,k=1} reduction={j} need_replication={k}",
    ),
    "scatter-add into a sharded operand": (
        "t = f32[64,8] parameter(0)\nids = s32[10,1] parameter(1)\nu = f32[10,8] parameter(2)\n"
        "ROOT s = f32[64,8] scatter(t, ids, u), update_window_dims={1}, inserted_window_dims={0}, "
        "scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=add_f32",
        "([j,k],[i,l],[i,k])->([j,k]) {i=10,j=64,k=8,l=1} reduction={i} need_replication={l}",
    ),
    "scatter that overwrites": (
        "t = f32[64,8] parameter(0)\nids = s32[10,1] parameter(1)\nu = f32[10,8] parameter(2)\n"
        "ROOT s = f32[64,8] scatter(t, ids, u), update_window_dims={1}, inserted_window_dims={0}, "
        "scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=overwrite_f32",
        "([j,k],[i,l],[i,k])->([j,k]) {i=10,j=64,k=8,l=1} need_replication={i,l}",
    ),
    "sort": ("a = f32[8,16] parameter(0)\nROOT s = f32[8,16] sort(a), dimensions={1}, to_apply=add_f32",
             "([i,j])->([i,j]) {i=8,j=16} need_replication={j}"),
    "sort of keys and values": (
        "a = f32[8,16] parameter(0)\nb = s32[8,16] parameter(1)\n"
        "ROOT s = (f32[8,16], s32[8,16]) sort(a, b), dimensions={1}, to_apply=add_f32",
        "([i,j],[i,j])->([i,j],[i,j]) {i=8,j=16} need_replication={j}",
    ),
    "iota": ("ROOT i = s32[8,16] iota(), iota_dimension=1", "()->([i,j]) {i=8,j=16} independent"),
    "constant": ("ROOT c = f32[4] constant({1, 2, 3, 4})", "()->([i]) {i=4} independent"),
    "convolution 3x3": (
        "x = f32[4,16,16,3] parameter(0)\nk = f32[3,3,3,8] parameter(1)\n"
        "ROOT c = f32[4,16,16,8] convolution(x, k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f",
        "([i,l,o,j],[n,q,j,k])->([i,m,p,k]) {i=4,j=3,k=8,l=16,m=16,n=3,o=16,p=16,q=3} "
        "reduction={j,n,q} need_replication={l,m,o,p}",
    ),
    "convolution with feature groups, 1x1": (  # depthwise: the group factor is major everywhere
        "x = f32[4,16,16,8] parameter(0)\nk = f32[1,1,1,8] parameter(1)\n"
        "ROOT c = f32[4,16,16,8] convolution(x, k), window={size=1x1}, dim_labels=b01f_01io->b01f, "
        "feature_group_count=8",
        "([i,m,o,jk],[n,p,k,jl])->([i,m,o,jl]) {i=4,j=8,k=1,l=1,m=16,n=1,o=16,p=1} reduction={k,n,p}",
    ),
    "while carries its tuple": (
        "a = (s32[], f32[8]) parameter(0)\nROOT w = (s32[], f32[8]) while(a), condition=cond, body=body",
        "([],[i])->([],[i]) {i=8} independent",
    ),
    "get-tuple-element": (
        "a = (s32[], f32[8], f32[4,2]) parameter(0)\nROOT g = f32[8] get-tuple-element(a), index=1",
        "([],[i],[j,k])->([i]) {i=8,j=4,k=2} independent",
    ),
    "tuple": ("a = f32[8] parameter(0)\nb = s32[] parameter(1)\nROOT t = (f32[8], s32[]) tuple(a, b)",
              "([i],[])->([i],[]) {i=8} independent"),
    "call links nothing locally": (
        "a = f32[8] parameter(0)\nROOT c = f32[8] call(a), to_apply=add_f32",
        "([i])->([j]) {i=8,j=8} independent",
    ),
    "all-gather": (
        "a = f32[8,8] parameter(0)\nROOT g = f32[16,8] all-gather(a), dimensions={0}, replica_groups={{0,1}}",
        "([i,k])->([j,k]) {i=8,j=16,k=8} need_replication={i,j} independent",
    ),
    "all-reduce": (
        "a = f32[8,8] parameter(0)\nROOT r = f32[8,8] all-reduce(a), replica_groups={}, to_apply=add_f32",
        "([i,j])->([i,j]) {i=8,j=8} independent",
    ),
    "reduce-scatter": (
        "a = f32[8,8] parameter(0)\nROOT r = f32[8,2] reduce-scatter(a), dimensions={1}, replica_groups={}, "
        "to_apply=add_f32",
        "([i,j])->([i,k]) {i=8,j=8,k=2} need_replication={j,k} independent",
    ),
    "all-to-all": (  # same shape, but dim 0 is exchanged between devices
        "a = f32[8,4] parameter(0)\nROOT r = f32[8,4] all-to-all(a), dimensions={0}, replica_groups={}",
        "([i,j])->([i,j]) {i=8,j=4} need_replication={i} independent",
    ),
    "collective-permute": (
        "a = f32[8,8] parameter(0)\nROOT r = f32[8,8] collective-permute(a), source_target_pairs={{0,1},{1,0}}",
        "([i,j])->([i,j]) {i=8,j=8} independent",
    ),
    "conditional links nothing locally": (
        "c = pred[] parameter(0)\na = f32[8] parameter(1)\n"
        "ROOT r = f32[8] conditional(c, a, a), true_computation=neg_f32, false_computation=neg_f32",
        "([],[i],[j])->([k]) {i=8,j=8,k=8} independent",
    ),
    "fft": ("a = c64[8,16] parameter(0)\nROOT f = c64[8,16] fft(a), fft_type=FFT, fft_length={16}",
            "([i,j])->([i,j]) {i=8,j=16} need_replication={j}"),
    "topk": ("a = f32[16,32] parameter(0)\nROOT t = (f32[16,4], s32[16,4]) topk(a), k=4, largest=true",
             "([i,j])->([i,k],[i,l]) {i=16,j=32,k=4,l=4} need_replication={j,k,l}"),
    "bitcast-convert to a narrower type": (
        "a = f32[4] parameter(0)\nROOT b = u8[4,4] bitcast-convert(a)",
        "([i])->([i,j]) {i=4,j=4} need_replication={j}",
    ),
    "reverse": ("a = f32[8,3] parameter(0)\nROOT r = f32[8,3] reverse(a), dimensions={1}",
                "([i,j])->([i,j]) {i=8,j=3} need_replication={j}"),
    "select-and-scatter": (
        "a = f32[4,8] parameter(0)\ns = f32[4,4] parameter(1)\nz = f32[] constant(0)\n"
        "ROOT r = f32[4,8] select-and-scatter(a, s, z), window={size=1x2 stride=1x2}, select=add_f32, "
        "scatter=add_f32",
        "([i,j],[i,k],[])->([i,j]) {i=4,j=8,k=4} need_replication={j,k}",
    ),
    "cholesky": ("a = f32[2,8,8] parameter(0)\nROOT c = f32[2,8,8] cholesky(a), lower=true",
                 "([i,j,k])->([i,l,m]) {i=2,j=8,k=8,l=8,m=8} need_replication={j,k,l,m}"),
    "custom-call Sharding is pointwise": (
        'a = f32[8,4] parameter(0)\nROOT s = f32[8,4] custom-call(a), custom_call_target="Sharding"',
        "([i,j])->([i,j]) {i=8,j=4}",
    ),
}


@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_golden_rule(case):
    body, expected = GOLDEN[case]
    computations = None
    if "conditional" in body:
        from .helpers import ADD, OVERWRITE

        computations = ADD + OVERWRITE + "neg_f32 {\n  p = f32[8] parameter(0)\n  ROOT n = f32[8] negate(p)\n}\n"
    if "while" in body:
        from .helpers import ADD, OVERWRITE

        loop = ("cond {\n  p = (s32[], f32[8]) parameter(0)\n  ROOT t = pred[] constant(true)\n}\n"
                "body {\n  ROOT p = (s32[], f32[8]) parameter(0)\n}\n")
        computations = ADD + OVERWRITE + loop
    text = rule_text(body, **({"computations": computations} if computations else {}))
    assert text == expected


def test_unknown_custom_call_is_all_need_replication_and_linked_to_nothing():
    text = rule_text('a = f32[8] parameter(0)\nROOT c = f32[8] custom-call(a), custom_call_target="mystery"')
    assert text == "([i])->([j]) {i=8,j=8} need_replication={i,j} independent"


def test_unknown_opcode_gets_fallback_rule_not_an_exception():
    operand = ArrayShape("f32", (8, 2))
    inst = Instruction("x", "frobnicate", TupleShape((ArrayShape("f32", (3,)), ArrayShape("s32", ()))), ("p",))
    rule = rule_for(inst, [operand])
    assert rule.fallback is not None and "frobnicate" in rule.fallback
    assert set(rule.factor_kinds) == {FactorKind.NEED_REPLICATION}
    assert [len(t) for t in rule.operands] == [2] and [len(t) for t in rule.results] == [1, 0]


def test_malformed_attributes_fall_back_instead_of_raising():
    # a dot whose contracting dim is out of range for the operand
    inst = Instruction("d", "dot", ArrayShape("f32", (8,)), ("a", "b"),
                       attributes=(("lhs_contracting_dims", "{5}"), ("rhs_contracting_dims", "{0}")))
    rule = rule_for(inst, [ArrayShape("f32", (8, 4)), ArrayShape("f32", (4,))])
    assert rule.fallback is not None and "dot" in rule.fallback


def _check_invariants(rule: OpRule, operand_leaves, result_leaves, where: str) -> None:
    assert len(rule.operands) == len(operand_leaves), where
    assert len(rule.results) == len(result_leaves), where
    for tensors, leaves in ((rule.operands, operand_leaves), (rule.results, result_leaves)):
        for tfactors, leaf in zip(tensors, leaves):
            assert len(tfactors) == leaf.rank, where
            for factors, size in zip(tfactors, leaf.dims):
                assert factors, f"{where}: a dim without factors"
                product = math.prod(rule.factor_sizes[f] for f in factors)
                assert product == size, f"{where}: factors {factors} of a dim of size {size}"
    kinds = rule.factor_kinds
    for f, kind in enumerate(kinds):
        if kind is FactorKind.REDUCTION:
            # a reduction factor never reaches a result
            assert all(f not in d for t in rule.results for d in t), where


def test_rules_hold_their_invariants_on_every_corpus_instruction(corpus_dir):
    from hlomap.hlo.parser import parse_file

    files = sorted((corpus_dir / "hlo").glob("*/*.hlo"))
    assert files
    seen = set()
    fallbacks: list[str] = []
    for path in files:
        for m in parse_file(path):
            for comp, inst in m.instructions():
                shapes = [comp[o].shape for o in inst.operands]
                rule = rule_for(inst, shapes, m)
                operand_leaves = [leaf for s in shapes for leaf in s.leaves()]
                _check_invariants(rule, operand_leaves, list(inst.shape.leaves()), f"{path.name}:{inst.name}")
                seen.add(inst.opcode)
                if rule.fallback:
                    # only custom-calls of unknown targets, and malformed test inputs, fall back
                    assert inst.opcode == "custom-call" or "rule failed" in rule.fallback, rule.fallback
                    fallbacks.append(rule.fallback)
    assert {"dot", "convolution", "gather", "scatter", "while", "conditional", "sort", "all-to-all"} <= seen
    # the one malformed transpose in XLA's indexing test file, and cuBLAS / test custom-calls
    assert sum("rule failed" in f for f in fallbacks) <= 2, fallbacks


def test_every_zoo_opcode_has_a_rule(zoo_graph):
    for name in ("gpt-tiny", "vgg19-tiny"):
        graph = zoo_graph(name)
        assert graph.unknown == {}, f"{name}: {graph.unknown}"


def test_factor_graph_warns_once_per_unknown_name(caplog):
    from hlomap.propagation import FactorGraph

    from .helpers import module

    m = module('a = f32[8] parameter(0)\nb = f32[8] custom-call(a), custom_call_target="mystery"\n'
               'ROOT c = f32[8] custom-call(b), custom_call_target="mystery"')
    with caplog.at_level(logging.WARNING, logger="hlomap.propagation.graph"):
        graph = FactorGraph.build(m)
    warnings = [r for r in caplog.records if "mystery" in r.getMessage()]
    assert len(warnings) == 1 and "2 instruction" in warnings[0].getMessage()
    assert graph.unknown == {"custom-call target 'mystery'": 2}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=0, max_size=4), st.data())
def test_reshape_factorization_is_consistent(in_dims, data):
    total = math.prod(in_dims)
    # an output shape with the same number of elements: split `total` into random factors
    out_dims, rest = [], total
    while rest > 1:
        divisors = [d for d in range(2, rest + 1) if rest % d == 0]
        d = data.draw(st.sampled_from(divisors))
        out_dims.append(d)
        rest //= d
    if data.draw(st.booleans()):
        out_dims.insert(data.draw(st.integers(0, len(out_dims))), 1)
    sizes, in_map, out_map, shared = reshape_factorization(in_dims, out_dims)
    for dims, mapping in ((in_dims, in_map), (out_dims, out_map)):
        assert [math.prod(sizes[f] for f in fs) for fs in mapping] == list(dims)
    # shared factors appear on both sides, in the same relative order (row-major)
    in_order = [f for fs in in_map for f in fs if shared[f]]
    out_order = [f for fs in out_map for f in fs if shared[f]]
    assert in_order == out_order
