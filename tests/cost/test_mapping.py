"""Mesh axes onto cluster devices: nesting order, groups per axis, explicit layouts."""

import numpy as np
import pytest

from hlomap.cost.cluster import cluster_preset, mesh_topology
from hlomap.cost.mapping import AxisMapping, MappingError, axis_devices


@pytest.fixture(scope="module")
def cluster_a():
    return cluster_preset("A")  # 2 servers x 8 GPUs, ids 0-7 on server 0


def _nodes(cluster, group):
    return {cluster.node_of[d] for d in group}


def test_model_inside_a_node_data_across(cluster_a):
    m = axis_devices(cluster_a, {"data": 2, "model": 8}, order=("data", "model"))
    assert m.shape == (2, 8) and m.axis_names == ("data", "model")
    np.testing.assert_array_equal(m.devices, np.arange(16).reshape(2, 8))
    assert all(len(_nodes(cluster_a, g)) == 1 for g in m.groups("model"))
    assert all(len(_nodes(cluster_a, g)) == 2 for g in m.groups("data"))
    assert m.groups("data")[3] == (3, 11)


def test_swapping_the_order_swaps_which_axis_stays_local(cluster_a):
    m = axis_devices(cluster_a, {"data": 2, "model": 8}, order=("model", "data"))
    assert m.shape == (2, 8)  # still shaped like the mesh
    assert all(len(_nodes(cluster_a, g)) == 1 for g in m.groups("data"))
    assert all(len(_nodes(cluster_a, g)) == 2 for g in m.groups("model"))
    assert m.devices[1, 0] == 1 and m.devices[0, 1] == 2


def test_groups_partition_the_devices_for_every_axis_and_pair_of_axes(cluster_a):
    m = axis_devices(cluster_a, {"a": 2, "b": 2, "c": 4}, order=("c", "a", "b"))
    for axes, size in (("a", 2), ("b", 2), ("c", 4), (("a", "c"), 8), (("a", "b", "c"), 16)):
        groups = m.groups(axes)
        assert all(len(g) == size for g in groups)
        assert sorted(d for g in groups for d in g) == list(range(16))
    # A group along "c" changes only the c coordinate.
    for g in m.groups("c"):
        coords = [np.argwhere(m.devices == d)[0] for d in g]
        assert len({(int(c[0]), int(c[1])) for c in coords}) == 1
        assert [int(c[2]) for c in coords] == [0, 1, 2, 3]


def test_default_order_is_the_mesh_order_and_a_smaller_mesh_uses_the_first_devices(cluster_a):
    m = axis_devices(cluster_a, {"x": 4})
    assert m.groups("x") == ((0, 1, 2, 3),)
    stage = axis_devices(cluster_a, {"x": 2, "y": 2}, devices=[8, 9, 10, 11])
    assert stage.groups("y") == ((8, 9), (10, 11))


def test_explicit_mapping_round_trips_through_json():
    torus = mesh_topology((2, 2), "H100-80GB", 1e11, 1e-6, torus=True)
    m = AxisMapping((("x", 2), ("y", 2)), np.array([[0, 3], [1, 2]]))
    m.check_fits(torus)
    assert m.groups("y") == ((0, 3), (1, 2))
    assert AxisMapping.from_json(m.to_json()) == m
    with pytest.raises(MappingError, match="4 devices"):
        AxisMapping((("x", 8),), np.arange(8)).check_fits(torus)


@pytest.mark.parametrize("call, message", [
    (lambda c: axis_devices(c, {"data": 4, "model": 8}), "32 devices"),
    (lambda c: axis_devices(c, {"data": 2}, order=("model",)), "order"),
    (lambda c: axis_devices(c, {"data": 0}), "sizes"),
    (lambda c: axis_devices(c, {"data": 2}).groups("model"), "'model'"),
    (lambda c: AxisMapping((("x", 2),), np.array([1, 1])), "twice"),
    (lambda c: AxisMapping((("x", 2),), np.arange(3)), "shape"),
    (lambda c: AxisMapping.from_json({"axes": {"x": 2}}), "devices"),
])
def test_errors(cluster_a, call, message):
    with pytest.raises(MappingError, match=message):
        call(cluster_a)
