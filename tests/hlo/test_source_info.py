"""Readers of instruction metadata: layer names and scopes from JAX's name stacks."""

import pytest

from hlomap.hlo.ir import Metadata
from hlomap.hlo.source_info import layer_name, nearest_scopes, scope_of


@pytest.mark.parametrize("op_name, expected", [
    ("jit(train_step)/jvp(layers_0)/dot_general", "layers_0/dot_general"),
    ("jit(train_step)/transpose(jvp(layers_0))/dot_general", "layers_0/dot_general"),
    ("jit(train_step)/jvp(decoder)/layers_5/add", "decoder/layers_5/add"),
    ("jit(train_step)/jvp(jit(_take))", "_take"),
    ("jit(train_step)/jvp()/add", "add"),
    ("jit(train_step)/transpose(jvp())/mul;jit(train_step)/transpose(jvp())/add", "mul"),
])
def test_layer_name_unwraps_jax_name_stacks(op_name, expected):
    assert layer_name(Metadata(op_name=op_name)) == expected


def test_layer_name_falls_back_without_metadata():
    assert layer_name(None, fallback="dot.3") == "dot.3"


def test_scope_of_drops_the_op_name():
    assert scope_of("layers_0/attn/dot_general") == "layers_0/attn"
    assert scope_of("add") == ""


def test_nearest_scopes_fall_back_to_the_closest_scoped_layer():
    layers = ["add", "embed/gather", "mul", "layers_0/attn/dot", "layers_0/add", "mul", "sub"]
    assert nearest_scopes(layers) == (
        "before embed", "embed", "after embed", "layers_0/attn", "layers_0",
        "after layers_0", "after layers_0",
    )
    assert nearest_scopes(["add", "mul"]) == ("", "")
