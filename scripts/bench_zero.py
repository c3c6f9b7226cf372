"""The optimizer state split over the data replicas (ZeRO-1), and the parameters with it (FSDP /
ZeRO-3), against the same plan without them, on the present devices: memory as the cost model and
XLA see it, and step time predicted and measured.

For each model, the data-parallel plan (and data x Megatron) without `state_sharding`, with the
optimizer state split and with the parameters split too:
- memory per device: the estimate's persistent bytes (parameters + optimizer state + inputs) and
  XLA's `memory_analysis` argument bytes, and the peak of each;
- step time: predicted on `--cluster` (default `local`, the calibrated present devices) and
  measured, the six plans of a model timed in interleaved rounds (median of round medians, IQR).

    python scripts/bench_zero.py [--models haiku-mlp gpt-tiny] [--rounds 20] [--cluster local]

Prints one table per model and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import hlomap  # noqa: E402
from hlomap import zoo  # noqa: E402
from hlomap.plan import Plan, resolve_plan  # noqa: E402
from hlomap.propagation.graph import FactorGraph  # noqa: E402
from hlomap.verify.timing import stateful_step, time_interleaved  # noqa: E402
from hlomap.verify.xla import xla_reference  # noqa: E402

MIB = 2**20


def plans_for(cap: object, graph: FactorGraph) -> dict[str, Plan]:
    out = {}
    for name, mesh in (("dp", {"data": 8}), ("dp+megatron", {"data": 2, "model": 4})):
        array, axes, _ = resolve_plan(graph, name, mesh)
        plan = Plan.from_groups(cap, graph, array, axes)
        label = "data=8" if name == "dp" else "data=2 x model=4"
        out[label] = plan
        out[label + " + ZeRO-1"] = plan.with_sharded_state(graph)
        out[label + " + FSDP"] = plan.with_sharded_state(graph, parameters=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=["haiku-mlp", "gpt-tiny"])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--cluster", default="local")
    args = parser.parse_args()
    console = Console(width=200)
    console.print(f"load average before: {os.getloadavg()}")
    cluster = hlomap.load_cluster(args.cluster)
    for name in args.models:
        model = zoo.get(name)
        cap = hlomap.load_source(f"zoo:{name}")
        graph = FactorGraph.from_capture(cap)
        plans = plans_for(cap, graph)
        example = tuple(model.example_args(seed=0))
        runs, rows = {}, {}
        for label, plan in plans.items():
            est = hlomap.estimate(cap, plan, cluster=cluster)
            ref = xla_reference(cap, plan, graph)
            mem = est.memory
            rows[label] = (mem.parameters + mem.optimizer + mem.inputs, ref.memory.argument_bytes, mem.total,
                           ref.memory.peak, est.step_seconds)
            step = hlomap.parallelize(model.train_step(), plan)
            params, opt_state = step.place(example[0], example[1])
            runs[label] = stateful_step(step, params, opt_state, *example[2:])
        timed = time_interleaved(runs, rounds=args.rounds)
        table = Table(title=f"{name} on {len(__import__('jax').devices())} devices, priced on {cluster.name}")
        for column in ("plan", "persistent MiB (model)", "arguments MiB (XLA)", "peak MiB (model)", "peak MiB (XLA)",
                       "predicted ms", "measured ms (median)", "IQR ms"):
            table.add_column(column, justify="left" if column == "plan" else "right")
        for label, (persistent, arguments, peak, xla_peak, predicted) in rows.items():
            run = timed[label]
            table.add_row(label, f"{persistent / MIB:.2f}", f"{arguments / MIB:.2f}", f"{peak / MIB:.2f}",
                          f"{xla_peak / MIB:.2f}", f"{predicted * 1e3:.2f}", f"{run.median * 1e3:.2f}",
                          f"{run.iqr * 1e3:.2f}")
        console.print(table)
    console.print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
