"""Joint plans (pipeline x tensor x data, `hlomap.tasks.joint`) under `hlomap.parallelize` on a
simulated cluster of 2 servers x 4 devices: every stage runs on its own devices and mesh with its
own PartitionSpecs (the stage's `specs`, not the replicated top-level parameters), and the
pipelined step's loss and gradients equal the unsharded step's with the plan's microbatches
(`check_pipeline`)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import jax
import pytest
from jax.sharding import PartitionSpec as P

import hlomap
from hlomap.cost.cluster import hierarchical
from hlomap.cost.pipeline.stages import Schedule
from hlomap.plan import ParameterSpec, PipelineKind, Plan, PlanError, PlanSource, Recompute
from hlomap.run.compare import check_pipeline
from hlomap.run.errors import RunError
from hlomap.run.pipeline.section import pipeline_section
from hlomap.run.runner import Executor
from hlomap.tasks.joint.costs import StageOption
from hlomap.tasks.joint.explore import JointResult, joint_model, joint_plan
from hlomap.tasks.joint.solve import JointSpace, solve
from tests.run.helpers import FAST_COMPILE

CLUSTER = hierarchical(2, 4)


def _stage_specs(plan: Plan, s: int) -> dict[int, Any]:
    """Flat state leaf -> the PartitionSpec stage s of the plan's JSON gives it (the oracle)."""
    specs = plan.pipeline.stages[s].specs
    return {p.index: dataclasses.replace(p, spec=spec).partition_spec() for p, spec in zip(plan.parameters, specs)}


def _check_layout(step: Any, plan: Plan, placed: tuple[Any, Any]) -> int:
    """The placed state sits on each stage's devices with the stage's specs; returns how many
    (stage, leaf) pairs are split over the `model` axis."""
    stages = plan.pipeline.stages
    split = 0
    for staged in step._runner._stage_state(*placed):  # the arrays each stage holds
        layout = staged.layout
        if step.executor is Executor.MPMD:
            for s, held in enumerate(layout.per_stage):
                expected = _stage_specs(plan, s)
                for leaf, value in zip(held, staged.parts[s]):
                    assert value.sharding.spec == expected[leaf], (s, leaf)
                    assert sorted(d.id for d in value.sharding.device_set) == list(stages[s].devices)
                    split += "model" in jax.tree.leaves(tuple(expected[leaf]))
        else:  # the spmd executor stores a split leaf as its local shards, one per slot of the buffer's lead dim
            expected = _stage_specs(plan, 0)
            mesh = dict(stages[0].mesh)
            for leaf in layout.leaves:
                entries = [(d, (e,) if isinstance(e, str) else tuple(e)) for d, e in enumerate(expected[leaf])
                           if e is not None]
                placement = layout.placements[leaf]
                assert (placement.dim, placement.shards) == (
                    (entries[0][0], math.prod(mesh[a] for a in entries[0][1])) if entries else (None, 1)), leaf
                split += any("model" in axes for _, axes in entries)
    return split


def _run_and_check(case: Any, plan: Plan, executor: str | None = None) -> tuple[Any, Any]:
    step = hlomap.parallelize(case.model.train_step(), plan, executor=executor, example_args=case.args,
                              compiler_options=FAST_COMPILE)
    description = step.describe()
    stages = plan.pipeline.stages
    assert [tuple(s.devices) for s in description.stages] == [s.devices for s in stages]
    assert [s.mesh for s in description.stages] == [dict(s.mesh) for s in stages]
    check = check_pipeline(step, case.args)
    # equal in float32 at check_pipeline's tolerances, no float64 rescue
    assert check.exact, "\n".join(c.words() for c in check.comparisons)
    return step, check


# ---------------------------------------------------------------------------------------------
# The planner's optimum
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt-tiny", pytest.param("t5-tiny", marks=pytest.mark.slow)])
def test_the_joint_optimum_runs_with_unsharded_numerics(zoo_case, name: str) -> None:
    case = zoo_case(name)
    plan = hlomap.explore(case.cap, task="auto", cluster=CLUSTER)
    stages = plan.pipeline.stages
    assert plan.pipeline.kind is PipelineKind.JOINT and len(stages) >= 2 and plan.mesh == ()
    used = sorted(d for s in stages for d in s.devices)
    assert used == list(range(len(used)))  # a prefix of the devices: the rest may stay idle
    slowest = max(s.seconds_per_microbatch for s in stages)  # no stage holds only the loss
    assert all(s.seconds_per_microbatch > 1e-3 * slowest for s in stages)
    step, _ = _run_and_check(case, plan)
    assert step.executor is (Executor.MPMD if plan.pipeline.schedule is Schedule.ONE_F_ONE_B else Executor.SPMD)
    for s, stage in enumerate(stages):  # the batch splits over each stage's own data axis
        assert stage.replication == 1 or step._runner.batch_axes[s] == ("data",)
    _check_layout(step, plan, step.place(case.args[0], case.args[1]))


# ---------------------------------------------------------------------------------------------
# A joint plan with tensor parallelism inside its stages
# ---------------------------------------------------------------------------------------------


def _two_tensor_parallel_stages(cap: Any) -> Plan:
    """The planner's best plan with 2 stages of one server each, data 2 x model 2 inside, GPipe:
    stages the optimum does not pick, forced through the space the DP searches."""
    model = joint_model(cap, CLUSTER)
    plan, cost = solve(model, JointSpace((StageOption(4, 2, 2),), (2,), Schedule.GPIPE, max_stages=2))
    return joint_plan(JointResult(model, plan, cost, (), 0.0, "exact", 1))


# the spmd executor with tensor-parallel stages stays in the fast run through
# tests/run/test_pipeline.py::test_mlp_two_stages_tensor_parallel_both_executors
@pytest.mark.parametrize("name,executor", [
    pytest.param("gpt-tiny", "spmd", marks=pytest.mark.slow), ("gpt-tiny", "mpmd"),
    pytest.param("t5-tiny", "spmd", marks=pytest.mark.slow), pytest.param("t5-tiny", "mpmd", marks=pytest.mark.slow),
])
def test_two_stages_with_tensor_parallelism_inside(zoo_case, name: str, executor: str) -> None:
    case = zoo_case(name)
    plan = _two_tensor_parallel_stages(case.cap)
    stages = plan.pipeline.stages
    assert [s.devices for s in stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert all(dict(s.mesh) == {"data": 2, "model": 2} for s in stages)
    assert hlomap.parallelize(case.model.train_step(), plan).executor is Executor.SPMD  # uniform stages: A
    step, _ = _run_and_check(case, plan, executor)
    placed = step.place(case.args[0], case.args[1])
    assert _check_layout(step, plan, placed) > 0  # some weights really are split over `model`


# ---------------------------------------------------------------------------------------------
# Reading the stages' specs
# ---------------------------------------------------------------------------------------------


def _tiny_plan(specs: list[Any], meshes: list[dict[str, int]]) -> Plan:
    parameters = (ParameterSpec(0, "params/w", (4, 3), (None, None)),)
    stages = [{"devices": [2 * s, 2 * s + 1], "mesh": mesh, "specs": spec} for s, (spec, mesh) in
              enumerate(zip(specs, meshes))]
    return Plan(mesh=(), parameters=parameters, source=PlanSource("", ""),
                pipeline={"stages": stages, "cuts": [{"instruction": "add.1"}] * (len(stages) - 1)})


def test_stage_specs_are_read_and_checked() -> None:
    two = [{"model": 2}, {"model": 2}]
    section = pipeline_section(_tiny_plan([[["model", None]], [["model", None]]], two))
    assert section.uniform and section.parameters[0][0].partition_spec() == P("model")
    assert not pipeline_section(_tiny_plan([[["model", None]], [[None, None]]], two)).uniform
    top = Plan(mesh=(("model", 2),), parameters=(ParameterSpec(0, "params/w", (4, 3), (("model",), None)),),
               pipeline={"stages": [{"devices": [0, 1]}]})
    assert pipeline_section(top).parameters == (top.parameters,)  # no stage specs: the top-level ones
    with pytest.raises(RunError, match="stage 1: parameter 'params/w' dim 0 is split on mesh axis 'model'"):
        pipeline_section(_tiny_plan([[["model", None]], [["model", None]]], [{"model": 2}, {"data": 2}]))
    with pytest.raises(PlanError, match="stage 0: 'specs' has 2 entries; the plan has 1 parameters"):
        _tiny_plan([[[None, None], [None, None]], [[None, None]]], two)
    with pytest.raises(PlanError, match=r"parameter 'params/w' has shape \[4, 3\] \(rank 2\) but its spec"):
        _tiny_plan([[[None, None, None]], [[None, None]]], two)
    short = pipeline_section(_tiny_plan([[["model"]], [[None, None]]], two))  # trailing dims replicated
    assert short.parameters[0][0].spec == (("model",), None)
    with pytest.raises(RunError, match="dim 1 has size 3, which its split over model"):
        pipeline_section(_tiny_plan([[[None, "model"]], [[None, None]]], two))


# ---------------------------------------------------------------------------------------------
# The CLI
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow  # 20 s: the joint plan's run and pricing are tested through the API above
def test_cli_explores_runs_and_simulates_a_joint_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hlomap.cli import run

    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps(CLUSTER.to_json()))
    plan_path = tmp_path / "plan.json"
    assert run(["explore", "zoo:gpt-tiny", "--task", "auto", "--cluster", str(cluster), "-q",
                "-o", str(plan_path)]) == 0
    saved = json.loads(plan_path.read_text())
    assert saved["pipeline"]["kind"] == "joint"
    capsys.readouterr()

    assert run(["run", str(plan_path), "--source", "zoo:gpt-tiny", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["float32_equal"] is True and not report["float64"]
    assert [s["devices"] for s in report["description"]["stages"]] == [s["devices"] for s in saved["pipeline"]["stages"]]
    assert [s["mesh"] for s in report["description"]["stages"]] == [s["mesh"] for s in saved["pipeline"]["stages"]]

    # simulate prices the saved plan again, stage by stage: the explorer's own figures
    assert run(["simulate", "zoo:gpt-tiny", "--plan", str(plan_path), "--cluster", str(cluster), "--json"]) == 0
    priced = json.loads(capsys.readouterr().out)
    assert priced["step_seconds"] == pytest.approx(saved["estimate"]["step_seconds"], rel=1e-9)
    assert priced["stage_seconds"] == pytest.approx([s["seconds_per_microbatch"] for s in saved["pipeline"]["stages"]],
                                                    rel=1e-9)
    assert run(["simulate", "zoo:gpt-tiny", "--plan", str(plan_path), "--cluster", str(cluster)]) == 0
    out = capsys.readouterr().out
    assert "a saved plan priced again" in out and "L = " in out
    # on a cluster too small for its stages: one line saying so
    small = tmp_path / "small.json"
    last = max(d for s in saved["pipeline"]["stages"] for d in s["devices"])
    small.write_text(json.dumps(hierarchical(1, last).to_json()))  # one device short
    assert run(["simulate", "zoo:gpt-tiny", "--plan", str(plan_path), "--cluster", str(small)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and "devices" in err


# ---------------------------------------------------------------------------------------------
# Stages that recompute their forward pass
# ---------------------------------------------------------------------------------------------


def _two_stages(cap: Any, recompute: Recompute, schedule: Schedule = Schedule.ONE_F_ONE_B) -> Plan:
    """Two stages of one server each (data 2 x model 2), 2 microbatches, recomputing or not (on
    these roomy devices the planner would not recompute: the stages are marked by hand)."""
    from hlomap.tasks.joint.plans import evaluate

    model = joint_model(cap, CLUSTER)
    plan, _ = solve(model, JointSpace((StageOption(4, 2, 2),), (2,), schedule, max_stages=2))
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, recompute=recompute) for s in plan.stages))
    return joint_plan(JointResult(model, plan, evaluate(model, plan), (), 0.0, "exact", 1))


def _whole(plan: Plan) -> Plan:
    """`plan` with its recomputing stages checkpointed whole (no recompute cuts)."""
    section = plan.pipeline
    stages = tuple(dataclasses.replace(s, recompute_cuts=()) for s in section.stages)
    return dataclasses.replace(plan, pipeline=dataclasses.replace(section, stages=stages))


def _stage_memory(step: Any, s: int) -> tuple[int, int]:
    """(the residual bytes stage s's forward kept at most, the temporary bytes XLA's compiled
    backward program of stage s needs on a device): what holding activations and recomputing
    them cost the stage."""
    backward = step._runner._backward[s]._executables
    assert len(backward) == 1
    return step._runner.stats.peak_residual_bytes[s], next(iter(backward.values())).memory_analysis().temp_size_in_bytes


# selective differs from full by the checkpoint policy only: in the slow run with the spmd executor;
# the fast run checkpoints full recomputation block by block in the test after this one
@pytest.mark.parametrize("executor, recompute", [pytest.param("mpmd", Recompute.FULL, marks=pytest.mark.slow),
                                                 pytest.param("mpmd", Recompute.SELECTIVE, marks=pytest.mark.slow),
                                                 pytest.param("spmd", Recompute.FULL, marks=pytest.mark.slow)])
def test_recomputing_stages_run_with_unsharded_numerics(zoo_case, executor: str, recompute: Recompute) -> None:
    """The plan file says which stages recompute (`"recompute": "full"` or `"selective"`) and, for
    a stage checkpointed one transformer block at a time, the cuts between its blocks
    (`"recompute_cuts"`: the planner writes them where that holds less than checkpointing the stage
    whole, as here). The mpmd executor checkpoints each block, so the forward keeps only the
    blocks' inputs (full) or those and the matmul outputs (selective) for the backward: fewer
    residual bytes than the same stages keeping everything, and selective between the two, as the
    cost model prices their memory. The spmd executor recomputes stages whole (it refuses the
    grouped plan, naming the mpmd executor); either way loss and gradients equal the unsharded
    step's, and `simulate` prices the saved plan as the planner did."""
    case = zoo_case("gpt-tiny")
    schedule = Schedule.ONE_F_ONE_B if executor == "mpmd" else Schedule.GPIPE
    plan = _two_stages(case.cap, recompute, schedule)
    saved = plan.to_json()
    assert [s.get("recompute") for s in saved["pipeline"]["stages"]] == [recompute.value] * 2
    assert all(len(s["recompute_cuts"]) == 1 for s in saved["pipeline"]["stages"])  # layers_0 | layers_1
    assert Plan.from_json(saved).pipeline.stages[0].recompute is recompute
    assert Plan.from_json(saved).pipeline.stages[0].recompute_cuts == plan.pipeline.stages[0].recompute_cuts
    if executor == "spmd":
        with pytest.raises(RunError, match="mpmd executor"):
            hlomap.parallelize(case.model.train_step(), plan, executor="spmd")
        plan = _whole(plan)
    step, _ = _run_and_check(case, plan, executor)
    if executor == "mpmd":
        others = {r: _two_stages(case.cap, r) for r in Recompute if r is not recompute}
        steps = {recompute: step, **{r: hlomap.parallelize(case.model.train_step(), p, executor="mpmd",
                                                            example_args=case.args, compiler_options=FAST_COMPILE)
                                     for r, p in others.items()}}
        for s in steps.values():
            s(*s.place(case.args[0], case.args[1]), *case.args[2:])
        residual = {r: s._runner.stats.peak_residual_bytes[0] for r, s in steps.items()}
        assert residual[Recompute.FULL] < residual[Recompute.SELECTIVE] < residual[Recompute.NONE], residual
        priced = {r: p.pipeline.stages[0].memory_bytes for r, p in {**others, recompute: plan}.items()}
        assert priced[Recompute.FULL] < priced[Recompute.SELECTIVE] < priced[Recompute.NONE], priced
    else:
        assert step._runner.remat
    simulated = hlomap.estimate(case.cap, plan, cluster=CLUSTER)
    assert simulated.step_seconds == pytest.approx(plan.estimate["step_seconds"], rel=1e-9)


def test_checkpointing_block_by_block_keeps_the_blocks_inputs_and_recomputes_one_block_at_a_time(zoo_case) -> None:
    """XLA as the oracle of what a grouped checkpoint buys: the same fully recomputing stages run
    checkpointed block by block (the planner's recompute cuts) and whole. Block by block, the
    forward keeps more (each block's input, not just the stage's) and the compiled backward needs
    less temporary memory (it runs one block's forward again at a time), the trade the planner
    priced when it wrote the cuts. The grouped one gives the unsharded step's loss and gradients."""
    case = zoo_case("gpt-tiny")
    grouped = _two_stages(case.cap, Recompute.FULL)
    steps = {"grouped": _run_and_check(case, grouped, "mpmd")[0],  # checkpointed whole: checked in the slow run
             "whole": hlomap.parallelize(case.model.train_step(), _whole(grouped), executor="mpmd",
                                         example_args=case.args, compiler_options=FAST_COMPILE)}
    for step in steps.values():
        step(*step.place(case.args[0], case.args[1]), *case.args[2:])
    (kept_g, temp_g), (kept_w, temp_w) = _stage_memory(steps["grouped"], 0), _stage_memory(steps["whole"], 0)
    assert kept_g > kept_w and temp_g < temp_w, (kept_g, temp_g, kept_w, temp_w)


def test_one_recomputing_stage_is_the_spmd_plan_checkpointed_block_by_block(zoo_case) -> None:
    """A joint plan of one stage and one microbatch that recomputes stays a pipeline plan (an
    SPMD plan keeps every activation): its blocks checkpointed one by one on the mpmd executor,
    with the unsharded step's loss and gradients, and priced below the same mesh keeping its
    activations."""
    from hlomap.tasks.joint.plans import JointPlan, JointStage, evaluate

    case = zoo_case("gpt-tiny")
    model = joint_model(case.cap, CLUSTER)
    plans = {}
    for recompute in (Recompute.NONE, Recompute.FULL):
        option = StageOption(8, 4, 2, recompute=recompute)
        plan = JointPlan((JointStage.of(0, model.n_layers, 0, option),), 1, Schedule.ONE_F_ONE_B)
        plans[recompute] = joint_plan(JointResult(model, plan, evaluate(model, plan), (), 0.0, "exact", 1))
    assert plans[Recompute.NONE].pipeline is None and dict(plans[Recompute.NONE].mesh) == {"data": 4, "model": 2}
    recomputing = plans[Recompute.FULL]
    (stage,) = recomputing.pipeline.stages
    assert stage.recompute is Recompute.FULL and len(stage.recompute_cuts) == 2  # 3 groups: 2 blocks and the head
    assert stage.memory_bytes < plans[Recompute.NONE].estimate["memory"]["total"]
    step, _ = _run_and_check(case, recomputing)
    assert step.executor is Executor.MPMD


def test_a_recompute_cut_the_step_does_not_have_is_refused_naming_the_recompute_cuts(zoo_case) -> None:
    """A recompute cut after an instruction the step does not have, or out of forward order, is
    a RunError that names the recompute cuts (not a traceback from deep in the split)."""
    case = zoo_case("gpt-tiny")
    data = _two_stages(case.cap, Recompute.FULL).to_json()
    cuts = data["pipeline"]["stages"][0]["recompute_cuts"]
    for change in (lambda c: c[0].update(instruction="no_such.7"),
                   lambda c: c.append(data["pipeline"]["cuts"][0])):
        changed = json.loads(json.dumps(data))
        change(changed["pipeline"]["stages"][0]["recompute_cuts"])
        with pytest.raises(RunError, match="recompute_cuts"):
            hlomap.parallelize(case.model.train_step(), Plan.from_json(changed), example_args=case.args)
    assert cuts  # the plan had one to change
