"""`hlomap place PLAN.json --cluster ...`: choose which physical device takes each logical
position of a plan."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from hlomap import api
from hlomap.cli import common

DESCRIPTION = ("Topology-aware device placement: choose which device of the cluster takes each logical position of "
               "a plan (the mesh's positions, each pipeline stage's replicas, or each joint stage's mesh) to "
               "minimize the estimated step time: collectives along the mesh axes, stage all-reduces and the "
               "transfers between stages. Writes the plan with a placement section; hlomap simulate then prices "
               "it on that order.")
EPILOG = ("examples:\n  hlomap place plan.json --cluster torus:8x8x8\n"
          "  hlomap place pipeline.json --cluster random:64:3 --agent ppo -o placed.json\n"
          "  hlomap place auto.json --cluster torus:4x4 --source zoo:gpt-tiny    # a joint plan (--task auto)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("place", help="choose which physical device takes each position of a plan",
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan", metavar="PLAN.json", help="a plan saved by hlomap explore or Plan.save")
    p.add_argument("--cluster", required=True, metavar=common.CLUSTER_METAVAR, help=common.CLUSTER_HELP)
    p.add_argument("--agent", default="greedy", metavar="|".join(api.PLACEMENT_AGENTS),
                   help="greedy: construction + pairwise-swap local search; ppo: the shipped placement policy, then "
                        "local search; exact: every permutation (clusters of up to 8 devices); random: best random "
                        "placement; identity: the plan's own order (default greedy)")
    common.add_budget_options(p, seconds_help="wall-clock budget of the command, reading the plan and pricing it on "
                                              "the cluster included (default 60; the search stops earlier once "
                                              "a quarter of it passes without a better placement)",
                              evaluations_help="also stop after N evaluations (a swap tried, or a placement priced)")
    p.add_argument("--source", metavar="SOURCE",
                   help="the plan's step (zoo:NAME, FILE.py:FUNCTION or HLO file): an SPMD plan's collectives are "
                        "estimated again on this cluster instead of taken from the estimate saved in the plan; a "
                        "joint plan (hlomap explore --task auto) needs it")
    common.add_role_options(p)
    p.add_argument("--policy", metavar="POLICY.npz", help="ppo: a placement policy file (default: the shipped one)")
    p.add_argument("--finetune-seconds", type=common.seconds, default=0.0, metavar="N",
                   help="ppo: fine-tune the policy on this plan for N seconds of the budget first (default 0)")
    p.add_argument("-o", "--output", metavar="OUT.json", help="the placed plan (default: PLAN.placed.json beside it)")
    p.add_argument("--json", action="store_true", help="print the placement section as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress message")
    p.set_defaults(func=cmd_place)


def cmd_place(args: argparse.Namespace) -> int:
    from hlomap.report.placement import format_placement

    started = time.perf_counter()
    if args.agent not in api.PLACEMENT_AGENTS:
        raise common.CliError(f"--agent {args.agent}: choose one of {', '.join(api.PLACEMENT_AGENTS)}")
    for flag, given in (("--policy", args.policy is not None), ("--finetune-seconds", args.finetune_seconds != 0.0)):
        if given and args.agent != "ppo":
            raise common.CliError(f"{flag}: only --agent ppo reads it (--agent is {args.agent})")
    plan = api.load_plan_file(args.plan)
    cluster = common.cluster_argument(args.cluster, None)
    output = Path(args.output) if args.output else common.beside(Path(args.plan), "placed.json")
    common.check_outputs(output)
    cap = common.load_capture(args) if api.reads_source(plan, args.source) else None
    job = api.prepare_placement(plan, cluster, agent=args.agent, cap=cap, policy=args.policy,
                                finetune_seconds=args.finetune_seconds, where=args.plan)
    if not args.quiet:
        for text in job.notes:
            common.note(text)
        common.say(f"placing {job.positions} logical positions on {cluster.n_devices} devices of {cluster.name} "
                   f"with {args.agent} ...")
    # the set-up (reading, estimating, building the problem) counts against the budget
    budget = max(0.0, args.budget_seconds - (time.perf_counter() - started))
    placed = api.place(job, budget_seconds=budget, budget_evaluations=args.budget_evaluations,
                       seed=args.seed, output=output)
    result = placed.result
    if args.json:
        common.print_json(placed.plan.placement.to_json() | {"evaluations": result.evaluations,
                                                              "seconds": result.seconds, "optimal": result.optimal})
    else:
        common.console().print(format_placement(placed.problem, result))
    common.say(f"placed plan: {output}")
    return 0
