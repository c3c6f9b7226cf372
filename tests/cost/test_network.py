"""The network model of tori and meshes: routes, link sharing, and collectives priced as flows.

Checked against closed forms worked out by hand and against `_fluid`, a flow-level simulator
written here from scratch (plain Python, the bottleneck-link algorithm for max-min fairness,
events at every finishing flow), which shares no code with `hlomap.cost.network`.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from hlomap.cost.cluster import Cluster, first_devices, load_cluster, mesh_topology, with_busy_devices
from hlomap.cost.collectives import (
    Collective, all_reduce_terms, collective_group_times, collective_permute_time, collective_time,
)
from hlomap.cost.network import Grid, Network, fluid_finish_times, grid_network, max_min_rates

B, A = 50e9, 1e-6  # a topology string's link: 50 GB/s, 1 us per hop
N = 1e8
RING_KINDS = (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER)


# -- an independent fluid simulator -----------------------------------------------------------


def _fair_rates(paths: list[list[int]], capacity: dict[int, float]) -> list[float]:
    """Max-min fair rates by the bottleneck-link algorithm: the link with the least capacity per
    unassigned flow fixes its flows at that share; take them off every link; repeat."""
    left = dict(capacity)
    unassigned = {f for f, path in enumerate(paths) if path}
    rates = [float("inf")] * len(paths)
    while unassigned:
        users: dict[int, list[int]] = {}
        for f in unassigned:
            for link in paths[f]:
                users.setdefault(link, []).append(f)
        link = min(users, key=lambda k: left[k] / len(users[k]))
        share = left[link] / len(users[link])
        for f in users[link]:
            rates[f] = share
            unassigned.discard(f)
            for other in paths[f]:
                left[other] -= share
    return rates


def _fluid(paths: list[list[int]], sizes: list[float], capacity: dict[int, float]) -> list[float]:
    """Finishing time of each flow, all starting at 0, sharing max-min fairly at every instant."""
    left = list(map(float, sizes))
    finish = [0.0] * len(paths)
    running = [f for f in range(len(paths)) if left[f] > 0 and paths[f]]  # an empty path arrives at once
    now = 0.0
    while running:
        rates = _fair_rates([paths[f] for f in running], capacity)
        step = min(left[f] / r for f, r in zip(running, rates))
        now += step
        still = []
        for f, r in zip(running, rates):
            left[f] -= r * step
            if left[f] <= 1e-9 * sizes[f]:
                finish[f] = now
            else:
                still.append(f)
        running = still
    return finish


def _paths(network: Network, pairs) -> list[list[int]]:
    return [list(network.route(int(s), int(d))) for s, d in pairs]


def _capacity(network: Network) -> dict[int, float]:
    return {link: float(bw) for link, bw in enumerate(network.bandwidth)}


def _ring_pairs(groups) -> list[tuple[int, int]]:
    return [(g[i], g[(i + 1) % len(g)]) for g in groups for i in range(len(g)) if len(g) > 1]


def _simulated(kind: Collective, network: Network, groups, nbytes: float) -> float:
    """The collective as flows in the simulator (link latency 0): a ring's phases one after the
    other, each phase every group's flows at once; an all-to-all's flows all at once."""
    if kind is Collective.ALL_TO_ALL:
        pairs = [(g[i], g[j]) for g in groups for i in range(len(g)) for j in range(len(g)) if i != j]
        p = len(groups[0])
        return max(_fluid(_paths(network, pairs), [nbytes / p] * len(pairs), _capacity(network)), default=0.0)
    p = len(groups[0])
    pairs = _ring_pairs(groups)
    phase = max(_fluid(_paths(network, pairs), [nbytes / p] * len(pairs), _capacity(network)), default=0.0)
    return (2 * (p - 1) if kind is Collective.ALL_REDUCE else p - 1) * phase


# -- routes -----------------------------------------------------------------------------------


def _coords(shape, node):
    return np.unravel_index(node, shape)


@pytest.mark.parametrize("shape, torus", [((8, 8), True), ((4, 4, 4), True), ((5, 3), False), ((6, 5), True),
                                          ((2, 4, 3), True), ((16, 16), False)])
def test_routes_go_axis_by_axis_the_shorter_way_round(shape, torus):
    net = grid_network(shape, B, A, torus)
    rng = np.random.default_rng(0)
    n = net.n_nodes
    for s, d in rng.integers(0, n, size=(200, 2)).tolist():
        route = net.route(s, d)
        src, dst = _coords(shape, s), _coords(shape, d)
        expected_hops, axes = 0, []
        for axis, size in enumerate(shape):
            delta = (dst[axis] - src[axis]) % size if torus else abs(dst[axis] - src[axis])
            hops = min(delta, size - delta) if torus else delta
            expected_hops += hops
            axes += [axis] * hops
        assert len(route) == expected_hops
        at = s
        for link, axis in zip(route, axes):  # contiguous, one axis at a time, in axis order
            assert net.src[link] == at
            a, b = _coords(shape, int(net.src[link])), _coords(shape, int(net.dst[link]))
            moved = [i for i in range(len(shape)) if a[i] != b[i]]
            assert moved == [axis]
            at = int(net.dst[link])
        assert at == d
        assert net.route_latency(net.routes([s], [d]))[0] == pytest.approx(expected_hops * A, abs=1e-18)


def test_a_tie_half_way_round_goes_the_positive_way_and_a_mesh_never_wraps():
    ring = grid_network((8,), B, A, torus=True)
    assert [int(ring.dst[x]) for x in ring.route(2, 6)] == [3, 4, 5, 6]  # 4 hops either way
    assert [int(ring.dst[x]) for x in ring.route(6, 2)] == [7, 0, 1, 2]
    assert [int(ring.dst[x]) for x in ring.route(1, 7)] == [0, 7]  # 2 hops back, not 6 on
    line = grid_network((8,), B, A, torus=False)
    assert [int(line.dst[x]) for x in line.route(1, 7)] == [2, 3, 4, 5, 6, 7]
    assert line.route(3, 3) == ()


@pytest.mark.parametrize("shape, torus, links", [((8, 8), True, 4 * 64), ((4, 4, 4), True, 6 * 64),
                                                 ((5, 3), False, 2 * (4 * 3 + 5 * 2)), ((2, 4), True, 8 + 16),
                                                 ((2,), False, 2), ((1, 3), True, 6)])
def test_link_counts(shape, torus, links):
    net = grid_network(shape, B, A, torus)
    assert net.n_links == links
    # every link joins neighbours, and no two links join the same ordered pair
    assert len({(int(s), int(d)) for s, d in zip(net.src, net.dst)}) == links


def test_route_latency_is_the_clusters_latency_table():
    for text in ("torus:4x4x4", "mesh:6x5", "torus:2x3"):
        c = load_cluster(text)
        s, d = np.meshgrid(np.arange(c.n_devices), np.arange(c.n_devices), indexing="ij")
        lat = c.network.route_latency(c.network.routes(s.reshape(-1), d.reshape(-1))).reshape(s.shape)
        assert np.allclose(lat, c.latency, rtol=1e-12, atol=1e-18)


@pytest.mark.slow  # the cluster's dense 8192 x 8192 tables take most of its 15 s
def test_routes_are_worked_out_per_batch_on_a_large_torus():
    # 8192 devices: no all-pairs route table is built, only the batch asked for.
    net = load_cluster("torus:16x16x32").network
    rng = np.random.default_rng(1)
    s, d = rng.integers(0, net.n_nodes, size=(2, 4096))
    routes = net.routes(s, d)
    assert routes.shape == (4096, 8 + 8 + 16)
    hops = (routes >= 0).sum(axis=1)
    dist = sum(np.minimum((np.array(_coords((16, 16, 32), d))[a] - np.array(_coords((16, 16, 32), s))[a]) % k,
                          (np.array(_coords((16, 16, 32), s))[a] - np.array(_coords((16, 16, 32), d))[a]) % k)
               for a, k in enumerate((16, 16, 32)))
    assert np.array_equal(hops, dist)


# -- sharing: the flow model against the simulator --------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_max_min_rates_and_fluid_times_match_the_simulator_on_random_flows(seed):
    rng = np.random.default_rng(seed)
    n_links = 9
    capacity = rng.uniform(1.0, 5.0, n_links)
    paths = [sorted(rng.choice(n_links, size=rng.integers(1, 4), replace=False).tolist()) for _ in range(14)]
    paths.append([])  # a flow that crosses nothing
    width = max(len(p) for p in paths)
    routes = np.array([p + [-1] * (width - len(p)) for p in paths], dtype=np.int64)
    cap = {i: float(c) for i, c in enumerate(capacity)}
    rates = max_min_rates(routes, capacity)
    expected = _fair_rates(paths, cap)
    assert np.isinf(rates[-1]) and np.isinf(expected[-1])
    assert np.allclose(rates[:-1], expected[:-1], rtol=1e-9)
    sizes = rng.uniform(0.5, 3.0, len(paths))
    assert np.allclose(fluid_finish_times(routes, sizes, capacity), _fluid(paths, sizes.tolist(), cap), rtol=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_equal_flows_finish_when_the_busiest_link_says(seed):
    # On a torus with a slower axis: random pairs, all one size, starting together.
    net = grid_network((4, 3), (2e9, 5e9), A, torus=True)
    rng = np.random.default_rng(seed)
    pairs = [(s, d) for s, d in rng.integers(0, net.n_nodes, size=(25, 2)).tolist() if s != d]
    size = 3e8
    routes = net.routes(*np.array(pairs).T)
    per_byte = net.busiest_link_seconds_per_byte(routes)
    simulated = _fluid(_paths(net, pairs), [size] * len(pairs), _capacity(net))
    # the last flow finishes when the busiest link of all has moved its flows ...
    assert max(simulated) == pytest.approx(size * per_byte.max(), rel=1e-9)
    # ... and no flow later than its own busiest link says
    assert all(t <= size * b * (1 + 1e-9) for t, b in zip(simulated, per_byte))


# -- collectives: closed forms ---------------------------------------------------------------


@pytest.mark.parametrize("kind, steps", [(Collective.ALL_REDUCE, 14), (Collective.ALL_GATHER, 7),
                                         (Collective.REDUCE_SCATTER, 7)])
def test_an_uncontended_ring_on_a_torus_row_is_the_closed_form(kind, steps):
    c = load_cluster("torus:8x8")
    expected = steps / 8 * N / B + steps * A
    rows = np.arange(64).reshape(8, 8)
    assert collective_time(kind, c, [rows[3]], N) == pytest.approx(expected, rel=1e-12)
    # every row at once: rows share no link, so nothing changes; nor for columns
    assert collective_time(kind, c, rows, N) == pytest.approx(expected, rel=1e-12)
    assert collective_time(kind, c, rows.T, N) == pytest.approx(expected, rel=1e-12)


def test_a_ring_whose_members_are_far_apart_pays_its_hops_and_its_shared_links():
    c = load_cluster("torus:8")
    # 0 -> 4 -> 1 -> 5 -> 0 on a ring of 8: 0 -> 4 and 1 -> 5 are ties (4 hops, the + way: 01 12
    # 23 34 and 12 23 34 45), 4 -> 1 goes 3 hops back, 5 -> 0 3 hops on (56 67 70). Links 12, 23
    # and 34 carry 2 flows; the longest route is 4 hops.
    group = (0, 4, 1, 5)
    expected = 2 * 3 * (2 * N / 4 / B) + 2 * 3 * 4 * A
    assert collective_time(Collective.ALL_REDUCE, c, [group], N) == pytest.approx(expected, rel=1e-12)
    # the tables alone said: slowest pair 50 GB/s, largest ring neighbour latency 4 hops
    tables = Cluster(c.name, c.devices, c.node_of, c.bandwidth, c.latency)
    assert collective_time(Collective.ALL_REDUCE, tables, [group], N) == pytest.approx(
        2 * 3 / 4 * N / B + 2 * 3 * 4 * A, rel=1e-12)


@pytest.mark.parametrize("k", [4, 8, 16])
def test_all_to_all_over_a_whole_torus_is_within_a_tie_of_the_bisection_bound(k):
    # k x k torus, p = k^2 devices, each sends n/p to every other. Bisection: cutting axis 0 into
    # halves cuts 2k links each way; (p/2)^2 flows of n/p cross each way: at least k n / (8 B).
    # Dimension-order routes with ties half way round taken the + way put on each + link
    # k * (1 + 2 + ... + k/2) flows (in its column on the axis-0 leg, in its row on the axis-1
    # leg), so the model's bandwidth term is (n/p) k (k/2)(k/2 + 1)/2 / B = n (k + 2) / (8 B).
    c = mesh_topology((k, k), "A100-80GB", B, A, torus=True)
    p = k * k
    n = p * 1e6
    bisection = k * n / (8 * B)
    latency = (p - 1) * k * A  # p - 1 steps of the longest route, k/2 + k/2 hops
    got = collective_time(Collective.ALL_TO_ALL, c, [range(p)], n)
    assert got - latency == pytest.approx(n * (k + 2) / (8 * B), rel=1e-9)
    assert got - latency >= bisection


def test_collective_permute_pairs_share_their_links():
    c = load_cluster("torus:8")
    # 0 -> 2 and 1 -> 3 both cross link 1->2; 5 -> 6 is alone
    assert collective_permute_time(c, [(0, 2), (1, 3)], N) == pytest.approx(2 * A + 2 * N / B, rel=1e-12)
    assert collective_permute_time(c, [(5, 6)], N) == pytest.approx(A + N / B, rel=1e-12)
    assert collective_permute_time(c, [(0, 2), (1, 3), (5, 6)], N) == pytest.approx(2 * A + 2 * N / B, rel=1e-12)
    assert collective_permute_time(c, [(0, 1), (1, 0)], N) == pytest.approx(A + N / B, rel=1e-12)  # both ways


# -- collectives against the simulator --------------------------------------------------------


def _zero_latency(shape, torus=True, bw=B) -> Cluster:
    return mesh_topology(shape, "A100-80GB", bw, 0.0, torus=torus)


@pytest.mark.parametrize("kind", RING_KINDS + (Collective.ALL_TO_ALL,))
@pytest.mark.parametrize("seed", range(3))
def test_collectives_over_scrambled_groups_match_the_simulator(kind, seed):
    c = _zero_latency((4, 4), bw=(2e10, 5e10))
    rng = np.random.default_rng(seed)
    p = 4 if kind is Collective.ALL_TO_ALL else int(rng.choice([4, 8]))
    groups = rng.permutation(16).reshape(-1, p).tolist()
    expected = _simulated(kind, c.network, groups, N)
    assert collective_time(kind, c, groups, N) == pytest.approx(expected, rel=1e-9)


def test_a_mesh_collective_matches_the_simulator_too():
    c = _zero_latency((3, 5), torus=False)
    groups = np.random.default_rng(4).permutation(15).reshape(3, 5).tolist()
    for kind in (Collective.ALL_REDUCE, Collective.ALL_TO_ALL):
        assert collective_time(kind, c, groups, N) == pytest.approx(_simulated(kind, c.network, groups, N), rel=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_collective_permute_matches_the_simulator(seed):
    c = _zero_latency((4, 4))
    rng = np.random.default_rng(seed)
    pairs = [(int(s), int(d)) for s, d in zip(rng.permutation(16), rng.permutation(16)) if s != d]
    expected = max(_fluid(_paths(c.network, pairs), [N] * len(pairs), _capacity(c.network)))
    assert collective_permute_time(c, pairs, N) == pytest.approx(expected, rel=1e-9)


def test_with_latency_the_model_bounds_the_simulated_arrivals_from_above():
    # A flow arrives its route's latency after it finishes sending; the model adds the group's
    # longest route latency to its busiest link's time, which is never less.
    c = load_cluster("torus:4x4")
    rng = np.random.default_rng(7)
    groups = rng.permutation(16).reshape(4, 4).tolist()
    pairs = _ring_pairs(groups)
    finish = _fluid(_paths(c.network, pairs), [N / 4] * len(pairs), _capacity(c.network))
    arrive = [t + float(c.latency[s, d]) for t, (s, d) in zip(finish, pairs)]
    model = collective_time(Collective.ALL_GATHER, c, groups, N) / 3  # one of the 3 phases
    assert max(arrive) <= model * (1 + 1e-12)
    assert model <= max(arrive) + max(float(c.latency[s, d]) for s, d in pairs)


# -- the example: tensor-parallel groups on torus:8x8 ----------------------------------


def _orders() -> dict[str, np.ndarray]:
    rows = np.arange(64).reshape(8, 8)
    snake = rows.copy()
    snake[1::2] = snake[1::2, ::-1]  # boustrophedon: every other row reversed
    return {"row-major": rows, "snake": snake.T, "scrambled": np.random.default_rng(0).permutation(64).reshape(8, 8)}


def test_scrambled_tensor_parallel_groups_are_slower_than_row_major_and_snake_lies_between():
    # 8 groups of 8 all-reduce at once. Row-major: each group a torus row, no shared link. Snake
    # (devices listed boustrophedon, groups across the rows): busiest link 2 flows. Scrambled:
    # busiest link 4 flows. The tables alone priced the scramble within a few percent.
    c = load_cluster("torus:8x8")
    tables = Cluster(c.name, c.devices, c.node_of, c.bandwidth, c.latency)
    times = {name: collective_time(Collective.ALL_REDUCE, c, groups, N) for name, groups in _orders().items()}
    old = {name: collective_time(Collective.ALL_REDUCE, tables, groups, N) for name, groups in _orders().items()}
    assert times["row-major"] == pytest.approx(14 / 8 * N / B + 14 * A, rel=1e-12)
    assert times["row-major"] < times["snake"] < times["scrambled"]
    assert times["scrambled"] / times["row-major"] > 3.5  # busiest link 4 flows, routes up to 8 hops
    assert times["snake"] / times["row-major"] == pytest.approx((2 * 14 / 8 * N / B + 14 * 4 * A)
                                                                / (14 / 8 * N / B + 14 * A), rel=1e-12)
    assert old["scrambled"] / old["row-major"] < 1.05


# -- what the cluster keeps, and how it is used -----------------------------------------------


@pytest.mark.parametrize("text", ["torus:8x8", "mesh:4x4x2", "torus:2x3@H100-80GB"])
def test_a_clusters_network_survives_json_and_its_name(text, tmp_path):
    c = load_cluster(text)
    assert c.network is not None and c.network.grid.torus == text.startswith("torus")
    back = Cluster.from_json(json.loads(json.dumps(c.to_json())))
    assert back == c and back.network == c.network and hash(back) == hash(c)
    path = tmp_path / "c.json"
    c.save(path)
    assert load_cluster(str(path)).network == c.network
    data = c.to_json()
    del data["network"]  # a file without one prices over the tables, as before
    assert Cluster.from_json(data) != c and Cluster.from_json(data).network is None


def test_clusters_without_a_network_keep_their_tables():
    for text in ("A", "hier:2x4", "random:16:3", "uniform:8"):
        assert load_cluster(text).network is None


def test_bad_network_json_is_refused_by_field():
    data = load_cluster("torus:2x2").to_json()
    data["network"]["link_bandwidth"] = [0, 1]
    with pytest.raises(ValueError, match="network.*positive"):
        Cluster.from_json(data)
    data["network"] = {"topology": "ring", "shape": [4], "link_bandwidth": [1], "link_latency": [0]}
    with pytest.raises(ValueError, match="'topology'"):
        Cluster.from_json(data)
    data["network"] = {"topology": "torus", "shape": [2], "link_bandwidth": [1e9], "link_latency": [0]}
    with pytest.raises(ValueError, match="network has 2 nodes for 4 devices"):
        Cluster.from_json(data)


def test_sub_clusters_keep_routing_over_the_whole_torus():
    c = load_cluster("torus:8")
    part = first_devices(c, 6)
    assert part.network is c.network and with_busy_devices(c, 4).network is c.network
    # 0 <-> 5 on the first 6 devices of a ring of 8: 3 hops round through devices 6 and 7
    assert collective_time(Collective.ALL_GATHER, part, [(0, 5)], N) == pytest.approx(N / 2 / B + 3 * A, rel=1e-12)


def test_group_times_and_terms_agree_with_collective_time():
    c = load_cluster("torus:4x4x2")
    rng = np.random.default_rng(3)
    groups = rng.permutation(32).reshape(4, 8)
    for kind in RING_KINDS + (Collective.ALL_TO_ALL,):
        times = collective_group_times(kind, c, groups, N)
        assert collective_time(kind, c, groups, N) == times.max()
        alone = collective_group_times(kind, c, groups[:1], N)[0]
        assert alone <= times[0] * (1 + 1e-12)  # sharing never makes a group faster
    terms = all_reduce_terms(c, groups[1])
    assert terms.seconds(N) == pytest.approx(collective_time(Collective.ALL_REDUCE, c, [groups[1]], N), rel=1e-12)
    for bad, match in (([(0, 1), (1, 2)], r"\[1\]"), ([(0, 99)], "out of range"), ([(0, 0)], "twice")):
        with pytest.raises(ValueError, match=match):
            collective_time(Collective.ALL_GATHER, c, bad, N)


def test_a_network_is_equal_by_its_grid():
    a = grid_network((4, 4), B, A, torus=True)
    assert a == Network(Grid((4, 4), True, (B, B), (A, A))) and hash(a) == hash(grid_network((4, 4), B, A, True))
    assert a != grid_network((4, 4), B, A, torus=False)
    assert a.route(0, 5) == (a.link_of[0, 0, 0], a.link_of[4, 1, 0])  # (0, 0) -> (1, 0) -> (1, 1)


def test_device_nodes_route_ids_through_their_nodes_and_are_checked():
    plain = Grid((4, 4), True, (B, B), (A, A))
    assert Grid((4, 4), True, (B, B), (A, A), tuple(range(16))) == plain  # the identity is spelled None
    nodes = tuple(np.random.default_rng(1).permutation(16).tolist())
    moved = Network(Grid((4, 4), True, (B, B), (A, A), nodes))
    base = Network(plain)
    assert moved != base and moved.route(3, 9) == base.route(nodes[3], nodes[9])
    assert moved.device_coords.tolist() == base.coords[list(nodes)].tolist()
    assert Grid.from_json(moved.grid.to_json()) == moved.grid
    with pytest.raises(ValueError, match="device_nodes must list each of the 16"):
        Grid((4, 4), True, (B, B), (A, A), (0,) * 16)
    data = moved.grid.to_json()
    data["device_nodes"] = ["a"] * 16
    with pytest.raises(ValueError, match="'device_nodes'"):
        Grid.from_json(data)
