"""Re-planning under changing resources (AutoPipe): total training time per trace and policy.

    python scripts/bench_replan.py                 # 2 clusters x 4 trace kinds x 2 seeds (about 30 min)
    python scripts/bench_replan.py --clusters hier:8x2 --kinds steps drift --seeds 100 --json out.json
    python scripts/bench_replan.py --joint gpt-small --seeds 100     # a zoo model's joint plans

Every trace is generated (`hlomap.tasks.replan.trace.generate`, seeds not used to train the meta
network), the workload a GPT-style model (`options.transformer_workload`: 24 layers, hidden 2048, 16
microbatches) whose initial plan is the DP's optimum on the trace's first resources. Policies:
static (PipeDream: planned once, re-solved only when a device leaves), re-solve at every change
(migration ignored), the switch arbiter (exact prices), the meta policy (the shipped LSTM's
predicted gains; its agreement with the arbiter's choice is shown), and the oracle (knows the
future). Total training time: until the workload (the initial plan's iterations over half the
horizon at full strength) is done; throughput vs static = static's time / the policy's - 1.

With `--joint NAME` the workload is the zoo model's train step re-planned in the joint planner's
space (`hlomap.tasks.replan.joint`: stages with their own data x model meshes, stage count,
microbatches, recomputation and state splitting re-solved at every change), from the joint DP's
optimum on the trace's first resources.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402

from hlomap.report.placement import solver_table  # noqa: E402
from hlomap.tasks.replan.meta import DEFAULT_NETWORK, MetaPolicy, load_network  # noqa: E402
from hlomap.api import load_source  # noqa: E402
from hlomap.tasks.replan.joint import JointReplay  # noqa: E402
from hlomap.tasks.replan.options import ReplannedPlan, initial_plan, transformer_workload  # noqa: E402
from hlomap.tasks.replan.policies import PlanReplay, ReplanPolicy, Replay, run_policy  # noqa: E402
from hlomap.tasks.replan.trace import TraceKind, generate  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clusters", nargs="+", default=["hier:8x2", "hier:4x4"])
    parser.add_argument("--kinds", type=TraceKind, nargs="+", default=list(TraceKind))
    parser.add_argument("--seeds", type=int, nargs="+", default=[100, 101])
    parser.add_argument("--network", type=Path, default=DEFAULT_NETWORK)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--joint", metavar="ZOO_MODEL", help="re-plan this zoo model's joint plans instead")
    args = parser.parse_args()
    cap = load_source(f"zoo:{args.joint}") if args.joint else None
    console = Console(width=170)
    network = load_network(args.network) if args.network.is_file() else None
    policies = ([ReplanPolicy.STATIC, ReplanPolicy.RESOLVE, ReplanPolicy.ARBITER]
                + ([ReplanPolicy.META] if network else []) + [ReplanPolicy.ORACLE])
    rows, records = [], []
    gains: dict[tuple[str, ReplanPolicy], list[float]] = {}
    for cluster in args.clusters:
        for kind in args.kinds:
            for seed in args.seeds:
                trace = generate(kind, cluster, seed=seed)
                start = time.perf_counter()
                replay: PlanReplay
                if cap is not None:
                    replay = JointReplay.planned(cap, trace)
                    initial: ReplannedPlan = replay.initial
                else:
                    workload = transformer_workload(seed=seed)
                    replay = Replay(trace, workload)
                    initial = initial_plan(workload, replay.states[0][1])
                runs, agreement = {}, None
                for policy in policies:
                    chooser = MetaPolicy(trace.horizon, network) if policy is ReplanPolicy.META else None
                    runs[policy] = run_policy(replay, initial, policy, chooser=chooser)
                    agreement = chooser.agreement if chooser is not None else agreement
                static = runs[ReplanPolicy.STATIC].total_seconds
                cells = []
                for policy in policies:
                    r = runs[policy]
                    gain = static / r.total_seconds - 1
                    gains.setdefault((str(kind), policy), []).append(gain)
                    cells.append(f"{r.total_seconds / 3600:.2f} h ({100 * gain:+.1f}%)")
                switches = sum(1 for d in runs[ReplanPolicy.ARBITER].decisions if d.migration_seconds > 0)
                rows.append([f"{trace.name} on {cluster}", str(len(trace.events)), *cells, str(switches),
                             "-" if agreement is None else f"{100 * agreement:.0f}%"])
                records.append({"trace": trace.name, "cluster": cluster, "changes": len(trace.events),
                                "seconds": time.perf_counter() - start, "agreement": agreement,
                                **{p.value: {"total_seconds": r.total_seconds, "horizon_iterations": r.horizon_iterations,
                                             "migration_seconds": r.migration_seconds} for p, r in runs.items()}})
                console.print(f"  {trace.name} on {cluster}: {time.perf_counter() - start:.0f} s")
    console.print(solver_table(
        "Total training time per trace and policy (throughput against the static plan)",
        ["trace", "changes", *[p.value for p in policies], "arbiter switches", "meta = exact"], rows))
    if cap is not None:
        console.print(f"workload: {args.joint}'s joint plans (hlomap.tasks.replan.joint)")
    summary = [[kind, *[f"{100 * statistics.mean(gains[(kind, p)]):+.1f}%" for p in policies]]
               for kind in dict.fromkeys(str(k) for k in args.kinds)]
    console.print(solver_table("Mean throughput gain over the static plan, per trace kind",
                               ["trace kind", *[p.value for p in policies]], summary))
    if args.json:
        args.json.write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
