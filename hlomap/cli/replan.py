"""`hlomap replan PLAN.json --trace ...`: play re-planning policies over a trace of changing
bandwidth and GPUs."""

from __future__ import annotations

import argparse
from pathlib import Path

from hlomap import api
from hlomap.cli import common

DESCRIPTION = ("Play re-planning policies over a resource trace (per-link bandwidth and available GPUs per server "
               "over time) from a pipeline plan, or from a joint plan (stages with their own data x model meshes, "
               "re-solved in the joint planner's space): static (planned once), re-solve at every change, AutoPipe's switch "
               "arbiter (keep / move layers between two neighbouring stages / re-solve, priced by migration against "
               "the time saved), the learned meta policy, and an oracle that knows the future. Prints the decisions "
               "over time and every policy's total training time; draws the estimated throughput of each.")
EPILOG = ("the trace format is described in docs/placement-and-replanning.md (Re-planning when resources change) and in "
          "hlomap/tasks/replan/trace.py")


def add_parser(sub: argparse._SubParsersAction) -> None:
    policies = api.replan_policies()
    p = sub.add_parser("replan", help="re-plan a pipeline or joint plan over a trace of changing bandwidth and GPUs",
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan", metavar="PLAN.json", help="a pipeline plan (hlomap explore --task pipeline) or a plan of "
                                                   "hlomap explore --task auto (needs --source)")
    p.add_argument("--trace", required=True, metavar="TRACE.json", help="the resource trace")
    p.add_argument("--source", metavar="SOURCE",
                   help="the plan's step (zoo:NAME, FILE.py:FUNCTION or HLO file): a joint plan is re-planned in the "
                        "joint planner's space (stage meshes, stage count, microbatches) and needs it")
    common.add_role_options(p)
    p.add_argument("--show", default="arbiter", metavar="|".join(policies),
                   help="whose decisions to list (default arbiter)")
    p.add_argument("--network", metavar="GAIN.npz", help="the meta policy's gain network (default: the shipped one)")
    p.add_argument("--no-meta", action="store_true", help="leave the meta policy out")
    p.add_argument("--plot", metavar="FILE.png", help="throughput plot (default: next to the plan, *.replan.png)")
    p.add_argument("--json", action="store_true", help="print the runs as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress message")
    p.set_defaults(func=cmd_replan)


def cmd_replan(args: argparse.Namespace) -> int:
    from hlomap.report.replan import format_decisions, format_totals, plot_throughput, replan_json

    policies = api.replan_policies()
    if args.show not in policies:
        raise common.CliError(f"--show {args.show}: choose one of {', '.join(policies)}")
    plan = api.load_plan_file(args.plan)
    plot = Path(args.plot) if args.plot else common.beside(Path(args.plan), "replan.png")
    if args.source is None and api.replans_from_module(plan):
        raise common.CliError(f"{args.plan}: a joint plan is re-planned from its step's module: give its SOURCE "
                              "with --source (zoo:NAME, FILE.py:FUNCTION or HLO file)")
    cap = common.load_capture(args) if api.reads_source(plan, args.source) else None
    job = api.prepare_replan(plan, args.trace, network=args.network, use_meta=not args.no_meta, where=args.plan,
                             source=cap)
    common.check_outputs(plot)
    for text in job.notes:
        common.note(text)
    if not args.quiet:
        common.say(f"playing {job.policies} policies over {len(job.trace.events)} changes of {job.trace.name} ...")
    report = api.replan(job)
    shown = api.replan_run(report, args.show)
    plot_throughput(job.trace, report.runs, plot)
    if args.json:
        common.print_json(replan_json(job.trace, report), default=lambda x: None)
    else:
        out = common.console()
        out.print(format_decisions(job.trace, shown))
        out.print(format_totals(job.trace, report.runs, report.agreement))
    common.say(f"throughput plot: {plot}")
    return 0
