"""The Plan type: from a user's PartitionSpecs (with conflicts reported), reference plans, JSON
round trips and the PartitionSpec / NamedSharding pytrees."""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from hlomap.plan import Plan, PlanConflict
from hlomap.propagation import ConflictChecker, MeshAxes, combine, data_parallel_plan, megatron_plan


def _model_path(path: str) -> str | None:
    """`params/x/y` or `opt_state/0/mu/x/y` -> `x/y`; None for the batch and counters."""
    m = re.match(r"^(?:params|opt_state/\d+/(?:mu|nu))/(.*)$", path)
    return m.group(1) if m else None


def megatron_by_hand(path: str) -> P:
    """Megatron-LM's tensor parallelism for the zoo GPT, written out per weight name."""
    name = _model_path(path)
    if name is None:
        return P()
    if re.search(r"attn/(query|key|value)/kernel$", name) or re.search(r"mlp/fc_in/kernel$", name):
        return P(None, "model")  # column parallel (heads / hidden)
    if re.search(r"attn/(query|key|value)/bias$", name) or re.search(r"mlp/fc_in/bias$", name):
        return P("model")
    if re.search(r"attn/out/kernel$", name) or re.search(r"mlp/fc_out/kernel$", name):
        return P("model")  # row parallel
    if name == "embed/embedding":
        return P("model")  # vocabulary parallel
    return P()  # layer norms, row-parallel biases, position embeddings


def _specs(cap, fn):
    return jax.tree_util.tree_unflatten(cap.in_tree, [fn(p.path) for p in cap.parameters])


def test_megatron_plan_is_derived_not_listed_and_equals_megatrons_own_specs(zoo_capture, zoo_graph):
    cap, g = zoo_capture("gpt-tiny"), zoo_graph("gpt-tiny")
    axes = MeshAxes.from_mesh({"model": 8})
    derived = megatron_plan(g, "model", axes)
    by_hand = Plan.from_specs(cap, _specs(cap, megatron_by_hand), mesh={"model": 8}, graph=g, strict=True)
    assert np.array_equal(by_hand.group_array(g, axes), derived)
    assert ConflictChecker(g, axes).ok(derived).tolist() == [True]
    plan = Plan.from_groups(cap, g, derived, axes)
    specs = {p.path: p.partition_spec() for p in plan.parameters}
    assert specs["params/layers_1/attn/query/kernel"] == P(None, "model")
    assert specs["params/layers_0/mlp/fc_out/kernel"] == P("model")
    assert specs["opt_state/0/nu/layers_0/mlp/fc_in/bias"] == P("model")
    assert specs["params/ln_f/scale"] == P() and specs["params/layers_0/attn/out/bias"] == P()
    assert specs["batch/tokens"] == P()


def test_data_parallel_and_hybrid_plans(zoo_capture, zoo_graph):
    cap, g = zoo_capture("gpt-tiny"), zoo_graph("gpt-tiny")
    axes = MeshAxes.from_mesh({"data": 2, "model": 4})
    dp = data_parallel_plan(g, "data", axes)
    plan = Plan.from_groups(cap, g, combine(dp, megatron_plan(g, "model", axes)), axes)
    specs = {p.path: p.partition_spec() for p in plan.parameters}
    assert specs["batch/tokens"] == P("data") and specs["batch/targets"] == P("data")
    assert specs["params/layers_0/attn/query/kernel"] == P(None, "model")
    assert all(s == P() for path, s in specs.items() if path.startswith("params/ln"))


def test_data_parallel_plan_warns_when_the_batch_cannot_split(zoo_graph, caplog):
    g = zoo_graph("gpt-tiny")  # batch 8: splits over 8, not over 3
    with caplog.at_level("WARNING", logger="hlomap.propagation.plans"):
        assert (data_parallel_plan(g, "data", MeshAxes.from_mesh({"data": 8})) >= 0).any()
        assert not caplog.records
        assert not (data_parallel_plan(g, "data", MeshAxes.from_mesh({"data": 3})) >= 0).any()
    assert "batch/tokens" in caplog.text and "stays replicated" in caplog.text


def test_wrong_plan_is_rejected_naming_the_weight(zoo_capture, zoo_graph):
    cap, g = zoo_capture("gpt-tiny"), zoo_graph("gpt-tiny")

    def wrong(path: str) -> P:
        return P("model", "model") if path == "params/layers_0/mlp/fc_in/kernel" else megatron_by_hand(path)

    with pytest.raises(PlanConflict) as info:
        Plan.from_specs(cap, _specs(cap, wrong), mesh={"model": 8}, graph=g)
    message = str(info.value)
    assert "params/layers_0/mlp/fc_in/kernel" in message and "same_axis" in message
    assert any(c.tensor == "params/layers_0/mlp/fc_in/kernel" and c.dims == (0, 1) for c in info.value.conflicts)


def test_a_spec_on_an_axis_the_mesh_lacks_names_the_weight(zoo_capture, zoo_graph):
    from hlomap.plan import PlanError

    cap, g = zoo_capture("gpt-tiny"), zoo_graph("gpt-tiny")

    def typo(path: str) -> P:
        return P(None, "modle") if path == "params/layers_0/mlp/fc_in/kernel" else megatron_by_hand(path)

    with pytest.raises(PlanError, match=re.escape("'params/layers_0/mlp/fc_in/kernel' dim 1 is split on mesh axis "
                                                  "'modle', which the mesh {'model': 8} does not have")):
        Plan.from_specs(cap, _specs(cap, typo), mesh={"model": 8}, graph=g)


def test_a_bare_device_count_names_the_one_axis_the_specs_use(zoo_capture, zoo_graph):
    from hlomap.plan import PlanError

    cap, g = zoo_capture("gpt-tiny"), zoo_graph("gpt-tiny")
    plan = Plan.from_specs(cap, _specs(cap, megatron_by_hand), mesh=8, graph=g)
    assert dict(plan.mesh) == {"model": 8}

    def two_axes(path: str) -> P:
        return P("data") if path.startswith("batch/") else megatron_by_hand(path)

    with pytest.raises(PlanError, match=re.escape("mesh=8: the specs use axes ['data', 'model']; name the mesh's axes")):
        Plan.from_specs(cap, _specs(cap, two_axes), mesh=8, graph=g)


def test_inconsistent_specs_name_both_parameters(zoo_capture, zoo_graph):
    cap, g = zoo_capture("gpt-tiny"), zoo_graph("gpt-tiny")

    def mixed(path: str) -> P:
        if path == "params/layers_0/attn/key/kernel":
            return P(None, "data")  # the heads group, which query shards on "model"
        return megatron_by_hand(path)

    with pytest.raises(PlanConflict) as info:
        Plan.from_specs(cap, _specs(cap, mixed), mesh={"data": 2, "model": 4}, graph=g)
    message = str(info.value)
    assert message.startswith("inconsistent specs")
    assert "'params/layers_0/attn/key/kernel' dim 1 is split on 'data'" in message
    # the other parameter of the heads group, split on "model" by Megatron
    assert re.search(r"'params/layers_0/attn/(key|query|value)/(bias|kernel)' dim \d is split on 'model'", message)


def test_replicated_optimizer_state_is_resolved_unless_strict(zoo_capture, zoo_graph):
    cap, g = zoo_capture("gpt-tiny"), zoo_graph("gpt-tiny")

    def params_only(path: str) -> P:
        return megatron_by_hand(path) if path.startswith("params/") else P()

    with pytest.raises(PlanConflict, match="opt_state/0/(mu|nu)/.* is replicated"):
        Plan.from_specs(cap, _specs(cap, params_only), mesh={"model": 8}, graph=g, strict=True)
    plan = Plan.from_specs(cap, _specs(cap, params_only), mesh={"model": 8}, graph=g)
    specs = {p.path: p.partition_spec() for p in plan.parameters}
    assert specs["opt_state/0/mu/layers_0/mlp/fc_in/kernel"] == P(None, "model")


def test_prefix_specs_apply_to_whole_subtrees(zoo_capture, zoo_graph):
    cap, g = zoo_capture("gpt-tiny"), zoo_graph("gpt-tiny")
    params, opt_state, batch = cap.args
    specs = (jax.tree_util.tree_map(lambda _: P(), params), None, {"targets": P("data"), "tokens": P("data")})
    plan = Plan.from_specs(cap, specs, mesh={"data": 8}, graph=g)
    assert {p.path: p.partition_spec() for p in plan.parameters}["batch/tokens"] == P("data")
    assert all(p.partition_spec() == P() for p in plan.parameters if p.path.startswith("params/"))


def test_json_round_trip_and_pytrees(zoo_capture, zoo_graph, tmp_path):
    cap, g = zoo_capture("gpt-tiny"), zoo_graph("gpt-tiny")
    axes = MeshAxes.from_mesh({"data": 2, "model": 4})
    plan = Plan.from_groups(cap, g, combine(data_parallel_plan(g, "data", axes), megatron_plan(g, "model", axes)),
                            axes)
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["mesh"] == {"axes": {"data": 2, "model": 4}}
    assert data["source"]["sha256"] == cap.text_sha256
    loaded = Plan.load(path)
    assert loaded == plan  # in_tree is not compared
    assert np.array_equal(loaded.group_array(g, axes), plan.group_array(g, axes))
    # pytrees: the captured treedef, `like=` after loading, or nested containers from paths
    tree = plan.partition_specs()
    assert jax.tree_util.tree_structure(tree, is_leaf=lambda x: isinstance(x, P)) == cap.in_tree
    like = loaded.partition_specs(like=cap.args)
    assert jax.tree_util.tree_leaves(like, is_leaf=lambda x: isinstance(x, P)) == \
        jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, P))
    rebuilt = loaded.partition_specs()
    assert rebuilt[0]["layers_0"]["attn"]["query"]["kernel"] == P(None, "model")
    assert rebuilt[2]["tokens"] == P("data")
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    shardings = plan.shardings(mesh)
    assert isinstance(shardings[0]["embed"]["embedding"], NamedSharding)
    with pytest.raises(ValueError, match="size"):
        plan.shardings(jax.make_mesh((4, 2), ("data", "model")))


def test_load_rejects_other_versions(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"version": 0}))
    with pytest.raises(ValueError, match=r"old\.json.*version 0"):
        Plan.load(path)


def test_a_spec_using_one_axis_twice_names_the_tensor_the_user_wrote(zoo_capture, zoo_graph):
    cap, g = zoo_capture("gpt-tiny"), zoo_graph("gpt-tiny")

    def twice(path: str) -> P | None:
        return P(None, "model", "model") if path == "params/layers_0/attn/query/kernel" else None

    with pytest.raises(PlanConflict) as info:
        Plan.from_specs(cap, _specs(cap, twice), mesh={"model": 8}, graph=g)
    message = str(info.value)
    assert "'params/layers_0/attn/query/kernel' dim 1 on 'model'" in message and "dim 2 too" in message
    assert "attn/key" not in message  # not a tensor the user touched
    assert "reshard" not in message  # one spec: nothing for XLA to reshard


def test_two_specs_meeting_in_one_tensor_are_named_with_the_instructions_linking_them(zoo_capture, zoo_graph):
    """query splits head_dim, key splits heads: the attention scores' dot ties query's heads to
    key's heads, so query would carry "model" twice. XLA would reshard; hlomap says why it does
    not, naming both specs and the instructions between them."""
    cap, g = zoo_capture("gpt-tiny"), zoo_graph("gpt-tiny")
    specs = {"params/layers_0/attn/query/kernel": P(None, None, "model"),
             "params/layers_0/attn/key/kernel": P(None, "model", None)}

    with pytest.raises(PlanConflict) as info:
        Plan.from_specs(cap, _specs(cap, specs.get), mesh={"model": 8}, graph=g)
    message = str(info.value)
    assert "your spec splits 'params/layers_0/attn/key/kernel' dim 1" in message
    assert "your spec splits 'params/layers_0/attn/query/kernel' dim 2" in message
    assert "bqhd,bkhd->bhqk" in message  # the attention scores: where the two specs meet
    assert "XLA would accept such specs and insert a reshard" in message


def test_a_plan_loaded_with_its_capture_gives_specs_shaped_like_the_arguments(tmp_path, zoo_capture, zoo_graph):
    """Without the capture's argument structure, specs rebuilt from paths lose optax's empty
    states and no longer fit `from_specs`; loading with `cap=` keeps the structure."""
    cap, g = zoo_capture("gpt-tiny"), zoo_graph("gpt-tiny")
    plan = Plan.from_specs(cap, _specs(cap, megatron_by_hand), mesh={"model": 8}, graph=g)
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json", cap=cap)
    specs = loaded.partition_specs()
    assert jax.tree_util.tree_structure(specs, is_leaf=lambda x: isinstance(x, P)) == \
        jax.tree_util.tree_structure(plan.partition_specs(), is_leaf=lambda x: isinstance(x, P))
    again = Plan.from_specs(cap, specs, mesh={"model": 8}, graph=g)
    assert again.parameters == plan.parameters


def test_specs_missing_keys_are_named_in_one_line():
    from hlomap import capture
    from hlomap.plan import PlanError
    from tests.run.user_step import make

    step, args = make()
    cap = capture(step, *args)
    with pytest.raises(PlanError) as caught:
        Plan.from_specs(cap, ({"w0": P("model")}, None, None), mesh={"model": 8})
    assert str(caught.value) == ("spec pytree does not match the step's arguments at [0]: keys b0, b1, b2, w1, w2 are "
                                 "in one and not the other (give every key a spec; None replicates)")
    with pytest.raises(PlanError, match=r"at the top: pytree structure error: different lengths of tuple$"):
        Plan.from_specs(cap, ({"w0": P("model")}, None), mesh={"model": 8})
