"""The plan estimate: closed forms for tensor parallelism, the API, time and the text report.

Closed forms (issue #4):
- Megatron on an MLP of L [H, H] layers alternates column- and row-parallel layers; each row-
  parallel layer leaves a partial [B, H] sum: L/2 all-reduces of B*H*4 bytes in the forward pass
  (L - 1 = 1 for L = 2). Column-then-all-row plans, which would give L - 1, re-split a replicated
  activation and are not conflict-free in the linkage-group model; XLA is asked about them in
  test_against_xla.py.
- A Megatron transformer layer (fused QKV) has 2 all-reduces forward and 2 backward, each of
  b*s*h elements.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hlomap.cost.cluster import hierarchical
from hlomap.cost.collectives import Collective
from hlomap.cost.devices import DeviceSpec
from hlomap.api import estimate, parse_mesh_text as parse_mesh
from hlomap.cost.estimate import Overlap, Reason
from hlomap.plan import reference_plan
from hlomap.report.estimate import format_estimate, instruction_labels
from hlomap.cost.mapping import axis_devices
from hlomap.hlo.capture import Phase, Role, capture
from hlomap.propagation.conflicts import MeshAxes, PlanConflict
from hlomap.propagation.graph import FactorGraph

F32 = 4


def mlp_capture(layers: int, batch: int, hidden: int):  # type: ignore[no-untyped-def]
    def step(params, x):  # type: ignore[no-untyped-def]
        def loss(ws):  # type: ignore[no-untyped-def]
            h = x
            for w in ws:
                h = jnp.tanh(h @ w)
            return jnp.mean(h ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        return [w - 0.1 * g for w, g in zip(params, grads)], value

    params = [jax.ShapeDtypeStruct((hidden, hidden), jnp.float32)] * layers
    x = jax.ShapeDtypeStruct((batch, hidden), jnp.float32)
    return capture(step, params, x, arg_names=("params", "x"))


def transformer_capture(b: int, s: int, h: int, heads: int, f: int):  # type: ignore[no-untyped-def]
    d = h // heads

    def layer(p, x):  # type: ignore[no-untyped-def]
        qkv = jnp.einsum("bsh,htnd->tbsnd", x, p["wqkv"])
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = jax.nn.softmax(jnp.einsum("bsnd,btnd->bnst", q, k) / np.sqrt(d), axis=-1)
        o = jnp.einsum("bnst,btnd->bsnd", att, v)
        x = x + jnp.einsum("bsnd,ndh->bsh", o, p["wo"])
        return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]

    def step(params, x):  # type: ignore[no-untyped-def]
        # the layer's whole backward pass: weight gradients and the input gradient that would
        # flow on to the layer below
        value, (grads, dx) = jax.value_and_grad(lambda p, x: jnp.mean(layer(p, x) ** 2), argnums=(0, 1))(params, x)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), dx, value

    params = {"wqkv": jax.ShapeDtypeStruct((h, 3, heads, d), jnp.float32),
              "wo": jax.ShapeDtypeStruct((heads, d, h), jnp.float32),
              "w1": jax.ShapeDtypeStruct((h, f), jnp.float32),
              "w2": jax.ShapeDtypeStruct((f, h), jnp.float32)}
    return capture(step, params, jax.ShapeDtypeStruct((b, s, h), jnp.float32), arg_names=("params", "x"))


def _by_phase(est, phase: Phase) -> list:  # type: ignore[no-untyped-def]
    return [c for c in est.collectives if c.phase is phase and c.kind is Collective.ALL_REDUCE]


@pytest.mark.parametrize("layers", [2, 4, 6])
def test_megatron_mlp_forward_all_reduces(layers: int) -> None:
    batch, hidden = 16, 64
    cap = mlp_capture(layers, batch, hidden)
    est = estimate(cap, "megatron", mesh=8)
    forward = _by_phase(est, Phase.FORWARD)
    partial_rows = [c for c in forward if c.nbytes == batch * hidden * F32]
    assert len(partial_rows) == layers // 2
    assert all(c.reason is Reason.PARTIAL and c.axes == ("model",) and c.group_size == 8 for c in partial_rows)
    # nothing else moves in the forward pass but the loss's scalar partial mean, if any
    assert all(c.nbytes <= F32 for c in forward if c not in partial_rows)
    # no gradient sync: the batch is not split
    assert not [c for c in est.collectives if c.reason is Reason.GRADIENT_SYNC]


def test_megatron_transformer_layer_two_forward_two_backward() -> None:
    b, s, h = 2, 16, 64
    cap = transformer_capture(b, s, h, heads=8, f=256)
    est = estimate(cap, "megatron", mesh={"model": 4})
    big = [c for c in est.collectives if c.nbytes == b * s * h * F32]
    assert [c.phase for c in big].count(Phase.FORWARD) == 2
    assert [c.phase for c in big].count(Phase.BACKWARD) == 2
    assert all(c.kind is Collective.ALL_REDUCE and c.axes == ("model",) for c in big)
    assert all(c.nbytes < b * s * h * F32 for c in est.collectives if c not in big)


@pytest.fixture(scope="module")
def gpt():  # type: ignore[no-untyped-def]
    from hlomap.api import load_source

    cap = load_source("zoo:gpt-tiny")
    return cap, FactorGraph.from_capture(cap)


def test_data_parallel_syncs_every_gradient_once(gpt) -> None:  # type: ignore[no-untyped-def]
    cap, graph = gpt
    est = estimate(cap, "dp", mesh=8, graph=graph)
    assert est.mesh == (("data", 8),)
    sync = [c for c in est.collectives if c.reason is Reason.GRADIENT_SYNC]
    trainable = sum(p.byte_size for p in cap.parameters if p.role is Role.TRAINABLE)
    synced = sum(c.nbytes for c in sync)
    # Every trainable parameter's gradient, except the position-table rows beyond seq_len
    # (the gradient is computed for the slice, then padded), plus the tied embedding twice: its
    # gradient has two partial contributions (the token lookup's scatter-add and the output
    # projection's dot), each all-reduced before they are added (XLA does the same).
    embed = cap.parameter("params/embed/embedding")
    pos = cap.parameter("params/pos_embed/embedding")
    seq_len = cap.parameter("batch/tokens").shape.dims[1]
    unused_pos = (pos.shape.dims[0] - seq_len) * pos.shape.dims[1] * F32
    assert synced == trainable - unused_pos + embed.byte_size
    assert all(c.phase is Phase.BACKWARD and c.axes == ("data",) for c in sync)
    # one combined all-reduce: the sync's time is that of one all-reduce of all the bytes
    from hlomap.cost.cluster import cluster_preset
    from hlomap.cost.collectives import collective_time

    cluster = cluster_preset("A")
    groups = axis_devices(cluster, {"data": 8}).groups("data")
    assert np.isclose(sum(c.seconds for c in sync),
                      collective_time(Collective.ALL_REDUCE, cluster, groups, synced))


def test_plan_forms_agree(gpt) -> None:  # type: ignore[no-untyped-def]
    from hlomap.plan import Plan

    cap, graph = gpt
    array, axes = reference_plan(graph, "dp+megatron", {"data": 2, "model": 4})
    by_name = estimate(cap, "dp+megatron", mesh={"data": 2, "model": 4}, graph=graph)
    by_array = estimate(cap, array, mesh=axes, graph=graph)
    by_plan = estimate(cap, Plan.from_groups(cap, graph, array, axes), graph=graph)
    for other in (by_array, by_plan):
        assert other.flops == pytest.approx(by_name.flops)
        assert other.communication_seconds == pytest.approx(by_name.communication_seconds)
        assert other.memory.total == by_name.memory.total
    assert {c.axes for c in by_name.collectives} == {("data",), ("model",)}


def test_bad_plans_are_named(gpt) -> None:  # type: ignore[no-untyped-def]
    cap, graph = gpt
    with pytest.raises(ValueError, match="dp, megatron"):
        estimate(cap, "zero3", mesh=8, graph=graph)
    with pytest.raises(ValueError, match="two named mesh axes"):
        estimate(cap, "dp+megatron", mesh=8, graph=graph)
    axes = MeshAxes.from_mesh({"model": 8})
    bad = np.full(graph.num_groups, -1, dtype=np.int8)
    bad[list(graph.parameter_groups(cap.parameter("params/layers_0/attn/query/kernel").index))] = 0  # all dims
    with pytest.raises(PlanConflict):
        estimate(cap, bad, mesh=axes, graph=graph)
    with pytest.raises(ValueError, match="mesh"):
        estimate(cap, bad, graph=graph)


def test_communication_terms_reprice_the_estimate_on_any_device_order(gpt) -> None:  # type: ignore[no-untyped-def]
    from hlomap.cost.cluster import load_cluster
    from hlomap.cost.collectives import collective_time
    from hlomap.cost.estimate import CollectiveEstimate, communication_terms
    from hlomap.cost.mapping import AxisMapping

    cap, graph = gpt
    cluster = load_cluster("random:16:3")
    mesh = {"data": 2, "model": 4}
    order = np.random.default_rng(0).permutation(16)[:8].reshape(2, 4)
    mapping = AxisMapping(tuple(mesh.items()), order)
    est = estimate(cap, "dp+megatron", mesh=mesh, graph=graph, cluster=cluster, axis_devices=mapping)
    # the saved form reads back
    saved = [CollectiveEstimate.from_json(json.loads(json.dumps(c.to_json()))) for c in est.collectives]
    assert saved == list(est.collectives)
    terms = communication_terms(saved)
    assert sum(t.count for t in terms) < sum(c.count for c in est.collectives)  # merged
    repriced = sum(t.count * collective_time(t.kind, cluster, mapping.groups(t.axes), t.nbytes) for t in terms)
    assert repriced == pytest.approx(est.communication_seconds, rel=1e-9)
    with pytest.raises(ValueError, match="collectives\\[0\\]: missing field 'kind'"):
        CollectiveEstimate.from_json({}, where="collectives[0]")


def test_parse_mesh() -> None:
    assert parse_mesh("8") == 8
    assert parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
    for bad in ("data=2,data=4", "data", "model=0", "x=y", "0"):
        with pytest.raises(ValueError):
            parse_mesh(bad)


def test_axis_order_keeps_tensor_parallel_inside_a_node(gpt) -> None:  # type: ignore[no-untyped-def]
    # cluster A: two 8-GPU servers over 25 GbE. Megatron on `model` inside a server is faster
    # (gpt-tiny's all-reduces are small, so latency, not bandwidth, dominates both).
    cap, graph = gpt
    mesh = {"data": 2, "model": 8}
    inside = estimate(cap, "dp+megatron", mesh=mesh, graph=graph, axis_order=("data", "model"))
    across = estimate(cap, "dp+megatron", mesh=mesh, graph=graph, axis_order=("model", "data"))
    tp = lambda e: sum(c.total_seconds for c in e.collectives if c.axes == ("model",))  # noqa: E731
    assert tp(inside) < tp(across)
    assert inside.compute_seconds == pytest.approx(across.compute_seconds)


def test_overlap_hides_gradient_sync(gpt) -> None:  # type: ignore[no-untyped-def]
    cap, graph = gpt
    none = estimate(cap, "dp", mesh=8, graph=graph)
    hidden = estimate(cap, "dp", mesh=8, graph=graph, overlap=Overlap.GRADIENT_SYNC)
    assert none.exposed_communication_seconds == pytest.approx(none.communication_seconds)
    assert hidden.exposed_communication_seconds < none.exposed_communication_seconds
    assert hidden.step_seconds == pytest.approx(hidden.compute_seconds + hidden.exposed_communication_seconds)


def test_compute_is_split_by_the_plan(gpt) -> None:  # type: ignore[no-untyped-def]
    cap, graph = gpt
    one = estimate(cap, np.full(graph.num_groups, -1, dtype=np.int8), mesh={"data": 1}, graph=graph)
    dp = estimate(cap, "dp", mesh=8, graph=graph)
    dots = lambda e: sum(i.flops for i in e.instructions if i.opcode == "dot")  # noqa: E731
    assert dots(dp) == pytest.approx(dots(one) / 8)  # every dot has the batch in it
    assert not one.collectives and one.communication_seconds == 0
    assert one.step_seconds == pytest.approx(one.compute_seconds)
    row = {r.kind: r for r in dp.by_kind()}
    assert row["dot"].flops == pytest.approx(dots(dp))
    assert row["all-reduce"].seconds == pytest.approx(dp.communication_seconds)


def test_data_parallel_over_one_device_is_the_unsharded_step(gpt) -> None:  # type: ignore[no-untyped-def]
    """A split over one device is no split: no all-reduce, no local sums, the module's flops."""
    from hlomap.cost.compute import module_flops

    cap, graph = gpt
    one = estimate(cap, "dp", mesh={"data": 1}, graph=graph)
    assert not one.collectives and one.communication_seconds == 0
    assert one.flops == module_flops(cap.module)


def test_report_and_json(gpt) -> None:  # type: ignore[no-untyped-def]
    cap, graph = gpt
    est = estimate(cap, "megatron", mesh=8, graph=graph)
    text = format_estimate(est)
    for needle in ("by kind:", "all-reduce", "partial reduction", "memory per device", "fits"):
        assert needle in text
    json.dumps(est.to_json())


def test_report_names_each_call_of_a_computation_called_twice() -> None:
    """A computation called from two places runs its instructions once per call: the slowest
    instructions list tells the two apart instead of printing one name twice."""
    @jax.jit
    def scaled(v):  # type: ignore[no-untyped-def]
        return jnp.tanh(v @ v.T)

    def step(params, x):  # type: ignore[no-untyped-def]
        return scaled(x @ params["w"]).sum() + scaled(2.0 * x).sum()

    cap = capture(step, {"w": jnp.ones((64, 64), jnp.float32)}, jnp.ones((64, 64), jnp.float32),
                  roles={0: Role.TRAINABLE, 1: Role.DATA})
    est = estimate(cap, "dp", mesh={"data": 1})
    called = [i for i in est.instructions if i.instance]
    assert len({i.instance for i in called}) == 2  # the two call sites
    labels = instruction_labels(est.instructions)
    assert len(set(labels)) == len(labels)
    first = next(i for i in called)
    both = [label for i, label in zip(est.instructions, labels) if i.name == first.name and i.computation == first.computation]
    assert sorted(both) == [f"{first.name} (in {first.computation}, call {k} of 2)" for k in (1, 2)]
    table = format_estimate(est, top=len(est.instructions)).split("slowest")[1].split("collectives")[0]
    assert all(label in table for label in labels)
    # the JSON of `hlomap simulate --json --top N` says the same in fields
    from hlomap.api import simulate_plan
    from hlomap.report.simulate import simulation_json

    data = simulation_json(simulate_plan(cap, "dp", mesh={"data": 1}), top=len(est.instructions))
    rows = [(r["instruction"], r["computation"], r["call"] and tuple(r["call"])) for r in data["slowest_instructions"]]
    assert len(set(rows)) == len(rows) == len(est.instructions)
    assert sorted(r[2] for r in rows if r[:2] == (first.name, first.computation)) == [(1, 2), (2, 2)]
    assert "slowest_instructions" not in simulation_json(simulate_plan(cap, "dp", mesh={"data": 1}))


def test_plan_that_does_not_fit_says_by_how_much(gpt) -> None:  # type: ignore[no-untyped-def]
    cap, graph = gpt
    tiny = DeviceSpec("tiny-1MiB", {"f32": 1e12}, 1e11, 2**20)
    cluster = hierarchical(1, 8, device=tiny)
    est = estimate(cap, "dp", mesh=8, graph=graph, cluster=cluster)
    assert not est.fits
    assert est.memory.shortfall == est.memory.total - 2**20 > 0
    assert "DOES NOT FIT, short by" in format_estimate(est)


def test_reference_plans_need_roles_and_default_to_eight_devices(gpt) -> None:  # type: ignore[no-untyped-def]
    from hlomap.plan import PlanError as EstimateError
    from hlomap.hlo.capture import from_module

    cap, graph = gpt
    assert estimate(cap, "megatron", graph=graph).mesh == (("model", 8),)
    bare = from_module(cap.module)  # a dump with no roles: no batch to split, no weights to split
    for plan in ("dp", "megatron"):
        with pytest.raises(EstimateError, match=plan):
            estimate(bare, plan)


def _reference_rows(sg, device, gathered, fused, kernel_seconds):  # type: ignore[no-untyped-def]
    """Each executed instruction's (node, degree, flops, bytes, compute, memory, seconds), one
    instruction at a time by the rules `instruction_arrays` computes with arrays."""
    from hlomap.cost.compute import folds_into_product, instruction_cost, transposed_product_cost
    from hlomap.cost.estimate import _runs

    g, mesh, rows = sg.graph, sg.axes.mesh_shape, []
    # a transpose of a product runs (as a copy) only after the plan all-reduces the product
    all_reduced = {pr.node for pr in sg.partials
                   if pr.node not in gathered and int(np.prod([mesh[a] for a in pr.axes])) > 1}
    for n, node in enumerate(g.nodes):
        inst, count = node.instruction, int(sg.node_count[n])
        comp = g.module.computation(node.computation)
        if count > 0 and folds_into_product(inst, comp):
            if sg.node_operand_nodes(n)[0] not in all_reduced:
                continue
            full = transposed_product_cost(inst, comp, device)
        elif not _runs(inst, comp, count):
            continue
        else:
            full = instruction_cost(inst, comp, g.module, device, {})
        degree = int(sg.node_degree[n])
        for axis in gathered.get(n, ()):
            degree //= mesh[axis]
        degree = max(degree, 1)
        nbytes = 0.0
        if full.bytes_accessed:
            # an operand named twice is read once
            reads = sum(sg.node_result_bytes(o) for o in dict.fromkeys(sg.node_operand_nodes(n)) if o not in fused)
            for axis in gathered.get(n, ()):
                reads *= mesh[axis]
            nbytes = reads + (0.0 if n in fused else sg.node_result_bytes(n))
        compute = full.compute_seconds / degree
        if degree > 1 and inst.opcode in device.narrow:
            compute *= sg.narrow_slowdown(n, device, {})
        memory = nbytes / device.hbm_bandwidth
        launch = 0.0 if n in fused else kernel_seconds
        rows.append((n, degree, full.flops / degree * count, nbytes * count, compute * count, memory * count,
                     (max(compute, memory) + launch) * count))
    return rows


@pytest.mark.parametrize("plan", ["dp", "megatron", "dp+megatron"])
def test_instruction_arrays_equal_the_per_instruction_rules(gpt, plan: str) -> None:  # type: ignore[no-untyped-def]
    """The vectorized per-instruction costs equal a loop over the instructions, on a device with
    a narrow-matrix curve (so the narrow slowdown applies) and a kernel launch cost, with and
    without fusion, and with a node whose operands are gathered."""
    from hlomap.cost.devices import NarrowCurve
    from hlomap.cost.estimate import _gathered_axes, instruction_arrays, instruction_estimates
    from hlomap.cost.memory import Fusion, fused_nodes
    from hlomap.cost.sharding import ShardedGraph

    cap, graph = gpt
    mesh = {"data": 2, "model": 4} if plan == "dp+megatron" else ({"data": 8} if plan == "dp" else {"model": 8})
    array, axes = reference_plan(graph, plan, mesh)
    device = DeviceSpec("narrow", {"f32": 1e13}, 1e12, 2**34, narrow={"dot": NarrowCurve(((1.0, 0.05), (512.0, 1.0)))})
    sg = ShardedGraph.build(graph, array, axes)
    gathered = dict(_gathered_axes(sg))
    some_dot = next(n for n, node in enumerate(graph.nodes)
                    if node.instruction.opcode == "dot" and sg.node_degree[n] > 1 and sg.node_count[n] > 0)
    gathered.setdefault(some_dot, axes.names[:1])  # exercise the gathered rule on a split matmul
    for fusion in (Fusion.NONE, Fusion.ELEMENTWISE):
        fused = fused_nodes(sg, fusion)
        found = instruction_arrays(sg, device, gathered, fused, {}, kernel_seconds=3e-6)
        expected = _reference_rows(sg, device, gathered, fused, 3e-6)
        assert found.node.tolist() == [r[0] for r in expected]
        assert found.degree.tolist() == [r[1] for r in expected]
        for k, column in enumerate((found.flops, found.bytes_accessed, found.compute_seconds, found.memory_seconds,
                                    found.seconds), start=2):
            np.testing.assert_allclose(column, [r[k] for r in expected], rtol=1e-12, atol=0)
        assert any(r[1] > 1 and graph.nodes[r[0]].instruction.opcode == "dot" for r in expected)
        unfolded = [r for r in expected if graph.nodes[r[0]].instruction.opcode == "transpose"
                    and graph.nodes[sg.node_operand_nodes(r[0])[0]].instruction.opcode == "dot"]
        assert unfolded or plan == "megatron"  # data parallelism all-reduces the weight gradients
        rows = instruction_estimates(sg, found)
        assert [(r.name, r.computation) for r in rows] == [
            (graph.nodes[n].instruction.name, graph.nodes[n].computation) for n in found.node.tolist()]


def test_costs_of_one_module_on_sped_up_devices_do_not_share_a_cache(gpt) -> None:  # type: ignore[no-untyped-def]
    """A measured device sped up for a smaller busy set keeps its name; one cache must still
    price it at its own speed."""
    from hlomap.cost.cluster import sped_up
    from hlomap.cost.estimate import instruction_arrays
    from hlomap.cost.sharding import ShardedGraph

    cap, graph = gpt
    array, axes = reference_plan(graph, "dp", {"data": 8})
    sg = ShardedGraph.build(graph, array, axes)
    device = DeviceSpec("cpu", {"f32": 1e11}, 1e10, 2**34)
    cache: dict = {}
    slow = instruction_arrays(sg, device, {}, frozenset(), cache)
    fast = instruction_arrays(ShardedGraph.build(graph, array, axes), sped_up(device, 2.0), {}, frozenset(), cache)
    np.testing.assert_allclose(fast.seconds, slow.seconds / 2, rtol=1e-12)
