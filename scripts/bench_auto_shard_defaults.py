"""`@hlomap.auto_shard` with every default on the devices present, against plain `jax.jit`: what a
new user gets on their first day (made for one GPU, where the 8 simulated CPU devices of the tests
never look). For each case: the decorated step's first call (its timings: capture, the `local`
calibration on first use, search, measuring, compile), the plan and its measured candidates, the
first step's loss against `jax.jit`'s, then `--rounds` interleaved rounds of `--repeats` steps of
each (median of round medians, IQR) and their ratio. With more than one device it also times plain
`jax.jit` data parallelism: the parameters and optimizer state replicated on every device, the
batch split along its first dim (the goal: `auto_shard` is never slower than it).

    python scripts/bench_auto_shard_defaults.py [--cases user-mlp,gpt-small] [--rounds 20]
        [--repeats 5] [--out DIR]
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/bench_auto_shard_defaults.py \
        --cases gpt-tiny,haiku-mlp,bert-tiny,t5-tiny,resnet50-tiny --rounds 10 --repeats 3

Cases: `user-mlp` (1024 -> 4096 -> 1024, batch 256, Adam, `hlomap.value_and_grad`) and any zoo
model (`gpt-small`, `gpt-base:bfloat16`, ...). Writes DIR/auto_shard_defaults.json after each
case. Nothing is asserted: this is a benchmark. On the CPU it uses the devices JAX shows (one
unless XLA_FLAGS asks for more).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import hlomap  # noqa: E402
from hlomap import zoo  # noqa: E402

Case = tuple[Callable[..., Any], Any, Any, Any]


def user_mlp() -> Case:
    optimizer = optax.adam(1e-3)

    def loss_fn(params: Any, batch: Any) -> Any:
        hidden = jax.nn.gelu(batch["x"] @ params["w1"] + params["b1"])
        return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)

    def step(params: Any, opt_state: Any, batch: Any) -> Any:
        loss, grads = hlomap.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    k1, k2, kx, ky = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k1, (1024, 4096)) / 32, "b1": jnp.zeros(4096),
              "w2": jax.random.normal(k2, (4096, 1024)) / 64}
    batch = {"x": jax.random.normal(kx, (256, 1024)), "y": jax.random.normal(ky, (256, 1024))}
    return step, params, optimizer.init(params), batch


def zoo_case(name: str) -> Case:
    model = zoo.get(name)
    params, opt_state, batch = model.example_args()
    return model.train_step(), params, opt_state, batch


def interleaved(steps: dict[str, Callable[..., Any]], state: dict[str, Any], batches: dict[str, Any], rounds: int,
                repeats: int) -> dict[str, dict[str, float]]:
    """Each step timed to completion on its own placed batch, `repeats` per round, the order
    alternating every round."""
    medians: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                out = jax.block_until_ready(steps[name](*state[name], batches[name]))
                samples.append(time.perf_counter() - start)
                state[name] = out[:2]
            medians[name].append(statistics.median(samples))
    out = {}
    for name, values in medians.items():
        quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
        out[name] = {"median_ms": 1e3 * statistics.median(values), "iqr_ms": 1e3 * (quartiles[2] - quartiles[0])}
    return out


def data_parallel_jit(step: Callable[..., Any], params: Any, opt_state: Any,
                      batch: Any) -> tuple[Callable[..., Any], tuple[Any, Any], Any]:
    """Plain `jax.jit` data parallelism over every device: the state replicated, each batch
    array split along its first dim where that divides (replicated otherwise); the jitted step,
    the placed state and the placed batch."""
    devices = jax.devices()
    mesh = Mesh(np.asarray(devices), ("data",))
    replicated = NamedSharding(mesh, P())

    def split(x: Any) -> NamedSharding:
        divides = getattr(x, "ndim", 0) and x.shape[0] % len(devices) == 0
        return NamedSharding(mesh, P("data")) if divides else replicated

    batch_shardings = jax.tree.map(split, batch)
    jitted = jax.jit(step, in_shardings=(replicated, replicated, batch_shardings), donate_argnums=(0, 1))
    # through host copies: a device_put of a one-device array can alias its buffer, which plain
    # jax.jit's donation would then delete
    host = jax.tree.map(np.asarray, (params, opt_state, batch))
    state = (jax.device_put(host[0], replicated), jax.device_put(host[1], replicated))
    return jitted, state, jax.device_put(host[2], batch_shardings)


def run_case(label: str, case: Case, rounds: int, repeats: int) -> dict[str, Any]:
    step, params, opt_state, batch = case
    auto = hlomap.auto_shard(step)  # every default: cluster "local", task "auto", measured selection
    start = time.perf_counter()
    auto_params, auto_state = auto.place(params, opt_state)
    auto_params, auto_state, auto_loss = jax.block_until_ready(auto(auto_params, auto_state, batch))
    first = time.perf_counter() - start
    timings = {name: getattr(auto.timings, name) for name in auto.timings.__dataclass_fields__}
    print(f"== {label}: first call {first:.2f} s ({auto.origin.value}); "
          + ", ".join(f"{k} {v:.2f} s" for k, v in timings.items() if v is not None), flush=True)
    auto.explain()
    measured = auto.plan.measured
    for record in measured.candidates if measured is not None else ():
        print(f"   candidate {record.name} ({record.family}): predicted {record.predicted_seconds}, "
              f"measured {record.median_seconds}", flush=True)
    # placed before plain jax.jit's first call donates the arguments
    data_parallel = data_parallel_jit(step, params, opt_state, batch) if len(jax.devices()) > 1 else None
    plain = jax.jit(step, donate_argnums=(0, 1))
    jit_params, jit_state, jit_loss = jax.block_until_ready(plain(params, opt_state, batch))
    relative = abs(float(auto_loss) - float(jit_loss)) / max(abs(float(jit_loss)), 1e-30)
    steps = {"auto_shard": auto, "jax.jit": plain}
    state = {"auto_shard": (auto_params, auto_state), "jax.jit": (jit_params, jit_state)}
    batches = {"auto_shard": batch, "jax.jit": batch}
    if data_parallel is not None:
        dp_step, dp_state, dp_batch = data_parallel
        dp_state = jax.block_until_ready(dp_step(*dp_state, dp_batch))[:2]
        steps["jax.jit data parallel"], state["jax.jit data parallel"] = dp_step, dp_state
        batches["jax.jit data parallel"] = dp_batch
    timing = interleaved(steps, state, batches, rounds, repeats)
    ratio = timing["auto_shard"]["median_ms"] / timing["jax.jit"]["median_ms"]
    print(f"   first-step loss {float(auto_loss):.6f} (jax.jit {float(jit_loss):.6f}, relative {relative:.1e}); "
          f"steady step auto_shard {timing['auto_shard']['median_ms']:.3f} ms (IQR "
          f"{timing['auto_shard']['iqr_ms']:.3f}), jax.jit {timing['jax.jit']['median_ms']:.3f} ms (IQR "
          f"{timing['jax.jit']['iqr_ms']:.3f}): {ratio:.3f}x", flush=True)
    dp = timing.get("jax.jit data parallel")
    if dp is not None:
        print(f"   jax.jit data parallel over {len(jax.devices())} devices {dp['median_ms']:.3f} ms (IQR "
              f"{dp['iqr_ms']:.3f}): auto_shard at {timing['auto_shard']['median_ms'] / dp['median_ms']:.3f}x of it",
              flush=True)
    return {"first_call_seconds": first, "origin": auto.origin.value, "timings": timings,
            "pipeline": auto.plan.pipeline is not None, "mesh": dict(auto.plan.mesh),
            "loss_relative_difference": relative, "timing": timing, "auto_over_jit": ratio,
            "auto_over_data_parallel_jit": (timing["auto_shard"]["median_ms"] / dp["median_ms"]) if dp else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="user-mlp,gpt-small", help="user-mlp and/or zoo model names")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench_auto_shard_defaults")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"devices": [str(d) for d in jax.devices()], "jax": jax.__version__}
    print(f"devices: {results['devices']}; jax {jax.__version__}", flush=True)
    for label in args.cases.split(","):
        case = user_mlp() if label == "user-mlp" else zoo_case(label)
        results[label] = run_case(label, case, args.rounds, args.repeats)
        (out / "auto_shard_defaults.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
