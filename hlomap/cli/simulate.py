"""`hlomap simulate SOURCE --plan ...`: price one step under any plan (SPMD, built-in, pipeline,
joint) on a cluster."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from hlomap import api
from hlomap.cli import common


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="estimate a step's time, collectives and memory under a plan",
                       description="Estimate one training step under a plan on a cluster: compute (roofline per "
                                   "instruction), the collectives the plan implies, and memory per device.")
    p.add_argument("source", metavar="SOURCE", help=common.SOURCE_HELP)
    p.add_argument("--plan", default="dp", metavar="dp|megatron|dp+megatron|PLAN.json",
                   help="a built-in reference plan (derived from roles and the factor graph) or a saved plan "
                        "(default: dp)")
    p.add_argument("--mesh", metavar="8|data=2,model=4",
                   help="device mesh; a bare count names its axis after the plan (data for dp, model for megatron)."
                        " Default: 8, or the saved plan's mesh")
    p.add_argument("--cluster", metavar=common.CLUSTER_METAVAR,
                   help=f"{common.CLUSTER_HELP} (default: the cluster a saved plan was placed on, else explored on, "
                        "where --cluster can name it: a preset, a topology or local; else A)")
    p.add_argument("--profile", metavar="PROFILE.json", help=common.PROFILE_HELP)
    p.add_argument("--axis-order", metavar="AXES",
                   help="mesh axes from outermost to innermost on the devices, e.g. data,model keeps model "
                        "inside a node (default: the mesh's order)")
    common.add_role_options(p)
    p.add_argument("--shard-optimizer-state", action="store_true",
                   help="split the optimizer state over the plan's data axes (ZeRO-1) and price that")
    p.add_argument("--shard-parameters", action="store_true",
                   help="store the trainable parameters split over the plan's data axes too (FSDP / ZeRO-3: "
                        "implies --shard-optimizer-state) and price that")
    p.add_argument("--executor", choices=("spmd", "mpmd"),
                   help="price a pipeline or joint plan on this executor (default: the one the runner would "
                        "choose: spmd for GPipe on stages alike, else mpmd)")
    p.add_argument("--top", type=common.count, default=None, metavar="N",
                   help="SPMD and built-in plans: slowest instructions to list (default 10; with --json: "
                        "listed as slowest_instructions only when given)")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.add_argument("--fail-if-oom", action="store_true", help="exit with status 3 when the plan does not fit")
    p.set_defaults(func=cmd_simulate, wants_local=prices_on_local)


def prices_on_local(args: argparse.Namespace) -> bool:
    """Whether `simulate` will price on `local` for want of --cluster (the plan file's cluster),
    read from the file alone: the host devices must be set up before anything starts JAX."""
    return args.cluster is None and args.plan not in api.BUILT_IN_PLANS and api.is_local(
        api.saved_plan_cluster(args.plan))


def cmd_simulate(args: argparse.Namespace) -> int:
    from hlomap.report.simulate import format_simulation, simulation_json

    if args.plan not in api.BUILT_IN_PLANS and not Path(args.plan).exists():
        raise common.CliError(f"--plan {args.plan}: not dp, megatron, dp+megatron, nor an existing plan file")
    plan = api.plan_or_built_in(args.plan)
    order = tuple(a.strip() for a in args.axis_order.split(",")) if args.axis_order else None
    api.check_simulation_options(plan, mesh=args.mesh, axis_order=order, where=args.plan)
    if args.top is not None and api.plan_category(plan) in (api.PlanCategory.PIPELINE, api.PlanCategory.JOINT):
        raise common.CliError(f"--top {args.top}: a {api.plan_category(plan).value} plan is priced by its stages, "
                              "not instruction by instruction")
    mesh = None if args.mesh is None else common.mesh_argument(args.mesh)
    # What the price assumes is said once it exists: a note before an unrelated error misleads.
    notes: list[str] = []
    if plan in ("dp", "megatron") and isinstance(mesh, dict) and len(mesh) > 1:
        notes.append(f"{plan} splits over every axis of {','.join(f'{k}={v}' for k, v in mesh.items())} together "
                     f"({'the batch' if plan == 'dp' else 'the weights'} {math.prod(mesh.values())} ways); "
                     "dp+megatron splits the batch on data and the weights on model")
    spelling = args.cluster or api.explored_cluster(plan) or "A"
    if args.cluster is None and spelling != "A":
        how = "placed" if getattr(plan, "placement", None) is not None else "explored"
        notes.append(f"pricing on {spelling}, the cluster the plan was {how} on (--cluster prices it elsewhere)")
    cluster = common.cluster_argument(spelling, args.profile)  # before the capture: fail fast
    warnings = [w for w in (api.other_cluster_warning(plan, cluster),) if w]
    notes += [n for n in (api.other_cluster_note(plan, cluster),) if n]
    cap = common.load_capture(args) if api.reads_source(plan, args.source) else None
    simulation = api.simulate_plan(cap, plan, cluster=cluster, mesh=mesh, axis_order=order, where=args.plan,
                                   shard_optimizer_state=args.shard_optimizer_state,
                                   shard_parameters=args.shard_parameters, executor=args.executor)
    warnings += [f"{problem}: `hlomap run` would refuse this plan for {args.source}; its price is a what-if"
                 for problem in (api.batch_split_problems(plan, cap) if cap is not None else ())]
    for warning in warnings:
        common.warn(warning)
    for note in notes if not args.json else ():
        common.note(note)
    if args.json:
        common.print_json(simulation_json(simulation, top=args.top), indent=2)
    else:
        common.show(*format_simulation(simulation, top=10 if args.top is None else args.top, name=args.source))
    return 0 if simulation.fits or not args.fail_if_oom else common.EXIT_OOM
