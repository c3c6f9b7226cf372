"""A user's own train step, as `hlomap run --source FILE.py:FUNCTION` loads it: a three-layer
MLP in plain JAX with Adam, its gradient marked with `hlomap.value_and_grad`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

import hlomap

WIDTHS = (32, 64, 64, 16)
BATCH = 16


def _loss(params: dict[str, Any], batch: dict[str, Any]) -> jax.Array:
    x = batch["x"]
    for i in range(len(WIDTHS) - 1):
        with jax.named_scope(f"layer{i}"):
            x = x @ params[f"w{i}"] + params[f"b{i}"]
            if i < len(WIDTHS) - 2:
                x = jnp.tanh(x)
    return jnp.mean((x - batch["y"]) ** 2)


def make() -> tuple[Any, tuple[Any, ...]]:
    optimizer = optax.adam(1e-2)

    def train_step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        loss, grads = hlomap.value_and_grad(_loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    keys = jax.random.split(jax.random.key(0), 2 * len(WIDTHS))
    params = {}
    for i, (a, b) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:])):
        params[f"w{i}"] = jax.random.normal(keys[2 * i], (a, b)) / a ** 0.5
        params[f"b{i}"] = 0.1 * jax.random.normal(keys[2 * i + 1], (b,))
    batch = {"x": jax.random.normal(keys[-2], (BATCH, WIDTHS[0])), "y": jax.random.normal(keys[-1], (BATCH, WIDTHS[-1]))}
    return train_step, (params, optimizer.init(params), batch)


def make_unmarked() -> tuple[Any, tuple[Any, ...]]:
    """The same step with jax.value_and_grad: not pipelinable (the runner cannot find the loss)."""
    optimizer = optax.adam(1e-2)
    _, args = make()

    def train_step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(_loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step, args


def make_raising() -> tuple[Any, tuple[Any, ...]]:
    """A step whose own code fails when traced (the user's bug, to report as theirs)."""
    _, args = make()

    def train_step(params: Any, opt_state: Any, batch: Any) -> Any:
        raise RuntimeError("the step's own bug")

    return train_step, args
