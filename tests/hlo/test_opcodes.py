"""The opcode table: its facts agree with each other and with the HLO text XLA and JAX print,
and every opcode it lists has a factor rule (or a stated reason to have none) and a cost class.

The coverage checks are built from the table, so adding a row without a rule or a cost class
fails here; the sets of the other layers may only name opcodes of the table, so a misspelt name
(`clz` for `count-leading-zeros`, `sin` for `sine`) fails here too.
"""

from __future__ import annotations

from typing import Mapping

import pytest

from hlomap.cost import compute, memory, sharding
from hlomap.hlo import parse, parse_file
from hlomap.hlo.ir import ArrayShape, TupleShape
from hlomap.hlo.opcodes import OPCODES, AsyncPart, Elementwise, InferredShape, OpcodeInfo, Storage
from hlomap.propagation import graph, rules


# -- coverage ------------------------------------------------------------------------------------


def _without_rule(table: Mapping[str, OpcodeInfo]) -> set[str]:
    return {name for name in table if name not in rules.RULES and name not in rules.UNKNOWN_OPCODES}


def _without_cost_class(table: Mapping[str, OpcodeInfo]) -> set[str]:
    return {name for name in table if compute.cost_class(name) is None}


def test_every_opcode_has_a_rule_or_a_reason_for_none():
    assert _without_rule(OPCODES) == set()
    assert not set(rules.RULES) & set(rules.UNKNOWN_OPCODES)
    assert all(reason.strip() for reason in rules.UNKNOWN_OPCODES.values())


def test_every_opcode_has_a_cost_class():
    assert _without_cost_class(OPCODES) == set()
    assert all(reason.strip() for reason in compute.FLOPS_NOT_MODELED.values())


def test_a_new_row_without_rule_or_cost_class_is_reported():
    """The checks above are not vacuous: a row the other layers do not know is caught."""
    grown = {**OPCODES, "frobnicate": OpcodeInfo("frobnicate", 1)}
    assert _without_rule(grown) == {"frobnicate"}
    assert _without_cost_class(grown) == {"frobnicate"}


@pytest.mark.parametrize("where, names", [
    ("rules.RULES", set(rules.RULES)),
    ("rules.UNKNOWN_OPCODES", set(rules.UNKNOWN_OPCODES)),
    ("rules.ELEMENTWISE_OPCODES", rules.ELEMENTWISE_OPCODES),
    ("compute._HANDLERS", set(compute._HANDLERS)),
    ("compute.FREE_OPCODES", compute.FREE_OPCODES),
    ("compute.ELEMENTWISE_OPCODES", compute.ELEMENTWISE_OPCODES),
    ("compute.TRANSCENDENTAL_OPCODES", compute.TRANSCENDENTAL_OPCODES),
    ("compute.DATA_MOVEMENT_OPCODES", compute.DATA_MOVEMENT_OPCODES),
    ("compute.FLOPS_NOT_MODELED", set(compute.FLOPS_NOT_MODELED)),
    ("memory.FUSING_CONSUMERS", memory.FUSING_CONSUMERS),
    ("memory.ALIASING_OPCODES", memory.ALIASING_OPCODES),
    ("memory.NO_BUFFER_OPCODES", memory.NO_BUFFER_OPCODES),
    ("sharding.CONTAINER_OPCODES", sharding.CONTAINER_OPCODES),
    ("graph._NEVER_FREE", graph._NEVER_FREE),
])
def test_other_layers_name_only_opcodes_of_the_table(where, names):
    assert set(names) - set(OPCODES) == set(), where


def test_the_elementwise_family_and_the_sources_come_from_the_table():
    for name, info in OPCODES.items():
        if info.elementwise is not None:
            assert rules.RULES[name] is rules.rule_elementwise, name
        if info.source:
            assert rules.RULES[name] is rules.rule_source, name


def test_cost_classes_follow_the_elementwise_kinds():
    expected = {
        Elementwise.ARITHMETIC: compute.CostClass.FLOP_PER_ELEMENT,
        Elementwise.PREDICATE: compute.CostClass.FLOP_PER_ELEMENT,
        Elementwise.TRANSCENDENTAL: compute.CostClass.TRANSCENDENTAL_PER_ELEMENT,
        Elementwise.COPY: compute.CostClass.BYTES_ONLY,
        Elementwise.MAPPED: compute.CostClass.FORMULA,
    }
    for name, info in OPCODES.items():
        if info.elementwise is not None:
            assert compute.cost_class(name) is expected[info.elementwise], name


# -- the table's own consistency ------------------------------------------------------------------


def test_rows_are_keyed_by_name_and_alphabetical():
    assert all(name == info.name for name, info in OPCODES.items())
    assert list(OPCODES) == sorted(OPCODES)


def test_facts_agree_with_each_other():
    for name, info in OPCODES.items():
        if info.storage is not Storage.OWN:
            assert info.free, name  # a view or a non-allocation is never a kernel
        if info.free:
            assert info.elementwise is None and info.calls is None, name
        if info.elementwise is not None and info.elementwise is not Elementwise.MAPPED:
            assert info.arity is not None, name
        if info.inferred_shape is InferredShape.SAME_AS_SECOND:
            assert info.arity == 3, name
        if info.async_part is AsyncPart.DONE:
            assert info.arity == 1, name
        if name.endswith("-start"):
            assert info.async_part is AsyncPart.START, name
        if name.endswith("-done"):
            assert info.async_part is AsyncPart.DONE, name


# -- the table against the text XLA and JAX print ---------------------------------------------------


def _corpus_modules(corpus_dir):
    for path in sorted(corpus_dir.glob("hlo/*/*.hlo")):
        try:
            yield from parse_file(path)
        except ValueError:
            continue  # files the parser rejects are the parser tests' business


def test_every_corpus_opcode_is_in_the_table_with_its_arity(corpus_dir):
    seen: set[str] = set()
    for module in _corpus_modules(corpus_dir):
        for comp, inst in module.instructions():
            seen.add(inst.opcode)
            info = OPCODES.get(inst.opcode)
            assert info is not None, f"{module.name}/{comp.name}/{inst.name}: {inst.opcode}"
            if info.arity is not None:
                assert len(inst.operands) == info.arity, f"{inst.name}: {inst.opcode}"
    assert len(seen) >= 50  # the corpus exercises most of the table


def test_jax_prints_the_table_names():
    """The names JAX prints for the ops whose names drifted in hlomap before the table."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def f(x):
        bits = lax.bitcast_convert_type(x, jnp.int32)
        return (jnp.sin(x), jnp.cos(x), lax.clz(bits), lax.population_count(bits),
                jnp.isfinite(x), jax.checkpoint(jnp.tanh)(x))

    text = jax.jit(f).lower(jax.ShapeDtypeStruct((4,), jnp.float32)).as_text(dialect="hlo")
    opcodes = {inst.opcode for _, inst in parse(text).instructions()}
    assert {"sine", "cosine", "count-leading-zeros", "popcnt", "is-finite"} <= opcodes
    assert opcodes <= set(OPCODES)


# -- what the table fixed -----------------------------------------------------------------------


@pytest.mark.parametrize("opcode, operands, expected", [
    ("sine", "x", ArrayShape("f32", (4,))),
    ("cosine", "x", ArrayShape("f32", (4,))),
    ("mulhi", "i, i", ArrayShape("s32", (4,))),
    ("count-leading-zeros", "i", ArrayShape("s32", (4,))),
    ("reduce-precision", "x", ArrayShape("f32", (4,))),
    ("is-finite", "x", ArrayShape("pred", (4,))),
    ("select", "p, x, x", ArrayShape("f32", (4,))),
    ("opt-barrier", "x", ArrayShape("f32", (4,))),
    ("tuple", "x, i", TupleShape((ArrayShape("f32", (4,)), ArrayShape("s32", (4,))))),
])
def test_the_parser_infers_omitted_shapes_from_the_table(opcode, operands, expected):
    module = parse(
        "ENTRY e {\n  x = f32[4] parameter(0)\n  i = s32[4] parameter(1)\n"
        "  p = pred[4] parameter(2)\n"
        f"  ROOT r = {opcode}({operands})\n}}\n"
    )
    assert module.entry.root.shape == expected


def test_names_that_are_not_xla_opcodes_get_no_inferred_shape():
    from hlomap.hlo import HloParseError

    with pytest.raises(HloParseError, match="cannot infer it for 'sin'"):
        parse("ENTRY e {\n  x = f32[4] parameter(0)\n  ROOT r = sin(x)\n}\n")


def test_count_leading_zeros_and_opt_barrier_have_real_rules():
    module = parse(
        "ENTRY e {\n  x = s32[8,4] parameter(0)\n  c = s32[8,4] count-leading-zeros(x)\n"
        "  t = (s32[8,4]) tuple(c)\n  ROOT b = (s32[8,4]) opt-barrier(t)\n}\n"
    )
    entry = module.entry
    for name in ("c", "b"):
        inst = entry[name]
        rule = rules.rule_for(inst, [entry[o].shape for o in inst.operands], module)
        assert rule.fallback is None, name
        assert rule.operands[0] == rule.results[0], name  # dims pass straight through
