"""Traces: the JSON format round-trips, events accumulate into states, bad traces are named."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from hlomap.cost.cluster import hierarchical, load_cluster
from hlomap.tasks.replan.trace import Event, Trace, TraceError, TraceKind, generate, load_trace


@pytest.mark.parametrize("kind", list(TraceKind))
def test_generated_traces_round_trip_through_json(kind, tmp_path):
    trace = generate(kind, "hier:4x2", seed=3, horizon=20_000)
    assert trace.events and all(e.time < trace.horizon for e in trace.events)
    path = tmp_path / "t.json"
    trace.save(path)
    again = load_trace(path)
    assert again.events == trace.events and again.cluster == trace.cluster and again.horizon == trace.horizon
    assert json.loads(path.read_text())["cluster"] == "hier:4x2"  # named when the name rebuilds it


def test_a_cluster_without_a_rebuilding_name_is_written_whole(tmp_path):
    cluster = hierarchical(2, 2, name="lab")
    trace = Trace("t", cluster, 100.0, (Event(10.0, ((0, 1, 1e9),)),))
    trace.save(tmp_path / "t.json")
    assert load_trace(tmp_path / "t.json").cluster == cluster


def test_events_accumulate_into_states():
    cluster = load_cluster("hier:3x2")
    trace = Trace("t", cluster, 1000.0, (Event(10.0, ((0, 1, 1e8),)), Event(20.0, gpus=(2, 0, 1)),
                                         Event(20.0, ((1, 2, 2e8),)), Event(30.0, gpus=(2, 2, 2))))
    states = trace.states()
    assert [t for t, _ in states] == [0.0, 10.0, 20.0, 30.0]
    assert states[0][1].devices == tuple(range(6)) and states[0][1].bandwidth_share() == pytest.approx(1.0)
    after = states[2][1]
    assert after.devices == (0, 1, 4)   # server 1 gone, server 2 offers its first GPU
    assert after.local(4) == 2 and after.local(2) is None
    assert after.cluster.bandwidth[0, 2] == cluster.bandwidth[0, 4]  # servers 0-2: untouched
    assert after.server_bandwidth[0, 1] == 1e8 and after.server_bandwidth[2, 1] == 2e8  # kept from before
    assert states[3][1].n_available == 6 and states[3][1].server_bandwidth[0, 1] == 1e8
    np.testing.assert_array_equal(after.cluster.latency, cluster.latency[np.ix_([0, 1, 4], [0, 1, 4])])


def test_a_straggler_slows_its_device_until_it_recovers():
    """A speed event gives the sub-cluster of the available devices a slowdown of 1 / speed on
    that device (in local ids), and a later event at full speed takes it away."""
    cluster = load_cluster("hier:3x2")
    trace = Trace("t", cluster, 1000.0, (Event(10.0, speed=((3, 0.5),)), Event(20.0, gpus=(2, 1, 2)),
                                         Event(30.0, speed=((3, 1.0),))))
    states = [state for _, state in trace.states()]
    assert states[0].cluster.slowdown is None and states[0].speed_share() == 1.0
    assert states[1].cluster.slowdown == (1.0, 1.0, 1.0, 2.0, 1.0, 1.0)
    assert states[1].speed_share() == pytest.approx(5.5 / 6)
    assert states[2].devices == (0, 1, 2, 4, 5)   # device 3 (server 1's second GPU) left: nothing is slow
    assert states[2].cluster.slowdown is None
    assert states[3].cluster.slowdown is None and states[3].speed == ()


@pytest.mark.parametrize("kind", [TraceKind.LINK, TraceKind.STRAGGLER])
def test_link_and_straggler_traces_change_one_link_or_one_device_at_a_time(kind):
    trace = generate(kind, "hier:4x2", seed=5, horizon=40_000)
    cluster = trace.cluster
    base = np.array([[cluster.bandwidth[np.ix_(cluster.node_array == a, cluster.node_array == b)].min()
                      for b in range(4)] for a in range(4)])
    changed = 0
    for _, state in trace.states():
        assert state.n_available == 8  # nobody leaves
        off = ~np.eye(4, dtype=bool)
        low = np.argwhere(off & (state.server_bandwidth < 0.31 * base))
        if kind is TraceKind.LINK:
            assert len(low) in (0, 2)  # one pair (both directions) at 5-30%, the others within noise
            changed += len(low) > 0
            assert state.cluster.slowdown is None
        else:
            assert not len(low)
            slow = [d for d, f in enumerate(state.speed) if f < 1.0]
            assert len(slow) <= 1 and all(state.speed[d] == 0.5 for d in slow)
            changed += len(slow) == 1
    assert changed >= 2


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(version=2), "version 2"),
    (lambda d: d.pop("horizon_seconds"), "'horizon_seconds'"),
    (lambda d: d["events"].append({"time": 5.0}), r"events\[1\]: time 5.0"),
    (lambda d: d["events"].append({"time": 50.0, "links": [[0, 7, 1e9]]}), r"link \[0, 7\]"),
    (lambda d: d["events"].append({"time": 50.0, "gpus": [2, 2]}), "gpus lists 2 servers"),
    (lambda d: d["events"].append({"time": 50.0, "gpus": [2, 3, 2]}), r"gpus\[1\] = 3"),
    (lambda d: d["events"].append({"time": 50.0, "nodes": 1}), "unknown field"),
    (lambda d: d["events"].append({"time": 50.0, "speed": [[9, 0.5]]}), "device 9 is not one of the cluster's 6"),
    (lambda d: d["events"].append({"time": 50.0, "speed": [[2, 0.0]]}), r"device 2 at 0.0; a speed is a fraction"),
    (lambda d: d["events"].append({"time": 50.0, "speed": [[2]]}), r"speed\[0\]: expected \[device, "),
    (lambda d: d["events"].append({"time": 50.0, "speed": 1}), "speed: expected a list, got 1"),
    (lambda d: d["events"].append({"time": 50.0, "links": "fast"}), "links: expected a list, got 'fast'"),
    (lambda d: d.update(cluster="torus:2xx2"), "shape '2xx2'"),
])
def test_bad_traces_name_the_field(mutate, message, tmp_path):
    data = Trace("t", load_cluster("hier:3x2"), 100.0, (Event(10.0, ((0, 1, 1e9),)),)).to_json()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TraceError, match=message) as raised:
        load_trace(path)
    assert str(raised.value).count("bad.json") == 1  # named once, where it was read from


def test_a_trace_named_after_its_file_is_named_once_in_an_error(tmp_path):
    path = tmp_path / "strag.json"
    path.write_text(json.dumps({"version": 1, "name": str(path), "cluster": "hier:2x2", "horizon_seconds": -5,
                                "events": []}))
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))}: horizon_seconds = -5.0 must be positive$"):
        load_trace(path)
