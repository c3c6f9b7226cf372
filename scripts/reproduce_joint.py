"""The joint planner (pipeline x tensor x data) against Megatron-LM's expert grid.

For each model and cluster prints: the joint plan's L (closed form of the cost model), its
stages (devices, mesh, layers), microbatches; the best expert-grid configuration (pp, tp, dp,
uniform layer split, Megatron inside stages, best microbatch count) priced by the same model,
and the ratio; the search time (capture and factor graph excluded, then included).
Then: the DQN over the joint outer level against the exact DP on small cases, and the search
time as the hierarchical cluster grows 8 -> 16 -> 32 -> 64 devices.

    python scripts/reproduce_joint.py [--models gpt-1.3b:float32 gpt-2.6b:float32 t5-3b:float32
        bert-48:float32] [--clusters A B C torus4x4] [--scaling-model gpt-1.3b:float32] [--no-dqn]
        [--no-scaling]

The models run in float32 by default (`NAME:float32`; the zoo's entries compute in bfloat16):
the clusters are V100s, which have no bfloat16 matmul, and the figures in docs/benchmarks.md
were measured so. Name a model without the suffix for its bfloat16 step.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from hlomap.api import load_source  # noqa: E402
from hlomap.cost.cluster import Cluster, hierarchical, load_cluster, mesh_topology  # noqa: E402
from hlomap.propagation.graph import FactorGraph  # noqa: E402
from hlomap.search.budget import Budget  # noqa: E402
from hlomap.search.dqn import dqn_search  # noqa: E402
from hlomap.tasks.joint.costs import JointModel, stage_options  # noqa: E402
from hlomap.tasks.joint.explore import explore_joint  # noqa: E402
from hlomap.tasks.joint.solve import JointSpace, solve  # noqa: E402
from hlomap.tasks.joint.task import JointSearchTask  # noqa: E402

#: NVLink-class links of a 4 x 4 torus of V100s (bytes/s, seconds per hop).
TORUS_LINK = (50e9, 2e-6)


def cluster_named(name: str) -> Cluster:
    if name == "torus4x4":
        return mesh_topology((4, 4), "V100-16GB", TORUS_LINK[0], TORUS_LINK[1], torus=True, name="torus4x4")
    return load_cluster(name)


def _stages(result) -> str:  # type: ignore[no-untyped-def]
    return "; ".join(f"{s.option.devices}d {s.option.data}x{s.option.model} [{s.start},{s.stop})"
                     for s in result.plan.stages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*",
                        default=["gpt-1.3b:float32", "gpt-2.6b:float32", "t5-3b:float32", "bert-48:float32"],
                        help="zoo models of the grid comparison (none: skip it)")
    parser.add_argument("--clusters", nargs="+", default=["A", "B", "C", "torus4x4"])
    parser.add_argument("--scaling-model", default="gpt-1.3b:float32")
    parser.add_argument("--no-dqn", action="store_true")
    parser.add_argument("--no-scaling", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    console = Console(width=250)
    console.print(f"load average before: {os.getloadavg()[0]:.2f}")
    table = Table(title="Joint plan vs the expert grid (same cost model)")
    for column in ("model", "cluster", "devices", "joint L (ms)", "stages", "M", "grid best", "grid L (ms)",
                   "speed-up", "search s", "search CPU s", "with capture s"):
        table.add_column(column, justify="left" if column in ("model", "cluster", "stages", "grid best") else "right")
    for model_name in args.models:
        start = time.perf_counter()
        cap = load_source(f"zoo:{model_name}")
        graph = FactorGraph.from_capture(cap)
        prepare = time.perf_counter() - start
        for cluster_name in args.clusters:
            cluster = cluster_named(cluster_name)
            cpu = time.process_time()
            result = explore_joint(cap, cluster, graph=graph)
            cpu = time.process_time() - cpu
            best = result.best_grid
            ratio = best.cost.latency / result.cost.latency if best else float("nan")  # type: ignore[union-attr]
            table.add_row(model_name, cluster_name, str(cluster.n_devices), f"{result.cost.latency * 1e3:.2f}",
                          _stages(result), str(result.plan.microbatches), best.label if best else "-",
                          f"{best.cost.latency * 1e3:.2f}" if best else "-", f"{ratio:.3f}x",  # type: ignore[union-attr]
                          f"{result.seconds:.1f}", f"{cpu:.1f}", f"{result.seconds + prepare:.1f}")
            console.print(f"  {model_name} on {cluster_name}: joint {result.cost.latency * 1e3:.2f} ms, grid "
                          f"{best.label if best else '-'} {best.cost.latency * 1e3 if best else float('nan'):.2f} ms "  # type: ignore[union-attr]
                          f"({ratio:.3f}x) in {result.seconds:.1f} s")
    if args.models:
        console.print(table)

    if not args.no_dqn:
        dqn = Table(title="DQN over the outer level vs the exact DP (gpt-tiny, small enough to enumerate)")
        for column in ("cluster", "layers", "exact L (us)", "DQN L (us)", "gap %", "DQN s", "episodes"):
            dqn.add_column(column, justify="right")
        cap = load_source("zoo:gpt-tiny")
        agreed = cases = 0
        for cluster in (hierarchical(2, 4, "V100-16GB"), hierarchical(1, 8, "V100-16GB"),
                        mesh_topology((2, 4), "V100-16GB", TORUS_LINK[0], TORUS_LINK[1], torus=True)):
            probe = JointModel.build(cap, cluster, ())
            n = probe.attribution.length
            for layers in (4, 6, 8):
                pivots = tuple(round(k * n / layers) - 1 for k in range(1, layers))
                model = JointModel.build(cap, cluster, pivots, graph=probe.graph)
                space = JointSpace(stage_options(cluster), (1, 2, 4))
                _, exact = solve(model, space)
                t = time.perf_counter()
                found = dqn_search(JointSearchTask(model, space), Budget(episodes=800, seconds=None), seed=0)
                gap = found.score.step_time / exact.latency - 1
                cases += 1
                agreed += gap <= 0.01
                dqn.add_row(cluster.name, str(layers), f"{exact.latency * 1e6:.3f}",
                            f"{found.score.step_time * 1e6:.3f}", f"{100 * gap:.3f}", f"{time.perf_counter() - t:.1f}",
                            str(found.episodes))
        console.print(dqn)
        console.print(f"the DQN is within 1% of the exact optimum on {agreed} of {cases} cases")

    if not args.no_scaling:
        scaling = Table(title=f"Search time as the cluster grows ({args.scaling_model}, servers of 8 V100s)")
        for column in ("devices", "layers", "options", "search s", "search CPU s", "joint L (ms)", "stages", "grid best",
                       "grid L (ms)"):
            scaling.add_column(column, justify="right")
        cap = load_source(f"zoo:{args.scaling_model}")
        graph = FactorGraph.from_capture(cap)
        for servers in (1, 2, 4, 8):
            cluster = hierarchical(servers, 8, "V100-16GB")
            cpu = time.process_time()
            result = explore_joint(cap, cluster, graph=graph)
            cpu = time.process_time() - cpu
            best = result.best_grid
            scaling.add_row(str(cluster.n_devices), str(result.model.n_layers), str(result.options),
                            f"{result.seconds:.1f}", f"{cpu:.1f}", f"{result.cost.latency * 1e3:.2f}", str(result.plan.n_stages),
                            best.label if best else "-", f"{best.cost.latency * 1e3:.2f}" if best else "-")  # type: ignore[union-attr]
        console.print(scaling)
    console.print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
