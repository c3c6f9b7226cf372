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
import sys
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
    if not text:
        return None
    return [int(t) if t.strip().isdigit() else t.strip() for t in text.split(",") if t.strip()]


def _inspect_report(cap: Any) -> dict[str, Any]:
    from hlomap.hlo.capture import Role
    from hlomap.hlo.stats import summarize

    summary = summarize(cap.module)
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
        "dot_flops": summary.dot_flops,
        "convolution_flops": summary.convolution_flops,
    }


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


MAX_COMPUTATION_ROWS = 12


def _console() -> Any:
    """A rich console; when output is not a terminal, wide enough that paths are not folded."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=140)


def _human_flops(n: float) -> str:
    text = _human_count(n)
    return f"{text}FLOP" if text[-1].isalpha() else f"{text} FLOP"


def _print_inspect(report: dict[str, Any], max_params: int) -> None:
    from rich.table import Table

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
                       _human_bytes(p["bytes"]))
    console.print(params)
    hidden = len(report["parameters"]) - len(shown)
    if hidden > 0:
        console.print(f"... {hidden} more parameters (use --all-params or --json)")

    console.print(f"Parameter bytes: {_human_bytes(report['parameter_bytes'])}"
                  + "".join(f"; {role} {_human_bytes(b)}" for role, b in report["parameter_bytes_by_role"].items()))
    if report["has_roles"]:
        console.print(f"Trainable parameters: {_human_count(report['trainable_parameter_count'])}")
    else:
        console.print("[yellow]The entry parameters have no roles[/yellow] (a bare HLO dump): pass --trainable "
                      "INDICES to name the trainable ones, or capture the step from JAX.")
    console.print(f"FLOPs: dots {_human_flops(report['dot_flops'])}, convolutions "
                  f"{_human_flops(report['convolution_flops'])} (while bodies counted once)")


def cmd_inspect(args: argparse.Namespace) -> int:
    from hlomap.source import load_source

    cap = load_source(args.source, trainable=_parse_trainable(args.trainable), module_index=args.module)
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

    rows = [(name, zoo.get(name)) for name in zoo.names()]
    if args.json:
        json.dump([{"name": n, "family": m.family, "parameters": m.param_count(), "description": m.description}
                   for n, m in rows], sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    table = Table(title="hlomap model zoo", show_edge=False)
    table.add_column("name")
    table.add_column("family")
    table.add_column("parameters", justify="right")
    table.add_column("description")
    for name, model in rows:
        table.add_row(name, model.family, _human_count(model.param_count()), model.description)
    _console().print(table)
    return 0


def cmd_zoo_dump(args: argparse.Namespace) -> int:
    from hlomap.source import load_source

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
    from hlomap.plan import Plan

    path = Path(text)
    if not path.exists():
        raise CliError(f"--plan {text}: not dp, megatron, dp+megatron, nor an existing plan file")
    return Plan.load(path)


def _mesh_argument(text: str) -> Any:
    from hlomap.cost.estimate import parse_mesh

    try:
        return parse_mesh(text)
    except ValueError as err:
        raise CliError(f"--mesh: {err}") from None


def cmd_simulate(args: argparse.Namespace) -> int:
    from hlomap.cost.estimate import estimate, format_estimate
    from hlomap.source import load_source

    plan = _plan_argument(args.plan)
    mesh = None if args.mesh is None else _mesh_argument(args.mesh)
    cap = load_source(args.source, trainable=_parse_trainable(args.trainable))
    order = tuple(a.strip() for a in args.axis_order.split(",")) if args.axis_order else None
    est = estimate(cap, plan, mesh=mesh, cluster=args.cluster, axis_order=order)
    if args.json:
        json.dump(est.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_estimate(est, top=args.top))
    return 0 if est.fits or not args.fail_if_oom else 3


# ---------------------------------------------------------------------------------------------
# argument parsing and error handling
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hlomap",
        description="Find distributed execution plans for JAX train steps on XLA's HLO.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("inspect", help="summarize an HLO module or a zoo train step",
                       description="Print opcode counts, computations, entry parameters (path, shape, dtype, role, "
                                   "bytes), total parameter bytes and the FLOPs of dots and convolutions.")
    p.add_argument("source", metavar="SOURCE", help="an HLO text file, or zoo:NAME (see `hlomap zoo list`)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--trainable", metavar="LIST",
                   help="for a bare HLO dump: comma-separated indices or names of the trainable entry parameters")
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
    p.add_argument("--cluster", default="A", metavar="A|B|C|FILE.json", help="cluster preset or JSON (default A)")
    p.add_argument("--axis-order", metavar="AXES",
                   help="mesh axes from outermost to innermost on the devices, e.g. data,model keeps model "
                        "inside a node (default: the mesh's order)")
    p.add_argument("--trainable", metavar="LIST", help="for a bare HLO dump: the trainable entry parameters")
    p.add_argument("--top", type=int, default=10, metavar="N", help="slowest instructions to list (default 10)")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.add_argument("--fail-if-oom", action="store_true", help="exit with status 3 when the plan does not fit")
    p.set_defaults(func=cmd_simulate)

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
    from hlomap.cost.estimate import EstimateError
    from hlomap.cost.mapping import MappingError
    from hlomap.hlo.parser import HloParseError
    from hlomap.propagation.conflicts import PlanConflict
    from hlomap.source import SourceError

    return (CliError, SourceError, HloParseError, ClusterSpecError, EstimateError, MappingError, PlanConflict,
            FileNotFoundError,
            IsADirectoryError, PermissionError)


def run(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
                        format="%(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    if os.environ.get("HLOMAP_DEBUG") == "1":
        return func(args)
    try:
        return func(args)
    except KeyboardInterrupt:
        print("hlomap: interrupted", file=sys.stderr)
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
