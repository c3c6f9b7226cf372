"""Memory model: liveness in program order, fusion, sharding, donation, gradient-sync buckets.

Hand-written modules give exact expected peaks; the zoo checks tie the categories to roles and to
what XLA holds at its own peak. Agreement with XLA's memory analysis over many plans is tested in
tests/verify/test_xla.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from hlomap.cost.memory import (
    Fusion,
    MemoryEstimate,
    aliased_outputs,
    donated_parameters,
    estimate_memory,
    outputs_early,
)
from hlomap.cost.sharding import ShardedGraph
from hlomap.hlo import parse
from hlomap.hlo.capture import Role, from_module
from hlomap.propagation.conflicts import MeshAxes
from hlomap.propagation.graph import FactorGraph
from hlomap.propagation.plans import empty_plan

ADD = """
add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}
"""


def _sharded(text: str, mesh: dict[str, int] | None = None, shard: dict[str, int] | None = None,
             trainable: tuple[int, ...] = ()) -> ShardedGraph:
    """Sharded graph of a module; `shard` maps an entry parameter name to the mesh option index
    its dim 0 group gets (everything else replicated)."""
    module = parse(text)
    cap = from_module(module, trainable=list(trainable) or None)
    graph = FactorGraph.build(module, cap.parameters)
    axes = MeshAxes.from_mesh(mesh or {"x": 2})
    plan = empty_plan(graph)
    for name, option in (shard or {}).items():
        index = next(p.index for p in cap.parameters if p.name == name)
        plan[graph.parameter_groups(index)[0]] = option
    return ShardedGraph.build(graph, plan, axes)


CHAIN = """HloModule chain
""" + ADD + """
ENTRY e {
  p = f32[256]{0} parameter(0)
  a = f32[256]{0} exponential(p)
  b = f32[256]{0} negate(a)
  zero = f32[] constant(0)
  ROOT r = f32[] reduce(b, zero), dimensions={0}, to_apply=add
}
"""

CONCAT = """HloModule concat
""" + ADD + """
ENTRY e {
  p = f32[256]{0} parameter(0)
  a = f32[256]{0} exponential(p)
  b = f32[256]{0} negate(a)
  c = f32[512]{0} concatenate(a, b), dimensions={0}
  d = f32[512]{0} multiply(c, c)
  zero = f32[] constant(0)
  ROOT r = f32[] reduce(d, zero), dimensions={0}, to_apply=add
}
"""


def test_unfused_chain_holds_producer_and_consumer() -> None:
    mem = estimate_memory(_sharded(CHAIN), 10**6, fusion=Fusion.NONE)
    assert mem.inputs == 1024
    assert mem.activations == 2048  # a and b live together while b is computed
    assert mem.peak_instruction == "b"


def test_elementwise_chain_into_reduce_is_fused_away() -> None:
    mem = estimate_memory(_sharded(CHAIN), 10**6, fusion=Fusion.ELEMENTWISE)
    assert mem.temporaries == 4  # only the scalar result is materialized


def test_fused_producer_keeps_its_operands_alive() -> None:
    # d = c * c is fused into the reduce, so c must live until the reduce runs: the peak is
    # a + b + c at the concatenate (4 KiB) in both models, and c is still live at r.
    for fusion in Fusion:
        mem = estimate_memory(_sharded(CONCAT), 10**6, fusion=fusion)
        assert mem.temporaries == 4096, fusion


def test_sharding_divides_bytes_and_adds_the_all_reduce_copy() -> None:
    replicated = estimate_memory(_sharded(CHAIN), 10**6, fusion=Fusion.NONE)
    split = estimate_memory(_sharded(CHAIN, shard={"p": 0}), 10**6, fusion=Fusion.NONE)
    assert split.inputs == replicated.inputs // 2
    assert split.activations == replicated.activations // 2
    sg = _sharded(CHAIN, shard={"p": 0})
    assert [sg.graph.nodes[p.node].instruction.name for p in sg.partials] == ["r"]


def test_fits_and_shortfall() -> None:
    mem = MemoryEstimate(parameters=100, optimizer=200, inputs=10, gradients=50, activations=40, outputs=0,
                         capacity=300)
    assert mem.total == 400 and mem.temporaries == 90
    assert not mem.fits and mem.shortfall == 100
    roomy = MemoryEstimate(1, 1, 1, 1, 1, 1, capacity=6)
    assert roomy.fits and roomy.shortfall == 0
    assert set(mem.to_json()) >= {"total", "capacity", "fits", "shortfall"}


UPDATE = """HloModule update
ENTRY e {
  w = f32[1024]{0} parameter(0)
  g = f32[1024]{0} parameter(1)
  lr = f32[] constant(0.1)
  s = f32[1024]{0} broadcast(lr), dimensions={}
  u = f32[1024]{0} multiply(g, s)
  w2 = f32[1024]{0} subtract(w, u)
  loss = f32[] constant(0)
  ROOT out = (f32[1024]{0}, f32[]) tuple(w2, loss)
}
"""


def test_donated_output_is_written_in_place() -> None:
    sg = _sharded(UPDATE, trainable=(0,))
    # with fusion, u = g * lr and the subtract are one kernel: w2 is the only new buffer
    donated = estimate_memory(sg, 10**6, donated=frozenset({0}))
    kept = estimate_memory(sg, 10**6, donated=frozenset())
    assert len(aliased_outputs(sg, frozenset({0}))) == 1
    assert not aliased_outputs(sg, frozenset())
    # w2 (4 KiB) costs nothing when it reuses w's buffer; otherwise it is an output
    assert kept.total - donated.total == 4096
    assert kept.outputs == 4096 and donated.outputs == 0


@pytest.fixture(scope="module")
def gpt_tiny():  # type: ignore[no-untyped-def]
    from hlomap.api import load_source

    cap = load_source("zoo:gpt-tiny")
    return cap, FactorGraph.from_capture(cap)


def test_donated_parameters_are_params_and_optimizer_state(gpt_tiny) -> None:  # type: ignore[no-untyped-def]
    cap, _ = gpt_tiny
    donated = donated_parameters(cap)
    for p in cap.parameters:
        if p.role in (Role.TRAINABLE, Role.OPTIMIZER_STATE):
            assert p.index in donated
        if p.role is Role.DATA:
            assert p.index not in donated


def test_persistent_memory_by_role_and_degree(gpt_tiny) -> None:  # type: ignore[no-untyped-def]
    from hlomap.propagation.plans import data_parallel_plan, megatron_plan

    cap, graph = gpt_tiny
    trainable = sum(p.byte_size for p in cap.parameters if p.role is Role.TRAINABLE)
    optimizer = sum(p.byte_size for p in cap.parameters if p.role is Role.OPTIMIZER_STATE)
    data = sum(p.byte_size for p in cap.parameters if p.role in (Role.DATA, Role.OTHER))
    axes = MeshAxes.from_mesh({"d": 8})
    dp = estimate_memory(ShardedGraph.build(graph, data_parallel_plan(graph, "d", axes), axes), 2**30)
    assert (dp.parameters, dp.optimizer) == (trainable, optimizer)  # replicated
    assert dp.inputs < data  # the batch is split
    tp = estimate_memory(ShardedGraph.build(graph, megatron_plan(graph, "d", axes), axes), 2**30)
    assert tp.parameters < trainable / 4 and tp.optimizer == 2 * tp.parameters  # Adam: mu and nu
    # data parallel: every gradient is synced in one bucket, so at its peak all gradients are live
    assert dp.gradients >= 0.9 * trainable
    # ... and nothing more than each use of a leaf's gradient with its all-reduced copy: the tied
    # token embedding is used twice (lookup and logits), every other leaf once
    embedding = next(p.byte_size for p in cap.parameters if p.path == "params/embed/embedding")
    assert dp.gradients <= 2 * (trainable + embedding)
    assert dp.max_gradients == dp.gradients


def test_memory_grows_with_batch_activations() -> None:
    # the same chain on twice the elements doubles the temporaries
    small = estimate_memory(_sharded(CHAIN), 10**6, fusion=Fusion.NONE)
    big = estimate_memory(_sharded(CHAIN.replace("256", "512")), 10**6, fusion=Fusion.NONE)
    assert big.activations == 2 * small.activations
    assert np.isclose(big.inputs, 2 * small.inputs)


# A data-parallel step: y = x @ w, a stand-in backward pass, and SGD. `dw` contracts the batch,
# so sharding the batch leaves it partial: the gradient sync.
DP_STEP = """HloModule dp_step
ENTRY e {
  x = f32[8,64]{1,0} parameter(0)
  w = f32[64,64]{1,0} parameter(1)
  y = f32[8,64]{1,0} dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jvp(f)/dot"}
  dy = f32[8,64]{1,0} negate(y), metadata={op_name="transpose(jvp(f))/neg"}
  dw = f32[64,64]{1,0} dot(x, dy), lhs_contracting_dims={0}, rhs_contracting_dims={0},
    metadata={op_name="transpose(jvp(f))/dot"}
  lr = f32[] constant(0.1)
  s = f32[64,64]{1,0} broadcast(lr), dimensions={}, metadata={op_name="mul"}
  u = f32[64,64]{1,0} multiply(dw, s), metadata={op_name="mul"}
  w2 = f32[64,64]{1,0} subtract(w, u), metadata={op_name="sub"}
  ROOT out = (f32[64,64]{1,0}) tuple(w2)
}
"""


def test_synced_gradient_lives_next_to_its_reduced_copy() -> None:
    sg = _sharded(DP_STEP, shard={"x": 0}, trainable=(1,))
    assert [(sg.graph.nodes[p.node].instruction.name, p.gradient_sync) for p in sg.partials] == [("dw", True)]
    mem = estimate_memory(sg, 10**6)
    # at the sync: the local dw (16 KiB) and the all-reduce's output (16 KiB), next to dy (1 KiB)
    assert (mem.gradients, mem.activations, mem.outputs) == (2 * 16384, 1024, 0)
    assert mem.peak_instruction == "dw"
    assert mem.gradients <= 2 * mem.parameters  # one gradient per leaf, and its reduced copy
    assert mem.max_gradients == mem.gradients
    assert mem.max_activations == 2048  # y and dy, while dy is computed
    # replicated, the gradient is never partial: one copy, read by the update
    replicated = estimate_memory(_sharded(DP_STEP, trainable=(1,)), 10**6)
    assert (replicated.gradients, replicated.activations) == (16384, 2 * 1024)


# The loss is emitted last in post-order text, but only the outputs read it.
LOSS_LAST = """HloModule loss_last
""" + ADD + """
ENTRY e {
  p = f32[256]{0} parameter(0)
  a = f32[256]{0} exponential(p), metadata={op_name="jvp(f)/exp"}
  g = f32[256]{0} negate(a), metadata={op_name="transpose(jvp(f))/neg"}
  h = f32[256]{0} sqrt(g), metadata={op_name="transpose(jvp(f))/sqrt"}
  t = f32[256]{0} log(a), metadata={op_name="jvp(f)/log"}
  zero = f32[] constant(0)
  loss = f32[] reduce(t, zero), dimensions={0}, to_apply=add, metadata={op_name="jvp(f)/reduce_sum"}
  ROOT r = (f32[256]{0}, f32[]) tuple(h, loss)
}
"""


def test_the_loss_runs_with_the_forward_pass() -> None:
    module = parse(LOSS_LAST)
    order = [i.name for i in outputs_early(module.entry.instructions, module.entry.root.name)]
    assert order == ["p", "zero", "a", "t", "loss", "g", "h", "r"]
    # t is freed by the loss before the backward pass: a and t, then a, g (1 KiB each) at most;
    # in text order a, g and h (or a, h and t) would be live at once
    mem = estimate_memory(_sharded(LOSS_LAST), 10**6, fusion=Fusion.NONE)
    assert mem.temporaries == 2048 + 4


# A call whose two results die at different times (a forward residual kept for the backward pass).
RESIDUALS = """HloModule residuals
pair {
  x = f32[256]{0} parameter(0)
  e = f32[256]{0} exponential(x)
  n = f32[256]{0} negate(x)
  ROOT t = (f32[256]{0}, f32[256]{0}) tuple(e, n)
}

ENTRY e {
  p = f32[256]{0} parameter(0)
  c = (f32[256]{0}, f32[256]{0}) call(p), to_apply=pair
  first = f32[256]{0} get-tuple-element(c), index=0
  second = f32[256]{0} get-tuple-element(c), index=1
  a = f32[256]{0} sqrt(first)
  b = f32[256]{0} log(a)
  ROOT d = f32[256]{0} multiply(b, second)
}
"""


def test_each_element_of_a_tuple_result_is_freed_on_its_own() -> None:
    # c's first element dies at a, its second at d: at most three 1 KiB buffers are live (c{1},
    # a, b at b); one buffer for the whole tuple would hold four
    mem = estimate_memory(_sharded(RESIDUALS), 10**6, fusion=Fusion.NONE)
    assert mem.temporaries == 3072


def test_data_parallel_peak_is_xla_gradient_all_reduce(gpt_tiny) -> None:  # type: ignore[no-untyped-def]
    """XLA's peak under data parallelism is its combined gradient all-reduce: each local gradient
    and its all-reduced copy are live there and no forward value is, so its temporaries are the
    gradients we count at our peak, and the totals agree."""
    from hlomap.plan import Plan, resolve_plan
    from hlomap.verify.xla import xla_reference

    cap, graph = gpt_tiny
    array, axes, _ = resolve_plan(graph, "dp", 8)
    mem = estimate_memory(ShardedGraph.build(graph, array, axes), 2**30)
    ref = xla_reference(cap, Plan.from_groups(cap, graph, array, axes), graph).memory
    assert mem.gradients == pytest.approx(ref.temp_bytes, rel=0.01)
    assert mem.activations <= 0.01 * mem.gradients
    assert mem.temporaries == pytest.approx(ref.temp_bytes + ref.output_bytes - ref.alias_bytes, rel=0.01)
    assert mem.total == pytest.approx(ref.peak, rel=0.01)


# JAX's nested jit of `jnp.where` returns a zero broadcast as a residual that the transposed call
# takes and never reads. XLA inlines both calls: the zeros are no buffer, and nothing keeps them.
NESTED_WHERE = """HloModule nested_where
fwd {
  m = f32[256]{0} parameter(0)
  x = f32[256]{0} parameter(1)
  y = f32[256]{0} exponential(x)
  s = f32[256]{0} multiply(y, m)
  zero = f32[] constant(0)
  z = f32[256]{0} broadcast(zero), dimensions={}
  ROOT t = (f32[256]{0}, f32[256]{0}) tuple(s, z)
}

bwd {
  unused = f32[256]{0} parameter(0)
  g = f32[256]{0} parameter(1)
  ROOT h = f32[256]{0} negate(g)
}

ENTRY e {
  p = f32[256]{0} parameter(0)
  q = f32[256]{0} parameter(1)
  c = (f32[256]{0}, f32[256]{0}) call(q, p), to_apply=fwd
  s = f32[256]{0} get-tuple-element(c), index=0
  z = f32[256]{0} get-tuple-element(c), index=1
  a = f32[256]{0} sqrt(s)
  b = f32[256]{0} log(a)
  ROOT d = f32[256]{0} call(z, b), to_apply=bwd
}
"""


def test_a_called_computations_constant_residual_is_no_buffer() -> None:
    # Two 1 KiB buffers at most: c{0} and a at a, a and b at b, b and d's result at d. Were c's
    # zero element a buffer, d's read would keep it alive beside a and b (3 KiB).
    mem = estimate_memory(_sharded(NESTED_WHERE), 10**6, fusion=Fusion.NONE)
    assert mem.temporaries == 2048


TIED = """HloModule tied
ENTRY e {
  x = f32[64,128]{1,0} parameter(0)
  w = f32[512,128]{1,0} parameter(1)
  view = f32[128,512]{0,1} transpose(w), dimensions={1,0}
  copy = f32[128,512]{1,0} transpose(w), dimensions={1,0}
  a = f32[64,512]{1,0} dot(x, view), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  b = f32[64,512]{1,0} dot(x, copy), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT r = f32[64,512]{1,0} add(a, b)
}
"""


def test_a_transpose_that_keeps_the_byte_order_is_a_view() -> None:
    from hlomap.cost.memory import is_layout_bitcast

    module = parse(TIED)
    inst = {i.name: i for i in module.entry.instructions}
    assert is_layout_bitcast(inst["view"], inst["w"])
    assert not is_layout_bitcast(inst["copy"], inst["w"])
    # view is w itself: the peak is copy (256 KiB), a and b (128 KiB each) at b; a view of its
    # own would be live with copy and a at a (640 KiB)
    mem = estimate_memory(_sharded(TIED), 10**8, fusion=Fusion.NONE)
    assert mem.temporaries == 4 * 128 * 512 + 2 * 4 * 64 * 512


def test_data_parallelism_splits_the_gpt_activations_by_the_data_axis(gpt_tiny) -> None:  # type: ignore[no-untyped-def]
    """The zoo GPT's causal mask lowers to nested calls (`jnp.where`); their results are split
    like the rest of the batch, so 8-way data parallelism keeps about an eighth of one device's
    activations (parameter-shaped temporaries, such as the embedding's gradient, are whole)."""
    from hlomap.plan import resolve_plan

    cap, graph = gpt_tiny
    peaks = []
    for data in (1, 8):
        array, axes, _ = resolve_plan(graph, "dp", data)
        peaks.append(estimate_memory(ShardedGraph.build(graph, array, axes), 2**30).max_activations)
    assert peaks[1] <= 0.13 * peaks[0]
