"""What the executors do besides the numbers: the mpmd executor compiles each stage once (the last
stage's forward and backward fused where its schedule runs them back to back) and holds at most
S - s microbatches under 1F1B; the mpmd executor refuses several processes; SPMD plans run as one
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
        # the last stage's forward and backward of a microbatch run as one program where its
        # schedule runs them back to back: every microbatch under 1F1B, none under GPipe with
        # M > 1 (its backward passes start at microbatch 0); the last of them runs the stage's
        # update too (no other stage reads the MLP's last parameters)
        fused = schedule == "1f1b"
        expected = {(kind, s): 1 for kind in ("forward", "backward") for s in (range(2) if fused else range(3))}
        expected.update({("update", s): 1 for s in (range(2) if fused else range(3))})
        if fused:
            expected[("forward_backward", 2)] = expected[("forward_backward_update", 2)] = 1
        assert runner.trace_counts == expected
        assert runner.fused == (frozenset(range(m)) if fused else frozenset())
        assert runner.final_update == fused
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
    with pytest.raises(RunError, match="unknown executor 'b'; the pipeline executors are spmd, mpmd"):
        choose_executor(Schedule.GPIPE, True, "b")  # the executors have names, not letters


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


# -- the plan's placement (hlomap place) ------------------------------------------------------


def _device_ids(mesh) -> list[int]:
    return [int(d.id) for d in np.asarray(mesh.devices).flat]


def test_a_placed_spmd_plan_lays_its_mesh_on_the_placement_order(zoo_case) -> None:
    import dataclasses

    from hlomap.plan import Placement

    case = zoo_case("gpt-tiny")
    graph = FactorGraph.from_capture(case.cap)
    array, axes = reference_plan(graph, "dp+megatron", {"data": 2, "model": 4})
    order = (5, 7, 3, 1, 0, 2, 6, 4)
    plan = dataclasses.replace(Plan.from_groups(case.cap, graph, array, axes), placement=Placement(order, "test"))
    step = hlomap.parallelize(case.model.train_step(), plan, compiler_options=FAST_COMPILE)
    params, opt_state = step.place(case.args[0], case.args[1])
    assert _device_ids(params["layers_0"]["attn"]["query"]["kernel"].sharding.mesh) == list(order)
    _, _, loss = step(params, opt_state, case.args[2])
    plain = jax.jit(case.model.train_step())(*case.args)
    np.testing.assert_allclose(float(loss), float(plain[2]), rtol=1e-6)


def test_a_placed_pipeline_plan_runs_each_stage_on_its_placed_devices(zoo_case) -> None:
    import dataclasses

    from hlomap.plan import Placement

    case = zoo_case("haiku-mlp")
    plan = pipeline_plan(case.cap, case.chain, pivots_at(case.chain, [0.5]), microbatches=2, schedule="1f1b",
                         devices_per_stage=4)
    placed = dataclasses.replace(plan, placement=Placement((6, 1, 7, 0, 3, 5, 2, 4), "test"))
    step = hlomap.parallelize(case.model.train_step(), placed, executor="mpmd", compiler_options=FAST_COMPILE)
    params, opt_state = step.place(case.args[0], case.args[1])
    _, _, loss = step(params, opt_state, case.args[2])
    assert [_device_ids(mesh) for mesh in step._runner.meshes] == [[6, 1, 7, 0], [3, 5, 2, 4]]
    assert [s.devices for s in step.describe().stages] == list(placed.stage_devices())
    plain = jax.jit(case.model.train_step())(*case.args)
    np.testing.assert_allclose(float(loss), float(plain[2]), rtol=1e-5)


def test_a_placement_on_devices_jax_does_not_see_is_refused(zoo_case) -> None:
    import dataclasses

    from hlomap.plan import Placement

    case = zoo_case("haiku-mlp")
    plan = pipeline_plan(case.cap, case.chain, pivots_at(case.chain, [0.5]), microbatches=2, devices_per_stage=2)
    placed = dataclasses.replace(plan, placement=Placement((0, 1, 2, 63), "torus:4x4x4"))
    with pytest.raises(RunError, match=r"devices \[63\] that JAX does not see"):
        hlomap.parallelize(case.model.train_step(), placed, executor="mpmd", compiler_options=FAST_COMPILE)


def test_the_runner_order_follows_a_placement_of_stages_listed_out_of_order() -> None:
    from hlomap.plan import Placement, PlanSource
    from hlomap.verify.mesh import ordered_devices

    plan = Plan(mesh=(), parameters=(), source=PlanSource("test", ""), placement=Placement((4, 5, 6, 7, 0)),
                pipeline={"stages": [{"devices": [2, 3]}, {"devices": [0, 1, 5]}], "microbatches": 2})
    order = [int(d.id) for d in ordered_devices(plan)]
    assert [order[i] for i in (2, 3)] == [4, 5] and [order[i] for i in (0, 1, 5)] == [6, 7, 0]
    assert len(set(order)) == len(order)  # id 4, which no stage uses, takes a device no position took


def test_mpmd_averages_a_stages_aux_sums_in_one_program() -> None:
    """The microbatches' aux sums (resnet's batch statistics: a hundred leaves) become means in
    one compiled call per stage, not an eager multiply per leaf; integer leaves pass through."""
    import jax.numpy as jnp

    from hlomap.run.pipeline.mpmd_executor import _means

    sums = (jnp.arange(6.0).reshape(2, 3), jnp.asarray([3, 5], dtype=jnp.int32), jnp.float32(8.0))
    means = _means(sums, 4)
    np.testing.assert_allclose(np.asarray(means[0]), np.arange(6.0).reshape(2, 3) / 4)
    assert means[1].dtype == jnp.int32 and np.asarray(means[1]).tolist() == [3, 5]
    assert float(means[2]) == 2.0
    traces = _means._cache_size()
    _means(tuple(x + 1 for x in sums), 4)  # same shapes: the compiled program is reused
    assert _means._cache_size() == traces


@pytest.mark.parametrize("executor", ["spmd", "mpmd"])
def test_per_example_inputs_beside_the_batch_are_split_with_it(executor: str) -> None:
    """`train_step(params, opt_state, x, y, shift)`: the labels `y` have the batch's leading dim, so
    they are cut into the same microbatches as the batch (before, they reached every microbatch
    whole: a broadcasting error here, and with logits of one example against a batch of integer
    labels, a wrong loss that no error flagged); `shift`, of another leading dim, is passed whole.
    Loss and gradients equal the unsharded step's on both executors, also at microbatches of one
    example."""
    import jax.numpy as jnp
    import optax

    from hlomap.run.compare import check_pipeline

    optimizer = optax.sgd(0.1)

    def train_step(params, opt_state, x, y, shift):
        def loss_fn(p):
            h = jnp.tanh(x @ p["w1"] + shift)
            return jnp.mean((h @ p["w2"] - y[:, None]) ** 2)

        loss, grads = hlomap.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = {"w1": jnp.ones((16, 16)) * 0.1, "w2": jnp.linspace(-1.0, 1.0, 16).reshape(16, 1)}
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16)), dtype=jnp.float32)
    args = (params, optimizer.init(params), x, jnp.arange(8.0), jnp.linspace(0.0, 1.0, 16))
    cap = hlomap.capture(train_step, *args)
    schedule = "gpipe" if executor == "spmd" else "1f1b"
    _, _, want = jax.jit(train_step)(*args)
    for microbatches in (2, 8):
        plan = hlomap.explore(cap, task="pipeline", stages=2, microbatches=microbatches, agent="dp",
                              cluster="hier:1x2", schedule=schedule)
        step = hlomap.parallelize(train_step, plan, executor=executor, example_args=args)
        check = check_pipeline(step, args)
        assert check.exact, "\n".join(c.words() for c in check.comparisons)
        placed = step.place(args[0], args[1])
        _, _, loss = step(*placed, *args[2:])
        np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
