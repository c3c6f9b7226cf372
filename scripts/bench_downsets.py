"""Cutting a captured step's chain order against cutting at downsets of its layer DAG.

For each zoo model: capture its train step, profile it as the pipeline explorer does
(`step_chain` on the cluster's device, scaled to a microbatch), and run the exact stage DP of
`hlomap explore --task pipeline --agent dp` two ways on the same space: over the prefixes of the
forward chain's order (the linear DP) and over downsets of the layer DAG
(`step_dag.solve_step_downsets`, at most --max-states cut states around the DAG's latest order,
plus the chain's prefixes). Prints the predicted step time L of each optimum (the closed form
the DP minimizes), how much lower the downset one is, the states searched, and the time each
DP took on this machine (with the load average: on a shared machine only a rough figure).

    python scripts/bench_downsets.py [--models resnet50 t5-small] [--stages 8] [--microbatches 4]
        [--cluster A | pipedream] [--bandwidth-gbps 10] [--max-states 512]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import hlomap  # noqa: E402
from hlomap import zoo  # noqa: E402
from hlomap.cost.cluster import load_cluster  # noqa: E402
from hlomap.cost.pipeline.chain import step_chain  # noqa: E402
from hlomap.cost.pipeline.profile import scale_batch  # noqa: E402
from hlomap.tasks.pipeline.dp import solve  # noqa: E402
from hlomap.tasks.pipeline.explore import pipeline_task  # noqa: E402
from hlomap.tasks.pipeline.pipedream import pipedream_cluster  # noqa: E402
from hlomap.tasks.pipeline.step_dag import EXPLORER_MAX_STATES, solve_step_downsets, step_dag  # noqa: E402


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet50", "t5-small"])
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--cluster", default="A",
                        help="preset or cluster JSON (default A: 16 V100s, 2 servers), or 'pipedream': one V100 per "
                             "stage on --bandwidth-gbps links, memory unlimited (PipeDream's network)")
    parser.add_argument("--bandwidth-gbps", type=float, default=10.0)
    parser.add_argument("--max-states", type=int, default=EXPLORER_MAX_STATES)
    args = parser.parse_args()

    console = Console(width=200)
    cluster = (pipedream_cluster(args.stages, args.bandwidth_gbps) if args.cluster == "pipedream"
               else load_cluster(args.cluster))
    table = Table(title=f"Exact pipeline DP, {args.stages} stages, M = {args.microbatches}, cluster {cluster.name}: "
                        "the chain's order vs downsets of the layer DAG")
    for column in ("model", "layers", "branches", "cut states", "L chain order (s)", "L downsets (s)", "lower by",
                   "linear DP (s)", "downset DP (s)", "load"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for name in args.models:
        model = zoo.get(name)
        cap = hlomap.capture(model.train_step(), *model.abstract_args())
        hlo = step_chain(cap, cluster.devices[0])
        m = args.microbatches
        profile = scale_batch(hlo.profile, 1.0 / m)
        task = pipeline_task(profile, cluster, stages=args.stages, microbatches=m, batch=cap.batch_size)
        start = time.perf_counter()
        linear = solve(profile, cluster, task.space)
        linear_seconds = time.perf_counter() - start
        start = time.perf_counter()
        dag = step_dag(hlo, 1.0 / m)
        found = solve_step_downsets(dag, cluster, task.space, max_states=args.max_states)
        downset_seconds = time.perf_counter() - start
        states = f"{found.found.states} " + ("all" if found.found.complete else f"h={found.found.lookahead}")
        table.add_row(name, str(profile.n_layers), "no" if dag.is_chain else "yes", states,
                      f"{linear.value:.6g}", f"{found.value:.6g}", f"{100 * (1 - found.value / linear.value):.2f}%",
                      f"{linear_seconds:.2f}", f"{downset_seconds:.2f}", _load())
        console.print(f"  {name}: chain order {linear.value:.6g} s, downsets {found.value:.6g} s ({states})")
    console.print(table)
    console.print("L: the closed-form step time of one global batch the DP minimizes (latency objective, 1F1B); "
                  "cut states: the downsets searched, 'all' or those within lookahead h of the DAG's latest order, "
                  "plus the chain's prefixes; DP times are wall-clock on this machine, load average beside them.")


if __name__ == "__main__":
    main()
