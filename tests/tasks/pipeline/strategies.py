"""Hypothesis strategies and seeded random tasks for small pipelines, shared by the pipeline tests."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
from hypothesis import strategies as st

from hlomap.cost.cluster import Cluster, hierarchical
from hlomap.cost.devices import device_preset
from hlomap.cost.pipeline.costs import CommModel, CostOptions
from hlomap.cost.pipeline.links import with_device_memory
from hlomap.cost.pipeline.profile import PipelineProfile
from hlomap.cost.pipeline.stages import Schedule
from hlomap.tasks.pipeline.downsets import LayerDag
from hlomap.tasks.pipeline.space import PipelineObjective, PipelineSpace

if TYPE_CHECKING:
    from hlomap.tasks.pipeline.cutenv import CutTask


@st.composite
def profiles(draw: st.DrawFn, *, min_layers: int = 1, max_layers: int = 6) -> PipelineProfile:
    """Random small profiles; times on a coarse grid sometimes, so that exact ties occur."""
    n = draw(st.integers(min_layers, max_layers))
    coarse = draw(st.booleans())
    time = st.integers(0, 3).map(float) if coarse else st.floats(0.0, 2.0)
    nbytes = st.floats(0.0, 2e9)
    params = st.one_of(st.just(0.0), st.floats(1e6, 1e9))
    forward = np.array(draw(st.lists(time, min_size=n, max_size=n)))
    backward = np.array(draw(st.lists(time, min_size=n, max_size=n)))
    forward_fixed, backward_fixed = draw(fixed_parts(forward, backward))
    return PipelineProfile(
        names=tuple(f"l{i}" for i in range(n)),
        forward_time=forward,
        backward_time=backward,
        activation_bytes=np.array(draw(st.lists(nbytes, min_size=n - 1, max_size=n - 1))),
        parameter_bytes=np.array(draw(st.lists(params, min_size=n, max_size=n))),
        stash_bytes=np.array(draw(st.lists(st.floats(0.0, 1e9), min_size=n, max_size=n))),
        source="hypothesis",
        forward_fixed=forward_fixed,
        backward_fixed=backward_fixed,
        **draw(sync_parts(n)),
    )


@st.composite
def fixed_parts(draw: st.DrawFn, forward: np.ndarray,
                backward: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
    """None (every second shrinks with a split batch), or a random share of each layer's time
    that does not (`PipelineProfile.forward_fixed`), sometimes all of it."""
    if not draw(st.booleans()):
        return None, None
    share = st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(0.0, 1.0))
    n = len(forward)
    return (forward * np.array(draw(st.lists(share, min_size=n, max_size=n))),
            backward * np.array(draw(st.lists(share, min_size=n, max_size=n))))


@st.composite
def sync_parts(draw: st.DrawFn, n: int) -> dict[str, np.ndarray]:
    """Nothing (no all-reduces inside the passes, no gradient arrays or transposes counted), or
    random counts of them per layer and direction with their bytes (`PipelineProfile.forward_syncs`):
    at least a byte per layer that has some (an all-reduce of nothing is free, `links.allreduce_cost`;
    a statistic has bytes), random counts of each layer's gradient arrays and random seconds of
    the transposes after its all-reduce."""
    if not draw(st.booleans()):
        return {}
    counts = st.lists(st.integers(0, 3).map(float), min_size=n, max_size=n)
    nbytes = st.lists(st.one_of(st.just(1.0), st.floats(1.0, 1e7)), min_size=n, max_size=n)
    forward, backward = np.array(draw(counts)), np.array(draw(counts))
    return {"forward_syncs": forward, "backward_syncs": backward,
            "forward_sync_bytes": np.where(forward > 0, draw(nbytes), 0.0),
            "backward_sync_bytes": np.where(backward > 0, draw(nbytes), 0.0),
            # the arrays of each layer's gradient (`PipelineProfile.gradient_buffers`)
            "gradient_buffers": np.array(draw(st.lists(st.integers(0, 4).map(float), min_size=n, max_size=n))),
            # the transposes after its all-reduce (`PipelineProfile.replica_transposes`)
            "replica_transposes": np.array(draw(st.lists(st.floats(0.0, 0.5), min_size=n, max_size=n)))}


@st.composite
def layer_dags(
    draw: st.DrawFn, *, min_layers: int = 1, max_layers: int = 5, chain: bool = False
) -> LayerDag:
    """Random small layer DAGs numbered in a topological order; each later pair is an edge with
    random odds, so both wide graphs (many downsets) and near-chains occur. `chain`: every layer
    also feeds the next one (the straight order is the only order; skip edges stay random)."""
    n = draw(st.integers(min_layers, max_layers))
    coarse = draw(st.booleans())
    time = st.integers(0, 3).map(float) if coarse else st.floats(0.0, 2.0)
    density = draw(st.sampled_from([0.0, 0.3, 0.6]))
    consumers = []
    for i in range(n):
        later = [j for j in range(i + 1, n)
                 if (chain and j == i + 1) or draw(st.floats(0.0, 1.0)) < density]
        consumers.append(tuple(later))

    def vector(values: st.SearchStrategy[float]) -> np.ndarray:
        return np.array(draw(st.lists(values, min_size=n, max_size=n)))

    forward, backward = vector(time), vector(time)
    forward_fixed, backward_fixed = draw(fixed_parts(forward, backward))
    return LayerDag(
        names=tuple(f"v{i}" for i in range(n)),
        forward_time=forward,
        backward_time=backward,
        parameter_bytes=vector(st.one_of(st.just(0.0), st.floats(1e6, 1e9))),
        stash_bytes=vector(st.floats(0.0, 1e9)),
        output_bytes=vector(st.floats(0.0, 2e9)),
        consumers=tuple(consumers),
        source="hypothesis-dag",
        forward_fixed=forward_fixed,
        backward_fixed=backward_fixed,
        **draw(sync_parts(n)),
    )


@st.composite
def clusters(draw: st.DrawFn, *, max_devices: int = 4) -> Cluster:
    """Random asymmetric alpha-beta tables on 1..max_devices devices grouped into nodes with one
    or two NICs each, and devices of random memory."""
    d = draw(st.integers(1, max_devices))
    bandwidth = draw(st.lists(st.floats(1e8, 1e10), min_size=d * d, max_size=d * d))
    latency = draw(st.lists(st.floats(0.0, 1e-3), min_size=d * d, max_size=d * d))
    nodes = sorted(draw(st.lists(st.integers(0, 2), min_size=d, max_size=d)))
    memory = draw(st.lists(st.floats(4e9, 4e10), min_size=d, max_size=d))
    v100 = device_preset("V100-16GB")
    return Cluster(
        "hypothesis",
        tuple(replace(v100, memory_bytes=m) for m in memory),
        tuple(nodes),
        np.reshape(bandwidth, (d, d)),
        np.reshape(latency, (d, d)),
        nics_per_node=draw(st.integers(1, 2)),
    )


def uniform_cluster(
    n_devices: int,
    *,
    bandwidth: float,
    latency: float = 0.0,
    memory_bytes: float = math.inf,
    devices_per_node: int | None = None,
) -> Cluster:
    """Every pair of devices joined by the same link; consecutive `devices_per_node` devices
    share a server with one NIC (default: all on one server)."""
    per_node = devices_per_node or n_devices
    cluster = hierarchical(n_devices // per_node, per_node, "V100-16GB", bandwidth, bandwidth,
                           latency, latency)
    return with_device_memory(cluster, memory_bytes)


@st.composite
def spaces(draw: st.DrawFn) -> PipelineSpace:
    """Random search spaces exercising every option."""
    return PipelineSpace(
        microbatches=draw(st.integers(1, 6)),
        schedule=draw(st.sampled_from([Schedule.GPIPE, Schedule.ONE_F_ONE_B])),  # what the explorers offer
        objective=draw(st.sampled_from(PipelineObjective)),
        replication=tuple(draw(st.sets(st.integers(1, 4), min_size=1, max_size=3))),
        use_all_devices=draw(st.booleans()),
        max_stages=draw(st.one_of(st.none(), st.integers(1, 4))),
        cut_on_node_boundary=draw(st.booleans()),
        require_trainable=draw(st.booleans()),
        check_memory=draw(st.booleans()),
        cost=CostOptions(comm=draw(st.sampled_from(CommModel))),
    )


def random_cut_task(stages: int = 3, seed: int = 0, memory: float = float("inf")) -> CutTask:
    """A seeded 14-layer cut problem on `2 * stages` devices (2 per server, cuts on servers)."""
    from hlomap.tasks.pipeline.cutenv import CutTask

    rng = np.random.default_rng(seed)
    n = 14
    profile = PipelineProfile(
        names=tuple(f"l{i}" for i in range(n)),
        forward_time=rng.uniform(0.5, 2.0, n),
        backward_time=rng.uniform(1.0, 4.0, n),
        activation_bytes=rng.uniform(1e7, 3e8, n - 1),
        parameter_bytes=rng.uniform(1e6, 5e7, n),
        stash_bytes=rng.uniform(1e6, 1e7, n),
        source=f"random{seed}",
    )
    cluster = uniform_cluster(2 * stages, bandwidth=1e9, latency=1e-5, devices_per_node=2,
                              memory_bytes=memory)
    space = PipelineSpace(microbatches=4, replication=(2,), cut_on_node_boundary=True)
    return CutTask(profile, cluster, space, stages)
