"""Device specs, topology builders, JSON round trips and their error messages."""

import dataclasses
import json
import math
import re

import numpy as np
import pytest
from scipy.sparse.csgraph import shortest_path

from hlomap.cost.cluster import (
    Cluster, ClusterSpecError, cluster_preset, first_devices, hierarchical, load_cluster, mesh_topology,
    random_block, uniform,
)
from hlomap.cost.devices import DEVICE_PRESETS, DeviceSpec, DeviceSpecError, device_preset


# -- devices ----------------------------------------------------------------------------------


def test_every_preset_round_trips_and_has_an_f32_rate():
    for name, spec in DEVICE_PRESETS.items():
        assert device_preset(name.lower()) is spec
        assert DeviceSpec.from_json(spec.to_json()) == spec
        assert DeviceSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
        assert spec.flops_for("s32") == spec.flops_for("f32")  # fallback for untyped rates


def test_tensor_core_rates_exceed_fp32_where_the_hardware_has_them():
    for name in ("V100-16GB", "A100-40GB", "A100-80GB", "H100-80GB"):
        spec = device_preset(name)
        assert spec.flops_for("f16") > spec.flops_for("f32")
    # V100 has no bf16 units: XLA computes bf16 in f32.
    assert device_preset("V100-32GB").flops_for("bf16") == device_preset("V100-32GB").flops_for("f32")
    assert device_preset("A100-80GB").hbm_bandwidth > device_preset("A100-40GB").hbm_bandwidth
    assert device_preset("V100-32GB").memory_bytes == 2 * device_preset("V100-16GB").memory_bytes


def test_device_spec_is_frozen_and_hashable():
    spec = device_preset("H100-80GB")
    with pytest.raises(TypeError):
        spec.peak_flops["f32"] = 1.0  # type: ignore[index]
    assert len({spec, device_preset("H100-80GB"), device_preset("A100-80GB")}) == 2


def test_a_device_with_narrow_curves_round_trips_and_one_without_writes_none():
    from dataclasses import replace

    from hlomap.cost.devices import NarrowCurve

    curves = {"dot": NarrowCurve(((8.0, 0.3), (128.0, 1.0))), "convolution": NarrowCurve(((1.0, 0.003), (32.0, 0.9)))}
    spec = replace(device_preset("V100-16GB"), narrow=curves)
    data = json.loads(json.dumps(spec.to_json()))
    assert data["narrow"]["dot"] == {"points": [[8.0, 0.3], [128.0, 1.0]]}
    assert DeviceSpec.from_json(data) == spec and hash(DeviceSpec.from_json(data)) == hash(spec)
    assert "narrow" not in device_preset("V100-16GB").to_json()
    assert spec != device_preset("V100-16GB")
    # a hand-edited kind the cost model has no use for is named, not silently ignored
    data["narrow"]["conv2d"] = {"points": [[1.0, 0.5]]}
    with pytest.raises(DeviceSpecError, match=r"narrow: unknown matrix kind\(s\) \['conv2d'\]; expected keys among "
                                              r"\['convolution', 'dot', 'oversized-convolution'\]"):
        DeviceSpec.from_json(data)


def test_unlimited_memory_is_infinity_written_as_null():
    """PipeDream's optimizer never checks memory: a device may say so, and strict JSON keeps it."""
    from dataclasses import replace

    unlimited = replace(device_preset("V100-16GB"), memory_bytes=math.inf)
    data = unlimited.to_json()
    assert data["memory_bytes"] is None and "Infinity" not in json.dumps(data)
    assert DeviceSpec.from_json(json.loads(json.dumps(data))) == unlimited
    with pytest.raises(DeviceSpecError, match="memory_bytes = nan must be positive"):
        replace(unlimited, memory_bytes=math.nan)


@pytest.mark.parametrize("data, field", [
    ("TPU-v9", "TPU-v9"),
    ({"name": "x", "peak_flops": {"f32": 1e12}, "hbm_bandwidth": 1e12}, "memory_bytes"),
    ({"name": "x", "peak_flops": {"f32": "fast"}, "hbm_bandwidth": 1e12, "memory_bytes": 1}, "peak_flops.f32"),
    ({"name": "x", "peak_flops": {"f16": 1e12}, "hbm_bandwidth": 1e12, "memory_bytes": 1}, "'f32'"),
    ({"name": "x", "peak_flops": {"f32": 1e12}, "hbm_bandwidth": 1e12, "memory_bytes": 1, "efficiency": 2}, "efficiency"),
    ({"name": "x", "peak_flops": {"f32": 1e12}, "hbm_bandwidth": 1e12, "memory_bytes": 1, "colour": 1}, "colour"),
    ({"name": "x", "peak_flops": {"f32": 1e12}, "hbm_bandwidth": 1e12, "memory_bytes": 1,
      "narrow": {"fft": {"points": [[8, 0.5]]}}}, "narrow"),
    ({"name": "x", "peak_flops": {"f32": 1e12}, "hbm_bandwidth": 1e12, "memory_bytes": 1,
      "narrow": {"dot": {"points": [[8, 0.5], [4, 0.9]]}}}, r"narrow\.dot: .*widths \[8.0, 4.0\] must increase"),
    ({"name": "x", "peak_flops": {"f32": 1e12}, "hbm_bandwidth": 1e12, "memory_bytes": 1,
      "narrow": {"dot": {"points": [[8, 0.5], [16, 0.2]]}}}, "must not fall"),
    ({"name": "x", "peak_flops": {"f32": 1e12}, "hbm_bandwidth": 1e12, "memory_bytes": 1,
      "narrow": {"dot": {"points": [[8, 1.5]]}}}, r"share in \(0, 1\]"),
])
def test_bad_device_json_names_the_field(data, field):
    with pytest.raises(DeviceSpecError, match=field):
        DeviceSpec.from_json(data, where="devices[3]")


# -- topologies ---------------------------------------------------------------------------------


def test_hierarchical_tables():
    c = hierarchical(3, 4, "A100-80GB", intra_bw=2e11, inter_bw=1e10, intra_lat=1e-6, inter_lat=1e-5)
    assert c.n_devices == 12 and c.n_nodes == 3
    assert c.node_of == (0,) * 4 + (1,) * 4 + (2,) * 4
    assert c.devices_on(1) == (4, 5, 6, 7)
    for i in range(12):
        for j in range(12):
            if i == j:
                assert c.bandwidth[i, j] == np.inf and c.latency[i, j] == 0
            elif i // 4 == j // 4:
                assert (c.bandwidth[i, j], c.latency[i, j]) == (2e11, 1e-6)
            else:
                assert (c.bandwidth[i, j], c.latency[i, j]) == (1e10, 1e-5)
    assert c.p2p_time(0, 5, 1e6) == pytest.approx(1e-5 + 1e6 / 1e10)
    assert c.p2p_time(0, 1, 1e6) == pytest.approx(1e-6 + 1e6 / 2e11)
    assert c.p2p_time(2, 2, 1e9) == 0.0
    with pytest.raises(IndexError, match="12"):
        c.p2p_time(0, 12, 1.0)


def test_cluster_tables_are_read_only():
    c = cluster_preset("A")
    with pytest.raises(ValueError):
        c.bandwidth[0, 1] = 1.0


@pytest.mark.parametrize("name, servers", [("A", 2), ("B", 3), ("C", 4)])
def test_automap_presets(name, servers):
    c = cluster_preset(name)
    assert c.n_devices == 8 * servers and c.n_nodes == servers
    assert {d.name for d in c.devices} == {"V100-16GB"}
    assert c.bandwidth[0, 8] == pytest.approx(25e9 / 8)  # 25 Gbps between servers
    assert c.bandwidth[0, 7] > 30 * c.bandwidth[0, 8]    # NVLink inside a server
    assert load_cluster(name.lower()) == c


def _grid_graph(shape, torus):
    """Adjacency matrix of a mesh/torus built edge by edge (an independent oracle)."""
    n = int(np.prod(shape))
    adj = np.zeros((n, n))
    for idx in np.ndindex(*shape):
        for axis, size in enumerate(shape):
            nxt = list(idx)
            nxt[axis] += 1
            if nxt[axis] == size:
                if not torus or size <= 2:
                    continue
                nxt[axis] = 0
            a, b = np.ravel_multi_index(idx, shape), np.ravel_multi_index(nxt, shape)
            adj[a, b] = adj[b, a] = 1
    return adj


@pytest.mark.parametrize("shape", [(4, 4), (3, 5), (2, 3, 4), (5,)])
@pytest.mark.parametrize("torus", [False, True])
def test_mesh_latency_is_hops_times_link_latency(shape, torus):
    c = mesh_topology(shape, "H100-80GB", link_bw=5e10, link_lat=2e-6, torus=torus)
    hops = shortest_path(_grid_graph(shape, torus), unweighted=True)
    np.testing.assert_allclose(c.latency, hops * 2e-6, rtol=1e-12)
    off = ~np.eye(c.n_devices, dtype=bool)
    assert np.all(c.bandwidth[off] == 5e10)
    assert c.n_nodes == c.n_devices  # one device per node


def test_mesh_bandwidth_is_the_bottleneck_link():
    c = mesh_topology((2, 3), "A100-80GB", link_bw=(1e9, 2e9), link_lat=(1e-6, 3e-6))
    assert c.bandwidth[0, 1] == 2e9 and c.latency[0, 1] == 3e-6      # along axis 1
    assert c.bandwidth[0, 3] == 1e9 and c.latency[0, 3] == 1e-6      # along axis 0
    assert c.bandwidth[0, 5] == 1e9 and c.latency[0, 5] == 1e-6 + 2 * 3e-6  # both axes
    with pytest.raises(ValueError, match="link_bw"):
        mesh_topology((2, 3), "A100-80GB", link_bw=(1e9, 2e9, 3e9), link_lat=1e-6)


def test_random_block_is_seeded_and_respects_ranges():
    kw = dict(n_devices=20, n_blocks=4, device="A100-80GB", intra_bw=3e11, inter_bw=(1e9, 1e10),
              intra_lat=1e-6, inter_lat=(1e-5, 3e-5))
    a, b, other = random_block(**kw, seed=7), random_block(**kw, seed=7), random_block(**kw, seed=8)
    assert a == b and a != other
    node = np.asarray(a.node_of)
    assert sorted(set(a.node_of)) == [0, 1, 2, 3] and np.all(np.diff(node) >= 0)
    same = node[:, None] == node[None, :]
    off = ~np.eye(20, dtype=bool)
    assert np.all(a.bandwidth[same & off] == 3e11)
    cross = a.bandwidth[~same]
    assert cross.min() >= 1e9 and cross.max() <= 1e10
    np.testing.assert_array_equal(a.bandwidth, a.bandwidth.T)
    # One link per pair of blocks: every device pair between two blocks sees the same one.
    first = {int(b): int(np.argmax(node == b)) for b in set(a.node_of)}
    for i, j in zip(*np.nonzero(~same)):
        assert a.bandwidth[i, j] == a.bandwidth[first[node[i]], first[node[j]]]
    lat = a.latency[~same]
    assert lat.min() >= 1e-5 and lat.max() <= 3e-5


def test_uniform_distance():
    fixed = uniform(6, "V100-32GB", 1e10, 2e-6)
    off = ~np.eye(6, dtype=bool)
    assert np.all(fixed.bandwidth[off] == 1e10) and np.all(fixed.latency[off] == 2e-6)
    drawn = uniform(6, "V100-32GB", (1e9, 2e9), (1e-6, 2e-6), seed=np.random.default_rng(3))
    assert drawn.bandwidth[off].min() >= 1e9 and drawn.bandwidth[off].max() <= 2e9
    assert len(np.unique(drawn.bandwidth[off])) == 15  # one draw per unordered pair
    np.testing.assert_array_equal(drawn.latency, drawn.latency.T)


# -- JSON -------------------------------------------------------------------------------------


def test_json_round_trip_through_a_file(tmp_path):
    custom = DeviceSpec("my-gpu", {"f32": 1e13, "bf16": 1e14}, 1e12, 2**34, efficiency=0.5)
    c = random_block(10, 3, custom, 1e11, (1e9, 2e9), 1e-6, 1e-5, seed=1, nics_per_node=2, name="lab")
    path = tmp_path / "lab.json"
    c.save(path)
    text = path.read_text()
    assert "Infinity" not in text  # strict JSON
    loaded = load_cluster(str(path))
    assert loaded == c and loaded.nics_per_node == 2 and loaded.devices[0] == custom
    preset = cluster_preset("B")
    data = preset.to_json()
    assert data["devices"][0] == "V100-16GB"  # presets are written by name
    assert Cluster.from_json(json.loads(json.dumps(data))) == preset


def _good():
    return cluster_preset("A").to_json()


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.pop("latency"), "latency"),
    (lambda d: d.update(colour="red"), "colour"),
    (lambda d: d.update(name=3), "name"),
    (lambda d: d.update(devices="V100-16GB"), "devices"),
    (lambda d: d["devices"].__setitem__(2, "TPU"), r"devices'\[2\]"),
    (lambda d: d.update(node_of=[0] * 15), "node_of"),
    (lambda d: d["bandwidth"].pop(), "bandwidth"),
    (lambda d: d["bandwidth"][3].__setitem__(5, "fast"), r"'bandwidth'\[3\]\[5\]"),
    (lambda d: d["bandwidth"][3].__setitem__(5, -1.0), r"bandwidth\[3\]\[5\]"),
    (lambda d: d["latency"][1].__setitem__(2, None), r"'latency'\[1\]\[2\]"),
    (lambda d: d.update(nics_per_node=0), "nics_per_node"),
])
def test_bad_json_names_the_field(mutate, field):
    data = _good()
    mutate(data)
    with pytest.raises(ClusterSpecError, match=field) as err:
        Cluster.from_json(data, source="lab.json")
    assert "lab.json" in str(err.value)


def test_load_cluster_errors(tmp_path):
    with pytest.raises(ClusterSpecError, match="nope.json"):
        load_cluster(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x",\n "devices": [}')
    with pytest.raises(ClusterSpecError, match=r"bad.json:2:\d+"):
        load_cluster(str(bad))
    with pytest.raises(ClusterSpecError, match="'D'"):
        cluster_preset("D")


# -- topology strings ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["torus:4x4x2", "mesh:4x4", "hier:4x8", "random:64:7", "random:24:1:5",
                                  "uniform:16", "uniform:12:3", "torus:2x4@H100-80GB"])
def test_topology_strings_round_trip_through_json(text, tmp_path):
    c = load_cluster(text)
    assert c.name == text
    assert Cluster.from_json(json.loads(json.dumps(c.to_json()))) == c
    path = tmp_path / "c.json"
    c.save(path)
    assert load_cluster(str(path)) == c
    assert load_cluster(c.name) == c  # the name is the canonical string: it rebuilds the cluster


def test_topology_strings_build_what_they_name():
    torus = load_cluster("torus:4x4x2")
    assert torus == mesh_topology((4, 4, 2), "A100-80GB", 50e9, 1e-6, torus=True, name="torus:4x4x2")
    assert torus.latency[0, 3] == pytest.approx(2e-6)  # (0,0,0) -> (0,1,1): two hops
    assert torus.latency[0, 24] == pytest.approx(1e-6)  # (0,0,0) -> (3,0,0): one hop round the ring
    hier = load_cluster("hier:2x8")
    assert hier.n_nodes == 2 and np.array_equal(hier.bandwidth, cluster_preset("A").bandwidth)
    blocks = load_cluster("random:64:7")
    assert blocks.n_nodes == 8 and blocks != load_cluster("random:64:8")
    assert load_cluster("random:24:1:5").n_nodes == 5
    off = ~np.eye(12, dtype=bool)
    assert len(np.unique(load_cluster("uniform:12").bandwidth[off])) == 1
    assert len(np.unique(load_cluster("uniform:12:3").bandwidth[off])) > 1
    assert {d.name for d in load_cluster("mesh:2x2@V100-32GB").devices} == {"V100-32GB"}
    assert load_cluster("HIER:2x4@a100-80gb").name == "hier:2x4@A100-80GB"


@pytest.mark.parametrize("text, part", [
    ("tor:4x4", "unknown topology 'tor'"),
    ("local:4", "'local' takes no size or device"),
    ("torus:8xx8", "shape '8xx8'"),
    ("mesh:", "expected mesh:AxB"),
    ("hier:4", "shape '4' needs 2 sizes"),
    ("random:64", "expected random:N:SEED"),
    ("random:x:1", "device count 'x'"),
    ("random:8:-1", "seed '-1'"),
    ("random:8:1:9", "9 blocks do not fit 8 devices"),
    ("uniform:0", "device count '0'"),
    ("torus:4x4@X100", "device 'X100'"),
    ("no-such-preset", "neither a preset"),
])
def test_bad_topology_strings_name_the_bad_part(text, part):
    with pytest.raises(ClusterSpecError, match=re.escape(part)) as info:
        load_cluster(text)
    assert text in str(info.value)


@pytest.mark.parametrize("text, devices", [("torus:64x64x64", 262144), ("mesh:128x128", 16384),
                                           ("hier:2048x8", 16384), ("uniform:10000", 10000),
                                           ("random:9000:1", 9000)])
def test_topologies_beyond_the_table_limit_are_refused_before_allocating(text, devices, monkeypatch):
    # Dense [n, n] tables of a 64x64x64 torus would take a TiB: the string is refused by name,
    # and no table of that size is ever asked for.
    from hlomap.cost import topology

    real_full = np.full

    def guarded_full(shape, *args, **kwargs):
        assert np.prod(shape) <= topology.MAX_TABLE_DEVICES ** 2, f"allocated a {shape} table"
        return real_full(shape, *args, **kwargs)

    monkeypatch.setattr(topology.np, "full", guarded_full)
    with pytest.raises(ClusterSpecError, match=rf"has {devices} devices.*at most {topology.MAX_TABLE_DEVICES}") as info:
        load_cluster(text)
    assert text in str(info.value)


def test_first_devices_keeps_their_links_and_is_one_server_of_a_preset():
    a = cluster_preset("A")
    eight = first_devices(a, 8)
    assert eight == hierarchical(1, 8, "V100-16GB", name="A[:8]")
    assert first_devices(a, 16) is a
    twelve = first_devices(a, 12)
    assert twelve.n_nodes == 2 and twelve.p2p_time(0, 11, 1e6) == a.p2p_time(0, 11, 1e6)
    with pytest.raises(ClusterSpecError, match="has 16 devices; cannot take the first 17"):
        first_devices(a, 17)


def test_shift_period_is_a_server_of_alike_servers() -> None:
    """Servers alike in id order repeat every server; anything that tells two servers apart
    (a slowed device, other links, blocks of other sizes, a single server) leaves no period."""
    import dataclasses

    cluster = hierarchical(4, 8, "A100-80GB")
    assert cluster.shift_period() == 8
    assert hierarchical(1, 8, "A100-80GB").shift_period() == 0
    slowed = dataclasses.replace(cluster, slowdown=(1.0,) * 31 + (2.0,))
    assert slowed.shift_period() == 0
    bandwidth = cluster.bandwidth.copy()
    bandwidth[0, 8] = bandwidth[8, 0] = bandwidth[0, 8] / 2  # one slower link between servers 0 and 1
    assert dataclasses.replace(cluster, bandwidth=bandwidth).shift_period() == 0
    assert random_block(32, 4, "V100-16GB", 150e9, (5e9, 25e9), 3e-6, (5e-6, 2e-5), seed=1).shift_period() == 0
    assert mesh_topology((4, 4), "V100-16GB", 25e9, 1e-6).shift_period() == 0


def test_most_per_node_counts_the_largest_node() -> None:
    """Servers of four, a torus of one device per node, and nodes of unequal size (the largest)."""
    assert hierarchical(3, 4).most_per_node == 4
    assert mesh_topology((2, 2), "V100-16GB", 1e9, 1e-6, torus=True).most_per_node == 1
    cluster = hierarchical(2, 4)
    assert dataclasses.replace(cluster, node_of=(0, 0, 0, 1, 1, 1, 1, 1)).most_per_node == 5
