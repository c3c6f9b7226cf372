"""Traces: the JSON format round-trips, events accumulate into states, bad traces are named."""

from __future__ import annotations

import json

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


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(version=2), "version 2"),
    (lambda d: d.pop("horizon_seconds"), "'horizon_seconds'"),
    (lambda d: d["events"].append({"time": 5.0}), r"events\[1\]: time 5.0"),
    (lambda d: d["events"].append({"time": 50.0, "links": [[0, 7, 1e9]]}), r"link \[0, 7\]"),
    (lambda d: d["events"].append({"time": 50.0, "gpus": [2, 2]}), "gpus lists 2 servers"),
    (lambda d: d["events"].append({"time": 50.0, "gpus": [2, 3, 2]}), r"gpus\[1\] = 3"),
    (lambda d: d["events"].append({"time": 50.0, "speed": 1}), "unknown field"),
    (lambda d: d.update(cluster="torus:2xx2"), "shape '2xx2'"),
])
def test_bad_traces_name_the_field(mutate, message, tmp_path):
    data = Trace("t", load_cluster("hier:3x2"), 100.0, (Event(10.0, ((0, 1, 1e9),)),)).to_json()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TraceError, match=message):
        load_trace(path)
