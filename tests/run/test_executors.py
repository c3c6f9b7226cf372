"""What the executors do besides the numbers: executor B compiles each stage once and holds at
most S - s microbatches under 1F1B; executor B refuses several processes; SPMD plans run as one
jit with the plan's shardings."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import hlomap
from hlomap.plan import Plan, reference_plan
from hlomap.propagation.graph import FactorGraph
from hlomap.run.errors import RunError
from tests.run.helpers import FAST_COMPILE, boundary_pivots, pipeline_plan, pivots_at


def test_mpmd_compiles_each_stage_once_and_1f1b_bounds_the_stash(zoo_case) -> None:
    case = zoo_case("haiku-mlp")
    pivots = pivots_at(case.chain, [0.3, 0.6])  # 3 stages
    m = 8
    peaks = {}
    for schedule in ("1f1b", "gpipe"):
        plan = pipeline_plan(case.cap, case.chain, pivots, microbatches=m, schedule=schedule, devices_per_stage=2)
        step = hlomap.parallelize(case.model.train_step(), plan, executor="mpmd", compiler_options=FAST_COMPILE)
        params, opt_state = step.place(case.args[0], case.args[1])
        for _ in range(2):  # two steps of M microbatches: nothing traces again
            params, opt_state, loss = step(params, opt_state, case.args[2])
        runner = step._runner
        assert runner.trace_counts == {(kind, s): 1 for kind in ("forward", "backward", "update") for s in range(3)}
        peaks[schedule] = runner.stats.peak_in_flight
        assert np.isfinite(float(loss))
    assert peaks["1f1b"] == [3, 2, 1]  # min(S - s, M): PipeDream-Flush's bound
    assert peaks["gpipe"] == [m, m, m]


def test_mpmd_refuses_several_processes(zoo_case, monkeypatch: pytest.MonkeyPatch) -> None:
    case = zoo_case("haiku-mlp")
    plan = pipeline_plan(case.cap, case.chain, boundary_pivots(case.chain, 1), microbatches=4, schedule="1f1b")
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(RunError, match="single-controller"):
        hlomap.parallelize(case.model.train_step(), plan)


def test_executor_choice() -> None:
    from hlomap.cost.pipeline.stages import Schedule
    from hlomap.run.runner import Executor, choose_executor

    assert choose_executor(Schedule.GPIPE, True, None) is Executor.SPMD
    assert choose_executor(Schedule.ONE_F_ONE_B, True, None) is Executor.MPMD
    assert choose_executor(Schedule.GPIPE, False, None) is Executor.MPMD  # stages with different meshes
    assert choose_executor(Schedule.GPIPE, True, "mpmd") is Executor.MPMD
    with pytest.raises(RunError, match="runs GPipe only"):
        choose_executor(Schedule.ONE_F_ONE_B, True, "spmd")


def test_spmd_plan_is_jit_with_the_plans_shardings(zoo_case) -> None:
    """A hybrid plan (data 2 x model 4) through `parallelize`: the state lands on the plan's
    shardings, stays there after a step, and the step equals the plain one."""
    case = zoo_case("gpt-tiny")
    graph = FactorGraph.from_capture(case.cap)
    array, axes = reference_plan(graph, "dp+megatron", {"data": 2, "model": 4})
    plan = Plan.from_groups(case.cap, graph, array, axes)
    step = hlomap.parallelize(case.model.train_step(), plan, compiler_options=FAST_COMPILE)
    params, opt_state = step.place(case.args[0], case.args[1])
    specs = {p.path: p.partition_spec() for p in plan.parameters}
    query = params["layers_0"]["attn"]["query"]["kernel"]
    assert query.sharding.spec == specs["params/layers_0/attn/query/kernel"] != jax.sharding.PartitionSpec()
    new_params, new_opt_state, loss = step(params, opt_state, case.args[2])
    assert new_params["layers_0"]["attn"]["query"]["kernel"].sharding == query.sharding
    plain = jax.jit(case.model.train_step())(*case.args)
    np.testing.assert_allclose(float(loss), float(plain[2]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(step.gather(new_params, new_opt_state)), jax.tree.leaves(plain[:2])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    assert step.describe().kind == "spmd" and step.describe().mesh == {"data": 2, "model": 4}
