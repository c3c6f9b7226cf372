"""Device placement benchmark: every structured start against the solvers on issue 23's topologies,
solver gaps and step-time gains per topology, 512 devices within 60 s, and the PPO policy against
random and greedy search at equal budget.

    python scripts/bench_placement.py --quick               # the starts table, short budgets (about 4 min)
    python scripts/bench_placement.py                       # everything (about an hour on 2 busy cores)
    python scripts/bench_placement.py --sizes 8 16 64 --families torus hier random
    python scripts/bench_placement.py --only starts|gaps|large|ppo --json out.json

Problems (`hlomap.tasks.placement.generate`): for every topology family and size, an SPMD
transformer step on a data x model mesh (tensor-parallel all-reduces along `model`, the gradient
all-reduce along `data`), a pipeline of S stages replicated r ways, and a joint plan of S stages
each with its own data x model mesh, priced by the cost model.

Tables:
0. starts: scrambled torus:8x8 (device ids a random permutation of its nodes), torus:4x4x4,
   torus:8x8x8, mesh:16x16, hier:8x8, random:64 and random:512 (and a scrambled torus:2x4 where
   exact enumeration fits, without --quick), each with a tensor-parallel workload (n / 8 groups
   of 8 all-reducing 100 MB at once), the pipeline and the joint workload: the step time of the identity,
   random search, every structured start (walks over the topology coordinates: row-major,
   snake, Hilbert, and the mesh-axis nestings over them; recursive bisection; the constructive
   placement), greedy (`place`'s default), PPO and exact, priced by the cost model (tori and
   meshes: the network model, flows sharing links). `place / best start` is greedy's step over
   the best structured start's (never above 1: the search refines the best start); wall times
   include setting the problem up (cluster, layout, task).
1. gaps: each solver (identity, random, greedy, ppo, and exact on 8 devices) with the same
   wall-clock budget per problem (--budget-scale x a per-size default); the gain is the step time
   saved against the identity order, the gap how far a solver is from the best any found.
2. large: the greedy solver on 512-device 3-D tori, with budgets of 10, 30 and 60 seconds.
3. ppo: PPO (inference + local search), random and greedy at equal budgets on held-out
   problems, the gain over identity of each (mean and median over the problems).

Times are wall-clock on a shared machine (the load average is printed): an idle machine gets
more evaluations into the same budget.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402

from hlomap.report.placement import solver_table  # noqa: E402
from hlomap.search.tracker import Budget, Driver, SearchResult  # noqa: E402
from hlomap.cost.cluster import load_cluster  # noqa: E402
from hlomap.tasks.placement.construct import named_starts  # noqa: E402
from hlomap.tasks.placement.generate import (BENCHMARK_SIZES, BenchmarkWorkload, TopologyFamily,  # noqa: E402
                                             benchmark_problem, joint_layout, model_for, pipeline_layout, random_problem,
                                             scrambled, tensor_parallel_layout)
from hlomap.tasks.placement.place import search_placement  # noqa: E402
from hlomap.tasks.placement.ppo import DEFAULT_POLICY, load_placement_policy  # noqa: E402
from hlomap.tasks.placement.problem import PlacementProblem, step_seconds  # noqa: E402
from hlomap.tasks.placement.task import PlacementTask  # noqa: E402

#: Seconds per solver and problem, by device count (x --budget-scale).
BUDGET = {8: 2.0, 16: 3.0, 32: 5.0, 64: 8.0, 128: 15.0, 512: 30.0}
DEFAULT_FAMILIES = (TopologyFamily.TORUS, TopologyFamily.MESH, TopologyFamily.HIER, TopologyFamily.RANDOM,
                    TopologyFamily.UNIFORM_RANDOM, TopologyFamily.UNIFORM)


#: The starts table's clusters (topology string, scrambled or not), issue 23's list.
START_CLUSTERS = (("torus:8x8", True), ("torus:4x4x4", False), ("torus:8x8x8", False), ("mesh:16x16", False),
                  ("hier:8x8", False), ("random:64:0", False), ("random:512:0", False))
#: Where exact enumeration fits (8 devices), without --quick.
EXACT_CLUSTERS = (("torus:2x4", True),)
START_WORKLOADS = ("tp", "pipeline", "joint")
#: Seconds per solver in the starts table, by device count (x --budget-scale); --quick: QUICK_BUDGET.
START_BUDGET = {8: 2.0, 64: 8.0, 256: 20.0, 512: 30.0}
QUICK_BUDGET = {8: 1.0, 64: 2.0, 256: 4.0, 512: 6.0}


def _load() -> str:
    return "{:.1f}".format(os.getloadavg()[0])


def _run(problem: Any, solver: Driver, seconds: float, seed: int, policy: Any) -> SearchResult:
    options = {"policy": policy} if solver is Driver.PPO else {}
    budget = Budget(None, None) if solver in (Driver.IDENTITY, Driver.EXACT) else Budget(seconds, None)
    return search_placement(problem, solver, budget, seed, **options)


def _starts_problem(topology: str, scramble: bool, workload: str) -> PlacementProblem:
    cluster = load_cluster(topology)
    cluster = scrambled(cluster, seed=0) if scramble else cluster
    n = cluster.n_devices
    stages = 4 if n <= 8 else None
    layout = (tensor_parallel_layout(n, group=min(8, n // 2)) if workload == "tp"
              else joint_layout(cluster, n, model_for(n), stages=stages) if workload == "joint"
              else pipeline_layout(cluster, n, model_for(n), stages=stages))
    return PlacementProblem(cluster, layout, name=f"{workload} on {cluster.name}")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g}"


def _start_columns(starts: dict[str, float]) -> dict[str, float]:
    """The table's start columns: each walk, the best nesting over the walks, bisection, construct."""
    nestings = [v for k, v in starts.items() if " " in k]
    out = {k: starts[k] for k in ("row-major", "snake", "hilbert")}
    out["best nesting"] = min(nestings) if nestings else float("nan")
    out["bisection"], out["construct"] = starts["bisection"], starts["construct"]
    return out


def starts_table(args: argparse.Namespace, console: Console, policy: Any) -> list[dict[str, Any]]:
    budgets = QUICK_BUDGET if args.quick else START_BUDGET
    clusters = START_CLUSTERS + (() if args.quick else EXACT_CLUSTERS)
    records = []
    for topology, scramble in clusters:
        for workload in args.start_workloads:
            start = time.perf_counter()
            problem = _starts_problem(topology, scramble, workload)
            task = PlacementTask(problem)  # what every driver builds first: identity priced
            setup = time.perf_counter() - start
            n = problem.n_devices
            seconds = budgets[n] * args.budget_scale
            start = time.perf_counter()
            starts = {name: step_seconds(problem, order[: problem.n_positions])
                      for name, order in named_starts(problem, task.affinity).items()}
            starts_wall = time.perf_counter() - start
            solvers = [Driver.RANDOM, Driver.GREEDY] + ([Driver.PPO] if policy is not None else [])
            solvers += [Driver.EXACT] if n <= 8 else []
            results, walls = {}, {}
            for solver in solvers:
                start = time.perf_counter()
                results[solver] = _run(problem, solver, seconds, args.seed, policy)
                walls[solver] = time.perf_counter() - start + setup
            identity = task.identity_seconds
            best_start = min(v for k, v in starts.items() if k != "identity")
            greedy = results[Driver.GREEDY].plan.step_seconds
            record = {"problem": problem.name, "devices": n, "workload": workload, "budget_seconds": seconds,
                      "setup_seconds": setup, "starts_seconds": starts_wall, "identity_seconds": identity,
                      "starts": starts, "best_start_seconds": best_start,
                      "solvers": {s.value: {"step_seconds": r.plan.step_seconds, "evaluations": r.evaluations,
                                            "search_seconds": r.seconds, "wall_seconds": walls[s], "notes": r.notes}
                                  for s, r in results.items()}}
            records.append(record)
            console.print(f"  {problem.name}: identity {identity * 1e3:.4g} ms, best start {best_start * 1e3:.4g} ms, "
                          f"greedy {greedy * 1e3:.4g} ms (set-up {setup:.1f} s, starts {starts_wall:.1f} s), "
                          f"load {_load()}")
    print_starts(records, console)
    return records


STARTS_HEADER = ["problem", "identity", "random", "row-major", "snake", "hilbert", "best nesting", "bisection",
                 "construct", "greedy", "ppo", "exact", "greedy / best start", "ppo / best start", "budget s",
                 "greedy wall s", "ppo wall s"]


def _starts_row(record: dict[str, Any]) -> list[str]:
    solvers = record["solvers"]

    def step(solver: str) -> str:
        return _ms(solvers[solver]["step_seconds"]) if solver in solvers else "-"

    def ratio(solver: str) -> str:
        return f"{solvers[solver]['step_seconds'] / record['best_start_seconds']:.4f}" if solver in solvers else "-"

    columns = _start_columns(record["starts"])
    return [record["problem"], _ms(record["identity_seconds"]), step("random"),
            *["-" if v != v else _ms(v) for v in columns.values()], step("greedy"), step("ppo"), step("exact"),
            ratio("greedy"), ratio("ppo"), f"{record['budget_seconds']:g}",
            f"{solvers['greedy']['wall_seconds']:.1f}",
            f"{solvers['ppo']['wall_seconds']:.1f}" if "ppo" in solvers else "-"]


def print_starts(records: list[dict[str, Any]], console: Console) -> None:
    """The starts table as markdown (estimated step ms; ratios to the best structured start)."""
    lines = ["| " + " | ".join(STARTS_HEADER) + " |", "|" + "---|" * len(STARTS_HEADER)]
    lines += ["| " + " | ".join(_starts_row(r)) + " |" for r in records]
    console.print("Placement starts and solvers: estimated step ms (walls include set-up)", markup=False)
    console.print("\n".join(lines), markup=False, soft_wrap=True)


def gaps(args: argparse.Namespace, console: Console, policy: Any) -> list[dict[str, Any]]:
    records = []
    rows = []
    for family in args.families:
        for n in args.sizes:
            for workload in args.workloads:
                problem = benchmark_problem(family, n, workload, seed=args.seed)
                seconds = BUDGET[n] * args.budget_scale
                solvers = [Driver.IDENTITY, Driver.RANDOM, Driver.GREEDY]
                solvers += [Driver.PPO] if policy is not None else []
                solvers += [Driver.EXACT] if n <= 8 else []
                results = {s: _run(problem, s, seconds, args.seed, policy) for s in solvers}
                best = min(r.plan.step_seconds for r in results.values())
                identity = results[Driver.IDENTITY].plan.step_seconds
                record = {"family": str(family), "devices": n, "workload": str(workload), "problem": problem.name,
                          "budget_seconds": seconds, "identity_seconds": identity, "best_seconds": best,
                          "solvers": {s.value: {"step_seconds": r.plan.step_seconds,
                                                "gap": r.plan.step_seconds / best - 1, "gain": r.plan.gain,
                                                "evaluations": r.evaluations, "seconds": r.seconds,
                                                "optimal": r.optimal} for s, r in results.items()}}
                records.append(record)
                cells = [f"{100 * (results[s].plan.step_seconds / best - 1):.3f}%" if s in results else "-"
                         for s in (Driver.RANDOM, Driver.GREEDY, Driver.PPO, Driver.EXACT)]
                rows.append([problem.name, str(n), f"{identity * 1e3:.4g}", f"{best * 1e3:.4g}",
                             f"{100 * (1 - best / identity):+.3f}%",
                             f"{100 * (results[Driver.IDENTITY].plan.step_seconds / best - 1):.3f}%",
                             *cells])
                console.print(f"  {problem.name}: identity {identity * 1e3:.4g} ms, best {best * 1e3:.4g} ms "
                              f"({100 * (1 - best / identity):+.3f}%), load {_load()}")
    console.print(solver_table(
        f"Placement: gap to the best solution found, per solver (budget {args.budget_scale:g} x "
        f"{ {n: BUDGET[n] for n in args.sizes} } s per solver)",
        ["problem", "devices", "identity ms", "best ms", "gain", "identity gap", "random gap", "greedy gap",
         "ppo gap", "exact gap"], rows))
    summary = []
    for family in args.families:
        gains = [1 - r["best_seconds"] / r["identity_seconds"] for r in records if r["family"] == str(family)]
        if gains:
            summary.append([str(family), f"{100 * statistics.mean(gains):+.3f}%", f"{100 * min(gains):+.3f}%",
                            f"{100 * max(gains):+.3f}%",
                            f"{sum(g > 1e-9 for g in gains)}/{len(gains)}"])
    console.print(solver_table("Estimated step-time gain of the best placement over identity, per topology family",
                               ["family", "mean gain", "min", "max", "problems improved"], summary))
    return records


def large(args: argparse.Namespace, console: Console) -> list[dict[str, Any]]:
    records, rows = [], []
    for workload in args.workloads:
        problem = benchmark_problem(TopologyFamily.TORUS, 512, workload)
        for seconds in (10.0, 30.0, 60.0):
            start, cpu = time.perf_counter(), time.process_time()
            result = search_placement(problem, Driver.GREEDY, Budget(seconds, None), args.seed)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            records.append({"problem": problem.name, "budget_seconds": seconds, "wall_seconds": wall,
                            "cpu_seconds": cpu, "evaluations": result.evaluations, "gain": result.plan.gain,
                            "step_seconds": result.plan.step_seconds, "identity_seconds": result.plan.identity_seconds})
            rows.append([problem.name, f"{seconds:g}", f"{wall:.1f}", f"{cpu:.1f}", str(result.evaluations),
                         f"{result.plan.identity_seconds * 1e3:.5g}", f"{result.plan.step_seconds * 1e3:.5g}",
                         f"{100 * result.plan.gain:+.4f}%", _load()])
    console.print(solver_table("512 devices (3-D torus 8x8x8): greedy + local search within a budget",
                               ["problem", "budget s", "wall s", "cpu s", "evaluations", "identity ms", "placed ms",
                                "gain", "load"], rows))
    return records


def ppo_comparison(args: argparse.Namespace, console: Console, policy: Any) -> list[dict[str, Any]]:
    rng = np.random.default_rng([args.seed, 0xBE7C4])
    problems = [random_problem(rng, sizes=(16, 32, 64)) for _ in range(args.ppo_problems)]
    records, rows = [], []
    for seconds in args.ppo_budgets:
        gains: dict[Driver, list[float]] = {s: [] for s in (Driver.RANDOM, Driver.GREEDY, Driver.PPO)}
        wins = {s: 0 for s in gains}
        for problem in problems:
            results = {s: _run(problem, s, seconds, args.seed, policy) for s in gains}
            best = min(r.plan.step_seconds for r in results.values())
            for s, r in results.items():
                gains[s].append(r.plan.gain)
                wins[s] += r.plan.step_seconds <= best * (1 + 1e-12)
            records.append({"problem": problem.name, "budget_seconds": seconds,
                            **{s.value: r.plan.step_seconds for s, r in results.items()},
                            "identity": results[Driver.GREEDY].plan.identity_seconds})
        for s in gains:
            rows.append([f"{seconds:g} s", s.value, f"{100 * statistics.mean(gains[s]):+.3f}%",
                         f"{100 * statistics.median(gains[s]):+.3f}%", f"{wins[s]}/{len(problems)}"])
    console.print(solver_table(f"PPO vs random vs greedy at equal wall-clock budget ({args.ppo_problems} held-out "
                               "random problems of 16-64 devices): gain over identity",
                               ["budget", "solver", "mean gain", "median gain", "best (ties count)"], rows))
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("starts", "gaps", "large", "ppo"), action="append")
    parser.add_argument("--quick", action="store_true",
                        help="only the starts table, with short budgets (a few minutes on 2 cores)")
    parser.add_argument("--start-workloads", choices=START_WORKLOADS, nargs="+", default=list(START_WORKLOADS))
    parser.add_argument("--sizes", type=int, nargs="+", default=list(BENCHMARK_SIZES))
    parser.add_argument("--families", type=TopologyFamily, nargs="+", default=list(DEFAULT_FAMILIES))
    parser.add_argument("--workloads", type=BenchmarkWorkload, nargs="+", default=list(BenchmarkWorkload))
    parser.add_argument("--budget-scale", type=float, default=1.0)
    parser.add_argument("--ppo-problems", type=int, default=16)
    parser.add_argument("--ppo-budgets", type=float, nargs="+", default=[2.0, 10.0])
    parser.add_argument("--policy", type=Path, default=DEFAULT_POLICY)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--report", type=Path, help="print the starts table of a saved --json run, run nothing")
    args = parser.parse_args()
    console = Console(width=160)
    if args.report:
        print_starts(json.loads(args.report.read_text())["starts"], console)
        return
    policy = load_placement_policy(args.policy) if args.policy.is_file() else None
    if policy is None:
        console.print(f"no placement policy at {args.policy}: the ppo columns are left out")
    parts = args.only or (["starts"] if args.quick else ["starts", "gaps", "large", "ppo"])
    out: dict[str, Any] = {"load_average_at_start": os.getloadavg()[0]}
    if "starts" in parts:
        out["starts"] = starts_table(args, console, policy)
    if "gaps" in parts:
        out["gaps"] = gaps(args, console, policy)
    if "large" in parts:
        out["large"] = large(args, console)
    if "ppo" in parts and policy is not None:
        out["ppo"] = ppo_comparison(args, console, policy)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
