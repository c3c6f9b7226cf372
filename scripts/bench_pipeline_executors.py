"""The same pipeline plans on both executors: predicted against measured step time.

For each zoo model, the 2- and 4-stage plans `bench_fidelity.py` builds (cut by the exact DP, the
most microbatches up to `--microbatches` whose microbatch splits over a stage) are run as GPipe on
the spmd executor and on the mpmd executor, and as 1F1B on the mpmd executor, all timed together
in `--rounds` interleaved rounds (`hlomap.verify.timing.time_interleaved`), each priced by
`hlomap.estimate` on `--cluster` for the executor that runs it. The same GPipe plan on two
executors separates what the cost model gets wrong about an executor from what it gets wrong about
the plan. Prints per model the table (predicted, measured median and IQR, predicted / measured)
and the load average before and after. Nothing is asserted: this is a benchmark.

    python scripts/bench_pipeline_executors.py [--models gpt-tiny,t5-tiny] [--rounds 12]
        [--repeats 3] [--cluster local] [--microbatches 4]

`--cluster` should describe the devices the plans run on (`local`, or a file written by
`hlomap calibrate -o FILE`). On a machine without an accelerator the plans run on 8 simulated host
devices sharing the CPU cores, so measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from hlomap import api, zoo  # noqa: E402
from hlomap.run import parallelize  # noqa: E402
from hlomap.verify.fidelity import pipeline_microbatches  # noqa: E402
from hlomap.verify.timing import load_average, stateful_step, time_interleaved  # noqa: E402

DEVICES = 8
#: (schedule, executor) of each run of a plan: GPipe on both executors, 1F1B on the mpmd one.
RUNS = (("gpipe", "spmd"), ("gpipe", "mpmd"), ("1f1b", "mpmd"))


def runs_for(name: str, cluster: Any, stages: int, preferred: int,
             host: tuple[Any, ...]) -> list[tuple[str, float, Callable[[], Any]]]:
    """(label, predicted seconds, runnable) of each run of `name`'s `stages`-stage plans."""
    model = zoo.get(name)
    cap = api.load_source(f"zoo:{name}")
    batch = int(cap.batch_size)
    microbatches = pipeline_microbatches(batch, stages, DEVICES, preferred) or 1
    out = []
    plans: dict[str, Any] = {}
    for schedule, executor in RUNS:
        if schedule not in plans:
            plans[schedule] = api.explore(cap, task="pipeline", agent="dp", stages=stages, microbatches=microbatches,
                                          schedule=schedule, cluster=cluster)
        plan = plans[schedule]
        devices = "+".join(str(len(s.devices)) for s in plan.pipeline.stages)
        label = f"S={stages} M={microbatches} {schedule} on {executor} (devices {devices})"
        step = parallelize(model.train_step(), plan, executor=executor, example_args=host)
        params, opt_state = step.place(host[0], host[1])
        run = stateful_step(step, params, opt_state, *host[2:])
        jax.block_until_ready(run())  # compiled before the timing starts
        predicted = float(api.estimate(cap, plan, cluster=cluster, executor=executor).step_seconds)
        out.append((label, predicted, run))
    return out


def bench_model(name: str, cluster: Any, args: argparse.Namespace, console: Console) -> None:
    before = load_average()
    host = tuple(jax.tree.map(np.asarray, tuple(zoo.get(name).example_args(0))))
    runs = [run for stages in (2, 4) for run in runs_for(name, cluster, stages, args.microbatches, host)]
    timed = time_interleaved({label: run for label, _, run in runs}, rounds=args.rounds, repeats=args.repeats)
    after = load_average()
    load = " ".join(f"{x:.2f}" for x in before), " ".join(f"{x:.2f}" for x in after)
    table = Table(title=f"{name}: load average (1, 5, 15 min) before {load[0]}, after {load[1]}")
    for column in ("plan and executor", "predicted ms", "measured ms", "IQR ms", "predicted / measured"):
        table.add_column(column, justify="left" if column == "plan and executor" else "right")
    for label, predicted, _ in runs:
        figure = timed[label]
        table.add_row(label, f"{1e3 * predicted:.2f}", f"{1e3 * figure.median:.2f}", f"{1e3 * figure.iqr:.2f}",
                      f"{predicted / figure.median:.2f}")
    console.print(table)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be positive")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt-tiny,t5-tiny", help="zoo models, comma-separated")
    parser.add_argument("--rounds", type=positive_int, default=12, help="interleaved timing rounds (default 12)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="calls per plan and round (default 3)")
    parser.add_argument("--cluster", default="local", help="what the plans are priced on (default local)")
    parser.add_argument("--microbatches", type=positive_int, default=4,
                        help="the most microbatches a plan may have (default 4)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(markup=False) if sys.stdout.isatty() else Console(markup=False, width=160)
    cluster = api.load_cluster(args.cluster)
    console.print(f"{jax.device_count()} x {jax.devices()[0].platform}; cluster {args.cluster}; {args.rounds} rounds of "
                  f"{args.repeats} steps per run")
    for name in args.models.split(","):
        bench_model(name.strip(), cluster, args, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
