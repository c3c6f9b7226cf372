"""Packing leaves into flat rows (the spmd executor), the circular pipeline's row order and the mpmd executor's
fusable passes: small pure pieces, checked directly."""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hlomap.cost.pipeline.stages import Schedule
from hlomap.run.pipeline.dispatch import dispatch_order, fusable_passes
from hlomap.run.pipeline.layout import BatchedLayout, FlatLayout, Slot, buffer_dtype, matched_buffers
from hlomap.run.pipeline.spmd_executor import circular_rows


def _avals(*shapes: tuple[int, ...]) -> list[tuple[int, jax.ShapeDtypeStruct]]:
    return [(k, jax.ShapeDtypeStruct(shape, jnp.float32)) for k, shape in enumerate(shapes)]


def test_pack_then_unpack_gives_the_leaves_back_with_gaps_and_padding() -> None:
    end_to_end = FlatLayout.of(_avals((2, 3), (4,), ()))
    layout = FlatLayout(end_to_end.keys, tuple(replace(slot, offset=slot.offset + 5)  # a 5-element region before them
                                               for slot in end_to_end.slots))
    values = {0: jnp.arange(6.0).reshape(2, 3), 1: jnp.arange(4.0) + 10, 2: jnp.asarray(7.0)}
    packed = layout.pack(values, {"float32": 20})
    assert packed["float32"].shape == (20,)
    np.testing.assert_array_equal(packed["float32"][:5], 0)  # the region before the leaves
    out = layout.unpack(packed)
    for key, value in values.items():
        np.testing.assert_array_equal(out[key], value)


def test_the_gradient_of_unpacking_is_one_concatenate_not_a_pad_per_leaf() -> None:
    layout = FlatLayout.of(_avals((8,), (3, 3), (5,)))

    def loss(row: jax.Array) -> jax.Array:
        return sum(jnp.sum(v ** 2) for v in layout.unpack({"float32": row}).values())

    row = jnp.arange(float(layout.lengths["float32"] + 2))  # 2 padding elements at the end
    jaxpr = jax.make_jaxpr(jax.grad(loss))(row)
    primitives = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    assert "pad" not in primitives and primitives.count("concatenate") == 1
    expected = 2 * np.asarray(row)
    expected[-2:] = 0
    np.testing.assert_allclose(jax.grad(loss)(row), expected)


def test_batched_values_keep_their_microbatch_dim() -> None:
    avals = [jax.ShapeDtypeStruct((4, 3), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.float32),
             jax.ShapeDtypeStruct((4, 2, 2), jnp.float32)]
    layout = BatchedLayout.of(avals, microbatch=4)
    values = [jnp.ones((4, 3)), jnp.asarray([1.0, 2.0]), jnp.arange(16.0).reshape(4, 2, 2)]
    packed = layout.pack(values, layout.lengths)
    assert packed[("float32", True)].shape == (4, 7) and packed[("float32", False)].shape == (2,)
    for got, want in zip(layout.unpack(packed), values):
        np.testing.assert_array_equal(got, want)


def test_overlapping_slots_are_refused() -> None:
    layout = FlatLayout((0, 1), (Slot("float32", 0, 4, (4,)), Slot("float32", 2, 4, (4,))))
    with pytest.raises(ValueError, match="overlap"):
        layout.unpack({"float32": jnp.zeros(8)})


def test_leaves_matched_on_every_stage_get_buffers_of_their_own() -> None:
    every = frozenset({0, 1, 2})
    residence = [every, {0}, {0}, {1}, {1}, {2}, {2}, {0, 2}]
    sizes = {0: 4, 1: 10, 2: 6, 3: 10, 4: 10, 5: 10, 6: 6, 7: 3}
    base = {leaf: "float32" for leaf in sizes}
    names = matched_buffers(range(8), sizes, base, [frozenset(r) for r in residence], 3)
    assert names[0] == "float32#0"  # every stage holds it
    assert names[1] == names[3] == names[5] == "float32#10.0"  # the first size-10 leaf of each stage
    assert names[4] == "float32"  # stage 1's second size-10 leaf has no counterpart on stages 0 and 2
    assert names[2] == names[6] == "float32"  # stage 1 has no size-6 leaf
    assert names[7] == "float32"  # held by two of the three stages
    assert {buffer_dtype(name) for name in names.values()} == {"float32"}
    one_stage = matched_buffers(range(3), {0: 5, 1: 5, 2: 2}, {0: "float32", 1: "float32@model", 2: "int32"},
                                [frozenset({0})] * 3, 1)
    assert one_stage == {0: "float32#0", 1: "float32@model#1", 2: "int32#2"}  # one stage: every leaf alone
    assert buffer_dtype("float32@model#10.0") == "float32"


def test_circular_rows_put_each_device_stages_logical_stages_together() -> None:
    # 3 device stages x 2 rounds: device stage s holds rows 2s, 2s + 1 = logical stages s, 3 + s
    rows = circular_rows(3, 2)
    assert rows == (0, 2, 4, 1, 3, 5)
    assert circular_rows(4, 1) == (0, 1, 2, 3)
    for k, row in enumerate(rows):
        assert row // 2 == k % 3  # the row lies in its device stage's block of the stage-sharded array


def test_the_last_stage_fuses_where_its_backward_follows_its_forward() -> None:
    assert fusable_passes(dispatch_order(Schedule.ONE_F_ONE_B, 4, 8), 4) == frozenset(range(8))
    assert fusable_passes(dispatch_order(Schedule.GPIPE, 4, 8), 4) == frozenset()
    assert fusable_passes(dispatch_order(Schedule.GPIPE, 1, 1), 1) == frozenset({0})
