"""The user's pytrees in and out on every plan kind: a training loop that indexes its
params by key, logs a global norm and saves and restores its state through pickle and numpy runs
unchanged, with equal losses, on an SPMD plan and on a pipeline plan under both executors; a
step fed its own outputs moves no state."""

from __future__ import annotations

import math
import operator
import pickle
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlomap
from hlomap.plan import Plan, reference_plan
from hlomap.propagation.graph import FactorGraph
from hlomap.run.pipeline import mpmd_executor
from hlomap.run.pipeline.spmd_executor import RowLayout
from tests.run.helpers import FAST_COMPILE, pipeline_plan, pivots_at

STEPS = 4
SAVED_AFTER = 1  # the loop saves and restores its state after this step


def _user_loop(step: Any, params: Any, opt_state: Any, batch: Any) -> tuple[list[float], list[float]]:
    """What a user writes around a train step; it knows nothing of plans."""
    losses, norms = [], []
    first_layer = sorted(params)[0]
    structure = jax.tree.structure((params, opt_state))
    shapes = jax.tree.map(np.shape, params)
    for i in range(STEPS):
        params, opt_state, loss = step(params, opt_state, batch)
        assert jax.tree.structure((params, opt_state)) == structure
        assert params[first_layer]["w"].shape == shapes[first_layer]["w"]  # indexed by the user's keys
        # per leaf, then on the host: a pipeline's leaves live on different stages' devices, and
        # JAX combines no arrays committed to different devices (docs/python-api.md)
        squares = jax.tree.map(lambda x: float(jnp.sum(jnp.square(x))), params)
        norms.append(math.sqrt(jax.tree.reduce(operator.add, squares)))
        losses.append(float(loss))
        if i == SAVED_AFTER:
            saved = pickle.dumps(jax.tree.map(np.asarray, (params, opt_state)))
            params, opt_state = pickle.loads(saved)
    return losses, norms


@pytest.fixture(scope="module")
def mlp(zoo_case: Any) -> Any:
    return zoo_case("haiku-mlp")


def _spmd_plan(case: Any) -> Plan:
    graph = FactorGraph.from_capture(case.cap)
    array, axes = reference_plan(graph, "dp", {"data": 8})
    return Plan.from_groups(case.cap, graph, array, axes)


def _pipeline(case: Any) -> Plan:
    """2 stages x data-parallel 4, cut mid-chain (each holds weights), GPipe, M = 2: both executors run it."""
    return pipeline_plan(case.cap, case.chain, pivots_at(case.chain, [0.3]), microbatches=2, devices_per_stage=4)


def test_one_user_loop_runs_unchanged_on_every_plan_kind(mlp: Any) -> None:
    results = {}
    for name, plan, executor in (("spmd plan", _spmd_plan(mlp), None), ("pipeline, spmd executor", _pipeline(mlp), "spmd"),
                                 ("pipeline, mpmd executor", _pipeline(mlp), "mpmd")):
        step = hlomap.parallelize(mlp.model.train_step(), plan, executor=executor, compiler_options=FAST_COMPILE)
        params, opt_state = jax.tree.map(np.asarray, mlp.args[:2])  # as from a checkpoint (a step donates its state)
        results[name] = _user_loop(step, params, opt_state, mlp.args[2])
    losses, norms = results.pop("spmd plan")
    assert len(set(losses)) > 1  # it trains
    for name, (other_losses, other_norms) in results.items():
        np.testing.assert_allclose(other_losses, losses, rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(other_norms, norms, rtol=1e-5, err_msg=name)


def test_mpmd_leaves_live_on_their_home_stage_and_a_step_fed_its_outputs_moves_nothing(
        mlp: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    step = hlomap.parallelize(mlp.model.train_step(), _pipeline(mlp), executor="mpmd", example_args=mlp.args,
                              compiler_options=FAST_COMPILE)
    runner = step._runner
    params, opt_state, _ = step(*jax.tree.map(np.asarray, mlp.args[:2]), mlp.args[2])
    stage_devices = [set(mesh.devices.flat) for mesh in runner.meshes]
    shared = 0
    for layout, tree in ((runner.params, params), (runner.opt, opt_state)):
        for leaf, value in zip(layout.leaves, jax.tree.leaves(tree)):
            assert isinstance(value, jax.Array) and value.sharding.device_set == stage_devices[layout.home(leaf)]
            shared += len(layout.holders(leaf)) > 1
    assert shared > 0  # Adam's step count: every stage reads it, the user's tree holds its home copy
    shardings = [x.sharding for x in jax.tree.leaves((params, opt_state))]
    moved = []
    monkeypatch.setattr(mpmd_executor, "put", lambda value, sharding, **kw: moved.append(sharding))
    params, opt_state, _ = step(params, opt_state, mlp.args[2])
    assert moved == []  # no leaf copied or sent to another stage
    assert [x.sharding for x in jax.tree.leaves((params, opt_state))] == shardings


def test_spmd_executor_keeps_its_rows_for_the_leaves_it_returned(mlp: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    step = hlomap.parallelize(mlp.model.train_step(), _pipeline(mlp), executor="spmd", example_args=mlp.args,
                              compiler_options=FAST_COMPILE)
    params, opt_state, first = step(*jax.tree.map(np.asarray, mlp.args[:2]), mlp.args[2])
    runner = step._runner
    for layout, tree in ((runner.params, params), (runner.opt, opt_state)):
        for leaf, value in zip(layout.leaves, jax.tree.leaves(tree)):  # on its home stage's devices only
            home = runner.stage_meshes[layout.rows[layout.home(leaf)] // runner.repeats]
            assert value.sharding.device_set == set(home.devices.flat)
    assert {x.sharding.device_set == set(runner.stage_meshes[1].devices.flat) for x in jax.tree.leaves(params)} == {
        False, True}  # both stages hold some
    packed = []
    original = RowLayout.host_rows
    monkeypatch.setattr(RowLayout, "host_rows", lambda self, values: packed.append(1) or original(self, values))
    again, again_opt, _ = step(params, opt_state, mlp.args[2])  # its own outputs: the rows it kept
    assert packed == []
    # the same leaves once more: the rows were donated, so they are packed again from the leaves
    # (copies the step did not donate), and the step repeats itself
    repeated, _, _ = step(params, opt_state, mlp.args[2])
    assert len(packed) == 2
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(repeated)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.isfinite(float(first))


def test_an_spmd_step_names_the_argument_shaped_unlike_its_plan() -> None:
    """A batch the mesh does not divide, or trees handed to `place` in the wrong order, are
    explained by the argument's path and the plan's shape, not by JAX's words about an array."""
    from hlomap.run.errors import RunError
    from tests.run.user_step import make

    step, (params, opt_state, batch) = make()
    cap = hlomap.capture(step, params, opt_state, batch)
    graph = FactorGraph.from_capture(cap)
    array, axes = reference_plan(graph, "dp", {"data": 8})
    parallel = hlomap.parallelize(step, Plan.from_groups(cap, graph, array, axes))
    with pytest.raises(RunError, match=r"^place: argument \[0\]\[0\]\.count is shaped \[\], but the plan was "
                                       r"made for \[64\] there \(its parameter 'params/b0'\)"):
        parallel.place(opt_state, params)
    placed = parallel.place(params, opt_state)
    jax.block_until_ready(parallel(*placed, batch)[2])  # as planned: runs
    twelve = jax.tree.map(lambda x: x[:12], batch)
    with pytest.raises(RunError, match=r"^argument \[2\]\['x'\] is shaped \[12, 32\], but the plan was made for "
                                       r"\[16, 32\] there \(its parameter 'batch/x'\)"):
        parallel(*parallel.place(params, opt_state), twelve)
    with pytest.raises(RunError, match=r"nothing was given for its parameter 'batch/x' \(and 1 more\): was an "
                                       r"argument left out\?"):
        parallel(*parallel.place(params, opt_state))
    with pytest.raises(RunError, match=r"nothing was given for its parameter 'batch/y': was an argument left out"):
        parallel(*parallel.place(params, opt_state), {"x": batch["x"]})


def test_an_spmd_step_copies_the_caller_s_own_state_instead_of_deleting_it() -> None:
    """The step donates its state: the state a step or `place` returned is consumed (no copy), but
    arrays of the caller's own are copied first, so that a later `jax.jit` of the same step on
    them still runs, as the pipeline executors already copied them."""
    from tests.run.user_step import make

    step, (params, opt_state, batch) = make()
    cap = hlomap.capture(step, params, opt_state, batch)
    graph = FactorGraph.from_capture(cap)
    array, axes = reference_plan(graph, "dp", {"data": 8})
    parallel = hlomap.parallelize(step, Plan.from_groups(cap, graph, array, axes))
    mine = jax.device_put((params, opt_state))
    out = parallel(*mine, batch)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(mine))
    reference = jax.jit(step)(*mine, batch)
    assert float(out[2]) == pytest.approx(float(reference[2]), rel=1e-6)
    placed = parallel.place(params, opt_state)
    again = parallel(*placed, batch)  # its own: donated
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(placed))
    parallel(again[0], again[1], batch)  # a step's own: donated
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(again[:2]))


def test_a_parallel_step_takes_the_train_step_s_keywords() -> None:
    from tests.run.user_step import make

    step, (params, opt_state, batch) = make()
    cap = hlomap.capture(step, params, opt_state, batch)
    graph = FactorGraph.from_capture(cap)
    array, axes = reference_plan(graph, "dp", {"data": 8})
    parallel = hlomap.parallelize(step, Plan.from_groups(cap, graph, array, axes))
    by_position = parallel(*parallel.place(params, opt_state), batch)[2]
    placed = parallel.place(params, opt_state)
    assert float(parallel(params=placed[0], opt_state=placed[1], batch=batch)[2]) == float(by_position)
    with pytest.raises(TypeError, match=r"^train_step\(\): missing a required argument: 'batch'"):
        parallel(placed[0], opt_state=placed[1])
