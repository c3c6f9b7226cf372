"""Pipeline communication prices: hand-worked values, and the vectorized terms against the
scalar `hlomap.cost.collectives` functions they are derived from."""

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hlomap.cost.cluster import Cluster, cluster_preset, hierarchical, random_block
from hlomap.cost.collectives import all_reduce_time, collective_permute_time
from hlomap.cost.devices import device_preset
from hlomap.cost.pipeline.costs import evaluate_plan
from hlomap.cost.pipeline.links import (
    GroupPrices,
    allreduce_cost,
    allreduce_time,
    group_memory,
    is_node_boundary,
    transfer_cost,
    transfer_pairs,
    transfer_time,
    with_device_memory,
)
from hlomap.cost.pipeline.profile import uniform_profile
from hlomap.cost.pipeline.stages import PipelinePlan
from tests.tasks.pipeline.strategies import clusters, uniform_cluster

# Preset A: 2 servers x 8 V100; NVLink 130 GB/s, 5 us; 25 Gbps (3.125 GB/s), 15 us; one NIC.
B_IN, A_IN = 130e9, 5e-6
B_X, A_X = 25e9 / 8, 15e-6


def _one_server(bandwidth: np.ndarray) -> Cluster:
    n = len(bandwidth)
    return Cluster("one-server", (device_preset("V100-16GB"),) * n, (0,) * n, bandwidth,
                   np.zeros((n, n)))


def test_p2p_is_alpha_plus_bytes_over_beta():
    cluster = uniform_cluster(3, bandwidth=2e9, latency=1e-3)
    assert transfer_time(cluster, (0,), (2,), 4e9) == pytest.approx(1e-3 + 2.0)
    assert transfer_time(cluster, (1,), (1,), 4e9) == 0.0
    assert transfer_time(cluster, (0,), (1,), 0.0) == 0.0


def test_transfer_between_replicated_stages_splits_into_parallel_chunks():
    bandwidth = np.full((4, 4), 1e9)
    bandwidth[1, 2] = 0.5e9  # the second chunk's link is slower
    cluster = _one_server(bandwidth)
    assert transfer_pairs((0, 1), (2,)) == ((0, 2), (1, 2))
    # stage on (0, 1) -> stage on (2,): two chunks of 1 GB: 0 -> 2 (1 s) and 1 -> 2 (2 s)
    assert transfer_time(cluster, (0, 1), (2,), 2e9) == pytest.approx(2.0)
    # stage on (0,) -> stage on (1, 2, 3): three chunks of 1 GB from device 0
    assert transfer_time(cluster, (0,), (1, 2, 3), 3e9) == pytest.approx(1.0)


def test_chunks_leaving_a_server_share_its_nic():
    """Two 8-GPU servers, one NIC each: the 8 chunks of a stage-to-stage transfer take as long as
    the whole tensor over one link, 8 times one chunk alone; with a NIC per GPU they do not
    wait for each other."""
    n = 1e8
    alone = A_X + n / 8 / B_X
    shared = A_X + n / B_X
    assert transfer_time(cluster_preset("A"), range(8), range(8, 16), n) == pytest.approx(shared)
    assert transfer_time(hierarchical(2, 8, nics_per_node=8), range(8), range(8, 16), n) == (
        pytest.approx(alone))
    # Inside a server (NVLink) nothing is shared.
    assert transfer_time(cluster_preset("A"), range(4), range(4, 8), n) == pytest.approx(
        A_IN + n / 4 / B_IN)


@pytest.mark.parametrize("k", [2, 3, 5])
def test_ring_allreduce_matches_the_textbook_formula(k):
    """Uniform ring: 2 (k - 1) steps of N / k bytes: 2 (k - 1) / k * N / B + 2 (k - 1) alpha."""
    cluster = uniform_cluster(k, bandwidth=1e9, latency=1e-5)
    nbytes = 6e8
    expected = 2 * (k - 1) / k * nbytes / 1e9 + 2 * (k - 1) * 1e-5
    assert allreduce_time(cluster, range(k), nbytes) == pytest.approx(expected)
    assert allreduce_time(cluster, (0,), nbytes) == 0.0
    assert allreduce_time(cluster, range(k), 0.0) == 0.0  # nothing to reduce: no collective


def test_allreduce_is_as_slow_as_the_slowest_link_of_the_group():
    bandwidth = np.full((3, 3), 1e9)
    bandwidth[2, 0] = 1e8
    assert allreduce_time(_one_server(bandwidth), (0, 1, 2), 3e8) == pytest.approx(4 * (1e8 / 1e8))


def test_stage_allreduce_across_servers_is_hierarchical():
    """A stage on both servers of preset A all-reduces like `hlomap.cost.collectives`: inside
    each server, then 8 rings across the two sharing the one NIC."""
    n = 1e8
    intra = 7 / 8 * n / B_IN + 7 * A_IN
    inter = 2 * 1 / 2 * (n / 8) / (B_X / 8) + 2 * A_X
    assert allreduce_time(cluster_preset("A"), range(16), n) == pytest.approx(2 * intra + inter)


def test_node_boundaries_and_group_memory():
    v100 = device_preset("V100-16GB")
    devices = tuple(replace(v100, memory_bytes=m) for m in (8.0, 4.0, 16.0, 16.0))
    cluster = Cluster("two", devices, (0, 0, 1, 1), np.full((4, 4), 1e9), np.zeros((4, 4)))
    assert [is_node_boundary(cluster, d) for d in range(5)] == [True, False, True, False, True]
    assert group_memory(cluster, (0, 1)) == 4.0


def test_unlimited_memory_survives_the_cluster_json():
    cluster = with_device_memory(cluster_preset("A"), math.inf)
    assert group_memory(cluster, range(16)) == math.inf
    assert Cluster.from_json(cluster.to_json()) == cluster


@st.composite
def _spanning_clusters(draw):
    """Servers of equal or random sizes with 1..4 NICs each: groups can span servers."""
    seed = draw(st.integers(0, 2**16))
    nics = draw(st.integers(1, 4))
    if draw(st.booleans()):
        return hierarchical(draw(st.integers(1, 4)), draw(st.integers(1, 4)), nics_per_node=nics)
    n = draw(st.integers(2, 12))
    return random_block(n, draw(st.integers(1, n)), "A100-40GB", 1e11, (1e9, 1e10), 1e-6,
                        (1e-6, 1e-4), seed=seed, nics_per_node=nics)


def _group(data, n, name):
    return tuple(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True),
                           label=name))


@settings(max_examples=120, deadline=None)
@given(cluster=_spanning_clusters(), data=st.data(),
       nbytes=st.lists(st.floats(0.0, 1e10), min_size=1, max_size=6))
def test_vectorized_terms_equal_the_scalar_collectives(cluster, data, nbytes):
    n = cluster.n_devices
    group = _group(data, n, "group")
    src = _group(data, n, "src")
    dst = _group(data, n, "dst")
    x = np.array(nbytes)
    reduce = allreduce_cost(cluster, group)(x)
    move = transfer_cost(cluster, src, dst)(x)
    pairs = transfer_pairs(src, dst)
    for i, value in enumerate(nbytes):
        expected = all_reduce_time(cluster, group, value) if value > 0 and len(group) > 1 else 0.0
        assert allreduce_time(cluster, group, value) == pytest.approx(expected, rel=1e-12, abs=1e-18)
        assert reduce[i] == pytest.approx(expected, rel=1e-12, abs=1e-18)
        expected = collective_permute_time(cluster, pairs, value / len(pairs)) if value > 0 else 0.0
        assert transfer_time(cluster, src, dst, value) == pytest.approx(expected, rel=1e-12, abs=1e-18)
        assert move[i] == pytest.approx(expected, rel=1e-12, abs=1e-18)


@settings(max_examples=80, deadline=None)
@given(cluster=clusters(max_devices=6), data=st.data(), nbytes=st.floats(0.0, 1e10))
def test_affine_link_costs_match_links(cluster, data, nbytes):
    d = cluster.n_devices
    a = data.draw(st.integers(0, d - 1))
    b = data.draw(st.integers(a + 1, d))
    c = data.draw(st.integers(0, d - 1))
    e = data.draw(st.integers(c + 1, d))
    src, dst = tuple(range(a, b)), tuple(range(c, e))
    assert float(transfer_cost(cluster, src, dst)(nbytes)) == pytest.approx(
        transfer_time(cluster, src, dst, nbytes), rel=1e-12, abs=1e-18)
    assert float(allreduce_cost(cluster, src)(nbytes)) == pytest.approx(
        allreduce_time(cluster, src, nbytes), rel=1e-12, abs=1e-18)


def test_a_group_prices_memo_changes_no_cost_and_belongs_to_one_cluster():
    profile = uniform_profile(4, forward_time=1e-3, backward_time=2e-3, activation_bytes=1e7,
                              parameter_bytes=1e8)
    plan = PipelinePlan.linear([0, 2, 4], [8, 8], microbatches=4)
    cluster = cluster_preset("A")
    prices = GroupPrices(cluster)
    fresh = evaluate_plan(profile, cluster, plan)
    assert evaluate_plan(profile, cluster, plan, prices=prices) == fresh
    assert evaluate_plan(profile, cluster, plan, prices=prices) == fresh  # from the memo
    assert fresh.cut_transfer == (transfer_time(cluster, range(8), range(8, 16), 1e7),)
    with pytest.raises(ValueError, match="prices of cluster 'B' cannot price a plan on cluster 'A'"):
        evaluate_plan(profile, cluster, plan, prices=GroupPrices(cluster_preset("B")))
