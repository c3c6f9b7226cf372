"""The typed sections of a plan file: plan files written before the sections were typed load
into them (fixtures of each plan kind in tests/data/plans), round-trip through save and load,
take the one default schedule when they name none, and malformed sections are refused naming
the field."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from hlomap.cost.pipeline.stages import DEFAULT_SCHEDULE, Schedule
from hlomap.plan import ParameterSpec, Pipeline, PipelineKind, Plan, PlanError, PlanSource

PLANS = Path(__file__).resolve().parents[1] / "data" / "plans"


def _json(name: str) -> dict[str, Any]:
    return json.loads((PLANS / name).read_text())


def _spec(entries: list[Any]) -> tuple[tuple[str, ...] | None, ...]:
    return tuple(None if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in entries)


@pytest.mark.parametrize("name", ["spmd_v1.json", "pipeline_v1.json", "joint_v1.json"])
def test_old_plan_files_load_into_typed_sections_and_round_trip(name: str, tmp_path: Path) -> None:
    data = _json(name)
    plan = Plan.load(PLANS / name)
    assert [p.path for p in plan.parameters] == [p["path"] for p in data["parameters"]]
    assert [p.spec for p in plan.parameters] == [_spec(p["spec"]) for p in data["parameters"]]
    section = data["pipeline"]
    if section is None:
        assert plan.pipeline is None
    else:
        pipeline = plan.pipeline
        assert isinstance(pipeline, Pipeline)
        assert pipeline.kind is PipelineKind(section.get("kind", "cuts"))
        assert pipeline.microbatches == section["microbatches"]
        assert pipeline.schedule is Schedule(section["schedule"])
        assert [s.devices for s in pipeline.stages] == [tuple(s["devices"]) for s in section["stages"]]
        assert [s.layers for s in pipeline.stages] == [tuple(s["layers"]) for s in section["stages"]]
        assert [s.replication for s in pipeline.stages] == [s["replication"] for s in section["stages"]]
        assert [dict(s.mesh) for s in pipeline.stages] == [s.get("mesh", {}) for s in section["stages"]]
        assert [s.specs for s in pipeline.stages] == [
            None if "specs" not in s else tuple(_spec(x) for x in s["specs"]) for s in section["stages"]]
        assert [c.instruction for c in pipeline.cuts] == [c["instruction"] for c in section["cuts"]]
        assert (pipeline.block_profile is not None) == ("block_profile" in section)
        assert pipeline.layer_names == tuple(section.get("layer_names", ()))
        assert plan.logical_stage_devices() == tuple(tuple(s["devices"]) for s in section["stages"])
    saved = tmp_path / name
    plan.save(saved)
    again = Plan.load(saved)
    assert again == plan
    assert again.to_json() == plan.to_json()


def _hand_written(schedule: str | None) -> Plan:
    """A pipeline plan as a user writes it: two stages of two devices, no estimate, maybe no
    schedule, with the block profile of the pipeline fixture so placement can price it."""
    data = _json("pipeline_v1.json")
    section = {"stages": [{"devices": [0, 1]}, {"devices": [2, 3]}], "microbatches": 2,
               "cuts": data["pipeline"]["cuts"], "block_profile": data["pipeline"]["block_profile"]}
    if schedule is not None:
        section["schedule"] = schedule
    return Plan.from_json({**data, "pipeline": section, "estimate": None})


def test_a_plan_without_a_schedule_is_run_and_priced_with_the_one_default() -> None:
    from hlomap.run.pipeline.section import pipeline_section
    from hlomap.tasks.placement.place import problem_from_plan
    from hlomap.tasks.replan.replay_plan import workload_of
    from hlomap.cost.cluster import load_cluster

    plan = _hand_written(None)
    assert plan.pipeline is not None and plan.pipeline.schedule is DEFAULT_SCHEDULE is Schedule.ONE_F_ONE_B
    run_schedule = pipeline_section(plan).schedule
    priced_schedule = problem_from_plan(plan, load_cluster("hier:2x2")).layout.schedule
    replanned_schedule = workload_of(plan)[0].schedule
    assert run_schedule is priced_schedule is replanned_schedule is DEFAULT_SCHEDULE
    assert pipeline_section(_hand_written("gpipe")).schedule is Schedule.GPIPE


def test_the_plan_accepts_the_json_form_of_its_pipeline_section() -> None:
    plan = _hand_written(None)
    built = Plan(mesh=(), parameters=plan.parameters, source=plan.source, pipeline=plan.pipeline.to_json())
    assert built.pipeline == plan.pipeline


def test_a_cut_s_downset_runs_round_trip() -> None:
    data = _json("pipeline_v1.json")
    section = copy.deepcopy(data["pipeline"])
    section["cuts"][0]["downset"] = [["slice.1", "add.4"], ["dot.9", "add.12"]]
    plan = Plan.from_json({**data, "pipeline": section}, where="p.json")
    assert plan.pipeline.cuts[0].downset == (("slice.1", "add.4"), ("dot.9", "add.12"))
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))).pipeline == plan.pipeline


def test_a_stage_s_recompute_round_trips_and_defaults_to_none() -> None:
    from hlomap.plan import Recompute

    data = _json("pipeline_v1.json")
    section = copy.deepcopy(data["pipeline"])
    section["stages"][1]["recompute"] = "full"
    plan = Plan.from_json({**data, "pipeline": section}, where="p.json")
    assert [s.recompute for s in plan.pipeline.stages] == [Recompute.NONE, Recompute.FULL]
    written = plan.to_json()["pipeline"]["stages"]
    assert "recompute" not in written[0] and written[1]["recompute"] == "full"
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))).pipeline == plan.pipeline


def test_a_stage_s_recompute_cuts_and_gradient_specs_round_trip() -> None:
    data = _json("pipeline_v1.json")
    section = copy.deepcopy(data["pipeline"])
    cut = copy.deepcopy(section["cuts"][0])
    section["stages"][0].update(recompute="selective", recompute_cuts=[cut])
    plan = Plan.from_json({**data, "pipeline": section}, where="p.json")
    assert plan.pipeline.stages[0].recompute_cuts[0].instruction == cut["instruction"]
    assert not plan.pipeline.stages[1].recompute_cuts
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))).pipeline == plan.pipeline


@pytest.mark.parametrize("change, message", [
    (lambda s: s.update(schedule="zigzag"), r"pipeline: unknown pipeline schedule 'zigzag'"),
    (lambda s: s.update(stages=[]), r"pipeline: the pipeline section has no stages"),
    (lambda s: s["stages"][1].update(devices=[]), r"pipeline: stage 1: a stage lists no devices"),
    (lambda s: s["stages"][1].update(devices=[1, 2]), r"device\(s\) \[1\] are in two stages"),
    (lambda s: s["stages"][0].update(replication=3), r"stage 0: replication 3 disagrees"),
    (lambda s: s["stages"][0].update(mesh={"data": 4}), r"stage 0: the stage has 2 devices but its mesh"),
    (lambda s: s.update(microbatches=0), r"pipeline: microbatches: expected a whole number >= 1, got 0"),
    (lambda s: s.update(kind="ring"), r"unknown pipeline kind 'ring'"),
    (lambda s: s["cuts"][0].pop("instruction"), r"cut 0: a cut is an object with an 'instruction'"),
    (lambda s: s["cuts"][0].update(downset=[["a"]]), r"cut 0: downset is a non-empty list of \[first, last\]"),
    (lambda s: s["cuts"][0].update(downset=[]), r"cut 0: downset is a non-empty list"),
    (lambda s: s["stages"][1].update(recompute="some"), r"stage 1: recompute 'some': expected none or selective or full"),
    (lambda s: s["stages"][1].update(recompute_cuts=[{"instruction": "add.1"}]),
     r"stage 1: the stage lists recompute_cuts but does not recompute"),
    (lambda s: s["stages"][1].update(recompute="full", recompute_cuts="add.1"), r"stage 1: recompute_cuts is a list"),
    (lambda s: s["stages"][1].update(recompute="full", recompute_cuts=[{}]),
     r"stage 1: recompute cut 0: a cut is an object with an 'instruction'"),
    (lambda s: s["stages"][1].update(shard_gradients=True), r"stage 1: the stage splits its gradients"),
    (lambda s: s["stages"][1].update(shard_gradients="yes"), r"stage 1: shard_gradients is true or false"),
    (lambda s: s["stages"][1].update(gradient_specs=[]), r"stage 1: the stage lists gradient_specs but does not"),
])
def test_malformed_pipeline_sections_are_refused_naming_the_field(change: Any, message: str) -> None:
    data = _json("pipeline_v1.json")
    section = copy.deepcopy(data["pipeline"])
    change(section)
    with pytest.raises(PlanError, match=message):
        Plan.from_json({**data, "pipeline": section}, where="p.json")


def test_a_spec_longer_than_the_parameter_rank_is_refused_on_load(tmp_path: Path) -> None:
    data = _json("spmd_v1.json")
    index = next(i for i, p in enumerate(data["parameters"]) if len(p["shape"]) == 2)
    param = data["parameters"][index]
    param["spec"] = ["model", None, None, None]
    path = tmp_path / "long.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError) as err:
        Plan.load(path)
    text = str(err.value)
    assert str(path) in text and repr(param["path"]) in text and str(param["shape"]) in text
    assert "['model', None, None, None]" in text and "4 entries" in text


def test_a_stage_spec_longer_than_the_parameter_rank_is_refused_on_load() -> None:
    data = _json("joint_v1.json")
    index = next(i for i, p in enumerate(data["parameters"]) if len(p["shape"]) == 2)
    data["pipeline"]["stages"][1]["specs"][index] = ["model", None, None]
    with pytest.raises(PlanError, match=rf"stage 1: parameter {data['parameters'][index]['path']!r} has shape"):
        Plan.from_json(data, where="j.json")


def test_parameter_spec_refuses_more_entries_than_dims() -> None:
    with pytest.raises(PlanError, match=r"parameter 'w' has shape \[4, 4\] \(rank 2\) but its spec"):
        ParameterSpec(0, "w", (4, 4), (("model",), None, None))
    assert ParameterSpec(0, "w", (4, 4), (("model",),)).partition_spec() is not None
    assert Plan(mesh=(("model", 2),), parameters=(ParameterSpec(0, "w", (4, 4), (("model",),)),),
                source=PlanSource("t", "")).parameters[0].spec == (("model",),)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("mesh"), r"missing field\(s\) \['mesh'\] \(is this a plan hlomap explore wrote\?\)"),
    (lambda d: d.pop("parameters"), r"missing field\(s\) \['parameters'\]"),
    (lambda d: d.clear() or d.update(hello=1), r"missing field\(s\) \['version', 'mesh', 'parameters', 'source'\]"),
    (lambda d: d.__setitem__("version", 99), r"plan version 99 is not supported \(expected 1\)"),
    (lambda d: d.__setitem__("mesh", [8]), r"field 'mesh': expected an object with 'axes' \(name: size\), got \[8\]"),
    (lambda d: d.__setitem__("parameters", {}), r"field 'parameters': expected a list, got dict"),
])
def test_a_plan_missing_or_misshaping_a_top_field_names_it(change: Any, message: str) -> None:
    data = _json("spmd_v1.json")
    change(data)
    with pytest.raises(ValueError, match=rf"^p\.json: {message}"):
        Plan.from_json(data, where="p.json")


def test_other_json_given_as_a_plan_says_what_it_is() -> None:
    with pytest.raises(ValueError, match=r"^p\.json: expected a plan \(a JSON object\), got a JSON list"):
        Plan.from_json([1, 2], where="p.json")  # type: ignore[arg-type]
    cluster = {"name": "A", "devices": ["V100-16GB"], "node_of": [0], "bandwidth": [[0]], "latency": [[0]]}
    with pytest.raises(ValueError, match=r"^p\.json: a cluster file, not a plan \(give it to --cluster"):
        Plan.from_json(cluster, where="p.json")


@pytest.mark.parametrize("name, edit, message", [
    ("joint_v1.json", lambda s: s["stages"][1].__setitem__("layers", [18, 23]), "stage 1 has layers [18, 23)"),
    ("joint_v1.json", lambda s: s["stages"][3].__setitem__("layers", [30, 40]), "the stages run layers [0, 40) but "
                                                                              "the pipeline names 31 layers"),
    ("joint_v1.json", lambda s: s["stages"][2].pop("layers"), "give every stage's [start, stop) or none"),
    ("pipeline_v1.json", lambda s: s["stages"][0].__setitem__("layers", [1, 73]), "it must start at 0"),
    ("pipeline_v1.json", lambda s: s["stages"][1].__setitem__("layers", [73, 73]), "are not a range"),
    # a cuts pipeline splits where its cuts say: a boundary moved in the layers alone would not move
    ("pipeline_v1.json", lambda s: (s["stages"][0].__setitem__("layers", [0, 60]),
                                    s["stages"][1].__setitem__("layers", [60, 123])),
     "stage 1 starts at layer 60, but the cut before it follows layer 72 (add.303): the cuts decide where stages "
     "split (the step is split at their instructions), so stage 1 starts at layer 73"),
])
def test_edited_stage_layers_are_refused_naming_the_stage(name: str, edit: Any, message: str) -> None:
    """The joint planner reprices a plan from its stages' layers: a range edited out of order,
    out of the model or away is refused, not ignored; so is a cuts pipeline's range that moves a
    stage boundary its cuts do not."""
    data = _json(name)
    section = copy.deepcopy(data["pipeline"])
    edit(section)
    with pytest.raises(PlanError, match=re.escape(message)):
        Plan.from_json({**data, "pipeline": section}, where="p.json")
    for stage in section["stages"]:
        stage.pop("layers", None)
    assert Plan.from_json({**data, "pipeline": section}, where="p.json").pipeline.stages[0].layers is None


@pytest.mark.parametrize("spec, message", [
    (["model", "model"], "uses mesh axis 'model' twice"),
    (["foo", None], "split on mesh axis 'foo', which the plan's mesh"),
])
def test_plan_load_checks_every_spec_against_the_plan_s_mesh(tmp_path: Path, spec: list[Any], message: str) -> None:
    """As plan-format.md promises: an edited spec is refused on load, naming the parameter, not
    by JAX at the first call."""
    data = _json("spmd_v1.json")
    data["parameters"][0]["spec"] = spec
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=re.escape(f"{path}: parameter 'params/embed/embedding' ") + ".*"
                       + re.escape(message)):
        Plan.load(path)


def test_plan_load_names_the_file_and_position_of_broken_json(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"version": 1,\n  "mesh": }')
    with pytest.raises(PlanError, match=re.escape(f"{path}:2:11: not a plan JSON file: Expecting value")):
        Plan.load(path)


@pytest.mark.parametrize("size", [0, -2, 2.5, "4"])
def test_a_mesh_axis_of_no_devices_is_refused_naming_the_file(size: Any) -> None:
    data = _json("spmd_v1.json")
    data["mesh"]["axes"]["model"] = size
    with pytest.raises(PlanError, match=re.escape(f"p.json: mesh axis 'model' has size {size!r}")):
        Plan.from_json(data, where="p.json")


def test_a_joint_stage_mesh_with_another_axis_is_named() -> None:
    data = _json("joint_v1.json")
    data["pipeline"]["stages"][0]["mesh"] = {"dp": 2, "model": 1}
    with pytest.raises(PlanError, match=re.escape("p.json: pipeline: stage 0: mesh axis 'dp': a joint stage's mesh "
                                                  "has the axes data and model")):
        Plan.from_json(data, where="p.json")
