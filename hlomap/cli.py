"""The `hlomap` command.

Every command has --help. Errors a user can cause (bad file, bad HLO, unknown zoo name, bad
option) print one clear message on stderr and exit with status 2; nothing prints a traceback
unless HLOMAP_DEBUG=1 is set.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """An error to report to the user as one line, without a traceback."""


# ---------------------------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------------------------


def _parse_trainable(text: str | None) -> list[int | str] | None:
    """`--trainable 0-11,15,name`: indices, inclusive ranges of indices and HLO names."""
    if not text:
        return None
    out: list[int | str] = []
    for part in (t.strip() for t in text.split(",")):
        low, dash, high = part.partition("-")
        if dash and low.isdigit() and high.isdigit():
            if int(high) < int(low):
                raise CliError(f"--trainable {text}: range {part!r} runs backwards")
            out.extend(range(int(low), int(high) + 1))
        elif part.isdigit():
            out.append(int(part))
        elif part:
            out.append(part)
    return out


ROLE_HELP = ("name the trainable entry parameters with --trainable 0-11,15 (indices, ranges or HLO names) or "
             "--trainable-prefix params (the start of their path or name); `hlomap inspect FILE` lists them")


def _load_capture(args: argparse.Namespace, *, module_index: int = 0) -> Any:
    """The Capture of SOURCE with the roles the options name; a notice on stderr when the roles
    were inferred from a dump's parameter names."""
    from hlomap.api import load_source

    cap = load_source(args.source, trainable=_parse_trainable(getattr(args, "trainable", None)),
                      trainable_prefix=tuple(getattr(args, "trainable_prefix", None) or ()), module_index=module_index)
    if cap.role_source == "argument names":
        print(f"note: {args.source} is a bare dump; roles were inferred from its parameters' names (params -> "
              "trainable, opt_state -> optimizer state, batch -> data); to override, " + ROLE_HELP, file=sys.stderr)
    return cap


def _require_roles(cap: Any, what: str, *, trainable: bool = True) -> None:
    """Refuse a search that would be nonsense without roles (ADP on a role-less dump would
    split the weights as if they were data)."""
    from hlomap.hlo.capture import Role

    if not cap.has_roles:
        raise CliError(f"{cap.source} has no roles (a bare HLO dump whose parameters carry no names hlomap knows): "
                       f"{what} needs to know which parameters are weights; " + ROLE_HELP)
    if trainable and not cap.with_role(Role.TRAINABLE):
        raise CliError(f"{cap.source} names no trainable parameter: {what} splits weights; " + ROLE_HELP)


def _inspect_report(cap: Any) -> dict[str, Any]:
    from hlomap.cost.compute import flops_by_opcode, module_flops
    from hlomap.hlo.capture import Role
    from hlomap.hlo.stats import summarize

    summary = summarize(cap.module)
    flops = flops_by_opcode(cap.module)
    params = [
        {
            "index": p.index,
            "name": p.name,
            "path": p.path,
            "shape": list(p.shape.dims),
            "dtype": p.dtype,
            "role": p.role.value,
            "bytes": p.byte_size,
        }
        for p in cap.parameters
    ]
    bytes_by_role: dict[str, int] = {}
    for p in cap.parameters:
        bytes_by_role[p.role.value] = bytes_by_role.get(p.role.value, 0) + p.byte_size
    return {
        "source": cap.source,
        "module": summary.name,
        "instructions": summary.instruction_count,
        "opcodes": dict(summary.opcode_counts),
        "computations": [
            {"name": c.name, "instructions": c.instruction_count, "entry": c.is_entry} for c in summary.computations
        ],
        "parameters": params,
        "parameter_bytes": sum(p.byte_size for p in cap.parameters),
        "parameter_bytes_by_role": bytes_by_role,
        "trainable_parameter_count": sum(p.shape.num_elements for p in cap.parameters if p.role is Role.TRAINABLE),
        "has_roles": cap.has_roles,
        # One run of the module as the cost model counts it (`hlomap simulate` reports the same):
        # XLA's conventions, while loops times their trip counts.
        "flops": module_flops(cap.module),
        "dot_flops": flops.get("dot", 0.0),
        "convolution_flops": flops.get("convolution", 0.0),
    }


MAX_COMPUTATION_ROWS = 12


def _console() -> Any:
    """A rich console; when output is not a terminal, wide enough that paths are not folded."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=140)


def _print_inspect(report: dict[str, Any], max_params: int) -> None:
    from rich.table import Table

    from hlomap.report.units import human_bytes, human_count, human_flops

    console = _console()
    console.print(f"[bold]{report['module']}[/bold]  from {report['source']}  ({report['instructions']} instructions)")

    # The entry first, then the largest: a train step has dozens of 3-instruction reducers.
    ordered = sorted(report["computations"], key=lambda c: (not c["entry"], -c["instructions"], c["name"]))
    comps = Table(title=f"Computations ({len(ordered)})", show_edge=False)
    comps.add_column("name", overflow="fold")
    comps.add_column("instructions", justify="right")
    comps.add_column("entry")
    for c in ordered[:MAX_COMPUTATION_ROWS]:
        comps.add_row(c["name"], str(c["instructions"]), "ENTRY" if c["entry"] else "")
    console.print(comps)
    if len(ordered) > MAX_COMPUTATION_ROWS:
        rest = ordered[MAX_COMPUTATION_ROWS:]
        console.print(f"... {len(rest)} more computations with {sum(c['instructions'] for c in rest)} instructions")

    ops = Table(title="Instructions by opcode", show_edge=False)
    ops.add_column("opcode")
    ops.add_column("count", justify="right")
    for opcode, count in report["opcodes"].items():
        ops.add_row(opcode, str(count))
    console.print(ops)

    params = Table(title="Entry parameters", show_edge=False)
    params.add_column("#", justify="right")
    params.add_column("path / name", overflow="fold")
    for col in ("shape", "dtype", "role"):
        params.add_column(col, no_wrap=True)
    params.add_column("bytes", justify="right", no_wrap=True)
    shown = report["parameters"][:max_params] if max_params > 0 else report["parameters"]
    for p in shown:
        params.add_row(str(p["index"]), p["path"], "[" + ",".join(map(str, p["shape"])) + "]", p["dtype"], p["role"],
                       human_bytes(p["bytes"]))
    console.print(params)
    hidden = len(report["parameters"]) - len(shown)
    if hidden > 0:
        console.print(f"... {hidden} more parameters (use --all-params or --json)")

    console.print(f"Parameter bytes: {human_bytes(report['parameter_bytes'])}"
                  + "".join(f"; {role} {human_bytes(b)}" for role, b in report["parameter_bytes_by_role"].items()))
    if report["has_roles"]:
        console.print(f"Trainable parameters: {human_count(report['trainable_parameter_count'])}")
    else:
        console.print("[yellow]The entry parameters have no roles[/yellow] (a bare HLO dump): pass --trainable "
                      "INDICES to name the trainable ones, or capture the step from JAX.")
    console.print(f"FLOPs per run: {human_flops(report['flops'])} (dots {human_flops(report['dot_flops'])}, "
                  f"convolutions {human_flops(report['convolution_flops'])}; while loops times their trip counts)")


def cmd_inspect(args: argparse.Namespace) -> int:
    cap = _load_capture(args, module_index=args.module)
    report = _inspect_report(cap)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_inspect(report, max_params=0 if args.all_params else 40)
    return 0


# ---------------------------------------------------------------------------------------------
# zoo
# ---------------------------------------------------------------------------------------------


def cmd_zoo_list(args: argparse.Namespace) -> int:
    from rich.table import Table

    from hlomap import zoo
    from hlomap.report.units import human_count

    rows = [(name, zoo.get(name)) for name in zoo.names()]
    if args.json:
        json.dump([{"name": n, "family": m.family, "parameters": m.parameters, "description": m.description}
                   for n, m in rows], sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    table = Table(title="hlomap model zoo", show_edge=False)
    table.add_column("name")
    table.add_column("family")
    table.add_column("parameters", justify="right")
    table.add_column("description")
    for name, model in rows:
        table.add_row(name, model.family, human_count(model.parameters), model.description)
    _console().print(table)
    return 0


def cmd_zoo_dump(args: argparse.Namespace) -> int:
    from hlomap.api import load_source

    cap = load_source(f"zoo:{args.name}")
    text = str(cap.module)
    out = Path(args.output)
    if out.parent and not out.parent.exists():
        raise CliError(f"{out.parent}: directory does not exist")
    out.write_text(text)
    print(f"wrote {out} ({cap.module.instruction_count} instructions, {len(text)} characters)", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# simulate
# ---------------------------------------------------------------------------------------------


def _plan_argument(text: str) -> Any:
    """`dp`, `megatron`, `dp+megatron` name built-in reference plans; anything else is a file."""
    if text in ("dp", "megatron", "dp+megatron"):
        return text
    if not Path(text).exists():
        raise CliError(f"--plan {text}: not dp, megatron, dp+megatron, nor an existing plan file")
    return _load_plan(Path(text))


def _load_plan(path: Path) -> Any:
    """A saved plan, or one line saying what is wrong with the file (missing, a folder, not
    text, not JSON, not a plan, another version)."""
    from hlomap.plan import Plan

    if not path.exists():
        raise CliError(f"{path}: No such file (a plan saved by hlomap explore or Plan.save)")
    if path.is_dir():
        raise CliError(f"{path}: is a directory, not a plan file")
    try:
        text = path.read_text()
    except UnicodeDecodeError as err:
        raise CliError(f"{path}: not a plan file (binary data at byte {err.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise CliError(f"{path}:{err.lineno}:{err.colno}: not a plan JSON file: {err.msg}") from None
    if not isinstance(data, dict):
        raise CliError(f"{path}: not a plan JSON file (the top level is a {type(data).__name__}, not an object)")
    try:
        return Plan.from_json(data, where=str(path))
    except ValueError as err:
        raise CliError(str(err)) from None


def _mesh_argument(text: str) -> Any:
    from hlomap.api import parse_mesh_text

    try:
        return parse_mesh_text(text)
    except ValueError as err:
        raise CliError(f"--mesh: {err}") from None


def _check_plan_for(plan: Any, cap: Any, where: str) -> None:
    """A saved plan must have been made for this module, and its specs must fit the shapes and
    mesh it names: checked before anything is compiled or estimated."""
    try:
        plan.check_compatible(cap, where=str(where))
        plan.check_specs(where=str(where))
    except ValueError as err:
        raise CliError(str(err)) from None


def _cluster_argument(cluster: str, profile: str | None) -> Any:
    """The Cluster --cluster names (loaded now, so a bad preset or file fails before any work),
    with a --profile's efficiencies applied to the devices it was measured on."""
    from hlomap.cost.calibration import CalibrationError, apply_calibration, load_calibration
    from hlomap.cost.cluster import load_cluster

    loaded = load_cluster(cluster)
    if profile is None:
        return loaded
    try:
        calibration = load_calibration(profile)
    except CalibrationError as err:  # names the file and the field already
        raise CliError(f"--profile: {err}") from None
    try:
        calibrated = apply_calibration(loaded, calibration)
    except CalibrationError as err:
        raise CliError(f"--profile {profile}: {err}") from None
    if calibration.backend and calibration.backend not in ("gpu", "cuda", "rocm"):
        print(f"warning: --profile {profile} was measured on the {calibration.backend} backend, not a GPU: "
              f"its factors do not describe the {calibration.device}", file=sys.stderr)
    return calibrated


def _warn_other_cluster(plan: Any, cluster: Any) -> None:
    placement = getattr(plan, "placement", None)
    name = getattr(cluster, "name", str(cluster))
    if placement is not None and placement.cluster and placement.cluster != name:
        print(f"warning: the plan was placed on cluster {placement.cluster}, not {name}: its device order may "
              f"not suit this cluster (place it again with hlomap place --cluster {name})", file=sys.stderr)


def _simulate_pipeline(args: argparse.Namespace, plan: Any) -> int:
    """A pipeline plan, priced from the stage profile it carries, on its placement."""
    from hlomap.report.placement import format_pipeline_estimate
    from hlomap.tasks.placement.place import estimate_pipeline_plan

    if args.mesh is not None or args.axis_order:
        raise CliError("--mesh and --axis-order do not apply to a pipeline plan (its stages fix its devices)")
    cluster = _cluster_argument(args.cluster, args.profile)
    _warn_other_cluster(plan, cluster)
    est = estimate_pipeline_plan(plan, cluster, where=args.plan)
    if args.json:
        json.dump({"cluster": cluster.name, "step_seconds": est.placed.length,
                   "model_step_seconds": est.placed_model_seconds,
                   "identity_order_step_seconds": est.identity.length,
                   "stages": [list(stage.devices) for stage in est.placed.plan.stages],
                   "memory_violations": [str(v) for v in est.placed.violations]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_pipeline_estimate(est, cluster.name, plan.placement))
    return 0 if est.placed.feasible or not args.fail_if_oom else 3


def _simulate_joint(args: argparse.Namespace, plan: Any) -> int:
    """A joint plan priced again by the cost model on --cluster: per stage its layers, devices,
    mesh, time per microbatch and memory, then L and the transfers."""
    from hlomap.report.joint import format_joint_result
    from hlomap.tasks.joint.explore import reprice_joint_plan

    cluster = _cluster_argument(args.cluster, args.profile)
    cap = _load_capture(args)
    _check_plan_for(plan, cap, args.plan)
    try:
        result = reprice_joint_plan(cap, cluster, plan.pipeline)
    except ValueError as err:
        raise CliError(f"--plan {args.plan}: {err}") from None
    if args.json:
        cost = result.cost
        json.dump({"step_seconds": cost.latency, "bottleneck_seconds": cost.bottleneck,
                   "stage_seconds": list(cost.stage_seconds), "stage_memory_bytes": list(cost.stage_memory),
                   "transfer_seconds": list(cost.transfer_seconds), "fits": cost.fits}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _console().print(format_joint_result(result, name=args.source))
    return 0 if result.cost.fits or not args.fail_if_oom else 3


def cmd_simulate(args: argparse.Namespace) -> int:
    import dataclasses

    from hlomap.api import estimate
    from hlomap.plan import PipelineKind, Plan
    from hlomap.report.estimate import format_estimate
    from hlomap.report.placement import placement_line

    plan = _plan_argument(args.plan)
    if isinstance(plan, Plan) and plan.pipeline is not None:
        if plan.pipeline.kind is PipelineKind.JOINT:
            return _simulate_joint(args, plan)
        return _simulate_pipeline(args, plan)
    placed = isinstance(plan, Plan) and plan.placement is not None
    if placed and args.axis_order:
        raise CliError(f"{args.plan} is placed: its placement fixes the device order, so --axis-order does not apply")
    mesh = None if args.mesh is None else _mesh_argument(args.mesh)
    cluster = _cluster_argument(args.cluster, args.profile)  # before the capture: fail fast
    _warn_other_cluster(plan, cluster)
    cap = _load_capture(args)
    if not isinstance(plan, str):
        _check_plan_for(plan, cap, args.plan)
    else:
        _require_roles(cap, f"the built-in plan {plan!r}")
    order = tuple(a.strip() for a in args.axis_order.split(",")) if args.axis_order else None
    est = estimate(cap, plan, mesh=mesh, cluster=cluster, axis_order=order)
    identity = estimate(cap, dataclasses.replace(plan, placement=None), mesh=mesh, cluster=cluster) if placed else None
    if args.json:
        data = est.to_json()
        if identity is not None:
            data["identity_order_step_seconds"] = identity.step_seconds
        json.dump(data, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_estimate(est, top=args.top))
        if identity is not None:
            print(placement_line(plan.placement, est.step_seconds, identity.step_seconds))
    return 0 if est.fits or not args.fail_if_oom else 3


# ---------------------------------------------------------------------------------------------
# place
# ---------------------------------------------------------------------------------------------

PLACEMENT_AGENTS = ("greedy", "ppo", "exact", "random", "identity")


def cmd_place(args: argparse.Namespace) -> int:
    import dataclasses

    from hlomap.cost.cluster import load_cluster
    from hlomap.report.placement import format_placement
    from hlomap.search.tracker import Budget
    from hlomap.tasks.placement.place import problem_from_plan, search_placement, with_placement

    if args.agent not in PLACEMENT_AGENTS:
        raise CliError(f"--agent {args.agent}: choose one of {', '.join(PLACEMENT_AGENTS)}")
    plan = _load_plan(Path(args.plan))
    cluster = load_cluster(args.cluster)
    output = Path(args.output) if args.output else _beside(Path(args.plan), "placed.json")
    _check_output(output)
    estimate = None
    if args.source and plan.pipeline is None:
        from hlomap.api import estimate as estimate_step

        cap = _load_capture(args)
        _check_plan_for(plan, cap, args.plan)
        estimate = estimate_step(cap, dataclasses.replace(plan, placement=None), cluster=cluster)
    problem = problem_from_plan(plan, cluster, estimate=estimate, where=args.plan)
    estimated_on = (plan.estimate or {}).get("cluster")
    if plan.pipeline is None and estimate is None and estimated_on not in (None, cluster.name) and not args.quiet:
        print(f"note: compute time from the plan's estimate on cluster {estimated_on}; --source re-estimates the "
              f"step on {cluster.name}", file=sys.stderr)
    options: dict[str, Any] = {}
    if args.agent == "ppo":
        from hlomap.tasks.placement.ppo import load_placement_policy

        try:
            policy = load_placement_policy(args.policy)
        except ValueError as err:  # not a policy file, or one of another version (FileNotFoundError: a user error)
            raise CliError(f"--policy {err}" if args.policy else str(err)) from None
        options = {"policy": policy, "finetune_seconds": args.finetune_seconds}
    budget = Budget(args.budget_seconds, args.budget_evaluations)
    if not args.quiet:
        print(f"placing {problem.n_positions} logical positions on {cluster.n_devices} devices of {cluster.name} "
              f"with {args.agent} ...", file=sys.stderr)
    result = search_placement(problem, args.agent, budget, args.seed, **options)
    placed = with_placement(plan, problem, result)
    placed.save(output)
    if args.json:
        json.dump(placed.placement.to_json() | {"evaluations": result.evaluations, "seconds": result.seconds,
                                                "optimal": result.optimal}, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        _console().print(format_placement(problem, result))
    print(f"placed plan: {output}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# explore
# ---------------------------------------------------------------------------------------------

SHARDING_TASKS = ("opp", "adp", "hybrid")
SHARDING_AGENTS = ("dqn", "random", "greedy", "exact")
PIPELINE_AGENTS = ("dqn", "dqn-infer", "dp")


def _beside(output: Path, suffix: str) -> Path:
    """`plan.json` -> `plan.<suffix>`: reports land next to the plan they describe."""
    return output.with_name(f"{output.stem}.{suffix}")


def _check_output(path: Path) -> None:
    """An output path is checked before any work, so a long search never ends unable to save."""
    if path.is_dir():
        raise CliError(f"{path}: is a directory; name the file to write, e.g. {path / 'plan.json'}")
    if not path.parent.exists():
        raise CliError(f"{path.parent}: directory does not exist (for {path.name})")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise CliError(f"{path}: not writable")


def _explore_sharding(args: argparse.Namespace, output: Path) -> int:
    from hlomap.api import explore_detailed, parse_mesh
    from hlomap.report.sharding import format_plan_summary, plot_convergence, progress_bar

    if args.agent not in SHARDING_AGENTS:
        raise CliError(f"--agent {args.agent}: the {args.task} task takes {', '.join(SHARDING_AGENTS)}")
    try:
        mesh = parse_mesh(args.mesh, args.task)
    except ValueError as err:
        raise CliError(f"--mesh: {err}") from None
    if args.budget_seconds is None and args.budget_evaluations is None and args.agent in ("dqn", "random"):
        raise CliError(f"--agent {args.agent} needs --budget-seconds or --budget-evaluations")
    curve = Path(args.curve) if args.curve else _beside(output, "convergence.png")
    _check_output(curve)
    cluster = _cluster_argument(args.cluster, args.profile)
    cap = _load_capture(args)
    _require_roles(cap, f"the {args.task} task", trainable=args.task != "adp")
    _stop_if_interrupted(args)
    with progress_bar(not args.quiet, description=f"{args.task} / {args.agent}") as on_progress:
        found = explore_detailed(cap, args.task, mesh, cluster, args.agent, args.budget_seconds, args.seed,
                                 args.reward, budget_evaluations=args.budget_evaluations, output=output,
                                 on_progress=_interruptible(args, on_progress))
    plot_convergence([found.result], curve, title=f"{cap.source}: {args.task}, {args.reward} reward")
    if args.json:
        json.dump(found.plan.to_json(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        roles = {p.path: p.role.value for p in cap.parameters}
        _console().print(format_plan_summary(found.plan, roles=roles if cap.has_roles else None))
    print(f"plan: {output}; convergence curve: {curve}", file=sys.stderr)
    if found.result.interrupted:
        print("interrupted: the best plan found so far is saved", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def _pipeline_source(args: argparse.Namespace) -> tuple[Any, Any]:
    """(the source explore_pipeline reads, the Capture or None for a PipeDream profile)."""
    from hlomap.api import load_pipeline_source
    from hlomap.hlo.capture import Capture

    source = load_pipeline_source(args.source, trainable=_parse_trainable(args.trainable),
                                  trainable_prefix=tuple(args.trainable_prefix or ()))
    return source, source if isinstance(source, Capture) else None


def _check_stages(stages: int, cluster: Any) -> None:
    """A stage needs at least one device: say the maximum before any work."""
    if stages > cluster.n_devices:
        raise CliError(f"--stages {stages}: cluster {cluster.name} has {cluster.n_devices} devices, so at most "
                       f"{cluster.n_devices} stages")


def _explore_pipeline(args: argparse.Namespace, output: Path) -> int:
    from hlomap.plan import write_atomic
    from hlomap.report.gantt import draw_gantt
    from hlomap.report.pipeline import format_pipeline_result, gantt_title
    from hlomap.report.sharding import progress_bar
    from hlomap.tasks.pipeline.explore import explore_pipeline, pipeline_plan, unsplittable_stages

    if args.agent not in PIPELINE_AGENTS:
        raise CliError(f"--agent {args.agent}: the pipeline task takes {', '.join(PIPELINE_AGENTS)}")
    timeline = Path(args.timeline) if args.timeline else _beside(output, "timeline.png")
    _check_output(timeline)
    cluster = _cluster_argument(args.cluster, args.profile)
    _check_stages(args.stages, cluster)
    source, cap = _pipeline_source(args)

    def save(result: Any) -> None:
        if cap is not None:
            pipeline_plan(cap, result, seed=args.seed).save(output)
        else:  # a PipeDream profile has no HLO module to tie a Plan to: save the result itself
            write_atomic(output, json.dumps(result.to_json(), indent=1) + "\n")

    _stop_if_interrupted(args)
    with progress_bar(not args.quiet, description=f"pipeline / {args.agent}") as on_progress:
        result = explore_pipeline(source, stages=args.stages, microbatches=args.microbatches,
                                  schedule=args.schedule, cluster=cluster, agent=args.agent, seed=args.seed,
                                  budget_seconds=args.budget_seconds, episodes=args.episodes,
                                  finetune_episodes=args.finetune_episodes, compare_dp=args.compare_dp,
                                  name=args.source, on_best=save, on_progress=_interruptible(args, on_progress))
    save(result)
    draw_gantt(result.simulation, timeline, title=gantt_title(result, args.source))
    if args.json:
        json.dump(result.to_json(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        _console().print(format_pipeline_result(result))
    for problem in unsplittable_stages(cap, result) if cap is not None else ():
        print(f"note: {problem}", file=sys.stderr)
    print(f"plan: {output}; timeline: {timeline}", file=sys.stderr)
    if result.interrupted:
        print("interrupted: the best plan found so far is saved", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0 if not result.simulation.violations or not args.fail_if_oom else 3


def _explore_auto(args: argparse.Namespace, output: Path) -> int:
    from hlomap.report.joint import format_joint_result
    from hlomap.tasks.joint.explore import explore_joint, joint_plan

    cluster = _cluster_argument(args.cluster, args.profile)
    cap = _load_capture(args)
    _require_roles(cap, "the auto task")
    _stop_if_interrupted(args)
    if not args.quiet:
        print(f"planning {cap.source} on {cluster.name} ({cluster.n_devices} devices): stages x data x model ...",
              file=sys.stderr)
    result = explore_joint(cap, cluster, schedule=args.schedule)
    plan = joint_plan(result)
    plan.save(output)
    if args.json:
        json.dump(plan.to_json(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        _console().print(format_joint_result(result, name=args.source))
    print(f"plan: {output}", file=sys.stderr)
    return 0 if result.cost.fits or not args.fail_if_oom else 3


def cmd_explore(args: argparse.Namespace) -> int:
    output = Path(args.output)
    _check_output(output)
    if args.task == "pipeline":
        return _explore_pipeline(args, output)
    if args.task == "auto":
        return _explore_auto(args, output)
    from hlomap.api import PIPEDREAM_PREFIX, is_pipedream_graph

    if args.source.startswith(PIPEDREAM_PREFIX) or is_pipedream_graph(args.source):
        raise CliError(f"{args.source} is a PipeDream profile: it can only be explored with --task pipeline")
    return _explore_sharding(args, output)


# ---------------------------------------------------------------------------------------------
# replan
# ---------------------------------------------------------------------------------------------

REPLAN_POLICIES = ("static", "re-solve", "arbiter", "meta", "oracle")


def cmd_replan(args: argparse.Namespace) -> int:
    from hlomap.report.replan import format_decisions, format_totals, plot_throughput
    from hlomap.tasks.replan.policies import ReplanPolicy
    from hlomap.tasks.replan.replay_plan import replan_plan, workload_of
    from hlomap.tasks.replan.trace import load_trace

    if args.show not in REPLAN_POLICIES:
        raise CliError(f"--show {args.show}: choose one of {', '.join(REPLAN_POLICIES)}")
    plan = _load_plan(Path(args.plan))
    workload_of(plan, args.plan)  # a plan that cannot be re-planned fails before the trace is read
    trace = load_trace(args.trace)
    plot = Path(args.plot) if args.plot else _beside(Path(args.plan), "replan.png")
    _check_output(plot)
    network = None
    if not args.no_meta:
        from hlomap.tasks.replan.meta import load_network

        try:
            network = load_network(args.network)
        except FileNotFoundError as err:
            if args.network:
                raise CliError(str(err)) from None
            print(f"note: {err}; the meta policy is left out", file=sys.stderr)
        except ValueError as err:
            raise CliError(str(err)) from None
    if not args.quiet:
        print(f"playing {len(REPLAN_POLICIES) - (network is None)} policies over {len(trace.events)} changes of {trace.name} ...",
              file=sys.stderr)
    report = replan_plan(plan, trace, network=network, where=args.plan)
    shown = report.runs.get(ReplanPolicy(args.show))
    if shown is None:
        raise CliError(f"--show {args.show}: that policy did not run (no gain network)")
    plot_throughput(trace, report.runs, plot)
    if args.json:
        json.dump({"trace": trace.name, "agreement": report.agreement, "policies": {
            p.value: {"total_seconds": r.total_seconds, "iterations": r.iterations,
                      "horizon_iterations": r.horizon_iterations, "migration_seconds": r.migration_seconds,
                      "decisions": [{"time": d.time, "option": d.option.value, "step_seconds": d.step_seconds,
                                     "migration_seconds": d.migration_seconds, "moved_bytes": d.moved_bytes,
                                     "plan": d.plan.describe()} for d in r.decisions]}
            for p, r in report.runs.items()}}, sys.stdout, indent=1, default=lambda x: None)
        sys.stdout.write("\n")
    else:
        console = _console()
        console.print(format_decisions(trace, shown))
        console.print(format_totals(trace, report.runs, report.agreement))
    print(f"throughput plot: {plot}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------------

EXIT_MISMATCH = 3
FORCE_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def _ensure_host_devices(count: int) -> None:
    """Let the CPU backend show `count` devices, so that a plan for 8 devices runs on a laptop.
    Only possible before JAX initializes its backends, and harmless on GPU machines."""
    flags = os.environ.get("XLA_FLAGS", "")
    if FORCE_DEVICES_FLAG not in flags and "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = f"{flags} {FORCE_DEVICES_FLAG}={count}".strip()


def _plan_devices(plan: Any) -> int:
    """Devices a plan needs: its mesh, or every device its pipeline stages name, or, when it is
    placed, up to the highest device id of its placement."""
    if plan.placement is not None:
        return max(plan.device_order(), default=0) + 1
    if plan.pipeline is not None:
        ids = [d for stage in plan.pipeline.stages for d in stage.devices]
        return max(ids, default=0) + 1
    devices = 1
    for _, size in plan.mesh:
        devices *= size
    return devices


def _run_source(spec: str, seed: int) -> tuple[Any, tuple[Any, ...], Any]:
    """(train step, real example arguments, zoo model or None) of --source."""
    if spec.startswith("zoo:"):
        from hlomap import zoo

        try:
            model = zoo.get(spec.removeprefix("zoo:"))
        except KeyError as err:
            raise CliError(f"--source {spec}: {err}") from None
        return model.train_step(), tuple(model.example_args(seed)), model
    from hlomap.run.source import load_step_file

    step, example = load_step_file(spec)
    return step, example, None


def _print_run_description(description: Any) -> None:
    """The runner's cuts with the layer names `hlomap explore --task pipeline` printed, and what
    each stage runs."""
    from rich.table import Table

    from hlomap.report.pipeline import _short_path

    console = _console()
    n_logical = len(description.stages)
    stage_count = (f"{n_logical} stages" if description.repeats == 1 else
                   f"{n_logical} logical stages on {n_logical // description.repeats} device stages (circular, "
                   f"{description.repeats} rounds)")
    console.print(f"pipeline on {description.devices} devices: {stage_count}, executor "
                  f"{description.executor} ({'SPMD, one program' if description.executor == 'spmd' else 'one program per stage'}), "
                  f"{description.schedule}, {description.microbatches} microbatches; mesh {description.mesh}")
    cuts = Table(title="Cuts", show_edge=False)
    for column in ("#", "after HLO instruction", "layer (metadata)", "nearest layer", "source", "jaxpr equation", "match"):
        cuts.add_column(column, justify="right" if column == "#" else "left")
    for k, mapping in enumerate(description.cuts):
        cut = mapping.cut
        cuts.add_row(str(k), cut.instruction, cut.layer, cut.scope or "-", _short_path(cut.source) if cut.source else "-",
                     mapping.equation, "exact" if mapping.exact else f"[yellow]snapped[/yellow]: {mapping.note}")
    console.print(cuts)
    stages = Table(title="Stages", show_edge=False)
    for column in ("stage", "devices", "mesh", "first .. last equation", "parameters", "receives"):
        stages.add_column(column)
    for stage in description.stages:
        ids = list(stage.devices)
        devices = (f"{ids[0]}-{ids[-1]}" if len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1))
                   else ",".join(map(str, ids)))
        stages.add_row(str(stage.index), devices, ",".join(f"{k}={v}" for k, v in stage.mesh.items()),
                       f"{stage.first} .. {stage.last}", str(stage.parameters), " ".join(stage.receives) or "-")
    console.print(stages)
    if description.matched_equations:
        matched, total = description.matched_equations
        console.print(f"{matched} of the loss's {total} equations found their HLO instruction")
    for note in description.notes:
        console.print(f"[yellow]note:[/yellow] {note}")


def _print_check(check: Any) -> None:
    """Each comparison of a `StepCheck` in words, then what explains a float32 difference."""
    console = _console()
    for comparison in (*check.comparisons, *check.float64):
        style = "green" if comparison.ok else "red"
        console.print(f"[{style}]{comparison.words()}[/{style}]")
    if check.reference_float32 is not None:
        console.print(check.reference_float32.words().replace("to the unsharded step's", "to the unsharded float64 "
                                                                "step's"))
    if check.rounding:
        console.print("the float32 difference is float32 rounding amplified by an ill-conditioned step (the plan "
                      "agrees in float64, and the unsharded float32 step is as far from float64): not a wrong plan")
    for comparison in check.microbatching:
        if not comparison.ok:
            console.print(f"note: microbatching changes the step by design: {comparison.words()} (batch statistics "
                          "or a loss that is not a mean over examples)")


def _run_checked(args: argparse.Namespace, plan: Any, step: Any, example: tuple[Any, ...], devices: int) -> int:
    """Run the step under the plan with `hlomap.parallelize` and compare its loss and gradients
    (before the optimizer) with the unsharded step's: the one comparison every plan gets."""
    import jax

    from hlomap.run import parallelize
    from hlomap.run.compare import check_step

    parallel = parallelize(step, plan, executor=args.executor, example_args=example if plan.pipeline else None)
    description = parallel.describe(example) if plan.pipeline is not None else None
    if description is not None and not args.json:
        _print_run_description(description)
    check = check_step(parallel, example)
    if args.json:
        json.dump({"plan": str(args.plan), "source": args.source,
                   "description": description.to_json() if description else None, **check.to_json()},
                  sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0 if check.ok else EXIT_MISMATCH
    _print_check(check)
    verdict = ("[green]equal[/green]" if check.exact else "[green]equal in float64[/green] (float32 rounding)"
               if check.rounding else "[red]DIFFERENT[/red]")
    kind = "pipelined" if plan.pipeline is not None else "sharded"
    _console().print(f"{args.source} under {args.plan} on {devices} {jax.devices()[0].platform} devices: {verdict} "
                     f"to the unsharded step (loss and gradients before the optimizer); {kind} step "
                     f"{check.seconds * 1e3:.1f} ms")
    return 0 if check.ok else EXIT_MISMATCH


def _run_outputs(args: argparse.Namespace, plan: Any, source: Any, devices: int) -> int:
    """A step that does not mark its loss: compare its outputs (updated state included) with the
    unsharded step's, as `verify.numerics.run_plan` does."""
    import jax

    from hlomap.verify.numerics import run_plan

    report = run_plan(plan, source, seed=args.seed, rtol=args.rtol, atol=args.atol)
    if args.json:
        json.dump(report._asdict(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        verdict = "[green]equal[/green]" if report.ok else "[red]DIFFERENT[/red]"
        _console().print(
            f"{args.source} under {args.plan} on {devices} {jax.devices()[0].platform} devices: outputs {verdict} "
            f"to the unsharded step (rtol {args.rtol:g}, atol {args.atol:g}); max abs error "
            f"{report.max_abs_err:.3g}, max rel error {report.max_rel_err:.3g}"
            + (f" at {report.worst_leaf}" if report.worst_leaf else "")
            + f"; sharded step {report.seconds * 1e3:.1f} ms")
    return 0 if report.ok else EXIT_MISMATCH


def cmd_run(args: argparse.Namespace) -> int:
    plan = _load_plan(Path(args.plan))
    try:
        plan.check_specs(where=str(args.plan))
    except ValueError as err:
        raise CliError(str(err)) from None
    if plan.pipeline is None and args.executor is not None:
        raise CliError(f"--executor {args.executor}: {args.plan} has no pipeline section (executors run pipelines)")
    devices = _plan_devices(plan)
    _ensure_host_devices(max(devices, 1))

    import jax

    from hlomap.hlo.capture import capture
    from hlomap.run.errors import RunError, SplitError
    if jax.device_count() < devices:
        raise CliError(f"{args.plan} needs {devices} devices; JAX sees {jax.device_count()} "
                       f"({jax.devices()[0].platform})")
    try:
        step, example, model = _run_source(args.source, args.seed)
    except RunError as err:
        raise CliError(str(err)) from None
    cap = capture(step, *example, arg_names=model.arg_names if model is not None else None)
    _check_plan_for(plan, cap, args.plan)
    try:
        return _run_checked(args, plan, step, example, devices)
    except SplitError as err:
        if plan.pipeline is not None:
            raise CliError(str(err)) from None
        if not args.json:
            _console().print(f"note: {err}; comparing the step's outputs instead of its gradients")
    except RunError as err:
        raise CliError(str(err)) from None
    return _run_outputs(args, plan, model if model is not None else cap, devices)


# ---------------------------------------------------------------------------------------------
# argument parsing and error handling
# ---------------------------------------------------------------------------------------------


def _number_type(parse: Callable[[str], Any], noun: str, *, zero_allowed: bool) -> Callable[[str], Any]:
    """An argparse type: `parse(text)`, then > 0 (or >= 0 with `zero_allowed`); the message
    names the value. A budget of 0 or less would end a search before it starts and overwrite
    the plan file with nothing, so budgets are positive."""

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if zero_allowed and not value >= 0:
            raise argparse.ArgumentTypeError(f"{text} must be 0 or more")
        if not zero_allowed and not value > 0:
            raise argparse.ArgumentTypeError(f"{text} must be positive")
        return value

    return convert


_positive_float = _number_type(float, "a number", zero_allowed=False)
_positive_int = _number_type(int, "an integer", zero_allowed=False)
_seconds = _number_type(float, "a number", zero_allowed=True)  # a number of seconds >= 0
_count = _number_type(int, "an integer", zero_allowed=True)


TRAINABLE_HELP = ("for a bare HLO dump: the trainable entry parameters, as indices, ranges and HLO names "
                  "(0-11,15,name); a dump of a JAX step without it takes roles from its parameters' names")
PREFIX_HELP = "for a bare HLO dump: trainable are the entry parameters whose path or name starts with PREFIX"


def _add_role_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trainable", metavar="LIST", help=TRAINABLE_HELP)
    p.add_argument("--trainable-prefix", metavar="PREFIX", action="append", help=PREFIX_HELP)


CLUSTER_METAVAR = "A|B|C|TOPOLOGY|FILE.json"
CLUSTER_HELP = ("cluster: a preset (A, B, C: 2, 3, 4 servers of 8 V100s), a topology (torus:8x8x8, mesh:4x4, "
                "hier:4x8 servers x GPUs, random:64:SEED random-block, uniform:16[:SEED]; @DEVICE picks the device) "
                "or a cluster JSON file")
PROFILE_HELP = ("calibration profile (written by scripts/calibrate_gpu.py): the cluster's devices of the "
                "profiled kind get its fitted compute efficiency and HBM bandwidth")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (naming the option and where to look)
    and exit status 2, like every other user error of hlomap."""

    def error(self, message: str) -> Any:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hlomap",
        description="Find distributed execution plans for JAX train steps on XLA's HLO.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("inspect", help="summarize an HLO module or a zoo train step",
                       description="Print opcode counts, computations, entry parameters (path, shape, dtype, role, "
                                   "bytes), total parameter bytes and the FLOPs of dots and convolutions.")
    p.add_argument("source", metavar="SOURCE", help="an HLO text file, or zoo:NAME (see `hlomap zoo list`)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_role_options(p)
    p.add_argument("--module", type=int, default=0, metavar="K",
                   help="which module of a file split by '// -----' (default 0)")
    p.add_argument("--all-params", action="store_true", help="list every entry parameter (default: first 40)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("simulate", help="estimate a step's time, collectives and memory under a plan",
                       description="Estimate one training step under a plan on a cluster: compute (roofline per "
                                   "instruction), the collectives the plan implies, and memory per device.")
    p.add_argument("source", metavar="SOURCE", help="an HLO text file, or zoo:NAME")
    p.add_argument("--plan", default="dp", metavar="dp|megatron|dp+megatron|PLAN.json",
                   help="a built-in reference plan (derived from roles and the factor graph) or a saved plan "
                        "(default: dp)")
    p.add_argument("--mesh", metavar="8|data=2,model=4",
                   help="device mesh; a bare count names its axis after the plan (data for dp, model for megatron)."
                        " Default: 8, or the saved plan's mesh")
    p.add_argument("--cluster", default="A", metavar=CLUSTER_METAVAR, help=f"{CLUSTER_HELP} (default A)")
    p.add_argument("--profile", metavar="PROFILE.json", help=PROFILE_HELP)
    p.add_argument("--axis-order", metavar="AXES",
                   help="mesh axes from outermost to innermost on the devices, e.g. data,model keeps model "
                        "inside a node (default: the mesh's order)")
    _add_role_options(p)
    p.add_argument("--top", type=int, default=10, metavar="N", help="slowest instructions to list (default 10)")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.add_argument("--fail-if-oom", action="store_true", help="exit with status 3 when the plan does not fit")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("explore", help="search a plan: tensor, data, hybrid, pipeline or all at once (auto)",
                       description="Search a distributed plan for a train step. opp: operator partitioning of the "
                                   "trainable variables (tensor parallelism); adp: which dims of the data inputs to "
                                   "split (data parallelism); hybrid: both on a data x model mesh; pipeline: stage "
                                   "cuts, device groups and replication; auto: the whole cluster at once, pipeline stages "
                                   "each with its own data x model mesh and sharding (exact two-level search), "
                                   "beside Megatron-LM's pp x tp x dp grid. The best plan so far is saved to -o as the "
                                   "search runs (Ctrl-C keeps it).",
                       epilog="examples:\n  hlomap explore zoo:gpt-small --budget-seconds 30\n"
                              "  hlomap explore zoo:gpt-1.3b --task hybrid --mesh data=2,model=8 --reward cost\n"
                              "  hlomap explore zoo:bert-base --task pipeline --stages 2 --cluster A --agent dp\n"
                              "  hlomap explore zoo:gpt-1.3b --task auto --cluster A\n"
                              "  hlomap explore pipedream:vgg16.txt --task pipeline --stages 4   "
                              "(a PipeDream profiler graph file)",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="SOURCE",
                   help="an HLO text file, zoo:NAME, or (pipeline task only) a PipeDream graph, pipedream:GRAPH.txt or its bare path")
    p.add_argument("--task", choices=(*SHARDING_TASKS, "pipeline", "auto"), default="opp",
                   help="what to search (default opp); auto: pipeline stages x data x model for the whole cluster")
    p.add_argument("--mesh", default="8", metavar="8|data=2,model=4",
                   help="device mesh of the opp/adp/hybrid tasks; a bare count is one axis, model (data for adp) "
                        "(default 8)")
    p.add_argument("--cluster", default="A", metavar=CLUSTER_METAVAR,
                   help=f"{CLUSTER_HELP}, for the cost reward, the plan's estimate and the pipeline links (default A)")
    p.add_argument("--profile", metavar="PROFILE.json", help=PROFILE_HELP)
    p.add_argument("--agent", default="dqn", metavar="AGENT",
                   help=f"opp/adp/hybrid: {'|'.join(SHARDING_AGENTS)}; pipeline: {'|'.join(PIPELINE_AGENTS)} "
                        "(default dqn)")
    p.add_argument("--reward", choices=("paper", "cost"), default="paper",
                   help="paper: Auto-MAP's +0.4 per partitioned dim, +0.1 per replicated one, -1 on conflict; "
                        "cost: the cost model's step-time gain (default paper)")
    p.add_argument("--budget-seconds", type=_positive_float, default=60.0, metavar="N",
                   help="wall-clock budget of the search (default 60)")
    p.add_argument("--budget-evaluations", type=_positive_int, default=None, metavar="N",
                   help="also stop after N evaluated plans")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")
    p.add_argument("-o", "--output", default="plan.json", metavar="PLAN.json",
                   help="where the plan is saved, and kept up to date while searching (default plan.json)")
    p.add_argument("--curve", metavar="FILE.png",
                   help="convergence curve, score per episode (default: next to the plan, *.convergence.png)")
    _add_role_options(p)
    g = p.add_argument_group("pipeline task")
    g.add_argument("--stages", type=_positive_int, default=2, metavar="S", help="pipeline stages (default 2)")
    g.add_argument("--microbatches", type=_positive_int, default=8, metavar="M",
                   help="microbatches per step (default 8)")
    g.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b", help="pipeline schedule (default 1f1b)")
    g.add_argument("--episodes", type=_positive_int, default=2000, metavar="N",
                   help="DQN training episodes (default 2000; --budget-seconds also limits it)")
    g.add_argument("--finetune-episodes", type=_count, default=0, metavar="N",
                   help="dqn-infer: fine-tune the shipped network for N episodes on this model (default 0)")
    g.add_argument("--compare-dp", action="store_true", help="also solve the exact DP and report the gap")
    g.add_argument("--timeline", metavar="FILE.png",
                   help="Gantt chart of the simulated step (default: next to the plan, *.timeline.png)")
    g.add_argument("--fail-if-oom", action="store_true", help="exit with status 3 when a stage does not fit")
    p.add_argument("--json", action="store_true", help="print the plan (or pipeline result) as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_explore)

    p = sub.add_parser("run", help="run a step under a plan and check it against the unsharded step",
                       description="Run a train step under a plan on this machine's devices and check it computes "
                                   "what the unsharded step computes. The step runs under the plan with hlomap.parallelize "
                                   "(SPMD plans: jax.jit with the plan's NamedShardings; pipeline plans: a pipeline "
                                   "executor) and its loss and gradients are compared with the unsharded step's "
                                   "before the optimizer (Adam's first step would turn gradients that are zero up "
                                   "to rounding into +-lr), each gradient leaf within 1e-4 of its own scale; for SPMD "
                                   "plans also the updated parameters where the gradient is above rounding noise. "
                                   "When float32 differs, both run again in float64 to tell rounding from a wrong "
                                   "plan. A step that does not mark its loss with hlomap.value_and_grad has its "
                                   "outputs compared instead (|sharded - plain| <= atol + rtol |plain|). On a "
                                   "CPU-only machine the CPU backend is given as "
                                   "many devices as the plan needs. Exit status 3 when they differ, 2 on a user error.",
                       epilog="a FILE.py:FUNCTION source names a function of no arguments returning "
                              "(train_step, example_args); a pipelined step takes its gradient with "
                              "hlomap.value_and_grad")
    p.add_argument("plan", metavar="PLAN.json", help="a plan saved by hlomap explore or Plan.save")
    p.add_argument("--source", required=True, metavar="zoo:NAME|FILE.py:FUNCTION",
                   help="the train step the plan was made for: a zoo step, or a function of yours returning "
                        "(train_step, example_args)")
    p.add_argument("--executor", choices=("spmd", "mpmd"), default=None,
                   help="pipeline plans: spmd (A: one SPMD program, GPipe, multi-host) or mpmd (B: one program per "
                        "stage, any schedule); default: spmd for gpipe, mpmd for 1f1b")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the example arguments (default 0)")
    p.add_argument("--rtol", type=float, default=1e-4, help="steps without a marked loss: relative tolerance of the outputs (default 1e-4)")
    p.add_argument("--atol", type=float, default=1e-5, help="steps without a marked loss: absolute tolerance of the outputs (default 1e-5)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("place", help="choose which physical device takes each position of a plan",
                       description="Topology-aware device placement: choose which device of the cluster takes each "
                                   "logical position of a plan (the mesh's positions, or each pipeline stage's "
                                   "replicas) to minimize the estimated step time: collectives along the mesh axes, "
                                   "stage all-reduces and the transfers between stages. Writes the plan with a "
                                   "placement section; hlomap simulate then prices it on that order.",
                       epilog="examples:\n  hlomap place plan.json --cluster torus:8x8x8\n"
                              "  hlomap place pipeline.json --cluster random:64:3 --agent ppo -o placed.json",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan", metavar="PLAN.json", help="a plan saved by hlomap explore or Plan.save")
    p.add_argument("--cluster", required=True, metavar=CLUSTER_METAVAR, help=CLUSTER_HELP)
    p.add_argument("--agent", default="greedy", metavar="|".join(PLACEMENT_AGENTS),
                   help="greedy: construction + pairwise-swap local search; ppo: the shipped placement policy, then "
                        "local search; exact: every permutation (clusters of up to 8 devices); random: best random "
                        "placement; identity: the plan's own order (default greedy)")
    p.add_argument("--budget-seconds", type=_positive_float, default=60.0, metavar="N",
                   help="wall-clock budget (default 60)")
    p.add_argument("--budget-evaluations", type=_positive_int, default=None, metavar="N",
                   help="also stop after N evaluations (a swap tried, or a placement priced)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")
    p.add_argument("--source", metavar="SOURCE",
                   help="an SPMD plan's step (zoo:NAME or HLO file) to estimate its collectives on this cluster, "
                        "instead of the estimate saved in the plan")
    _add_role_options(p)
    p.add_argument("--policy", metavar="POLICY.npz", help="ppo: a placement policy file (default: the shipped one)")
    p.add_argument("--finetune-seconds", type=_seconds, default=0.0, metavar="N",
                   help="ppo: fine-tune the policy on this plan for N seconds of the budget first (default 0)")
    p.add_argument("-o", "--output", metavar="OUT.json", help="the placed plan (default: PLAN.placed.json beside it)")
    p.add_argument("--json", action="store_true", help="print the placement section as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress message")
    p.set_defaults(func=cmd_place)

    p = sub.add_parser("replan", help="re-plan a pipeline over a trace of changing bandwidth and GPUs",
                       description="Play re-planning policies over a resource trace (per-link bandwidth and available "
                                   "GPUs per server over time) from a pipeline plan: static (planned once), re-solve "
                                   "at every change, AutoPipe's switch arbiter (keep / move layers between two "
                                   "neighbouring stages / re-solve, priced by migration against the time saved), the "
                                   "learned meta policy, and an oracle that knows the future. Prints the decisions "
                                   "over time and every policy's total training time; draws the estimated "
                                   "throughput of each.",
                       epilog="the trace format is described in README.md (Re-planning when resources change) and in "
                              "hlomap/tasks/replan/trace.py",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan", metavar="PLAN.json", help="a pipeline plan (hlomap explore --task pipeline)")
    p.add_argument("--trace", required=True, metavar="TRACE.json", help="the resource trace")
    p.add_argument("--show", default="arbiter", metavar="|".join(REPLAN_POLICIES),
                   help="whose decisions to list (default arbiter)")
    p.add_argument("--network", metavar="GAIN.npz", help="the meta policy's gain network (default: the shipped one)")
    p.add_argument("--no-meta", action="store_true", help="leave the meta policy out")
    p.add_argument("--plot", metavar="FILE.png", help="throughput plot (default: next to the plan, *.replan.png)")
    p.add_argument("--json", action="store_true", help="print the runs as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress message")
    p.set_defaults(func=cmd_replan)

    zoo = sub.add_parser("zoo", help="list or dump the built-in benchmark train steps",
                         description="The model zoo: GPT, BERT, T5, VGG-19, ResNet-50, MoE and a Haiku MLP.")
    zsub = zoo.add_subparsers(dest="zoo_command", metavar="ZOO_COMMAND")
    zsub.required = True
    zl = zsub.add_parser("list", help="list the zoo's models", description="List the zoo's models.")
    zl.add_argument("--json", action="store_true", help="print as JSON")
    zl.set_defaults(func=cmd_zoo_list)
    zd = zsub.add_parser("dump", help="write a zoo model's train step as HLO text",
                         description="Lower a zoo train step abstractly (no weights allocated) and write its HLO.")
    zd.add_argument("name", metavar="NAME")
    zd.add_argument("-o", "--output", required=True, metavar="FILE.hlo")
    zd.set_defaults(func=cmd_zoo_dump)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    from hlomap.cost.cluster import ClusterSpecError
    from hlomap.api import SourceError
    from hlomap.cost.estimate import EstimateError
    from hlomap.plan import PlanError
    from hlomap.cost.mapping import MappingError
    from hlomap.tasks.sharding.exact import ExactTooLarge
    from hlomap.hlo.parser import HloParseError
    from hlomap.tasks.pipeline.pipedream import PipeDreamParseError
    from hlomap.tasks.pipeline.solution import NoFeasiblePlan
    from hlomap.propagation.conflicts import PlanConflict
    from hlomap.tasks.placement.problem import PlacementError
    from hlomap.tasks.replan.trace import TraceError

    return (CliError, SourceError, HloParseError, ClusterSpecError, EstimateError, PlanError, MappingError, PlanConflict,
            ExactTooLarge, PipeDreamParseError, NoFeasiblePlan, PlacementError, TraceError, FileNotFoundError,
            IsADirectoryError, PermissionError)


def _watch_interrupts(args: argparse.Namespace) -> None:
    """Ctrl-C sets `args.interrupted` as well as raising KeyboardInterrupt: Python drops an
    exception raised inside a garbage-collector callback (JAX's, while it traces and compiles),
    so the flag is checked again at every progress report and between the command's phases."""
    args.interrupted = threading.Event()

    def handler(signum: int, frame: Any) -> None:
        args.interrupted.set()
        if not _in_gc_callback(frame):  # there the exception would be printed and dropped
            raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, handler)


def _in_gc_callback(frame: Any) -> bool:
    """Whether Python is running a garbage-collector callback (JAX registers one), where a raised
    KeyboardInterrupt is reported as "Exception ignored" and lost."""
    while frame is not None:
        if frame.f_code.co_name.endswith("gc_callback"):
            return True
        frame = frame.f_back
    return False


def _stop_if_interrupted(args: argparse.Namespace) -> None:
    event = getattr(args, "interrupted", None)
    if event is not None and event.is_set():
        raise KeyboardInterrupt


def _interruptible(args: argparse.Namespace, callback: Callable[[Any], None] | None) -> Callable[[Any], None]:
    """A driver's progress callback that stops the search (keeping its best plan) once Ctrl-C
    was pressed, whether or not a bar is drawn."""

    def on_progress(progress: Any) -> None:
        _stop_if_interrupted(args)
        if callback is not None:
            callback(progress)

    return on_progress


def run(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
                        format="%(levelname)s %(name)s: %(message)s")
    _watch_interrupts(args)
    func: Callable[[argparse.Namespace], int] = args.func
    if os.environ.get("HLOMAP_DEBUG") == "1":
        return func(args)
    try:
        return func(args)
    except KeyboardInterrupt:
        print("hlomap: interrupted before a plan was found; nothing was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except _user_errors() as err:
        print(f"hlomap {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as err:  # noqa: BLE001 - last resort: one line, not a traceback
        print(f"hlomap {args.command}: internal error: {type(err).__name__}: {err}\n"
              "(set HLOMAP_DEBUG=1 for the traceback, and please report it)", file=sys.stderr)
        return 1


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
