"""Memory model: liveness in program order, fusion, sharding, donation, gradient-sync buckets.

Hand-written modules give exact expected peaks; the zoo checks tie the categories to roles.
Agreement with XLA's own memory analysis is tested in test_against_xla.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from hlomap.cost.memory import Fusion, MemoryEstimate, aliased_outputs, donated_parameters, estimate_memory
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


def test_memory_grows_with_batch_activations() -> None:
    # the same chain on twice the elements doubles the temporaries
    small = estimate_memory(_sharded(CHAIN), 10**6, fusion=Fusion.NONE)
    big = estimate_memory(_sharded(CHAIN.replace("256", "512")), 10**6, fusion=Fusion.NONE)
    assert big.activations == 2 * small.activations
    assert np.isclose(big.inputs, 2 * small.inputs)
