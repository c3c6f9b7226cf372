"""`hlomap.value_and_grad` is `jax.value_and_grad` outside a runner, and the zoo's marked step
lowers to the HLO plans were made for."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import hlomap
from hlomap.run.grad import GradCall, intercept, value_and_grad


def loss_fn(w: jax.Array, x: jax.Array, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    y = jnp.tanh(x @ w["a"]) @ w["b"]
    return scale * jnp.mean(y ** 2), jnp.max(y)


def test_same_values_as_jax_value_and_grad() -> None:
    w = {"a": jnp.ones((3, 4)) * 0.1, "b": jnp.arange(8.0).reshape(4, 2)}
    x = jnp.linspace(-1, 1, 6).reshape(2, 3)
    for kwargs in ({"has_aux": True}, {"has_aux": True, "argnums": (0, 1)}):
        mine = value_and_grad(loss_fn, **kwargs)(w, x, scale=2.0)
        theirs = jax.value_and_grad(loss_fn, **kwargs)(w, x, scale=2.0)
        assert jax.tree.structure(mine) == jax.tree.structure(theirs)
        for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)):
            np.testing.assert_array_equal(a, b)
    assert hlomap.value_and_grad is value_and_grad


def test_same_jaxpr_under_jit() -> None:
    w = {"a": jnp.ones((3, 4)), "b": jnp.ones((4, 2))}
    x = jnp.ones((2, 3))
    mine = jax.make_jaxpr(value_and_grad(loss_fn, has_aux=True))(w, x)
    theirs = jax.make_jaxpr(jax.value_and_grad(loss_fn, has_aux=True))(w, x)
    assert str(mine) == str(theirs)


def test_a_handler_receives_the_call() -> None:
    seen: list[GradCall] = []

    def handler(call: GradCall) -> object:
        seen.append(call)
        return call.plain()

    w = {"a": jnp.ones((3, 4)), "b": jnp.ones((4, 2))}
    with intercept(handler):
        value_and_grad(loss_fn, has_aux=True)(w, jnp.ones((2, 3)), scale=3.0)
    assert len(seen) == 1 and seen[0].has_aux and seen[0].argnums == 0 and dict(seen[0].kwargs) == {"scale": 3.0}
    value_and_grad(loss_fn, has_aux=True)(w, jnp.ones((2, 3)))  # the handler is gone again
    assert len(seen) == 1


def test_marked_zoo_step_keeps_the_plans_fingerprint() -> None:
    """The zoo's train step uses the marker; a plan records the HLO fingerprint (text without
    metadata), which must be what `jax.value_and_grad` gives."""
    from hlomap import zoo
    from hlomap.zoo.model import join_other, split_other

    entry = zoo.get("haiku-mlp")
    loss, optimizer = entry.config.make_loss(), entry.optimizer()

    def train_step(params, opt_state, batch):  # the zoo's step with jax.value_and_grad
        trainable, other = split_other(params)
        (value, new_other), grads = jax.value_and_grad(loss, has_aux=True)(trainable, other, batch)
        updates, new_opt_state = optimizer.update(grads, opt_state, trainable)
        return join_other(optax.apply_updates(trainable, updates), new_other), new_opt_state, value

    args = entry.abstract_args()
    marked = hlomap.capture(entry.train_step(), *args)
    plain = hlomap.capture(train_step, *args)
    assert marked.text_sha256 == plain.text_sha256
