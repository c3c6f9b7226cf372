"""The plan's placement section: JSON round trips, old plans without it, validation, and the
device order a runner builds its mesh from."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import numpy as np
import pytest

from hlomap.plan import Placement, Plan, PlanError, PlanSource

SPMD = Plan(mesh=(("data", 2), ("model", 4)), parameters=(), source=PlanSource("test", "abc"))
PIPELINE = Plan(mesh=(), parameters=(), source=PlanSource("test", "abc"),
                pipeline={"stages": [{"layers": [0, 3], "devices": [0, 1]}, {"layers": [3, 5], "devices": [2, 3, 4]}],
                          "microbatches": 4, "schedule": "1f1b"})


def test_without_a_placement_the_order_is_the_identity():
    assert SPMD.placement is None and SPMD.device_order() == tuple(range(8))
    assert PIPELINE.device_order() == (0, 1, 2, 3, 4)
    assert PIPELINE.stage_devices() == ((0, 1), (2, 3, 4))
    assert SPMD.stage_devices() == ()


def test_placement_round_trips_and_orders_the_devices(tmp_path):
    placed = dataclasses.replace(SPMD, placement=Placement((7, 3, 12, 0, 1, 2, 9, 4), "torus:2x2x4", "greedy",
                                                           1.5e-3, 2.0e-3))
    path = tmp_path / "plan.json"
    placed.save(path)
    data = json.loads(path.read_text())
    assert data["placement"] == {"devices": [7, 3, 12, 0, 1, 2, 9, 4], "cluster": "torus:2x2x4", "solver": "greedy",
                                 "step_seconds": 1.5e-3, "identity_step_seconds": 2.0e-3}
    loaded = Plan.load(path)
    assert loaded == placed and loaded.device_order() == (7, 3, 12, 0, 1, 2, 9, 4)
    stages = dataclasses.replace(PIPELINE, placement=Placement((5, 6, 0, 1, 2)))
    assert Plan.from_json(json.loads(json.dumps(stages.to_json()))).stage_devices() == ((5, 6), (0, 1, 2))


def test_a_plan_written_before_placements_existed_still_loads():
    data = SPMD.to_json()
    del data["placement"]
    assert Plan.from_json(data) == SPMD


def test_physical_devices_map_the_ids_a_pipeline_names_to_their_placed_devices():
    """Positions run stage by stage in the order each stage lists its devices, which need not be
    the plan's device ids in order: the runner indexes by id, so the map must follow the listing."""
    shuffled = Plan(mesh=(), parameters=(), source=PlanSource("test", "abc"),
                    pipeline={"stages": [{"devices": [3, 2]}, {"devices": [0, 1]}], "microbatches": 2})
    placed = dataclasses.replace(shuffled, placement=Placement((10, 11, 12, 13)))
    assert placed.physical_devices() == {3: 10, 2: 11, 0: 12, 1: 13}
    assert placed.stage_devices() == ((10, 11), (12, 13))
    assert SPMD.physical_devices() == {i: i for i in range(8)}


def test_the_runner_can_build_its_mesh_from_the_order():
    placed = dataclasses.replace(SPMD, placement=Placement((7, 6, 5, 4, 3, 2, 1, 0)))
    devices = np.asarray(jax.devices())[list(placed.device_order())].reshape(tuple(placed.mesh_shape.values()))
    mesh = jax.sharding.Mesh(devices, tuple(placed.mesh_shape))
    assert mesh.devices[0, 0].id == 7 and mesh.devices[1, 3].id == 0


@pytest.mark.parametrize("devices, message", [
    ((0, 1, 2), "lists 3 devices but the plan has 8 logical positions (mesh {'data': 2, 'model': 4})"),
    ((0, 1, 2, 3, 4, 5, 6, 6), "two logical positions on device(s) [6]"),
    ((0, 1, 2, 3, 4, 5, 6, -1), "non-negative integers"),
])
def test_bad_placements_say_what_is_wrong(devices, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        dataclasses.replace(SPMD, placement=Placement(devices))


def test_bad_placement_json_names_the_file():
    data = SPMD.to_json()
    data["placement"] = {"devices": [0, 1, 2, 3, 4, 5, 6, 7], "step_seconds": "fast"}
    with pytest.raises(PlanError, match=r"plan\.json: placement: field 'step_seconds'"):
        Plan.from_json(data, where="plan.json")
    data["placement"] = {"devices": [0, 0, 1, 2, 3, 4, 5, 6]}
    with pytest.raises(PlanError, match=r"plan\.json: placement: .*device\(s\) \[0\]"):
        Plan.from_json(data, where="plan.json")


def test_a_plan_reads_in_one_line(zoo_capture, zoo_graph):
    """`repr(plan)` says what the plan is in one short line (the generated one listed every
    parameter: about 10,000 characters for haiku-mlp, far more for a GPT)."""
    from hlomap.plan import resolve_plan

    cap, graph = zoo_capture("haiku-mlp"), zoo_graph("haiku-mlp")
    array, axes, _ = resolve_plan(graph, "dp", {"data": 8})
    plan = Plan.from_groups(cap, graph, array, axes).with_sharded_state(graph, parameters=True)
    text = repr(plan)
    assert "\n" not in text and len(text) < 200
    assert "mesh {'data': 8}" in text and "state leaves split over data" in text and "jax:" in text
    pipeline = repr(dataclasses.replace(PIPELINE, placement=Placement((4, 3, 2, 1, 0), "hier:1x8", "greedy")))
    assert pipeline == "Plan(for test: cuts pipeline of 2 stages on 5 devices, M=4, 1f1b; placed)"
