"""Gradient accumulation over microbatches with data parallelism: one gradient all-reduce per
microbatch (what both pipeline executors do today) against one per step.

Both pipeline executors reduce each microbatch's parameter gradients over the stage's data axis
before they add them up: XLA's partitioner materializes a replicated gradient wherever a
partial (per-replica) sum meets a replicated accumulator, inside the microbatch loop (spmd
executor) or at the end of every backward program (mpmd executor). The cost model, like
Megatron-LM, charges one all-reduce per step. This benchmark measures what that costs on the
devices at hand, on a dm-haiku-sized MLP (784-512-512-16, batch 32, 8 data replicas):

- per microbatch: `jax.grad` inside a `lax.scan` over microbatches, the batch split over `data`
  (the executors' pattern);
- per step: each replica's gradient of its own share (`jax.vmap` over a replica axis mapped to
  `data` with `spmd_axis_name`, the parameters broadcast to one copy per replica), accumulated
  per replica, summed over replicas once after the loop.

It checks the two agree (relative difference per leaf) and times them interleaved in rotating
order (`hlomap.verify.timing.time_interleaved`), median and IQR over rounds, with the load
average. The per-step form is exact only when examples of a microbatch do not interact across
replicas (no batch statistics), which is why the executors do not use it yet.

    python scripts/bench_grad_accumulation.py [--microbatches 4] [--rounds 15]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hlomap.verify.timing import time_interleaved  # noqa: E402

REPLICAS = 8
BATCH = 32
SIZES = (784, 512, 512, 16)


def loss(params: dict[str, Any], x: Any, y: Any) -> Any:
    h = x
    for k in range(len(SIZES) - 2):
        h = jax.nn.relu(h @ params[f"w{k}"])
    logits = h @ params[f"w{len(SIZES) - 2}"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def programs(mesh: Any, microbatches: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
    split = NamedSharding(mesh, P(None, "data"))

    @jax.jit
    def per_microbatch(params: Any, x: Any, y: Any) -> Any:
        xs = jax.lax.with_sharding_constraint(x.reshape(microbatches, -1, SIZES[0]), split)
        ys = jax.lax.with_sharding_constraint(y.reshape(microbatches, -1), split)

        def body(acc: Any, xy: Any) -> Any:
            return jax.tree.map(jnp.add, acc, jax.grad(loss)(params, *xy)), None

        acc, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), (xs, ys))
        return jax.tree.map(lambda a: a / microbatches, acc)

    @jax.jit
    def per_step(params: Any, x: Any, y: Any) -> Any:
        xs = jax.lax.with_sharding_constraint(x.reshape(microbatches, REPLICAS, -1, SIZES[0]), split)
        ys = jax.lax.with_sharding_constraint(y.reshape(microbatches, REPLICAS, -1), split)
        copies = jax.tree.map(lambda a: jax.lax.with_sharding_constraint(
            jnp.broadcast_to(a, (REPLICAS,) + a.shape), NamedSharding(mesh, P("data"))), params)
        replica_grad = jax.vmap(jax.grad(loss), spmd_axis_name="data")

        def body(acc: Any, xy: Any) -> Any:
            return jax.tree.map(jnp.add, acc, replica_grad(copies, *xy)), None

        acc, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, copies), (xs, ys))
        return jax.tree.map(lambda a: a.sum(axis=0) / (microbatches * REPLICAS), acc)

    return per_microbatch, per_step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10, help="timed calls per variant per round")
    args = parser.parse_args(argv)
    mesh = jax.make_mesh((REPLICAS,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    keys = jax.random.split(jax.random.key(0), len(SIZES))
    params = {f"w{k}": jax.random.normal(keys[k], (SIZES[k], SIZES[k + 1])) * 0.02 for k in range(len(SIZES) - 1)}
    params = jax.device_put(params, NamedSharding(mesh, P()))
    x = jax.device_put(jax.random.normal(keys[-1], (BATCH, SIZES[0])), NamedSharding(mesh, P("data")))
    y = jax.device_put(jnp.arange(BATCH) % SIZES[-1], NamedSharding(mesh, P("data")))
    variants = dict(zip(("one all-reduce per microbatch", "one all-reduce per step"), programs(mesh, args.microbatches)))
    results = {name: f(params, x, y) for name, f in variants.items()}
    first, second = results.values()
    worst = max(float(jnp.max(jnp.abs(first[k] - second[k])) / jnp.max(jnp.abs(first[k]))) for k in first)
    print(f"largest difference relative to a leaf's scale: {worst:.2e}")
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    timed = time_interleaved({name: (lambda f=f: f(params, x, y)) for name, f in variants.items()},
                             rounds=args.rounds, repeats=args.steps)
    for name, run in timed.items():
        print(f"{name}: median {run.median * 1e3:.1f} ms (IQR {run.iqr * 1e3:.1f} ms) over {len(run.rounds)} rounds")
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
