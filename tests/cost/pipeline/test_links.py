import math
from types import SimpleNamespace

import numpy as np
import pytest

from hlomap.cost.pipeline.links import Links


def test_p2p_is_alpha_plus_bytes_over_beta():
    links = Links.uniform(3, bandwidth=2e9, latency=1e-3)
    assert links.p2p_time(0, 2, 4e9) == pytest.approx(1e-3 + 2.0)
    assert links.p2p_time(1, 1, 4e9) == 0.0
    assert links.p2p_time(0, 1, 0.0) == 0.0


def test_transfer_between_replicated_stages_splits_into_parallel_chunks():
    bandwidth = np.full((4, 4), 1e9)
    bandwidth[1, 2] = 0.5e9  # the second chunk's link is slower
    links = Links(bandwidth, np.zeros((4, 4)), (0, 0, 0, 0), (math.inf,) * 4)
    # stage on (0, 1) -> stage on (2,): two chunks of 1 GB: 0 -> 2 (1 s) and 1 -> 2 (2 s)
    assert links.transfer_time((0, 1), (2,), 2e9) == pytest.approx(2.0)
    # stage on (0,) -> stage on (1, 2, 3): three chunks of 1 GB from device 0
    assert links.transfer_time((0,), (1, 2, 3), 3e9) == pytest.approx(1.0)


@pytest.mark.parametrize("k", [2, 3, 5])
def test_ring_allreduce_matches_the_textbook_formula(k):
    """Uniform ring: 2 (k - 1) steps of N / k bytes: 2 (k - 1) / k * N / B + 2 (k - 1) alpha."""
    links = Links.uniform(k, bandwidth=1e9, latency=1e-5)
    nbytes = 6e8
    expected = 2 * (k - 1) / k * nbytes / 1e9 + 2 * (k - 1) * 1e-5
    assert links.allreduce_time(range(k), nbytes) == pytest.approx(expected)
    assert links.allreduce_time((0,), nbytes) == 0.0


def test_allreduce_is_as_slow_as_the_slowest_ring_edge():
    links = Links.uniform(3, bandwidth=1e9)
    slow = np.array(links.bandwidth)
    slow[2, 0] = 1e8
    links = Links(slow, links.latency, links.node_of, links.memory_bytes)
    assert links.allreduce_time((0, 1, 2), 3e8) == pytest.approx(4 * (1e8 / 1e8))


def test_node_boundaries_and_group_memory():
    links = Links(
        np.full((4, 4), 1e9), np.zeros((4, 4)), (0, 0, 1, 1), (8.0, 4.0, 16.0, 16.0)
    )
    assert [links.is_node_boundary(d) for d in range(5)] == [True, False, True, False, True]
    assert links.group_memory((0, 1)) == 4.0


def test_rejects_bad_matrices_naming_the_entry():
    with pytest.raises(ValueError, match=r"bandwidth\[0, 1\] = 0.0"):
        Links(np.array([[1.0, 0.0], [1.0, 1.0]]), np.zeros((2, 2)), (0, 0), (1.0, 1.0))
    with pytest.raises(ValueError, match=r"latency has shape \(3, 3\)"):
        Links(np.ones((2, 2)), np.zeros((3, 3)), (0, 0), (1.0, 1.0))
    with pytest.raises(ValueError, match=r"memory_bytes\[1\] = 0.0"):
        Links(np.ones((2, 2)), np.zeros((2, 2)), (0, 0), (1.0, 0.0))


def test_from_cluster_reads_only_the_agreed_attributes():
    n = 3
    bandwidth = np.full((n, n), 5e9)
    np.fill_diagonal(bandwidth, np.inf)
    cluster = SimpleNamespace(
        bandwidth=bandwidth,
        latency=np.full((n, n), 2e-6),
        node_of=(0, 0, 1),
        devices=tuple(SimpleNamespace(memory_bytes=16 * 2**30) for _ in range(n)),
    )
    links = Links.from_cluster(cluster)
    assert links.node_of == (0, 0, 1)
    assert links.memory_bytes == (16.0 * 2**30,) * 3
    assert links.p2p_time(0, 2, 5e9) == pytest.approx(1.0 + 2e-6)


def test_from_real_cluster_preset_agrees_with_its_p2p_time():
    cluster_module = pytest.importorskip("hlomap.cost.cluster")
    if not hasattr(cluster_module, "cluster_preset"):
        pytest.skip("hlomap.cost.cluster_preset not written yet")
    cluster = cluster_module.cluster_preset("A")
    links = Links.from_cluster(cluster)
    assert links.n_devices == cluster.n_devices
    for src, dst in [(0, 1), (0, cluster.n_devices - 1)]:
        assert links.p2p_time(src, dst, 1e9) == pytest.approx(cluster.p2p_time(src, dst, 1e9))
