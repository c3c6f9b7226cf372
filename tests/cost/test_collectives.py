"""Collective times against closed forms worked out by hand from the alpha-beta model."""

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hlomap.cost.cluster import cluster_preset, hierarchical, mesh_topology, uniform
from hlomap.cost.collectives import (
    Collective, all_gather_time, all_reduce_time, all_to_all_time, collective_permute_time,
    collective_time, group_streams, group_time, reduce_scatter_time,
)
from hlomap.cost.mapping import axis_devices

# Preset A: 2 servers x 8 V100; NVLink 130 GB/s, 5 us; 25 Gbps (3.125 GB/s), 15 us; one NIC.
B_IN, A_IN = 130e9, 5e-6
B_X, A_X = 25e9 / 8, 15e-6
N = 1e8  # bytes


@pytest.fixture(scope="module")
def cluster_a():
    return cluster_preset("A")


def test_all_reduce_inside_one_server_is_a_ring(cluster_a):
    expected = 2 * 7 / 8 * N / B_IN + 2 * 7 * A_IN
    assert all_reduce_time(cluster_a, range(8), N) == pytest.approx(expected, rel=1e-12)


def test_all_reduce_across_servers_is_hierarchical(cluster_a):
    # reduce-scatter in each server, 8 rings across the 2 servers on N/8 each sharing the one
    # NIC (so each gets B_X/8), all-gather in each server.
    intra = 7 / 8 * N / B_IN + 7 * A_IN
    inter = 2 * 1 / 2 * (N / 8) / (B_X / 8) + 2 * 1 * A_X
    assert all_reduce_time(cluster_a, range(16), N) == pytest.approx(2 * intra + inter, rel=1e-12)


def test_hierarchical_all_reduce_with_one_nic_per_gpu():
    cluster = hierarchical(2, 8, nics_per_node=8)
    intra = 7 / 8 * N / B_IN + 7 * A_IN
    inter = 2 * 1 / 2 * (N / 8) / B_X + 2 * A_X  # each of the 8 rings has a NIC of its own
    assert all_reduce_time(cluster, range(16), N) == pytest.approx(2 * intra + inter, rel=1e-12)


def test_hierarchical_beats_a_flat_ring_across_servers(cluster_a):
    flat = 2 * 15 / 16 * N / B_X + 2 * 15 * A_X
    assert all_reduce_time(cluster_a, range(16), N) < flat


def test_concurrent_data_parallel_groups_share_the_nic(cluster_a):
    mapping = axis_devices(cluster_a, {"data": 2, "model": 8}, order=("data", "model"))
    groups = mapping.groups("data")
    assert groups == tuple((i, i + 8) for i in range(8))
    alone = 2 * 1 / 2 * N / B_X + 2 * A_X
    assert all_reduce_time(cluster_a, groups[0], N) == pytest.approx(alone, rel=1e-12)
    together = 2 * 1 / 2 * N / (B_X / 8) + 2 * A_X
    assert collective_time(Collective.ALL_REDUCE, cluster_a, groups, N) == pytest.approx(together, rel=1e-12)


def test_model_groups_inside_servers_do_not_slow_each_other(cluster_a):
    mapping = axis_devices(cluster_a, {"data": 2, "model": 8}, order=("data", "model"))
    one = all_reduce_time(cluster_a, mapping.groups("model")[0], N)
    assert collective_time(Collective.ALL_REDUCE, cluster_a, mapping.groups("model"), N) == one


@pytest.mark.parametrize("fn", [all_gather_time, reduce_scatter_time])
def test_all_gather_and_reduce_scatter_rings(cluster_a, fn):
    assert fn(cluster_a, (0, 1, 2, 3), N) == pytest.approx(3 / 4 * N / B_IN + 3 * A_IN, rel=1e-12)
    # Across servers one flat ring: the network link is its slowest; ring neighbours 7->8 and
    # 15->0 cross the network, so the per-step latency is A_X.
    assert fn(cluster_a, range(16), N) == pytest.approx(15 / 16 * N / B_X + 15 * A_X, rel=1e-12)


def test_all_to_all(cluster_a):
    inside = 7 * (A_IN + N / 8 / B_IN)
    assert all_to_all_time(cluster_a, range(8), N) == pytest.approx(inside, rel=1e-12)
    # 7 same-server steps, then 8 cross-server steps in which all 8 GPUs of a server share its NIC.
    across = 7 * (A_IN + N / 16 / B_IN) + 8 * (A_X + N / 16 * 8 / B_X)
    assert all_to_all_time(cluster_a, range(16), N) == pytest.approx(across, rel=1e-12)


def test_uneven_group_falls_back_to_a_flat_ring(cluster_a):
    # 3 members on server 0, 1 on server 1: ring 0-1-2-8-0, slowest link the network.
    expected = 2 * 3 / 4 * N / B_X + 2 * 3 * A_X
    assert all_reduce_time(cluster_a, (0, 1, 2, 8), N) == pytest.approx(expected, rel=1e-12)


def test_collective_permute(cluster_a):
    assert collective_permute_time(cluster_a, [(0, 8)], N) == pytest.approx(A_X + N / B_X, rel=1e-12)
    assert collective_permute_time(cluster_a, [(0, 1)], N) == pytest.approx(A_IN + N / B_IN, rel=1e-12)
    # Four pairs leave server 0 through its one NIC at once.
    four = [(i, i + 8) for i in range(4)]
    assert collective_permute_time(cluster_a, four, N) == pytest.approx(A_X + 4 * N / B_X, rel=1e-12)
    # A swap: one stream each way, send and receive sides each carry one.
    swap = [(0, 8), (8, 0)]
    assert collective_permute_time(cluster_a, swap, N) == pytest.approx(A_X + N / B_X, rel=1e-12)
    assert collective_permute_time(cluster_a, [(3, 3)], N) == 0.0
    assert collective_permute_time(cluster_a, [], N) == 0.0


def test_torus_ring_is_one_hop_per_step_but_a_line_is_not():
    lat, bw = 1e-6, 1e9
    torus = mesh_topology((4,), "A100-80GB", bw, lat, torus=True)
    line = mesh_topology((4,), "A100-80GB", bw, lat, torus=False)
    ring = 2 * 3 / 4 * N / bw
    assert all_reduce_time(torus, range(4), N) == pytest.approx(ring + 6 * lat, rel=1e-12)
    # On a line the ring closes 3 -> 0 over 3 hops.
    assert all_reduce_time(line, range(4), N) == pytest.approx(ring + 6 * 3 * lat, rel=1e-12)


def test_slowest_link_sets_the_speed_on_a_2d_mesh():
    # Faster links along axis 1 (rows) than axis 0: a row ring uses only fast links; a group
    # spanning rows is limited by the slow ones.
    mesh = mesh_topology((2, 4), "H100-80GB", (1e9, 4e9), 1e-6, torus=True)
    assert all_gather_time(mesh, (0, 1, 2, 3), N) == pytest.approx(3 / 4 * N / 4e9 + 3e-6, rel=1e-12)
    # Ring 0 -> 4 -> 5 -> 1 -> 0: neighbours one hop apart; slowest link 1 GB/s.
    assert all_gather_time(mesh, (0, 4, 5, 1), N) == pytest.approx(3 / 4 * N / 1e9 + 3e-6, rel=1e-12)


@pytest.mark.parametrize("kind", [Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.ALL_TO_ALL])
def test_group_time_under_the_joint_load_is_what_collective_time_takes_the_max_of(cluster_a, kind):
    # Mixed groups: some inside a server, some across both with uneven and even spreads.
    groups = [(0, 1, 2, 3), (4, 8, 5, 9), (6, 7, 10), (11, 12, 13, 14, 15)]
    load = sum((group_streams(kind, cluster_a, g) for g in groups), start=Counter())
    times = [group_time(kind, cluster_a, g, N, load) for g in groups]
    assert collective_time(kind, cluster_a, groups, N) == max(times)
    # Alone, a group gets the NIC to itself: never slower than under the joint load.
    alone = [group_time(kind, cluster_a, g, N, group_streams(kind, cluster_a, g)) for g in groups]
    assert all(a <= t for a, t in zip(alone, times)) and alone[1] < times[1]


def test_trivial_groups_cost_nothing(cluster_a):
    for kind in (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        assert collective_time(kind, cluster_a, [(5,)], N) == 0.0
        assert collective_time(kind, cluster_a, [], N) == 0.0


def test_errors_name_the_offending_value(cluster_a):
    with pytest.raises(ValueError, match="16"):
        all_reduce_time(cluster_a, (0, 16), N)
    with pytest.raises(ValueError, match="twice"):
        all_reduce_time(cluster_a, (0, 1, 1), N)
    with pytest.raises(ValueError, match=r"\[1\]"):
        collective_time(Collective.ALL_GATHER, cluster_a, [(0, 1), (1, 2)], N)
    with pytest.raises(ValueError, match="nbytes"):
        all_gather_time(cluster_a, (0, 1), -1)
    with pytest.raises(ValueError, match="out of range"):
        collective_permute_time(cluster_a, [(0, 99)], N)
    with pytest.raises(ValueError, match="collective_permute_time"):
        collective_time(Collective.COLLECTIVE_PERMUTE, cluster_a, [(0, 1)], N)


def test_collective_kinds_are_hlo_opcodes():
    assert Collective("all-reduce") is Collective.ALL_REDUCE
    assert Collective("collective-permute") is Collective.COLLECTIVE_PERMUTE


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), size=st.integers(2, 8), nbytes=st.floats(1.0, 1e9))
def test_ring_all_reduce_is_reduce_scatter_then_all_gather(seed, size, nbytes):
    # On a single-switch topology (one device per node) every collective is one flat ring.
    cluster = uniform(8, "A100-40GB", (1e9, 1e11), (1e-6, 1e-5), seed=seed)
    group = tuple(np.random.default_rng(seed).permutation(8)[:size].tolist())
    ar = all_reduce_time(cluster, group, nbytes)
    assert ar == pytest.approx(reduce_scatter_time(cluster, group, nbytes)
                               + all_gather_time(cluster, group, nbytes), rel=1e-9)
    assert all_reduce_time(cluster, group, 2 * nbytes) > ar
    # The slowest link bounds the bandwidth term from below.
    sub = cluster.bandwidth[np.ix_(group, group)]
    b_min = sub[~np.eye(size, dtype=bool)].min()
    assert ar >= 2 * (size - 1) / size * nbytes / b_min * (1 - 1e-12)
    assert math.isfinite(ar)
