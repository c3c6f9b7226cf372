"""Pipeline plans on 8 CPU devices: loss and gradients equal the unsharded step's (before the
optimizer, per-leaf scale-relative tolerance), and one step's update equals it where the
gradient is above rounding noise. A representative subset runs by default; the full matrix of
the acceptance criteria is marked slow."""

from __future__ import annotations

import pytest

from hlomap.propagation.graph import FactorGraph
from hlomap.propagation.plans import megatron_plan
from hlomap.propagation.conflicts import MeshAxes
from hlomap.run import parallelize
from tests.run.helpers import (FAST_COMPILE, assert_ok, boundary_pivots, check_gradients, check_update,
                               pipeline_plan, pivots_at)


def _megatron_specs(cap, size: int) -> dict[int, tuple]:
    """Megatron specs on a `model` axis of `size`, per flat parameter index (tensor parallel)."""
    graph = FactorGraph.from_capture(cap)
    axes = MeshAxes.from_mesh({"model": size})
    plan = megatron_plan(graph, ("model",), axes)
    specs = {}
    for p in cap.parameters:
        spec = tuple(None if plan[g] < 0 else axes.options[int(plan[g])] for g in graph.parameter_groups(p.index))
        if any(s is not None for s in spec):
            specs[p.index] = spec
    return specs


def _run(case, plan, executor, *, microbatches_reference=1, update=True):
    step = parallelize(case.model.train_step(), plan, executor=executor, example_args=case.args,
                       compiler_options=FAST_COMPILE)
    comparisons = check_gradients(step, case.args, microbatches_reference)
    if update:
        comparisons += check_update(step, case.args, microbatches_reference)
    assert_ok(comparisons)
    return step


# -- the default subset ---------------------------------------------------------------------------


def test_gpt_two_stages_data_parallel_spmd_executor(zoo_case) -> None:
    """Executor A, GPipe, 2 stages x data-parallel 4, M = 2: the tied embedding is read by both
    stages (its gradient is summed over them)."""
    case = zoo_case("gpt-tiny")
    plan = pipeline_plan(case.cap, case.chain, boundary_pivots(case.chain, 1), microbatches=2, devices_per_stage=4)
    step = _run(case, plan, "spmd")
    description = step.describe()
    assert description.executor == "spmd" and description.mesh == {"stage": 2, "data": 4}
    assert all(c.exact for c in description.cuts)


def test_mlp_four_stages_data_parallel_1f1b_mid_layer_cuts(zoo_case) -> None:
    """Executor B, 1F1B, 4 stages x data-parallel 2, M = 4, cuts inside layers."""
    case = zoo_case("haiku-mlp")
    plan = pipeline_plan(case.cap, case.chain, pivots_at(case.chain, [0.2, 0.45, 0.7]), microbatches=4,
                         schedule="1f1b", devices_per_stage=2)
    _run(case, plan, "mpmd")


def test_mlp_two_stages_tensor_parallel_both_executors(zoo_case) -> None:
    """2 stages x tensor-parallel 4 (Megatron specs inside each stage), M = 4, GPipe on A and B."""
    case = zoo_case("haiku-mlp")
    plan = pipeline_plan(case.cap, case.chain, boundary_pivots(case.chain, 1), microbatches=4, devices_per_stage=4,
                         mesh={"model": 4}, specs=_megatron_specs(case.cap, 4))
    for executor in ("spmd", "mpmd"):
        _run(case, plan, executor, update=executor == "spmd")


def test_uneven_microbatches_name_both_numbers(zoo_case) -> None:
    from hlomap.run.errors import RunError

    case = zoo_case("haiku-mlp")  # batch of 32
    plan = pipeline_plan(case.cap, case.chain, boundary_pivots(case.chain, 1), microbatches=3)
    with pytest.raises(RunError, match=r"batch of 32 examples cannot be split into 3 equal microbatches"):
        parallelize(case.model.train_step(), plan, example_args=case.args)
    plan = pipeline_plan(case.cap, case.chain, boundary_pivots(case.chain, 1), microbatches=16, devices_per_stage=4)
    with pytest.raises(RunError, match=r"microbatch of 2 examples cannot be split over the 4 devices"):
        parallelize(case.model.train_step(), plan, example_args=case.args)
