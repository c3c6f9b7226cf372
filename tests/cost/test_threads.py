"""Kernels XLA:CPU splits over the host's threads (`hlomap.cost.threads`) and what the estimate
makes of them: the split decisions against XLA's own compiled modules, the speedup only where a
device has cores to itself, and the host's cores through cluster files and calibrations."""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hlomap.cost.devices import DeviceSpec
from hlomap.cost.estimate import instruction_arrays
from hlomap.cost.measured import MeasuredCosts, MeasuredCostsError
from hlomap.cost.memory import Fusion, fused_nodes
from hlomap.cost.sharding import ShardedGraph
from hlomap.cost.threads import MEMORY_BOUND_BYTES_PER_TASK, parallel_tasks, spare_threads, split_speedup
from hlomap.hlo.capture import capture
from hlomap.propagation.conflicts import REPLICATED, MeshAxes
from hlomap.propagation.graph import FactorGraph

HOST_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
DEVICE = DeviceSpec("cpu", {"f32": 1e10}, 1e9, 2**34)


def _chain(x):  # type: ignore[no-untyped-def]
    for _ in range(20):
        x = x * 1.1 + 0.2
    return x


#: (name, function, argument shape): one kernel each, on both sides of XLA:CPU's thresholds.
KERNELS = [
    ("scale 128 KiB", lambda x: x * 2.0 + 1.0, (2**15,)),  # moves 256 KiB: one task
    ("scale 256 KiB", lambda x: x * 2.0 + 1.0, (2**16,)),  # moves 512 KiB: two
    ("scale 4 MiB", lambda x: x * 2.0 + 1.0, (2**20,)),
    ("exp 256 KiB", jnp.exp, (2**16,)),
    ("tanh 16 KiB", jnp.tanh, (2**12,)),
    ("40 flops per element, 4 KiB", _chain, (2**10,)),  # compute-bound, under 100 000 per task
    ("40 flops per element, 16 KiB", _chain, (2**12,)),  # compute-bound, over
    ("transpose 128 KiB", lambda x: x.T, (128, 256)),
    ("transpose 1 MiB", lambda x: x.T + 1.0, (512, 512)),
    ("broadcast into 2 MiB", lambda x: jnp.broadcast_to(x, (512, 1024)) * 2.0, (1024,)),
    ("column sums of 1 MiB", lambda x: jnp.sum(x, axis=0), (1024, 256)),  # a reduction: never split
]


def _xla_splits(fn, x) -> bool:  # type: ignore[no-untyped-def]
    """Whether XLA:CPU's compiled module splits a kernel into more than one task."""
    text = jax.jit(fn).lower(x).compile().as_text()
    partitions = re.findall(r'outer_dimension_partitions":\[([^\]]*)\]', text)
    return any(int(np.prod([int(v.strip('"')) for v in p.split(",")])) > 1 for p in partitions if p)


def _one_device_speedups(fn, x, cores: int, spare: float) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Per executed instruction of `fn` run whole on one device: how much faster it is priced
    with `spare` cores to itself on a host of `cores` than without."""
    graph = FactorGraph.from_capture(capture(fn, x))
    sg = ShardedGraph.build(graph, np.full(graph.num_groups, REPLICATED, dtype=np.intp), MeshAxes.from_mesh({"data": 1}))
    fused = fused_nodes(sg, Fusion.ELEMENTWISE)
    alone = instruction_arrays(sg, DEVICE, {}, fused, {})
    split = instruction_arrays(sg, DEVICE, {}, fused, {}, cores=cores, spare_threads=spare)
    return alone.seconds / split.seconds


@pytest.mark.skipif(HOST_CORES < 2, reason="XLA:CPU splits nothing on a host of one core")
@pytest.mark.parametrize("name,fn,shape", KERNELS, ids=[k[0] for k in KERNELS])
def test_split_kernels_are_the_ones_xla_cpu_splits(name: str, fn, shape: tuple[int, ...]) -> None:  # type: ignore[no-untyped-def]
    """Oracle: the kernels the estimate runs faster with spare cores are those XLA:CPU's
    compiled module marks with more than one `outer_dimension_partitions` task on this host."""
    x = jnp.ones(shape, jnp.float32)
    speedups = _one_device_speedups(fn, x, HOST_CORES, float(HOST_CORES))
    assert bool((speedups > 1.0).any()) == _xla_splits(fn, x), (name, speedups.tolist())


def test_a_split_kernel_runs_on_the_cores_its_device_has_to_itself() -> None:
    """On a host of 2 cores a device alone runs a 4 MiB elementwise kernel on both (2x), with
    4 cores to itself still on 2 (XLA splits memory-bound kernels in at most ceil(sqrt(cores))
    tasks), and with no core to spare at the speed it had."""
    x = jnp.ones((2**20,), jnp.float32)
    for cores, spare, expected in ((2, 2.0, 2.0), (4, 4.0, 2.0), (2, 1.0, 1.0), (0, 1.0, 1.0)):
        speedups = _one_device_speedups(lambda v: v * 2.0 + 1.0, x, cores, spare)
        np.testing.assert_allclose(speedups.max(), expected, rtol=1e-12)


def test_parallel_tasks_follow_the_memory_and_compute_rules() -> None:
    nbytes = np.array([MEMORY_BOUND_BYTES_PER_TASK * 2 - 1, MEMORY_BOUND_BYTES_PER_TASK * 2, 64e6, 4096.0, 4096.0])
    flops = np.array([0.0, 0.0, 1e6, 1e5, 5e4])
    transcendentals = np.array([0.0, 0.0, 0.0, 0.0, 0.0])
    # memory-bound: one task per 256 KiB moved, at most ceil(sqrt(cores)); compute-bound: one per
    # 100 000 of flops + 2 transcendentals + 10 bytes, at most the cores
    assert parallel_tasks(nbytes, flops, transcendentals, 16).tolist() == [1, 2, 4, 1, 1]
    assert parallel_tasks(nbytes, np.array([0, 0, 0, 2e6, 2e6]), transcendentals, 16).tolist() == [1, 2, 4, 16, 16]
    assert parallel_tasks(nbytes, flops, transcendentals, 1).tolist() == [1] * 5
    assert parallel_tasks(np.array([4096.0]), np.array([1e5]), np.array([5e4]), 4).tolist() == [2]


def test_spare_threads_and_split_speedup() -> None:
    assert spare_threads(2, 1) == 2.0
    assert spare_threads(2, 2) == 1.0
    assert spare_threads(2, 8) == 1.0
    assert spare_threads(0, 1) == 1.0  # cores unknown: nothing to spare
    assert split_speedup(np.array([1, 2, 8]), 2.0).tolist() == [1.0, 2.0, 2.0]
    assert split_speedup(np.array([4]), 1.0).tolist() == [1.0]


def test_measured_costs_carry_the_hosts_cores() -> None:
    costs = MeasuredCosts(solo_speedup=4.0, n_devices=8, cores=2)
    assert MeasuredCosts.from_json(json.loads(json.dumps(costs.to_json()))) == costs
    assert costs.spare_threads(1) == 2.0 and costs.spare_threads(8) == 1.0
    assert MeasuredCosts.from_json({}).cores == 0  # files from before: no cores to spare
    with pytest.raises(MeasuredCostsError, match="cores"):
        MeasuredCosts(cores=-1)
    with pytest.raises(MeasuredCostsError, match="cores"):
        MeasuredCosts.from_json({"cores": 2.5})


# ---------------------------------------------------------------------------------------------
# One device alone: each kernel at its own measured speedup (`MeasuredCosts.alone_dot`)
# ---------------------------------------------------------------------------------------------


def _mlp_layer(x, w):  # type: ignore[no-untyped-def]
    return jnp.tanh(x @ w) * 2.0 + 1.0


def _one_device(fn, *args):  # type: ignore[no-untyped-def]
    graph = FactorGraph.from_capture(capture(fn, *args))
    sg = ShardedGraph.build(graph, np.full(graph.num_groups, REPLICATED, dtype=np.intp), MeshAxes.from_mesh({"data": 1}))
    return sg, fused_nodes(sg, Fusion.ELEMENTWISE)


def test_a_device_alone_runs_each_kernel_at_its_own_measured_speedup() -> None:
    """A dot at the matmul curve's speedup for its flops, every other kernel at the memory curve's
    for the bytes its whole kernel moves, interpolated in log size; the thread split is not
    applied on top (the curves were timed with XLA's threads)."""
    sg, fused = _one_device(_mlp_layer, jnp.ones((64, 256)), jnp.ones((256, 256)))
    flat = MeasuredCosts(cores=2, alone_dot=((1e3, 3.0), (1e12, 3.0)), alone_memory=((1e3, 5.0), (1e12, 5.0)))
    busy = instruction_arrays(sg, DEVICE, {}, fused, {})
    alone = instruction_arrays(sg, DEVICE, {}, fused, {}, cores=2, spare_threads=2.0, alone=flat)
    opcodes = np.array([sg.graph.nodes[int(n)].instruction.opcode for n in busy.node])
    ran = busy.seconds > 0
    assert (opcodes == "dot").sum() == 1 and ran.sum() > 2
    np.testing.assert_allclose(busy.seconds[opcodes == "dot"] / alone.seconds[opcodes == "dot"], 3.0)
    np.testing.assert_allclose(busy.seconds[ran & (opcodes != "dot")] / alone.seconds[ran & (opcodes != "dot")], 5.0)

    # between two points: linear in log size, at the bytes the whole fused kernel moves (the
    # tanh, multiply and add read the dot's 64 KiB result once and write 64 KiB, and read two
    # scalar constants)
    kernel_bytes = 2 * 64 * 256 * 4
    rising = MeasuredCosts(cores=2, alone_dot=((1e3, 3.0),), alone_memory=((kernel_bytes / 4, 2.0), (kernel_bytes * 4, 6.0)))
    ratio = busy.seconds / instruction_arrays(sg, DEVICE, {}, fused, {}, alone=rising).seconds
    np.testing.assert_allclose(ratio[ran & (opcodes != "dot")], 4.0, rtol=1e-3)
    assert rising.alone_speedups(False, np.array([1.0, 1e15])).tolist() == [2.0, 6.0]  # the end points beyond


def test_one_device_of_a_measured_cluster_is_priced_alone_and_two_are_not(cap_of) -> None:  # type: ignore[no-untyped-def]
    """The estimate prices a one-device mesh on the alone curves of host devices, and keeps the
    busy-devices rule (`busy_speedup`) for two devices, for accelerators (no cores shared) and for
    cluster files without the curves."""
    import dataclasses

    import hlomap
    from tests.cost.test_measured import _cluster

    cap = cap_of("haiku-mlp")
    curves = MeasuredCosts(solo_speedup=4.0, n_devices=8, cores=2, alone_dot=((1e3, 8.0),), alone_memory=((1e3, 8.0),))
    one = {name: hlomap.estimate(cap, "dp", mesh={"data": 1}, cluster=_cluster(costs)).compute_seconds
           for name, costs in (("curves", curves), ("none", dataclasses.replace(curves, alone_dot=(), alone_memory=())),
                               ("accelerator", dataclasses.replace(curves, cores=0)))}
    assert curves.prices_alone and not dataclasses.replace(curves, cores=0).prices_alone
    # 8x faster per kernel against 4x (with the spare core's split on some kernels): faster
    assert one["curves"] < 0.75 * one["none"]
    assert one["accelerator"] >= one["none"]  # no core to spare, no split
    two = [hlomap.estimate(cap, "dp", mesh={"data": 2}, cluster=_cluster(costs)).compute_seconds
           for costs in (curves, dataclasses.replace(curves, alone_dot=(), alone_memory=()))]
    assert two[0] == two[1]


def test_alone_curves_round_trip_and_are_checked() -> None:
    costs = MeasuredCosts(cores=2, alone_dot=((4e6, 4.0), (5e5, 3.3)), alone_memory=((1.3e5, 4.6),))
    assert costs.alone_dot == ((5e5, 3.3), (4e6, 4.0))  # sorted by size
    assert MeasuredCosts.from_json(json.loads(json.dumps(costs.to_json()))) == costs
    assert not MeasuredCosts.from_json({"cores": 2}).prices_alone  # a file from before the curves
    for bad, match in (({"alone_dot": [[1e6, 0.5]]}, "speedup >= 1"), ({"alone_dot": [[0.0, 2.0]]}, "size > 0"),
                       ({"alone_memory": [[1e6, 2.0], [1e6, 3.0]]}, "two points of one size"),
                       ({"alone_dot": [1e6, 2.0]}, r"alone_dot\[0\]: expected \[size, speedup\]"),
                       ({"alone_memory": "fast"}, "expected a list")):
        with pytest.raises(MeasuredCostsError, match=match) as caught:
            MeasuredCosts.from_json(bad)
        assert str(caught.value).startswith("measured") and "measured: measured" not in str(caught.value)
