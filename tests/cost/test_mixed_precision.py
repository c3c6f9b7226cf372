"""A user's mixed-precision model needs nothing special: a Flax NNX model computing in bfloat16
with float32 parameters and optimizer state is captured, priced and run like any other. The cost
model prices each dot at its operands' dtype, the memory model counts each buffer at its dtype,
and a data-parallel plan runs with the unsharded step's loss."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import hlomap
from hlomap.cost.cluster import hierarchical

WIDTH, BATCH = 128, 1024  # activations outweigh the weights
A100 = hierarchical(1, 8, "A100-80GB")


class Mlp(nnx.Module):
    def __init__(self, dtype: Any, rngs: nnx.Rngs):
        self.fc_in = nnx.Linear(WIDTH, 4 * WIDTH, dtype=dtype, rngs=rngs)
        self.fc_out = nnx.Linear(4 * WIDTH, WIDTH, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc_out(jax.nn.gelu(self.fc_in(x)))


def _step_and_args(dtype: Any) -> tuple[Any, tuple[Any, ...]]:
    graphdef, params = nnx.split(Mlp(dtype, nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(params)
    optimizer = optax.adam(1e-3)

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        model = nnx.merge(graphdef, nnx.State(params))
        out = model(batch["x"].astype(dtype))
        return jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2)  # the loss in float32

    def train_step(params: Any, opt_state: Any, batch: Any) -> Any:
        loss, grads = hlomap.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    kx, ky = jax.random.split(jax.random.key(1))
    batch = {"x": jax.random.normal(kx, (BATCH, WIDTH)), "y": jax.random.normal(ky, (BATCH, WIDTH))}
    return train_step, (params, optimizer.init(params), batch)


@pytest.fixture(scope="module")
def captured() -> dict[str, Any]:
    out = {}
    for name, dtype in (("f32", jnp.float32), ("bf16", jnp.bfloat16)):
        step, args = _step_and_args(dtype)
        out[name] = (step, args, hlomap.capture(step, *args))
    return out


def test_bf16_compute_halves_activations_and_keeps_f32_state(captured: dict[str, Any]) -> None:
    f32 = hlomap.estimate(captured["f32"][2], "dp", mesh={"data": 1}, cluster=A100).memory
    bf16 = hlomap.estimate(captured["bf16"][2], "dp", mesh={"data": 1}, cluster=A100).memory
    assert bf16.parameters == f32.parameters and bf16.optimizer == f32.optimizer  # float32 state
    # the forward's values (matmul outputs, the GELU's input) are bfloat16: about half the bytes
    assert 0.4 * f32.max_activations <= bf16.max_activations <= 0.75 * f32.max_activations


def test_bf16_dots_are_priced_at_the_bf16_rate(captured: dict[str, Any]) -> None:
    """On an A100 (bf16 312 TFLOP/s, f32 19.5), the dots of the bfloat16 model cost a sixteenth."""
    def dot_seconds(name: str) -> float:
        est = hlomap.estimate(captured[name][2], "dp", mesh={"data": 1}, cluster=A100)
        return sum(i.seconds for i in est.instructions if i.opcode == "dot")

    assert dot_seconds("bf16") < dot_seconds("f32") / 4


def test_a_data_parallel_plan_of_the_bf16_model_runs_with_its_loss(captured: dict[str, Any]) -> None:
    step, args, cap = captured["bf16"]
    plan = hlomap.explore(cap, task="adp", mesh={"data": 8}, cluster="A", agent="greedy", budget_seconds=10)
    assert any(p.partition_spec() != jax.sharding.PartitionSpec() for p in plan.parameters)
    parallel = hlomap.parallelize(step, plan)
    params, opt_state = parallel.place(args[0], args[1])
    _, _, loss = parallel(params, opt_state, args[2])
    _, _, want = jax.jit(step)(*args)
    np.testing.assert_allclose(float(loss), float(want), rtol=2e-2)  # bfloat16 sums in another order
