"""Benchmark: wall time until the DQN explorer first finds the Megatron-equivalent plan.

For each model: capture the step and build the factor graph (timed separately), then run the
DQN driver (paper reward, 1-D mesh of 8, the residual stream kept replicated) and record the
wall time and evaluations until its best plan is identical to `megatron_plan` on the same graph.
Both search spaces are measured: positions tied across repeated layers (the default) and one
position per linkage group (the paper's). The clock starts before the agent is built, so it
includes compiling the agent's networks.

    python scripts/bench_explore.py                       # t5-base and t5-11b, tied and untied
    python scripts/bench_explore.py --models t5-base --untied-only --seeds 0 1 2

Goals on a 2-core CPU: under 60 s for zoo:t5-base, under 5 min for zoo:t5-11b.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hlomap.search.dqn import DqnSearchConfig, dqn_search  # noqa: E402
from hlomap.tasks.sharding.task import ShardingTask  # noqa: E402
from hlomap.tasks.sharding.objective import PaperObjective  # noqa: E402
from hlomap.tasks.sharding.compare import compare_with_megatron  # noqa: E402
from hlomap.search.tracker import Budget, SearchResult  # noqa: E402
from hlomap.tasks.sharding.space import opp_space  # noqa: E402
from hlomap.propagation.conflicts import MeshAxes  # noqa: E402
from hlomap.propagation.graph import FactorGraph  # noqa: E402
from hlomap.propagation.plans import megatron_plan  # noqa: E402
from hlomap.api import load_source  # noqa: E402

GOALS = {"t5-base": 60.0, "t5-11b": 300.0}


def time_to_megatron(graph: FactorGraph, axes: MeshAxes, *, tie: bool, seed: int, limit: float,
                     fine_tune: bool = True) -> dict[str, object]:
    space = opp_space(graph, axes, replicate_residual=True, tie=tie)
    mega = megatron_plan(graph, "model", axes)
    hit: list[tuple[float, int]] = []

    def on_best(result: SearchResult) -> None:
        # Megatron-equivalent: every group Megatron splits is split the same way and no layer norm
        # is split (the paper optimum may split more, e.g. T5's relative-bias buckets when its 12
        # heads do not divide by 8)
        if not hit and compare_with_megatron(space, result.choices, mega).equivalent:
            hit.append((result.seconds, result.evaluations))
            raise KeyboardInterrupt  # found: stop the search (the driver keeps the plan)

    start = time.perf_counter()
    result = dqn_search(ShardingTask(space, PaperObjective(space)), Budget(seconds=limit), seed,
                        config=DqnSearchConfig(fine_tune=fine_tune), on_best=on_best)
    total = time.perf_counter() - start
    return {"positions": space.num_positions, "tied": tie, "seed": seed,
            "found": bool(hit), "seconds": round(hit[0][0], 2) if hit else None,
            "evaluations": hit[0][1] if hit else result.evaluations, "wall": round(total, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["t5-base", "t5-11b"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--limit", type=float, default=600.0, help="give up after this many seconds per run")
    parser.add_argument("--tied-only", action="store_true")
    parser.add_argument("--untied-only", action="store_true")
    parser.add_argument("--no-fine-tune", action="store_true", help="ablation: the agent alone, no §5.2.1 stage")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    logging.getLogger("hlomap.search").setLevel(logging.ERROR)  # "interrupted" is how a run stops here
    ties = [True] if args.tied_only else [False] if args.untied_only else [True, False]
    rows = []
    print("| model | positions | seed | capture+graph s | search s to Megatron | evaluations | goal |")
    print("|---|---:|---:|---:|---:|---:|---|", flush=True)
    for name in args.models:
        start = time.perf_counter()
        cap = load_source(f"zoo:{name}")
        graph = FactorGraph.from_capture(cap)
        setup = time.perf_counter() - start
        axes = MeshAxes.from_mesh({"model": 8})
        for tie in ties:
            for seed in args.seeds:
                row = {"model": name, "setup": round(setup, 1),
                       **time_to_megatron(graph, axes, tie=tie, seed=seed, limit=args.limit,
                                          fine_tune=not args.no_fine_tune)}
                rows.append(row)
                goal = GOALS.get(name)
                verdict = "-" if goal is None or not row["found"] else ("met" if row["seconds"] <= goal else "missed")
                found = f"{row['seconds']:.1f}" if row["found"] else f"not found in {args.limit:.0f}"
                print(f"| {name} ({'tied' if tie else 'untied'}) | {row['positions']} | {seed} | {setup:.1f} | "
                      f"{found} | {row['evaluations']} | {verdict} (< {goal:.0f} s) |" if goal else
                      f"| {name} ({'tied' if tie else 'untied'}) | {row['positions']} | {seed} | {setup:.1f} | "
                      f"{found} | {row['evaluations']} | - |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
