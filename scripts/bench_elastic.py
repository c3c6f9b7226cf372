"""Elastic training on the present devices: what each change of devices costs.

A loop of `hlomap.elastic` on a zoo model runs `--steps` steps on every device, loses the devices
of `--lose` after a third of them, and gets them back after two thirds. For each change it prints
the re-plan (search and step build), the move of the live params and optimizer state onto the new
plan, the first step after the change (it compiles) and the median steady step before and after,
and the plans chosen. The loss curve is checked against the unsharded step (`jax.jit`).

    python scripts/bench_elastic.py [--model gpt-tiny] [--task auto] [--cluster local] [--lose 2,5]
        [--steps 12] [--budget-seconds 20]

Nothing is asserted: this is a benchmark.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import hlomap  # noqa: E402
from hlomap import zoo  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--task", default="auto")
    parser.add_argument("--cluster", default="local")
    parser.add_argument("--lose", default="2,5", help="positions of the devices lost in the middle third")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--agent", default="greedy", help="the search tasks' agent (auto takes none)")
    parser.add_argument("--budget-seconds", type=float, default=20.0, help="the search tasks' budget (auto takes none)")
    args = parser.parse_args(argv)

    model = zoo.get(args.model)
    train_step = model.train_step()
    params, opt_state, *rest = model.example_args(0)
    everything = tuple(range(len(jax.devices())))
    lost = {int(x) for x in args.lose.split(",") if x}
    survivors = tuple(d for d in everything if d not in lost)
    changes = {args.steps // 3: survivors, 2 * args.steps // 3: everything}
    mesh = None if args.task in ("auto", "pipeline") else (lambda n: n)
    # the auto task's joint planner is exact: it takes no agent and no budget
    search = {} if args.task == "auto" else {"agent": args.agent, "budget_seconds": args.budget_seconds}
    step = hlomap.elastic(train_step, cluster=args.cluster, task=args.task, mesh=mesh, **search)

    load_before = os.getloadavg()
    times: list[float] = []
    losses: list[float] = []
    first_after: dict[int, float] = {}
    for i in range(args.steps):
        if i in changes:
            params, opt_state = step.resize(changes[i], params, opt_state)
        start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, *rest)
        losses.append(float(jax.block_until_ready(loss)))
        times.append(time.perf_counter() - start)
        if i in changes:
            first_after[i] = times[-1]
    load_after = os.getloadavg()

    # the unsharded step from the same start, for the loss curve
    reference = jax.jit(train_step)
    p, o, *r = model.example_args(0)
    expected = []
    for _ in range(args.steps):
        p, o, loss = reference(p, o, *r)
        expected.append(float(loss))
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, expected))

    print(f"{args.model}, task {args.task}, cluster {args.cluster}, {len(everything)} devices, lose {sorted(lost)}; "
          f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    bounds = [0, *sorted(changes), args.steps]
    for lo, hi in zip(bounds, bounds[1:]):
        steady = times[lo + 1:hi] if hi - lo > 1 else times[lo:hi]
        print(f"  steps {lo}-{hi - 1}: median steady step {statistics.median(steady) * 1e3:.1f} ms")
    for event in step.history:
        print(f"  after step {event.after_steps}: {len(event.devices)} devices {list(event.devices)} -> {event.plan}; "
              f"{'re-planned' if event.replanned else 'plan reused'} in {event.plan_seconds:.2f} s, state moved in "
              f"{event.reshard_seconds * 1e3:.1f} ms, first step after {first_after[event.after_steps]:.2f} s")
    print(f"  loss {losses[0]:.4f} -> {losses[-1]:.4f}; worst relative difference from the unsharded step "
          f"{worst:.2e} ({'equal' if np.isfinite(worst) and worst < 1e-4 else 'DIFFERENT'})")


if __name__ == "__main__":
    main()
