"""`hlomap explore SOURCE --task ...`: search a plan (opp, adp, hybrid, pipeline, auto) and save
it as the search runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Sequence

from hlomap import api
from hlomap.cli import common
from hlomap.cli.interrupts import interrupts_of

SHARDING_TASKS = ("opp", "adp", "hybrid")
SHARDING_AGENTS = api.SHARDING_AGENTS
PIPELINE_AGENTS = api.PIPELINE_AGENTS

#: The tasks that read each task-specific option (its argparse dest). Given to another task, the
#: option is refused instead of silently ignored. Options every task reads are not listed.
TASK_OPTIONS: dict[str, tuple[str, ...]] = {
    "mesh": SHARDING_TASKS, "reward": SHARDING_TASKS, "curve": SHARDING_TASKS, "budget_evaluations": SHARDING_TASKS,
    "agent": (*SHARDING_TASKS, "pipeline"), "budget_seconds": (*SHARDING_TASKS, "pipeline"),
    "shard_optimizer_state": (*SHARDING_TASKS, "auto"), "shard_parameters": (*SHARDING_TASKS, "auto"),
    "stages": ("pipeline", "auto"), "microbatches": ("pipeline", "auto"), "schedule": ("pipeline", "auto"),
    "episodes": ("pipeline",), "finetune_episodes": ("pipeline",), "compare_dp": ("pipeline",),
    "downset_states": ("pipeline",), "timeline": ("pipeline",),
}


class _NotGiven:
    """The parsed value of a task option left out of the command line (`check_task_options`
    replaces it with the option's default), so that an option given at its default value is told
    from one not given at all."""

    def __repr__(self) -> str:
        return "(not given)"


NOT_GIVEN = _NotGiven()


def check_task_options(args: argparse.Namespace) -> None:
    """Refuse the options given (even at their default values) that `args.task` does not read,
    then give every option left out its default."""
    defaults = args.option_defaults
    foreign = [dest for dest, tasks in TASK_OPTIONS.items()
               if args.task not in tasks and getattr(args, dest) is not NOT_GIVEN]
    for dest in TASK_OPTIONS:
        if getattr(args, dest) is NOT_GIVEN:
            setattr(args, dest, defaults[dest])
    if not foreign:
        return
    parts = [f"--{dest.replace('_', '-')} (an option of {', '.join(TASK_OPTIONS[dest])})" for dest in foreign]
    raise common.CliError(f"--task {args.task} does not read {'; '.join(parts)}")

DESCRIPTION = ("Search a distributed plan for a train step. opp: operator partitioning of the trainable variables "
               "(tensor parallelism); adp: which dims of the data inputs to split (data parallelism); hybrid: both "
               "on a data x model mesh; pipeline: stage cuts, device groups and replication; auto: the whole "
               "cluster at once, pipeline stages each with its own data x model mesh and sharding (exact two-level "
               "search), beside Megatron-LM's pp x tp x dp grid. The best plan so far is saved to -o as the search "
               "runs (Ctrl-C keeps it).")
EPILOG = ("examples:\n  hlomap explore zoo:gpt-small --budget-seconds 30\n"
          "  hlomap explore zoo:gpt-1.3b --task hybrid --mesh data=2,model=8 --reward cost\n"
          "  hlomap explore zoo:bert-base --task pipeline --stages 2 --cluster A --agent dp\n"
          "  hlomap explore zoo:gpt-1.3b --task auto --cluster A\n"
          "  hlomap explore mymodel.py:make --task opp   (a function returning (train_step, example_args))\n"
          "  hlomap explore zoo:gpt-tiny --task hybrid --mesh data=2,model=4 --measure 3   (time the best 3 here)\n"
          "  hlomap explore pipedream:vgg16.txt --task pipeline --stages 4   (a PipeDream profiler graph file)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explore", help="search a plan: tensor, data, hybrid, pipeline or all at once (auto)",
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="SOURCE",
                   help=f"{common.SOURCE_HELP}; or (pipeline task only) a PipeDream graph, pipedream:GRAPH.txt or "
                        "its bare path")
    p.add_argument("--task", choices=(*SHARDING_TASKS, "pipeline", "auto"), default="opp",
                   help="what to search (default opp); auto: pipeline stages x data x model for the whole cluster")
    p.add_argument("--mesh", default="8", metavar="8|data=2,model=4",
                   help="device mesh of the opp/adp/hybrid tasks; a bare count is one axis, model (data for adp) "
                        "(default 8)")
    p.add_argument("--cluster", default="A", metavar=common.CLUSTER_METAVAR,
                   help=f"{common.CLUSTER_HELP}, for the cost reward, the plan's estimate and the pipeline links "
                        "(default A)")
    p.add_argument("--profile", metavar="PROFILE.json", help=common.PROFILE_HELP)
    p.add_argument("--agent", default="dqn", metavar="AGENT",
                   help=f"opp/adp/hybrid: {'|'.join(SHARDING_AGENTS)}; pipeline: {'|'.join(PIPELINE_AGENTS)} "
                        "(default dqn)")
    _add_search_options(p)
    common.add_role_options(p)
    _add_pipeline_options(p)
    _add_measure_options(p)
    p.add_argument("--fail-if-oom", action="store_true",
                   help="exit with status 3 when the plan (or a stage) does not fit device memory")
    p.add_argument("--json", action="store_true", help="print the plan (or pipeline result) as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_explore, option_defaults={dest: p.get_default(dest) for dest in TASK_OPTIONS})
    p.set_defaults(**{dest: NOT_GIVEN for dest in TASK_OPTIONS})  # told from given at the default


def _add_search_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reward", choices=("paper", "cost"), default="paper",
                   help="paper: Auto-MAP's +0.4 per partitioned dim, +0.1 per replicated one, -1 on conflict; "
                        "cost: the cost model's step-time gain (default paper)")
    common.add_budget_options(p, seconds_help="wall-clock budget of the search (default 60)",
                              evaluations_help="also stop after N evaluated plans")
    p.add_argument("-o", "--output", default="plan.json", metavar="PLAN.json",
                   help="where the plan is saved, and kept up to date while searching (default plan.json)")
    p.add_argument("--shard-optimizer-state", choices=("off", "on", "auto"), default="auto",
                   help="split the optimizer state over the plan's data axes (ZeRO-1): on; off; auto (default): "
                        "only when the plan does not fit device memory otherwise and does with it (--task auto: "
                        "each stage may split it where the planner finds that it fits or pays; off: none)")
    p.add_argument("--shard-parameters", choices=("off", "on", "auto"), default="auto",
                   help="store the trainable parameters split over the plan's data axes too (FSDP / ZeRO-3; XLA "
                        "gathers each before its use): on (splits the optimizer state as well); off; auto (default): "
                        "only when the plan with its optimizer state split still does not fit and does with it "
                        "(--task auto: on searches stages that split their parameters, or only their gradients "
                        "(ZeRO-2), auto only when no plan fits without them)")
    p.add_argument("--curve", metavar="FILE.png",
                   help="convergence curve, score per episode (default: next to the plan, *.convergence.png)")


def _add_pipeline_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pipeline and auto tasks")
    g.add_argument("--stages", type=common.positive_int, metavar="S",
                   help="pipeline stages, at most (pipeline task: default 2; auto: default any number)")
    g.add_argument("--microbatches", type=common.positive_int, metavar="M",
                   help="microbatches per step (pipeline task: default 8; auto: default every count that splits the "
                        "batch, searched)")
    g.add_argument("--schedule", choices=("1f1b", "gpipe", "zb-h1", "auto"), default="1f1b",
                   help="pipeline schedule (default 1f1b); auto: plan under 1F1B, then keep the fastest of 1f1b, zb-h1, "
                        "gpipe (and, for --task pipeline, interleaved-1f1b with 2 chunks per stage)")
    g.add_argument("--episodes", type=common.positive_int, default=2000, metavar="N",
                   help="DQN training episodes (default 2000; --budget-seconds also limits it)")
    g.add_argument("--finetune-episodes", type=common.count, default=0, metavar="N",
                   help="dqn-infer: fine-tune the shipped network for N episodes on this model (default 0)")
    g.add_argument("--compare-dp", action="store_true", help="also solve the exact DP and report the gap")
    g.add_argument("--downset-states", type=common.count, default=api.DOWNSET_STATES, metavar="K",
                   help="--agent dp on a branching step: also cut at downsets of the layer DAG, searching at most K "
                        f"of them besides the chain's prefixes, and keep that plan when cheaper (default "
                        f"{api.DOWNSET_STATES}: cut the chain's order only; {api.SUGGESTED_DOWNSET_STATES} searches "
                        "the zoo's steps in seconds)")
    g.add_argument("--timeline", metavar="FILE.png",
                   help="Gantt chart of the simulated step (default: next to the plan, *.timeline.png)")


def _add_measure_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("measured selection (needs SOURCE zoo:NAME or FILE.py:FUNCTION)")
    g.add_argument("--measure", type=common.count, default=0, metavar="K",
                   help="after the search, compile and time the best K distinct candidate plans on this machine's "
                        "devices (the pick and the best of each family always, so K may be raised) and keep the "
                        "measured fastest (default 0: off)")
    g.add_argument("--measure-rounds", type=common.positive_int, default=None, metavar="R",
                   help="interleaved timing rounds at most (default 10)")
    g.add_argument("--measure-budget-seconds", type=common.positive_float, default=None, metavar="S",
                   help="stop timing after the round that crosses S seconds (compiles not counted; default 60)")


def _measure_runnable(args: argparse.Namespace) -> Any:
    """The step that --measure runs, resolved before the search (an HLO file cannot be run)."""
    if not args.measure:
        alone = [flag for flag, value in (("--measure-rounds", args.measure_rounds),
                                          ("--measure-budget-seconds", args.measure_budget_seconds)) if value is not None]
        if alone:
            raise common.CliError(f"{' and '.join(alone)}: {'they bound' if len(alone) > 1 else 'it bounds'} the "
                                  "timing of --measure K, which is off")
        return None
    try:
        return api.measure_runnable(args.source, None, args.seed)
    except api.InputError as err:
        raise common.CliError(f"--measure {args.measure}: {err}") from None


def _measure(args: argparse.Namespace, found: Any, cap: Any, cluster: Any, runnable: Any, output: Path) -> Any:
    """Time the search's best candidates and save the measured fastest to `output`; returns the
    chosen plan (its `measured` section holds the table of predicted against measured)."""
    from hlomap.report.progress import measure_bar

    settings = api.measure_settings(args.measure, args.measure_rounds or api.MEASURE_ROUNDS,
                                    args.measure_budget_seconds or api.MEASURE_BUDGET_SECONDS)
    elsewhere = api.measuring_elsewhere(cluster)
    if elsewhere is not None:
        common.warn(elsewhere)

    def announce(selected: Sequence[Any]) -> None:
        if args.quiet:
            return
        raised = (f" (--measure {args.measure}, raised: the pick and the best of each family are always timed)"
                  if len(selected) > args.measure else "")
        common.say(f"measuring {len(selected)} candidate plan{'s' if len(selected) != 1 else ''}{raised} on this "
                   f"machine's devices, compiling first: {', '.join(c.name for c in selected)}")

    with measure_bar(not args.quiet) as on_round:
        selection = api.measure_found(found, cap, cluster, settings, runnable, on_round=on_round,
                                      on_candidates=announce)
    if selection.measurement is None and not args.quiet:
        why = ("--measure 1 selects only it" if args.measure == 1
               else "on one device every SPMD plan is the same program")
        common.say(f"one distinct candidate plan ({selection.chosen.name}; {why}): nothing to choose, not timed")
    selection.plan.save(output)
    return selection.plan


def _show_measurement(args: argparse.Namespace, plan: Any) -> None:
    from hlomap.report.measure import format_measurement

    if plan is not None and plan.measured is not None and not args.json:
        common.console().print(format_measurement(plan.measured))


def _measure_devices(args: argparse.Namespace) -> int | None:
    """Devices --measure runs the candidates on: the mesh's (opp, adp, hybrid) or the cluster's
    (pipeline, auto); None when the arguments are wrong (the task's own checks say why)."""
    import math

    from hlomap.plan import parse_mesh_text

    try:
        if args.task in SHARDING_TASKS:
            mesh = parse_mesh_text(args.mesh)
            return mesh if isinstance(mesh, int) else math.prod(mesh.values())
        return int(api.resolve_cluster(args.cluster, args.profile).cluster.n_devices)
    except (ValueError, OSError):  # reported by the task's own checks, once
        return None


def cmd_explore(args: argparse.Namespace) -> int:
    check_task_options(args)
    if args.measure:
        # A CPU-only machine shows one device unless told before JAX starts (as `hlomap run` does).
        devices = _measure_devices(args)
        if devices is not None:
            api.ensure_host_devices(devices)
    output = Path(args.output)
    if args.task == "pipeline":
        return _explore_pipeline(args, output)
    if args.task == "auto":
        common.check_outputs(output)
        return _explore_auto(args, output)
    if args.source.startswith(api.PIPEDREAM_PREFIX) or api.is_pipedream_graph(args.source):
        raise common.CliError(f"{args.source} is a PipeDream profile: it can only be explored with --task pipeline")
    return _explore_sharding(args, output)


def _finish(interrupted: bool, fits: bool, fail_if_oom: bool) -> int:
    """The exit status: 130 after Ctrl-C (the best plan so far is saved), 3 for a plan that
    does not fit under --fail-if-oom, else 0."""
    if interrupted:
        common.say("interrupted: the best plan found so far is saved")
        return common.EXIT_INTERRUPTED
    return 0 if fits or not fail_if_oom else common.EXIT_OOM


def _explore_sharding(args: argparse.Namespace, output: Path) -> int:
    from hlomap.report.sharding import format_plan_summary, plot_convergence, progress_bar

    api.check_agent(args.task, args.agent)
    mesh = api.parse_mesh(args.mesh, args.task)  # an OptionError names --mesh and the value given
    if args.budget_seconds is None and args.budget_evaluations is None and args.agent in ("dqn", "random"):
        raise common.CliError(f"--agent {args.agent} needs --budget-seconds or --budget-evaluations")
    curve = Path(args.curve) if args.curve else common.beside(output, "convergence.png")
    common.check_outputs(output, curve)
    cluster = common.cluster_argument(args.cluster, args.profile)
    runnable = _measure_runnable(args)
    interrupts = interrupts_of(args)
    cap = common.load_capture(args)
    api.require_roles(cap, f"the {args.task} task", trainable=args.task != "adp")
    interrupts.check()
    with progress_bar(not args.quiet, description=f"{args.task} / {args.agent}") as on_progress:
        found = api.explore_detailed(cap, args.task, mesh, cluster, args.agent, args.budget_seconds, args.seed,
                                     args.reward, budget_evaluations=args.budget_evaluations, output=output,
                                     on_progress=interrupts.wrap(on_progress),
                                     shard_optimizer_state=args.shard_optimizer_state,
                                     shard_parameters=args.shard_parameters)
    plot_convergence([found.result], curve, title=f"{cap.source}: {args.task}, {args.reward} reward")
    plan = found.plan
    if runnable is not None and not found.result.interrupted:
        plan = _measure(args, found, cap, cluster, runnable, output)
    if args.json:
        common.print_json(plan.to_json())
    else:
        roles = {p.path: p.role.value for p in cap.parameters}
        common.console().print(format_plan_summary(plan, roles=roles if cap.has_roles else None))
    _note_one_device(cap, plan, cluster, found.problem.graph)
    common.say(f"plan: {output}; convergence curve: {curve}")
    return _finish(found.result.interrupted, api.plan_fits(found.plan), args.fail_if_oom)


def _how_much_faster(speedup: float) -> str:
    """`2.3x faster`, or `4% faster` where a ratio would round to 1.0x."""
    return f"{speedup:.1f}x faster" if speedup >= 1.1 else f"{100 * (speedup - 1):.0f}% faster"


def _note_one_device(cap: Any, plan: Any, cluster: Any, graph: Any) -> None:
    """A note where the whole step on one device is priced faster than the plan found: the
    task searched the mesh it was given, but the user wants the fastest plan."""
    faster = api.one_device_faster(cap, plan, cluster, graph)
    if faster is None:
        return
    shared = f"the host's {faster.cores} cores" if faster.cores else "their hardware"
    common.note(f"the whole step on one device is priced at {1e3 * faster.one_device_seconds:.2f} ms per step, "
                f"{_how_much_faster(faster.speedup)} than this plan on {faster.plan_devices} devices "
                f"({1e3 * faster.plan_seconds:.2f} ms): they share {shared}, so one device alone computes faster "
                "than each of them busy; --task auto plans for that")


def _explore_pipeline(args: argparse.Namespace, output: Path) -> int:
    from hlomap.report.gantt import draw_gantt
    from hlomap.report.pipeline import format_pipeline_result, gantt_title
    from hlomap.report.sharding import progress_bar

    api.check_agent("pipeline", args.agent)
    timeline = Path(args.timeline) if args.timeline else common.beside(output, "timeline.png")
    common.check_outputs(output, timeline)
    cluster = common.cluster_argument(args.cluster, args.profile)
    stages = args.stages or 2
    if stages > cluster.n_devices:
        raise common.CliError(f"--stages {stages}: cluster {cluster.name} has {cluster.n_devices} devices, so "
                              f"at most {cluster.n_devices} stages")
    runnable = _measure_runnable(args)
    interrupts = interrupts_of(args)
    source = api.load_pipeline_source(args.source, trainable=common.parse_trainable(args.trainable),
                                      trainable_prefix=tuple(args.trainable_prefix or ()))
    interrupts.check()
    with progress_bar(not args.quiet, description=f"pipeline / {args.agent}") as on_progress:
        found = api.explore_pipeline_detailed(
            source, stages=stages, microbatches=args.microbatches or 8, schedule=args.schedule, cluster=cluster,
            agent=args.agent, seed=args.seed, budget_seconds=args.budget_seconds, episodes=args.episodes,
            finetune_episodes=args.finetune_episodes, compare_dp=args.compare_dp, name=args.source, output=output,
            on_progress=interrupts.wrap(on_progress), downset_states=args.downset_states)
    result = found.result
    draw_gantt(result.simulation, timeline, title=gantt_title(result, args.source))
    measured = None
    if runnable is not None and not result.interrupted:
        if not args.json:
            common.console().print(format_pipeline_result(result))
        measured = _measure(args, found, found.cap, cluster, runnable, output)
        _show_measurement(args, measured)
    if args.json:
        common.print_json(measured.to_json() if measured is not None else result.to_json())
    elif measured is None:
        common.console().print(format_pipeline_result(result))
    for text in found.notes:
        common.note(text)
    common.say(f"plan: {output}; timeline: {timeline}")
    return _finish(result.interrupted, found.fits, args.fail_if_oom)


def _explore_auto(args: argparse.Namespace, output: Path) -> int:
    from hlomap.report.joint import format_joint_result

    if args.schedule not in api.JOINT_SCHEDULES:
        raise api.InputError(f"--schedule {args.schedule}: the auto task takes {', '.join(api.JOINT_SCHEDULES)} "
                             "(auto: the fastest of 1f1b, zb-h1 and gpipe on the planned stages)")
    cluster = common.cluster_argument(args.cluster, args.profile)
    runnable = _measure_runnable(args)
    interrupts = interrupts_of(args)
    cap = common.load_capture(args)
    api.require_roles(cap, "the auto task")
    interrupts.check()
    if not args.quiet:
        common.say(f"planning {cap.source} on {cluster.name} ({cluster.n_devices} devices): stages x data x model ...")
    # a joint stage may split its state where the DP finds it fits or pays (ZeRO-1), and its
    # parameters too (FSDP): searched with "on", only when no plan fits without with "auto"
    found = api.explore_auto_detailed(cap, cluster=cluster, schedule=args.schedule, output=output,
                                      microbatches=[args.microbatches] if args.microbatches else None,
                                      max_stages=args.stages,
                                      split_state=args.shard_optimizer_state != "off" or args.shard_parameters == "on",
                                      shard_parameters={"off": False, "on": True, "auto": None}[args.shard_parameters])
    if not args.json:
        common.console().print(format_joint_result(found.result, name=args.source))
        refined = (found.plan.search or {}).get("refined") if found.joint is not None else None
        if refined:
            how = ("the whole step on one device" if refined.get("task") == "one device"
                   else f"the {refined.get('task')} sharding search on the pick's mesh")
            common.say(f"kept instead of the joint plan above: {how}, priced at {1e3 * refined['step_seconds']:.2f} ms "
                       f"per step against {1e3 * refined['joint_pick_step_seconds']:.2f} ms for the joint plan on the "
                       f"executor hlomap run gives it; {output} holds "
                       f"{'the one-device plan' if refined.get('task') == 'one device' else 'the searched plan'}")
    plan = _measure(args, found, cap, cluster, runnable, output) if runnable is not None else found.plan
    _show_measurement(args, plan)
    if args.json:
        common.print_json(plan.to_json())
    common.say(f"plan: {output}")
    return _finish(False, found.fits, args.fail_if_oom)


