"""Steps that cannot be split say why (SplitError), and the stage update finds each optimizer
leaf's stage from the step itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import hlomap
from hlomap.run.errors import SplitError
from hlomap.run.pipeline.loss_split import split_loss
from hlomap.run.pipeline.stage_update import plan_update
from hlomap.run.trace import trace_step

WIDTH = 8


def _loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w0"])
    return jnp.mean((h @ params["w1"] - batch["y"]) ** 2)


def _args(optimizer=optax.adam(1e-2)):
    params = {"w0": jnp.ones((WIDTH, WIDTH)) * 0.1, "w1": jnp.ones((WIDTH, 2)) * 0.1}
    batch = {"x": jnp.ones((4, WIDTH)), "y": jnp.zeros((4, 2))}
    return params, optimizer.init(params), batch


def _step(loss=_loss, grad=hlomap.value_and_grad, optimizer=optax.adam(1e-2), calls=1, before=None):
    def train_step(params, opt_state, batch):
        used = before(params) if before else params
        for _ in range(calls):
            value, grads = grad(loss)(used, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return train_step


@pytest.mark.parametrize("step, message", [
    (_step(grad=jax.value_and_grad), "takes no gradient with hlomap.value_and_grad"),
    (_step(calls=2), "calls hlomap.value_and_grad 2 times"),
    (_step(loss=lambda p, b: jnp.tanh(b["x"] @ p["w0"])), "a scalar"),
    (_step(before=lambda p: jax.tree.map(lambda x: 2 * x, p)), "computed in the step before hlomap.value_and_grad"),
])
def test_unsplittable_steps_say_why(step, message: str) -> None:
    with pytest.raises(SplitError, match=message):
        trace_step(step, _args())


def test_batch_leaves_with_different_leading_dims() -> None:
    params, opt_state, batch = _args()
    batch = {**batch, "y": jnp.zeros((3, 2))}
    with pytest.raises(SplitError, match=r"batch leaves \[2\]\['y'\] \(3\) and \[2\]\['x'\] \(4\)"):
        trace_step(_step(loss=lambda p, b: jnp.mean(b["x"] @ p["w0"]) + jnp.mean(b["y"])), (params, opt_state, batch))


def _two_stages(step, optimizer):
    traced = trace_step(step, _args(optimizer))
    eqns = traced.loss.jaxpr.eqns
    cut = next(i for i, e in enumerate(eqns) if e.primitive.name == "tanh")  # stage 0: x @ w0, tanh
    split = split_loss(traced, [0 if i <= cut else 1 for i in range(len(eqns))], 2)
    return traced, split


def test_adam_state_follows_its_parameter() -> None:
    optimizer = optax.adam(1e-2)
    traced, split = _two_stages(_step(optimizer=optimizer), optimizer)
    plan = plan_update(traced, split)
    by_path = dict(zip(traced.paths, plan.residence))
    assert by_path["[0]['w0']"] == {0} and by_path["[0]['w1']"] == {1}
    assert by_path["[1][0].mu['w0']"] == {0} and by_path["[1][0].nu['w1']"] == {1}
    assert by_path["[1][0].count"] == {0, 1}  # Adam's step count: every stage keeps one


def test_a_global_gradient_norm_cannot_run_per_stage() -> None:
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    traced, split = _two_stages(_step(optimizer=optimizer), optimizer)
    with pytest.raises(SplitError, match=r"combines the gradient of .* \(stage\(s\) [01]\) with the gradient of"):
        plan_update(traced, split)


def _jitted_tree_helper(transformation):
    """An optimizer transformation whose update runs a jitted function over the whole tree, as
    optax's bias correction does under current JAX (one `jit` equation reading every leaf)."""
    scale = jax.jit(lambda tree: jax.tree.map(lambda g: g * 0.5, tree), inline=False)

    def update(updates, state, params=None):
        return transformation.update(scale(updates), state, params)

    return optax.GradientTransformation(transformation.init, update)


def test_a_jitted_helper_over_the_tree_runs_per_stage() -> None:
    optimizer = _jitted_tree_helper(optax.adam(1e-2))
    traced, split = _two_stages(_step(optimizer=optimizer), optimizer)
    assert not any(e.primitive.name in ("jit", "pjit") for e in traced.step.jaxpr.eqns)
    plan = plan_update(traced, split)
    by_path = dict(zip(traced.paths, plan.residence))
    assert by_path["[0]['w0']"] == {0} and by_path["[0]['w1']"] == {1}
