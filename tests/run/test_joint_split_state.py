"""Joint stages that split their optimizer state over their data replicas (ZeRO-1,
`StageOption.split_state`): the plan file says so per stage, both pipeline executors run it with
the unsharded step's numerics, and each stage keeps its moments split over `data`; the joint
planner prices it (the moments at 1 / data, an all-gather of the updated parameters, 1 / data of
the update) and takes it where it makes a plan fit that would not."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import pytest

import hlomap
from hlomap.cost.cluster import hierarchical
from hlomap.cost.devices import device_preset
from hlomap.cost.pipeline.stages import Schedule
from hlomap.hlo.capture import Role
from hlomap.plan import Plan
from hlomap.run.compare import check_pipeline
from hlomap.tasks.joint.costs import StageOption
from hlomap.tasks.joint.explore import JointResult, joint_model, joint_plan, saved_joint_plan
from hlomap.tasks.joint.plans import evaluate
from hlomap.tasks.joint.solve import JointSpace, solve
from tests.run.helpers import FAST_COMPILE

CLUSTER = hierarchical(2, 4)


def _plan(cap: Any, split: bool) -> tuple[Plan, Any]:
    model = joint_model(cap, CLUSTER)
    option = StageOption(4, 2, 2, split_state=split)
    plan, cost = solve(model, JointSpace((option,), (2,), Schedule.GPIPE, max_stages=2))
    return joint_plan(JointResult(model, plan, cost, (), 0.0, "exact", 1)), cost


def _stepped_on_mpmd(case: Any, plan: Plan, check: bool = True) -> tuple[Any, Any]:
    """The spmd executor refuses `plan` (its stages split their state); the mpmd executor runs it,
    with the unsharded step's loss and gradients when `check`. Returns the step and one step's
    outputs."""
    from hlomap.run.errors import RunError
    from hlomap.run.runner import Executor

    with pytest.raises(RunError, match="spmd executor cannot keep a stage's optimizer state split"):
        hlomap.parallelize(case.model.train_step(), plan, executor="spmd")
    step = hlomap.parallelize(case.model.train_step(), plan, example_args=case.args, compiler_options=FAST_COMPILE)
    assert step.executor is Executor.MPMD
    if check:
        compared = check_pipeline(step, case.args)
        assert compared.exact, "\n".join(c.words() for c in compared.comparisons)
    params, opt_state = step.place(case.args[0], case.args[1])
    return step, step(params, opt_state, *case.args[2:])


def test_split_state_is_priced_and_written_per_stage(zoo_case) -> None:  # type: ignore[no-untyped-def]
    case = zoo_case("gpt-tiny")
    whole, whole_cost = _plan(case.cap, False)
    split, split_cost = _plan(case.cap, True)
    assert all(st.state_axes == ("data",) for st in split.pipeline.stages)
    assert all(st.state_axes == () for st in whole.pipeline.stages)
    # the same stages; each keeps half of its moments (data = 2): 4 x params -> 3 x params
    assert [s.layers for s in split.pipeline.stages] == [s.layers for s in whole.pipeline.stages]
    for a, b in zip(split_cost.stage_memory, whole_cost.stage_memory):
        assert a < b
    # a moment's spec in the stage adds `data` to a dim its parameter leaves whole
    moments = {p.index for p in case.cap.parameters if p.role is Role.OPTIMIZER_STATE and p.shape.rank}
    stage = split.pipeline.stages[0]
    with_data = [i for i in moments if any(s is not None and "data" in s for s in stage.specs[i])]
    assert len(with_data) >= len(moments) // 2
    # the saved plan prices again to the planner's figures
    again = saved_joint_plan(Plan.from_json(split.to_json()).pipeline)
    assert all(st.split_state for st in again.stages)
    model = joint_model(case.cap, CLUSTER)
    assert evaluate(model, again).latency == pytest.approx(split_cost.latency, rel=1e-9)


@pytest.mark.slow  # 17 s; the fast run runs split stages (their parameters too) in the next test but one
def test_split_state_stages_run_with_unsharded_numerics(zoo_case) -> None:  # type: ignore[no-untyped-def]
    """The GPipe plan's stages are alike, yet it runs on the mpmd executor (the spmd one cannot
    keep the state split and says so); loss, gradients and updates equal the unsharded step's and
    the moments stay split over `data` after a step."""
    case = zoo_case("gpt-tiny")
    plan, _ = _plan(case.cap, True)
    _, (_, new_state, _) = _stepped_on_mpmd(case, plan)
    specs = plan.pipeline.stages[0].specs
    offset = len(jax.tree_util.tree_leaves(case.args[0]))
    split = 0
    for k, leaf in enumerate(jax.tree_util.tree_leaves(new_state)):
        if any(s is not None and "data" in s for s in specs[offset + k]):
            split += 1
            assert "data" in jax.tree_util.tree_leaves(tuple(leaf.sharding.spec)), k
    assert split > 0


def test_the_planner_splits_the_state_where_it_makes_a_plan_fit(zoo_case) -> None:  # type: ignore[no-untyped-def]
    """With room to spare the planner splits no state (it would add an all-gather); on devices
    with 20% less memory than its plan needs, splitting a data-parallel stage's state beats every
    plan that keeps the state whole (those need a third stage)."""
    from hlomap.tasks.joint.explore import explore_joint

    case = zoo_case("gpt-tiny")
    roomy = explore_joint(case.cap, CLUSTER, with_grid=False, recompute=False)
    assert not any(st.split_state for st in roomy.plan.stages)
    device = dataclasses.replace(device_preset("V100-16GB"), memory_bytes=max(roomy.cost.stage_memory) * 0.8)
    tight = hierarchical(2, 4, device)
    whole = explore_joint(case.cap, tight, with_grid=False, recompute=False, split_state=False)
    found = explore_joint(case.cap, tight, with_grid=False, recompute=False)
    assert found.cost.fits and whole.cost.fits
    assert any(st.split_state for st in found.plan.stages)
    assert found.cost.latency < whole.cost.latency


def test_split_parameter_stages_are_written_and_run_with_unsharded_numerics(zoo_case) -> None:  # type: ignore[no-untyped-def]
    """A joint plan whose stages keep their parameters split over `data` (FSDP) says so per stage,
    prices again from its file to the planner's figure, runs on the mpmd executor with the
    unsharded step's loss and gradients, and its updated parameters stay split over `data`."""

    case = zoo_case("gpt-tiny")
    model = joint_model(case.cap, CLUSTER)
    option = StageOption(4, 2, 2, split_state=True, shard_parameters=True)
    found, cost = solve(model, JointSpace((option,), (2,), Schedule.GPIPE, max_stages=2))
    plan = Plan.from_json(joint_plan(JointResult(model, found, cost, (), 0.0, "exact", 1)).to_json())
    assert all(st.shard_parameters and st.state_axes == ("data",) for st in plan.pipeline.stages)
    again = saved_joint_plan(plan.pipeline)
    assert all(st.shard_parameters for st in again.stages)
    assert evaluate(model, again).latency == pytest.approx(cost.latency, rel=1e-9)
    trainable = [p.index for p in case.cap.parameters if p.role is Role.TRAINABLE and p.shape.rank]
    specs = plan.pipeline.stages[0].specs
    assert sum(any(s is not None and "data" in s for s in specs[i]) for i in trainable) >= len(trainable) // 2
    _, (new_params, _, _) = _stepped_on_mpmd(case, plan)
    split = [leaf for k, leaf in enumerate(jax.tree_util.tree_leaves(new_params))
             if any(s is not None and "data" in s for s in specs[k])]
    assert split and all("data" in jax.tree_util.tree_leaves(tuple(leaf.sharding.spec)) for leaf in split)


def _gradient_bytes(step: Any, specs: Any, mesh_shape: dict[str, int]) -> int:
    """Bytes on one device of stage 0's parameter gradients laid out as `specs` say (one spec per
    plan parameter): what its backward program returns."""
    import math

    program = step._runner.program
    leaves = [program.micro.loss_inputs[p].leaf for p in program.split.stages[0].params]
    flat = jax.tree_util.tree_leaves(program.micro.step.jaxpr.invars)
    total = 0
    for leaf in leaves:
        aval = flat[leaf].aval
        split = math.prod(mesh_shape[a] for entry in specs[leaf] if entry is not None for a in entry)
        total += aval.size * aval.dtype.itemsize // split
    return total


def test_split_gradient_stages_keep_their_gradients_split_as_xla_compiles_them(zoo_case) -> None:  # type: ignore[no-untyped-def]
    """A joint plan whose stages split their gradients over `data` (ZeRO-2, `"shard_gradients"`
    with each gradient's spec) runs with the unsharded step's loss and gradients (on the mpmd
    executor, as every plan that splits its state; ZeRO-1's numerics: the slow test above), prices again
    from its file to the planner's figure, and below the same stages splitting only their
    optimizer state (ZeRO-1) in memory. XLA as the oracle of the layout: the compiled backward
    program of the first stage returns exactly the bytes of its gradients under their split
    specs, less than half of what it returns under ZeRO-1."""
    case = zoo_case("gpt-tiny")
    model = joint_model(case.cap, CLUSTER)
    steps, plans, costs = {}, {}, {}
    for name, option in (("zero1", StageOption(4, 2, 2, split_state=True)),
                         ("zero2", StageOption(4, 2, 2, split_state=True, shard_gradients=True))):
        found, costs[name] = solve(model, JointSpace((option,), (2,), Schedule.GPIPE, max_stages=2))
        plans[name] = Plan.from_json(joint_plan(JointResult(model, found, costs[name], (), 0.0, "exact", 1)).to_json())
        steps[name], _ = _stepped_on_mpmd(case, plans[name], check=name == "zero2")  # ZeRO-1's: in the slow run
    stages = plans["zero2"].pipeline.stages
    assert all(st.shard_gradients and st.gradient_specs is not None for st in stages)
    assert not any(st.shard_gradients for st in plans["zero1"].pipeline.stages)
    again = saved_joint_plan(plans["zero2"].pipeline)
    assert all(st.shard_gradients for st in again.stages)
    assert evaluate(model, again).latency == pytest.approx(costs["zero2"].latency, rel=1e-9)
    assert all(a < b for a, b in zip(costs["zero2"].stage_memory, costs["zero1"].stage_memory))
    mesh = dict(stages[0].mesh)
    returned = {}
    for name, step in steps.items():
        backward = next(iter(step._runner._backward[0]._executables.values()))
        # XLA counts the result tuple's table too: a pointer (8 bytes) per gradient returned
        table = 8 * len(jax.tree_util.tree_leaves(backward.output_shardings))
        returned[name] = backward.memory_analysis().output_size_in_bytes - table
    assert returned["zero2"] == _gradient_bytes(steps["zero2"], stages[0].gradient_specs, mesh)
    # ZeRO-1's come out at least whole over `data` (as XLA chooses: the tied embedding's whole)
    assert returned["zero1"] >= _gradient_bytes(steps["zero1"], plans["zero1"].pipeline.stages[0].specs, mesh)
    assert returned["zero2"] < returned["zero1"] / 2
