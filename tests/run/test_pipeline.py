"""Pipeline plans on 8 CPU devices: loss and gradients equal the unsharded step's (before the
optimizer, per-leaf scale-relative tolerance), and one step's update equals it where the
gradient is above rounding noise. A representative subset runs by default; the full matrix of
the acceptance criteria is marked slow."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from hlomap.plan import PipelineStage
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


@pytest.mark.slow  # 19 s; the spmd executor's data-parallel stages run in the fast run on the mlp and one stage
def test_gpt_two_stages_data_parallel_spmd_executor(zoo_case) -> None:
    """The spmd executor, GPipe, 2 stages x data-parallel 4, M = 2: the tied embedding is read by both
    stages (its gradient is summed over them)."""
    case = zoo_case("gpt-tiny")
    plan = pipeline_plan(case.cap, case.chain, boundary_pivots(case.chain, 1), microbatches=2, devices_per_stage=4)
    step = _run(case, plan, "spmd")
    description = step.describe()
    assert description.executor == "spmd" and description.mesh == {"stage": 2, "data": 4}
    assert all(c.exact for c in description.cuts)


def test_mlp_four_stages_data_parallel_1f1b_mid_layer_cuts(zoo_case) -> None:
    """The mpmd executor, 1F1B, 4 stages x data-parallel 2, M = 4, cuts inside layers."""
    case = zoo_case("haiku-mlp")
    plan = pipeline_plan(case.cap, case.chain, pivots_at(case.chain, [0.2, 0.45, 0.7]), microbatches=4,
                         schedule="1f1b", devices_per_stage=2)
    _run(case, plan, "mpmd")


def test_mlp_two_stages_tensor_parallel_both_executors(zoo_case) -> None:
    """2 stages x tensor-parallel 4 (Megatron specs inside each stage), M = 4, GPipe on the spmd and mpmd executors."""
    case = zoo_case("haiku-mlp")
    plan = pipeline_plan(case.cap, case.chain, boundary_pivots(case.chain, 1), microbatches=4, devices_per_stage=4,
                         mesh={"model": 4}, specs=_megatron_specs(case.cap, 4))
    for executor in ("spmd", "mpmd"):
        _run(case, plan, executor, update=executor == "spmd")


@pytest.mark.slow  # the fast suite runs a circular plan in test_circular_plan_on_one_device_stage
def test_gpt_circular_two_stages_two_rounds(zoo_case) -> None:
    """The spmd executor, circular: 4 logical stages over 2 device stages (2 rounds) x data-parallel 2,
    M = 2 (a microbatch comes back to stage 0 in the same tick) and M = 4 (it waits 2 ticks)."""
    case = zoo_case("gpt-tiny")
    for microbatches in (2, 4):
        plan = pipeline_plan(case.cap, case.chain, boundary_pivots(case.chain, 3), microbatches=microbatches,
                             devices_per_stage=2, repeats=2)
        step = _run(case, plan, "spmd", update=microbatches == 4)
        description = step.describe()
        assert description.repeats == 2 and len(description.stages) == 4
        assert [s.devices for s in description.stages] == [(0, 1), (2, 3), (0, 1), (2, 3)]  # stage k on k mod 2


@pytest.mark.parametrize("executor, schedule, microbatches", [("spmd", "gpipe", 1), ("spmd", "gpipe", 4),
                                                               ("mpmd", "1f1b", 1), ("mpmd", "1f1b", 4)])
def test_one_stage_pipelines_equal_the_plain_step(zoo_case, executor: str, schedule: str, microbatches: int) -> None:
    """One stage over 4 devices (what the S = 1 overhead benchmark runs): the spmd executor without the
    shard_map over a one-device stage axis (rematerialized only with several microbatches),
    the mpmd executor with its last stage's passes and update fused into one program."""
    case = zoo_case("haiku-mlp")
    plan = pipeline_plan(case.cap, case.chain, [], microbatches=microbatches, schedule=schedule, devices_per_stage=4)
    step = _run(case, plan, executor)
    if executor == "mpmd":
        assert step._runner.final_update and step._runner.trace_counts[("forward_backward_update", 0)] == 1
        params, opt_state = step.place(*case.args[:2])
        step(params, opt_state, *case.args[2:])
        # the final pass donated the state its update replaced (every leaf here), as the plain jitted step does
        assert all(x.is_deleted() for x in jax.tree.leaves((params, opt_state)))
    else:
        assert step._runner.remat == (microbatches > 1)
        params, opt_state = step._runner._stage_state(*step.place(*case.args[:2]))  # the rows the program takes
        assert "shard_map" not in str(jax.make_jaxpr(step._runner._step)(params, opt_state, *case.args[2:]))
        if microbatches == 1:  # every state leaf in a buffer of its own: read and written whole, no row to assemble
            (compiled,) = step._runner._step_jit.compiled.values()
            assert " concatenate(" not in compiled.as_text()


def test_circular_plan_on_one_device_stage(zoo_case) -> None:
    """The spmd executor, 2 logical stages as 2 rounds of one device stage: what leaves the stage comes
    back to it (a ring of one), M = 2."""
    case = zoo_case("haiku-mlp")
    plan = pipeline_plan(case.cap, case.chain, pivots_at(case.chain, [0.5]), microbatches=2, devices_per_stage=4,
                         repeats=2)
    step = _run(case, plan, "spmd", update=True)
    assert step.describe().repeats == 2


def test_circular_plans_are_checked(zoo_case) -> None:
    from hlomap.run.errors import RunError

    case = zoo_case("haiku-mlp")
    pivots = pivots_at(case.chain, [0.2, 0.45, 0.7])
    plan = pipeline_plan(case.cap, case.chain, pivots, microbatches=1, devices_per_stage=4, repeats=2)
    with pytest.raises(RunError, match="at least as many microbatches as stages.*1 microbatches and 2 stages"):
        parallelize(case.model.train_step(), plan)
    plan = pipeline_plan(case.cap, case.chain, pivots, microbatches=4, devices_per_stage=4, repeats=2)
    with pytest.raises(RunError, match="the mpmd executor does not run circular pipelines"):
        parallelize(case.model.train_step(), plan, executor="mpmd")
    short = pipeline_plan(case.cap, case.chain, pivots[:2], microbatches=4, devices_per_stage=4)
    short = dataclasses.replace(short, pipeline=dataclasses.replace(short.pipeline, repeats=2))  # 3 stages x 2 rounds
    with pytest.raises(RunError, match=r"3 stages x 2 repeats = 6 logical stages need 5 cuts"):
        parallelize(case.model.train_step(), short)


def test_uneven_microbatches_name_both_numbers(zoo_case) -> None:
    from hlomap.run.errors import RunError

    case = zoo_case("haiku-mlp")  # batch of 32
    plan = pipeline_plan(case.cap, case.chain, boundary_pivots(case.chain, 1), microbatches=3)
    with pytest.raises(RunError, match=r"batch of 32 examples cannot be split into 3 equal microbatches"):
        parallelize(case.model.train_step(), plan, example_args=case.args)
    plan = pipeline_plan(case.cap, case.chain, boundary_pivots(case.chain, 1), microbatches=16, devices_per_stage=4)
    with pytest.raises(RunError, match=r"microbatch of 2 examples cannot be split over the 4 devices"):
        parallelize(case.model.train_step(), plan, example_args=case.args)


# -- the acceptance matrix (slow) -----------------------------------------------------------------

EXECUTORS = {"gpipe": "spmd", "1f1b": "mpmd"}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("microbatches", [1, 4, 8])
@pytest.mark.parametrize("stages", [2, 4])
def test_gpt_matrix(zoo_case, stages: int, microbatches: int, schedule: str) -> None:
    case = zoo_case("gpt-tiny")  # batch 8
    per_stage = max(1, min(8 // stages, 8 // microbatches))
    plan = pipeline_plan(case.cap, case.chain, boundary_pivots(case.chain, stages - 1), microbatches=microbatches,
                         schedule=schedule, devices_per_stage=per_stage)
    _run(case, plan, EXECUTORS[schedule])


@pytest.mark.slow
@pytest.mark.parametrize("microbatches", [4, 8])
def test_gpt_circular_four_stages_cuts_inside_layers(zoo_case, microbatches: int) -> None:
    """Circular, 8 logical stages (cuts anywhere, inside layers too) over 4 device stages
    (x data-parallel 2 while a microbatch has 2 examples)."""
    case = zoo_case("gpt-tiny")  # batch of 8
    pivots = pivots_at(case.chain, [k / 8 for k in range(1, 8)])
    plan = pipeline_plan(case.cap, case.chain, pivots, microbatches=microbatches,
                         devices_per_stage=8 // microbatches, repeats=2)
    _run(case, plan, "spmd", update=microbatches == 4)


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["spmd", "mpmd"])
def test_gpt_cuts_inside_layers(zoo_case, executor: str) -> None:
    case = zoo_case("gpt-tiny")
    plan = pipeline_plan(case.cap, case.chain, pivots_at(case.chain, [0.3, 0.55, 0.8]), microbatches=4,
                         devices_per_stage=2)
    step = _run(case, plan, executor)
    assert any(case.chain.pivots[k].scope.split("/")[0] == case.chain.pivots[k + 1].scope.split("/")[0]
               for k in pivots_at(case.chain, [0.3, 0.55, 0.8]))  # some cut lies inside a layer
    assert step.describe().cuts


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["spmd", "mpmd"])
def test_gpt_two_stages_tensor_parallel(zoo_case, executor: str) -> None:
    case = zoo_case("gpt-tiny")
    plan = pipeline_plan(case.cap, case.chain, boundary_pivots(case.chain, 1), microbatches=2, devices_per_stage=4,
                         mesh={"model": 4}, specs=_megatron_specs(case.cap, 4))
    _run(case, plan, executor)


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["spmd", "mpmd"])
def test_gpt_four_stages_data_parallel(zoo_case, executor: str) -> None:
    case = zoo_case("gpt-tiny")
    plan = pipeline_plan(case.cap, case.chain, boundary_pivots(case.chain, 3), microbatches=4, devices_per_stage=2)
    _run(case, plan, executor)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert-tiny", "haiku-mlp"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_other_families(zoo_case, name: str, schedule: str) -> None:
    case = zoo_case(name)
    plan = pipeline_plan(case.cap, case.chain, boundary_pivots(case.chain, 3), microbatches=8, schedule=schedule,
                         devices_per_stage=1)
    _run(case, plan, EXECUTORS[schedule])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_t5_encoder_output_crosses_stages(zoo_case, schedule: str) -> None:
    """Cuts at the end of the encoder and inside the decoder: the encoder output is sent from
    stage 0 through stage 1 to stage 2."""
    case = zoo_case("t5-tiny")
    pivots = case.chain.pivots
    encoder_end = max(k for k, p in enumerate(pivots) if p.scope.startswith("encoder"))
    decoder = min(k for k, p in enumerate(pivots) if p.scope.startswith("decoder/layers_1"))
    plan = pipeline_plan(case.cap, case.chain, [encoder_end, decoder], microbatches=4, schedule=schedule,
                         devices_per_stage=2)
    step = _run(case, plan, EXECUTORS[schedule])
    middle = step.program.split.stages[1]
    assert set(middle.receives) & set(middle.sends)  # passed through


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_resnet_batch_norm(zoo_case, schedule: str) -> None:
    """Batch norm: with M = 1 the pipeline is the plain step (running statistics included); with
    M = 4 each microbatch is normalized with its own statistics and the running statistics are
    averaged over microbatches, which the reference with the same microbatches computes.

    In float64: batch norm's statistics (E[x^2] - E[x]^2 over 8 examples at 1x1 resolution in the
    last stage) are so ill-conditioned in float32 that the unsharded step is 7e-4 (relative) from
    its float64 value and merely splitting the batch over 4 devices (plain jit, no pipeline)
    moves some gradients by 13%; in float64 both agree to 1e-12, and so must the pipeline."""

    import jax

    import hlomap
    from hlomap.verify.numerics import to_float64
    from tests.run.helpers import chain_of

    case = zoo_case("resnet50-tiny")
    executor = EXECUTORS[schedule]
    with jax.enable_x64(True):
        wide = tuple(to_float64(case.args))
        cap = hlomap.capture(case.model.train_step(), *wide)
        chain = chain_of(cap)
        wide_case = case._replace(cap=cap, chain=chain, args=wide)
        one = pipeline_plan(cap, chain, boundary_pivots(chain, 1), microbatches=1, schedule=schedule,
                            devices_per_stage=4)
        _run(wide_case, one, executor)
        four = dataclasses.replace(one, pipeline=dataclasses.replace(
            one.pipeline, microbatches=4, stages=(PipelineStage((0, 1)), PipelineStage((2, 3)))))
        _run(wide_case, four, executor, microbatches_reference=4, update=False)


def test_the_profiles_gradient_buffers_are_the_operands_of_each_stages_all_reduce(zoo_case) -> None:
    """Oracle for `PipelineProfile.gradient_buffers`: the spmd executor's compiled program
    all-reduces each stage's gradient in one all-reduce in its backward branch (XLA's combiner),
    with one operand per trainable array of the stage, as many as the profile counts."""
    import re

    case = zoo_case("haiku-mlp")
    pivots = pivots_at(case.chain, [0.25])  # three of its six arrays on each side
    plan = pipeline_plan(case.cap, case.chain, pivots, microbatches=2, devices_per_stage=4)
    step = parallelize(case.model.train_step(), plan, executor="spmd", example_args=case.args,
                       compiler_options=FAST_COMPILE)
    params, opt_state = step.place(*case.args[:2])
    jax.block_until_ready(step(params, opt_state, *case.args[2:]))
    (compiled,) = step._runner._step_jit.compiled.values()
    operands: dict[int, int] = {}
    for line in compiled.as_text().splitlines():
        found = re.search(r" all-reduce\(([^)]*)\).*transpose\(jvp\(\)\).*branch_(\d+)_fun", line)
        if found:
            stage = int(found.group(2))
            operands[stage] = operands.get(stage, 0) + found.group(1).count("%")
    profile = case.chain.profile
    bounds = [0, pivots[0] + 1, profile.n_layers]
    expected = {k: profile.gradient_buffers_of(slice(bounds[k], bounds[k + 1])) for k in range(2)}
    assert all(expected.values()) and operands == expected
