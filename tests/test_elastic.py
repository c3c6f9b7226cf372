"""`hlomap.elastic`: a loop loses 2 of its 8 devices between steps, re-plans for 6, moves the live
state and goes on; the devices come back and it returns to its 8-device plan. Oracles: the same
loop restarted from the gathered host state at every change (same plans), and the unsharded step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

LOCAL_CLUSTER = Path(__file__).resolve().parent / "data" / "clusters" / "cpu8.cluster.json"
#: Steps run before each change of devices, and the devices in use from then on.
SCHEDULE = ((3, (0, 1, 3, 4, 6, 7)), (6, tuple(range(8))))
STEPS = 9


def _model() -> tuple[Any, Any, Any, Any]:
    """An MLP whose batch (24) and hidden width (48) split over 8 and 6 devices alike."""
    import jax
    import jax.numpy as jnp
    import optax

    import hlomap

    optimizer = optax.adam(1e-2)

    def loss_fn(params: Any, batch: Any) -> Any:
        hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
        return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)

    def train_step(params: Any, opt_state: Any, batch: Any) -> Any:
        loss, grads = hlomap.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    k1, k2, kx, ky = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k1, (16, 48)) / 4, "b1": jnp.zeros(48), "w2": jax.random.normal(k2, (48, 8)) / 7}
    batch = {"x": jax.random.normal(kx, (24, 16)), "y": jax.random.normal(ky, (24, 8))}
    return train_step, params, optimizer.init(params), batch


def _elastic_run(task: str, mesh: Any) -> tuple[Any, list[float], Any, Any]:
    import jax

    import hlomap

    train_step, params, opt_state, batch = _model()
    search = {} if task == "auto" else {"agent": "greedy", "budget_seconds": 5}  # the auto planner is exact
    step = hlomap.elastic(train_step, cluster=str(LOCAL_CLUSTER), task=task, mesh=mesh, **search)
    changes = dict(SCHEDULE)
    losses = []
    for i in range(STEPS):
        if i in changes:
            params, opt_state = step.resize(changes[i], params, opt_state)
            # the moved state lies on the devices in use only (none of the lost ones)
            held = {d for leaf in jax.tree.leaves((params, opt_state)) if hasattr(leaf, "sharding")
                    for d in leaf.sharding.device_set}
            assert held <= set(step.devices) == {jax.devices()[d] for d in changes[i]}
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return step, losses, params, opt_state


@pytest.fixture(scope="module")
def hybrid_run() -> tuple[Any, list[float], Any, Any]:
    return _elastic_run("hybrid", lambda n: {"data": 2, "model": n // 2})


def test_the_loop_re_plans_for_the_survivors_and_comes_back(hybrid_run: Any) -> None:
    import jax

    step, losses, params, _ = hybrid_run
    first, second = step.history
    assert (first.after_steps, first.devices, first.replanned) == (3, (0, 1, 3, 4, 6, 7), True)
    assert first.plan == "mesh data=2,model=3" and first.plan_seconds > 0 and first.reshard_seconds > 0
    # the 8-device plan of the first call is reused when the devices return: only the move is paid
    assert (second.after_steps, second.devices, second.replanned) == (6, tuple(range(8)), False)
    assert second.plan == "mesh data=2,model=4"
    # the live state now sits on all 8 devices, and on none of the lost ones while they were gone
    assert {d for leaf in jax.tree.leaves(params) for d in leaf.sharding.device_set} == set(jax.devices())
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_the_loop_equals_restarting_from_the_gathered_state(hybrid_run: Any) -> None:
    """The same plans, each change made by gathering the state to the host and starting a new step
    from it: the loss curve and the final parameters agree to rounding."""
    import jax

    from hlomap.run import parallelize

    step, losses, params, _ = hybrid_run
    train_step, p, o, batch = _model()
    changes = dict(SCHEDULE)
    devices = tuple(range(8))
    restarted = []
    current = parallelize(train_step, step.step_for(devices).plan, devices=jax.devices())
    p, o = current.place(p, o)
    for i in range(STEPS):
        if i in changes:
            host_p, host_o = current.gather(p, o)
            devices = changes[i]
            current = parallelize(train_step, step.step_for(devices).plan, devices=[jax.devices()[d] for d in devices])
            p, o = current.place(host_p, host_o)
        p, o, loss = current(p, o, batch)
        restarted.append(float(loss))
    np.testing.assert_allclose(losses, restarted, rtol=1e-6)
    for name in params:
        np.testing.assert_allclose(np.asarray(params[name]), np.asarray(p[name]), rtol=1e-6, atol=1e-7)


def _unsharded_run() -> tuple[list[float], Any]:
    """The loss curve and final parameters of the same steps under plain `jax.jit`."""
    import jax

    train_step, p, o, batch = _model()
    jitted = jax.jit(train_step)
    losses = []
    for _ in range(STEPS):
        p, o, loss = jitted(p, o, batch)
        losses.append(float(loss))
    return losses, p


def test_the_loop_follows_the_unsharded_step(hybrid_run: Any) -> None:
    _, losses, params, _ = hybrid_run
    expected, p = _unsharded_run()
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    for name in params:
        scale = float(np.max(np.abs(np.asarray(p[name])))) or 1.0
        np.testing.assert_allclose(np.asarray(params[name]), np.asarray(p[name]), atol=1e-4 * scale)


def test_the_auto_planner_re_plans_and_the_loss_follows() -> None:
    """task="auto" (the default): the planner may choose a pipeline or leave devices idle."""
    step, losses, _, _ = _elastic_run("auto", None)
    assert [e.replanned for e in step.history] == [True, False]
    np.testing.assert_allclose(losses, _unsharded_run()[0], rtol=1e-4)


def test_bad_devices_and_options_are_named() -> None:
    import hlomap

    train_step, params, opt_state, batch = _model()
    with pytest.raises(ValueError, match="needs mesh="):
        hlomap.elastic(train_step, cluster=str(LOCAL_CLUSTER), task="hybrid")
    step = hlomap.elastic(train_step, cluster=str(LOCAL_CLUSTER), task="adp", agent="greedy", budget_seconds=2)
    with pytest.raises(ValueError, match="JAX sees 8 devices"):
        step.resize([0, 9], params, opt_state)
    with pytest.raises(ValueError, match="listed twice"):
        step.resize([1, 1], params, opt_state)
    with pytest.raises(ValueError, match="at least one device"):
        step.resize([], params, opt_state)
    with pytest.raises(TypeError, match="train step function"):
        hlomap.elastic(42)
    with pytest.raises(ValueError, match=r"agent='greedy': the auto task \(the default\) plans with an exact"):
        hlomap.elastic(train_step, cluster=str(LOCAL_CLUSTER), agent="greedy")


def test_the_survivors_cluster_keeps_their_devices_links_and_coordinates() -> None:
    from hlomap.cost.cluster import load_cluster
    from hlomap.elasticity import surviving_cluster

    servers = load_cluster("hier:2x4")
    assert surviving_cluster(servers, range(8)) is servers
    sub = surviving_cluster(servers, (0, 1, 5, 6))
    assert sub.n_devices == 4 and sub.node_of == (0, 0, 1, 1)
    assert sub.bandwidth[0, 1] == servers.bandwidth[0, 1] and sub.bandwidth[1, 2] == servers.bandwidth[1, 5]
    assert sub.coordinates.tolist() == servers.coordinates[[0, 1, 5, 6]].tolist()
    torus = load_cluster("torus:2x4")
    kept = surviving_cluster(torus, (1, 2, 7))
    # the routes need every node of the grid: the survivors keep their coordinates, not the network
    assert kept.network is None and kept.coordinates.tolist() == torus.coordinates[[1, 2, 7]].tolist()
    with pytest.raises(ValueError, match="distinct positions"):
        surviving_cluster(servers, (0, 0))
