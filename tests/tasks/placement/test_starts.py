"""Placement's structured starts: walks over topology coordinates (row-major, snake, Hilbert),
mesh-axis nestings over them, recursive bisection, and the scrambled clusters they must see
through."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hlomap.cost.cluster import Cluster, load_cluster
from hlomap.cost.collectives import Collective, collective_time
from hlomap.tasks.placement import curves
from hlomap.tasks.placement.bisection import bisect_coordinates, bisect_graph
from hlomap.tasks.placement.construct import named_starts, structured_starts, walk_starts
from hlomap.tasks.placement.generate import scrambled, tensor_parallel_layout
from hlomap.tasks.placement.objective import affinity
from hlomap.tasks.placement.problem import PlacementProblem, step_seconds

from tests.tasks.placement.helpers import mesh_layout, stage_layout


def grid(shape: tuple[int, ...]) -> np.ndarray:
    return np.stack(np.unravel_index(np.arange(int(np.prod(shape))), shape), axis=1)


@pytest.mark.parametrize("shape", [(8, 8), (4, 4, 4), (3, 5), (2, 3, 4), (16,)])
def test_snake_steps_to_a_neighbour_every_time(shape):
    coords = grid(shape)
    order = curves.snake(coords)
    assert sorted(order.tolist()) == list(range(len(coords)))
    assert (np.abs(np.diff(coords[order], axis=0)).sum(axis=1) == 1).all()


@pytest.mark.parametrize("shape", [(2, 2), (8, 8), (4, 4, 4), (8, 8, 8)])
def test_hilbert_is_a_walk_of_neighbours_whose_aligned_blocks_are_cubes(shape):
    coords = grid(shape)
    order = curves.hilbert(coords)
    assert sorted(order.tolist()) == list(range(len(coords)))
    assert (np.abs(np.diff(coords[order], axis=0)).sum(axis=1) == 1).all()
    rank = len(shape)
    block = 2 ** rank  # every aligned run of 2^rank devices is a 2 x 2 (x 2) cube
    for start in range(0, len(order), block):
        extent = np.ptp(coords[order[start:start + block]], axis=0)
        assert (extent == 1).all()


def test_hilbert_orders_any_shape():
    coords = grid((3, 6, 5))
    assert sorted(curves.hilbert(coords).tolist()) == list(range(90))


def test_row_major_reads_coordinates_not_ids():
    coords = np.array([[1, 0], [0, 1], [0, 0], [1, 1]])
    assert curves.row_major(coords).tolist() == [2, 1, 0, 3]


PROBLEMS = [
    ("torus:8x8", "scrambled", tensor_parallel_layout(64)),
    ("torus:4x4x4", "scrambled", mesh_layout((8, 8))),
    ("mesh:4x4", "", stage_layout((4, 4, 4, 4))),
    ("hier:4x4", "scrambled", mesh_layout((4, 4))),
    ("random:16:2", "", stage_layout((2, 2, 4))),
    ("uniform:12:1", "", mesh_layout((2, 4))),  # 8 positions on 12 devices
    ("torus:4x4", "scrambled", mesh_layout((2, 4))),
]


@pytest.mark.parametrize("topology, how, layout", PROBLEMS)
def test_every_structured_start_is_a_permutation_of_the_devices(topology, how, layout):
    cluster = load_cluster(topology)
    cluster = scrambled(cluster, seed=1) if how else cluster
    problem = PlacementProblem(cluster, layout)
    aff = affinity(problem)
    starts = named_starts(problem, aff)
    assert {"identity", "row-major", "snake", "hilbert", "bisection", "construct"} <= set(starts)
    for name, order in starts.items():
        assert sorted(order.tolist()) == list(range(cluster.n_devices)), name
        step_seconds(problem, order[: problem.n_positions])  # a valid placement
    distinct = structured_starts(problem, aff)
    assert distinct[0].tolist() == starts["identity"].tolist()
    assert len({o.tobytes() for o in distinct}) == len(distinct)


def test_mesh_starts_nest_every_axis_order_over_every_walk():
    problem = PlacementProblem(load_cluster("torus:4x4x4"), mesh_layout((8, 8)))
    names = set(walk_starts(problem))
    assert names == {f"{walk}{nesting}" for walk in ("row-major", "snake", "hilbert") for nesting in ("", " model>data")}


def test_row_major_by_coordinate_on_a_scrambled_torus_is_the_physical_row_major_order():
    physical = load_cluster("torus:8x8")
    cluster = scrambled(physical, seed=5)
    assert cluster.network is not None and cluster.network.grid.device_nodes is not None
    problem = PlacementProblem(cluster, tensor_parallel_layout(64))
    order = walk_starts(problem)["row-major"]
    assert cluster.network.node_of_device[order].tolist() == list(range(64))  # node k, in node order
    # and it prices as the unscrambled identity: every group on a torus row
    unscrambled = PlacementProblem(physical, tensor_parallel_layout(64))
    assert step_seconds(problem, order) == pytest.approx(step_seconds(unscrambled, tuple(range(64))), rel=1e-12)
    assert step_seconds(problem, tuple(range(64))) > 2.5 * step_seconds(problem, order)  # the ids' order


def test_a_scrambled_cluster_is_the_same_machine_under_other_ids():
    physical = load_cluster("torus:4x4")
    cluster = scrambled(physical, seed=2)
    ids = np.random.default_rng(0).permutation(16).reshape(4, 4)
    nodes = cluster.network.node_of_device[ids]
    for kind in (Collective.ALL_REDUCE, Collective.ALL_TO_ALL):
        assert collective_time(kind, cluster, ids, 1e8) == pytest.approx(collective_time(kind, physical, nodes, 1e8),
                                                                         rel=1e-12)
    assert np.array_equal(cluster.latency[np.ix_(ids[0], ids[1])], physical.latency[np.ix_(nodes[0], nodes[1])])
    back = Cluster.from_json(json.loads(json.dumps(cluster.to_json())))
    assert back == cluster and back.network == cluster.network and back.network != physical.network
    servers = scrambled(load_cluster("hier:2x4"), seed=1)
    again = Cluster.from_json(json.loads(json.dumps(servers.to_json())))
    assert again == servers and np.array_equal(again.coordinates, servers.coordinates)
    assert sorted(map(tuple, servers.coordinates.tolist())) == [(s, g) for s in range(2) for g in range(4)]


def test_clusters_carry_topology_coordinates():
    assert load_cluster("torus:2x3").coordinates.tolist() == grid((2, 3)).tolist()
    assert load_cluster("hier:2x4").coordinates.tolist() == grid((2, 4)).tolist()
    assert load_cluster("hier:2x4").to_json()["coords"] == grid((2, 4)).tolist()
    random = load_cluster("random:12:1")
    assert [tuple(c) for c in random.coordinates[:, :1].tolist()] == [(n,) for n in random.node_of]
    assert load_cluster("uniform:3").coordinates.tolist() == [[0, 0], [1, 0], [2, 0]]  # one device per node
    data = load_cluster("hier:2x2").to_json()
    data["coords"] = [[0, 0], [0, 0], [1, 0], [1, 1]]
    with pytest.raises(ValueError, match="distinct"):
        Cluster.from_json(data)


def test_bisection_splits_two_cliques_and_boxes():
    weights = np.zeros((8, 8))
    members = [[0, 3, 5, 6], [1, 2, 4, 7]]
    for group in members:
        weights[np.ix_(group, group)] = 1.0
    np.fill_diagonal(weights, 0.0)
    inside = bisect_graph(weights, 4)
    assert sorted(np.flatnonzero(inside).tolist()) in members
    coords = grid((2, 8))
    side = bisect_coordinates(coords, 8)
    assert np.ptp(coords[side], axis=0).tolist() == [1, 3]  # the longer axis is cut: a 2 x 4 box


def test_bisection_start_keeps_tensor_parallel_groups_off_each_others_links():
    problem = PlacementProblem(scrambled(load_cluster("torus:8x8"), seed=4), tensor_parallel_layout(64))
    order = named_starts(problem, affinity(problem))["bisection"]
    row_major = walk_starts(problem)["row-major"]
    assert step_seconds(problem, order[:64]) <= 1.02 * step_seconds(problem, row_major[:64])
