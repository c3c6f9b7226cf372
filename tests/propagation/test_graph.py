"""The factor graph: what is linked (and what must not be) across instructions and called
computations, and the linkage groups of the zoo GPT."""

from __future__ import annotations

import numpy as np
import pytest

from hlomap.propagation import FactorGraph

from .helpers import ADD, module


def _group(graph: FactorGraph, instruction: str, dim: int, leaf: int = 0, computation: str | None = None,
           instance: int | None = None) -> int:
    comp = computation or graph.module.entry_name
    node = graph.node_of(comp, instruction, instance)
    tensor = graph.result_tensors(node)[leaf]
    return int(graph.group_of_dim[graph.tensor_dims(tensor)[dim]])


def test_dot_links_contracting_dims_to_each_other_but_not_to_the_result():
    g = FactorGraph.build(module(
        "x = f32[8,16] parameter(0)\nw = f32[16,32] parameter(1)\n"
        "ROOT d = f32[8,32] dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}"))
    assert _group(g, "x", 1) == _group(g, "w", 0)
    assert _group(g, "d", 0) == _group(g, "x", 0)
    assert _group(g, "d", 1) == _group(g, "w", 1)
    assert len({_group(g, "x", 0), _group(g, "x", 1), _group(g, "w", 1)}) == 3
    # the contracting group appears as a reduction factor of the dot
    red = g.reductions
    assert list(red.group) == [_group(g, "x", 1)] and list(red.size) == [16]


def test_while_links_operand_body_condition_and_result():
    loop = """
cond {
  p = (s32[], f32[8,4]) parameter(0)
  ROOT t = pred[] constant(true)
}
body {
  p = (s32[], f32[8,4]) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  x = f32[8,4] get-tuple-element(p), index=1
  y = f32[8,4] negate(x)
  ROOT r = (s32[], f32[8,4]) tuple(i, y)
}
"""
    g = FactorGraph.build(module(
        "a = f32[8,4] parameter(0)\nz = s32[] constant(0)\nt = (s32[], f32[8,4]) tuple(z, a)\n"
        "ROOT w = (s32[], f32[8,4]) while(t), condition=cond, body=body", computations=loop))
    for dim in (0, 1):
        entry = _group(g, "a", dim)
        assert _group(g, "w", dim, leaf=1) == entry
        assert _group(g, "y", dim, computation="body") == entry
        assert _group(g, "p", dim, leaf=1, computation="cond") == entry
    assert _group(g, "a", 0) != _group(g, "a", 1)


def test_called_computation_is_instantiated_per_call_site():
    helper = ADD + """
helper {
  p = f32[8] parameter(0)
  ROOT n = f32[8] negate(p)
}
"""
    g = FactorGraph.build(module(
        "a = f32[8] parameter(0)\nb = f32[8] parameter(1)\n"
        "ca = f32[8] call(a), to_apply=helper\ncb = f32[8] call(b), to_apply=helper\n"
        "ROOT t = (f32[8], f32[8]) tuple(ca, cb)", computations=helper))
    assert _group(g, "ca", 0) == _group(g, "a", 0)
    assert _group(g, "cb", 0) == _group(g, "b", 0)
    # through one shared copy of `helper`, a and b would have been unioned
    assert _group(g, "a", 0) != _group(g, "b", 0)
    instances = [i for i, inst in enumerate(g.instances) if inst.computation == "helper"]
    assert len(instances) == 2
    assert {_group(g, "n", 0, computation="helper", instance=i) for i in instances} == \
        {_group(g, "a", 0), _group(g, "b", 0)}


def test_conditional_links_each_branch_to_its_operand_and_the_result():
    branches = ADD + """
yes {
  p = f32[8] parameter(0)
  ROOT n = f32[8] negate(p)
}
no {
  p = f32[8] parameter(0)
  ROOT n = f32[8] abs(p)
}
"""
    g = FactorGraph.build(module(
        "c = pred[] parameter(0)\na = f32[8] parameter(1)\nb = f32[8] parameter(2)\n"
        "ROOT r = f32[8] conditional(c, a, b), true_computation=yes, false_computation=no",
        computations=branches))
    assert _group(g, "r", 0) == _group(g, "a", 0) == _group(g, "b", 0)
    assert _group(g, "n", 0, computation="yes") == _group(g, "r", 0)


def test_fusion_links_like_a_call():
    fused = ADD + """
fused {
  p0 = f32[8,4] parameter(0)
  p1 = f32[4,2] parameter(1)
  ROOT d = f32[8,2] dot(p0, p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    g = FactorGraph.build(module(
        "x = f32[8,4] parameter(0)\nw = f32[4,2] parameter(1)\n"
        "ROOT f = f32[8,2] fusion(x, w), kind=kOutput, calls=fused", computations=fused))
    assert _group(g, "f", 0) == _group(g, "x", 0)
    assert _group(g, "f", 1) == _group(g, "w", 1)
    assert _group(g, "x", 1) == _group(g, "w", 0)


def test_shared_constant_broadcast_does_not_link_its_users():
    # JAX shares one broadcast zero between unrelated users; linking through it would merge
    # the two weights' groups into one.
    g = FactorGraph.build(module(
        "z = f32[] constant(0)\nzeros = f32[16] broadcast(z), dimensions={}\n"
        "a = f32[16] parameter(0)\nb = f32[16] parameter(1)\n"
        "sa = f32[16] add(a, zeros)\nsb = f32[16] add(b, zeros)\nROOT t = (f32[16], f32[16]) tuple(sa, sb)"))
    assert _group(g, "a", 0) != _group(g, "b", 0)
    assert _group(g, "sa", 0) == _group(g, "a", 0)
    # ...but when shardings are derived, the broadcast follows its first consumer
    zeros_dim = g.tensor_dims(g.result_tensors(g.node_of("main", "zeros"))[0])[0]
    assert g.sharding_group_of_dim[zeros_dim] == _group(g, "a", 0)


def test_reshape_links_only_the_major_factor_and_records_the_minor_one():
    g = FactorGraph.build(module("x = f32[8,6,4] parameter(0)\nROOT r = f32[48,4] reshape(x)"))
    assert _group(g, "r", 0) == _group(g, "x", 0)  # merged dim follows its major factor
    assert _group(g, "r", 1) == _group(g, "x", 2)
    minor = _group(g, "x", 1)
    assert minor != _group(g, "x", 0)
    assert g.constraints.compound_node[minor] >= 0  # sharding it would be a compound violation
    merged = g.tensor_dims(g.result_tensors(g.node_of("main", "r"))[0])[0]
    assert g.dim_effective_size[merged] == 8 and g.dim_size[merged] == 48


def test_zoo_gpt_groups(zoo_graph):
    g = zoo_graph("gpt-tiny")
    by_path = {(t.path, t.dim): t for t in g.trainable_dims}
    heads0 = by_path[("params/layers_0/attn/query/kernel", 1)]
    # the heads group holds Q/K/V's head dim and attention-out's input head dim (and biases)
    mates = set(heads0.others)
    assert {("params/layers_0/attn/key/kernel", 1), ("params/layers_0/attn/value/kernel", 1),
            ("params/layers_0/attn/out/kernel", 0), ("params/layers_0/attn/query/bias", 0)} <= mates
    # and nothing of layer 1: layers are separate groups
    assert not any(p.startswith("params/layers_1") for p, _ in mates)
    assert by_path[("params/layers_1/attn/query/kernel", 1)].group != heads0.group
    hidden0 = by_path[("params/layers_0/mlp/fc_in/kernel", 1)]
    assert ("params/layers_0/mlp/fc_out/kernel", 0) in hidden0.others
    # the residual stream's hidden dim links the embedding width, every layer norm and the
    # model-dim side of every projection, in both layers
    resid = by_path[("params/embed/embedding", 1)]
    assert {("params/layers_0/ln_1/scale", 0), ("params/layers_1/mlp/fc_out/kernel", 1),
            ("params/layers_1/attn/query/kernel", 0)} <= set(resid.others)
    assert by_path[("params/embed/embedding", 0)].group not in (resid.group, heads0.group)
    # group size is the number of tensor dims in the group
    assert heads0.group_size == int(np.sum(g.group_of_dim == heads0.group))
    # decision order: groups with trainable dims, largest first, the residual stream leading
    order = g.decision_order()
    sizes = [int(g.group_sizes[x]) for x in order]
    assert sizes == sorted(sizes, reverse=True)
    assert order[0] == resid.group and set(order) == set(g.trainable_groups)
    assert g.unknown == {}


def test_zoo_gpt_optimizer_state_shares_groups_with_its_parameter(zoo_graph, zoo_capture):
    g = zoo_graph("gpt-tiny")
    cap = zoo_capture("gpt-tiny")
    w = cap.parameter("params/layers_0/mlp/fc_in/kernel")
    mu = cap.parameter("opt_state/0/mu/layers_0/mlp/fc_in/kernel")
    nu = cap.parameter("opt_state/0/nu/layers_0/mlp/fc_in/kernel")
    assert g.parameter_groups(w.index) == g.parameter_groups(mu.index) == g.parameter_groups(nu.index)
    # the updated parameter (an output of the step) too
    out_groups = {tuple(int(x) for x in g.group_of_dim[g.tensor_dims(t)]) for t in g.output_tensors}
    assert g.parameter_groups(w.index) in out_groups


@pytest.mark.parametrize("name", ["bert-tiny", "t5-tiny", "vgg19-tiny", "moe-tiny"])
def test_zoo_graphs_build_without_unknown_rules(zoo_graph, name):
    g = zoo_graph(name)
    assert g.unknown == {}
    assert len(g.trainable_groups) > 3
    # every trainable dim of size > 1 is in a group with at least one other dim (its gradient)
    for t in g.trainable_dims:
        if t.size > 1:
            assert t.group_size > 1, t


def test_scalar_only_module_has_no_groups():
    from hlomap.propagation import ConflictChecker, MeshAxes

    g = FactorGraph.build(module("a = f32[] parameter(0)\nROOT s = f32[] add(a, a)"))
    assert g.num_dims == 0 and g.num_groups == 0
    checker = ConflictChecker(g, MeshAxes.from_mesh({"model": 8}))
    assert checker.ok(np.zeros((3, 0), dtype=np.int8)).tolist() == [True, True, True]
