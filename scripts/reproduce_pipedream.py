"""Straight-pipeline optima on PipeDream's profiled layer graphs.

For every graph in the corpus (per-layer V100 forward/backward ms, activation and parameter
bytes) and 2, 4 and 8 stages on a uniform 10 Gbps network, prints:
  - the DP optimum of PipeDream's own straight-pipeline objective: slowest stage's forward +
    backward compute, communication ignored (what its optimizer prints without
    --activation_compression_ratio), and the speed-up over one stage;
  - the DP optimum when the cut's activation (forward) and gradient (backward) transfers over the
    10 Gbps full-duplex links count in the bottleneck, overlapped with compute;
  - the least latency L of a global batch of M microbatches (the closed form the DP minimizes);
  - each of the three twice: cutting one topological order (the straight order, as the linear
    DP, the DQN and the inference network do) and cutting at any downset of the layer graph
    (`downsets.solve_downsets`, as PipeDream's antichain states do), with how much lower the
    downset optimum is. Graphs with more than --max-states downsets are searched over those
    within the largest lookahead that fits (the "downsets" column gives how many and h);
  - for that plan, the simulated length of a global batch of M microbatches under 1F1B and
    under GPipe, and the DP's closed-form estimate of it;
  - the online DQN's result on the same objective (with communication): the bottleneck of the
    best plan it found, its gap to the DP, when it found it, and its search time. Graphs with
    more than --dqn-pivots pivots are first coarsened to that many (`normalize.coarsen`: the
    cheapest cut in each bin of equal compute), so there the DQN searches fewer cuts than the
    DP; the DP's optimum over those same pivots is shown beside it;
  - two baselines on the DQN's ranked candidates (`hlomap.tasks.pipeline.baselines`), and what the
    shipped inference network alone (no training on the model) lands on.
vgg16's rows are checked against the numbers PipeDream's optimizer prints.

    python scripts/reproduce_pipedream.py [--corpus DIR] [--models vgg16 ...] [--stages 2 4 8]
        [--gantt OUT_DIR] [--dqn-episodes 2000] [--dqn-pivots 256] [--seed 0] [--no-dqn]
        [--max-states 2048] [--no-latency]
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hlomap.cost.pipeline.costs import CommModel, CostOptions
from hlomap.cost.pipeline.simulator import simulate
from hlomap.cost.pipeline.stages import Schedule
from hlomap.report.gantt import draw_gantt
from hlomap.tasks.pipeline.dp import solve
from hlomap.tasks.pipeline.downsets import DEFAULT_MAX_STATES, solve_downsets
from hlomap.tasks.pipeline.pipedream import load_pipedream_dag, pipedream_cluster
from hlomap.tasks.pipeline.space import PipelineObjective, PipelineSpace
from hlomap.tasks.pipeline.cutenv import CutTask
from hlomap.search.budget import Budget
from hlomap.search.dqn import dqn_search
from hlomap.search.random import random_search
from hlomap.tasks.pipeline.task import CutSearchTask
from hlomap.tasks.pipeline.infer import infer_cuts
from hlomap.tasks.pipeline.normalize import coarsen

#: Slowest-stage seconds PipeDream's optimizer reports for vgg16, straight pipelines.
PUBLISHED_VGG16 = {2: 0.370931, 4: 0.21645, 8: 0.159531}

DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "pipedream"


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def _value(cut: Any) -> float:
    """L or the bottleneck of a plan, infinite when it does not fit in memory."""
    return cut.value if cut.feasible else math.inf


def _gap(value: float, optimum: float) -> str:
    return f"{100 * (value / optimum - 1):+.2f}%" if math.isfinite(value) else "OOM"


def _searched(states: int, lookahead: int, complete: bool) -> str:
    """How many downsets the DP searched: all of them, or those within lookahead h."""
    return f"{states} all" if complete else f"{states} h={lookahead}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--models", nargs="+", default=None, help="graph names (default: all)")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--bandwidth-gbps", type=float, default=10.0)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--gantt", type=Path, default=None, help="write a Gantt PNG per row here")
    parser.add_argument("--dqn-episodes", type=int, default=2000)
    parser.add_argument("--dqn-pivots", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", default=None, help="inference policy file (default: shipped)")
    parser.add_argument("--no-dqn", action="store_true", help="skip the DQN, baselines, inference")
    parser.add_argument("--max-states", type=int, default=DEFAULT_MAX_STATES,
                        help="bound on the downsets the downset DP searches per graph")
    parser.add_argument("--no-latency", action="store_true", help="skip the least-L columns")
    args = parser.parse_args()

    console = Console(width=300)
    console.print(f"load average before: {_load()}")
    optima = Table(
        title=f"DP optima of straight pipelines on PipeDream profiles ({args.bandwidth_gbps:g} "
        f"Gbps; L for M = {args.microbatches}): cutting the straight order vs any downset"
    )
    for column in (
        "model", "layers", "downsets", "S", "1 stage (s)", "compute-only straight (s)",
        "compute-only downsets (s)", "lower by", "speed-up", "PipeDream",
        "with comm straight (s)", "with comm downsets (s)", "lower by", "least L straight (s)",
        "least L downsets (s)", "lower by", "L model (s)", "L sim 1F1B (s)", "L sim GPipe (s)",
        "DP time (s)", "downset DP (s)",
    ):
        optima.add_column(column, justify="left" if column == "model" else "right")
    searches = Table(
        title=f"Searches on the with-comm bottleneck objective (gaps to its DP optimum; DQN "
        f"{args.dqn_episodes} episodes, seed {args.seed})"
    )
    for column in (
        "model", "S", "DP optimum (s)", "DQN pivots", "DP on them", "DQN (s)", "DQN gap",
        "found at", "DQN time (s)", "first gap", "random gap", "infer (s)", "infer gap",
        "infer time (s)",
    ):
        searches.add_column(column, justify="left" if column == "model" else "right")
    if args.gantt:
        args.gantt.mkdir(parents=True, exist_ok=True)
    policy = None
    if not args.no_dqn:
        from hlomap.tasks.pipeline.infer import load_policy

        policy = load_policy(args.policy)
    checks = []

    paths = sorted(args.corpus.glob("*.txt"))
    if args.models:
        paths = [p for p in paths if p.stem in args.models]
    for path in paths:
        dag = load_pipedream_dag(path)
        profile = dag.straight
        total = float(profile.compute_time.sum())
        for n_stages in args.stages:
            network = pipedream_cluster(n_stages, args.bandwidth_gbps)
            compute_space = PipelineSpace(
                objective=PipelineObjective.BOTTLENECK,
                cost=CostOptions(comm=CommModel.IGNORED),
                check_memory=False,
            )
            space = PipelineSpace(
                objective=PipelineObjective.BOTTLENECK,
                microbatches=args.microbatches,
                schedule=Schedule.ONE_F_ONE_B,
                check_memory=False,
            )
            latency_space = replace(space, objective=PipelineObjective.LATENCY)
            spaces = [compute_space, space] + ([] if args.no_latency else [latency_space])
            start = time.perf_counter()
            straight = [solve(profile, network, s) for s in spaces]
            elapsed = time.perf_counter() - start
            start = time.perf_counter()
            downset = [solve_downsets(dag, network, s, max_states=args.max_states)
                       for s in spaces]
            downset_elapsed = time.perf_counter() - start
            compute_only, with_comm = straight[0], straight[1]
            searched = _searched(downset[0].states, downset[0].lookahead, downset[0].complete)
            result = simulate(profile, network, with_comm.plan)
            gpipe = simulate(profile, network, replace(with_comm.plan, schedule=Schedule.GPIPE))
            published = PUBLISHED_VGG16.get(n_stages) if path.stem == "vgg16" else None
            check = ""
            if published is not None:
                ok = all(abs(v - published) <= 5e-7 * published
                         for v in (compute_only.value, downset[0].value))
                checks.append(ok)
                check = f"{published:.6g} {'ok' if ok else 'MISMATCH'}"
            lower = [f"{100 * (1 - cut.value / line.value):.2f}%"
                     for line, cut in zip(straight, downset)]
            pairs = []
            for line, cut, by in zip(straight, downset, lower):
                pairs += [f"{line.value:.6g}", f"{cut.value:.6g}", by]
            if args.no_latency:
                pairs += ["", "", ""]
            optima.add_row(
                path.stem, str(profile.n_layers), searched, str(n_stages), f"{total:.6g}",
                *pairs[:3], f"{total / compute_only.value:.2f}x", check, *pairs[3:],
                f"{with_comm.cost.latency:.4g}", f"{result.length:.4g}", f"{gpipe.length:.4g}",
                f"{elapsed:.2f}", f"{downset_elapsed:.2f}",
            )
            console.print(f"  {path.stem} S={n_stages}: downsets ({searched}) lower the optima "
                          f"(compute only, with comm, L) by {', '.join(lower)}")
            if args.gantt:
                draw_gantt(result, args.gantt / f"{path.stem}_S{n_stages}.png")
            if args.no_dqn or not 2 <= n_stages <= profile.n_layers:
                continue
            optimum = with_comm.value
            coarse, _ = coarsen(profile, args.dqn_pivots)
            task = CutTask(coarse, network, space, n_stages)
            search = CutSearchTask(task)
            found = dqn_search(search, Budget(episodes=args.dqn_episodes, seconds=None), seed=args.seed)
            dqn = search.cut_plan(found.decisions)
            same = solve(coarse, network, space).value if coarse is not profile else None
            first = _value(search.cut_plan(CutSearchTask(task).initial()))
            randomly = random_search(CutSearchTask(task), Budget(episodes=found.episodes, seconds=None),
                                     seed=args.seed)
            random_value = _value(search.cut_plan(randomly.decisions))
            # The inference network coarsens the full profile to its own 128 points.
            inferred = infer_cuts(CutTask(profile, network, space, n_stages), policy,
                                  seed=args.seed)
            searches.add_row(
                path.stem, str(n_stages), f"{optimum:.6g}",
                f"{coarse.n_pivots}/{profile.n_pivots}",
                f"{same:.6g}" if same is not None else "same",
                f"{_value(dqn):.6g}", _gap(_value(dqn), optimum),
                f"{found.improvements[-1].evaluation}/{found.episodes}", f"{found.seconds:.1f}",
                _gap(first, optimum), _gap(random_value, optimum),
                f"{inferred.value:.6g}", _gap(inferred.value, optimum),
                f"{inferred.seconds:.2f}",
            )
            console.print(f"  {path.stem} S={n_stages}: DP {optimum:.6g}, DQN "
                          f"{_gap(_value(dqn), optimum)} in {found.seconds:.1f} s, inference "
                          f"{_gap(inferred.value, optimum)}")
    console.print(optima)
    console.print(
        "straight: cuts at any position of one topological order (ties by node number); "
        "downsets: cuts at any set of layers closed under predecessors (PipeDream's antichain "
        "states), the DP exact over all of them ('N all') or over the N within lookahead h of "
        "the straight order (every layer of the cut at most h positions after the first layer "
        "it leaves out; always a superset of the straight cuts); lower by: 1 - downsets / "
        "straight. The bytes crossing a cut are the outputs of distinct nodes before it used "
        "after it. L model and L sim are those of the straight with-comm plan. "
        "L model: the DP's closed form (sum of stage and link times "
        "+ (M - 1) x bottleneck); L sim: the event simulator. 1F1B keeps only S - s microbatches "
        "in flight on stage s and GPipe runs every forward before any backward, so a slow link "
        "is exposed in both and the simulated L exceeds the model's."
    )
    if checks:
        console.print(f"vgg16 against PipeDream's optimizer (straight and downset DP): "
                      f"{sum(checks)}/{len(checks)} match")
    if not args.no_dqn:
        console.print(searches)
        console.print(
            "first: always the best-estimated of the DQN's ranked candidates; random: random "
            "search over them with the DQN's episode budget; infer: the shipped inference "
            "network alone (no training on the model), on 128 points of the full profile."
        )
    console.print(f"load average after: {_load()}")


if __name__ == "__main__":
    main()
