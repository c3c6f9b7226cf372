"""`hlomap inspect SOURCE`: opcodes, computations, entry parameters and FLOPs of a module."""

from __future__ import annotations

import argparse

from hlomap import api
from hlomap.cli import common


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="summarize an HLO module or a zoo train step",
                       description="Print opcode counts, computations, entry parameters (path, shape, dtype, role, "
                                   "bytes), total parameter bytes and the FLOPs per run (all instructions; dots and convolutions "
                                   "apart).")
    p.add_argument("source", metavar="SOURCE", help=common.SOURCE_HELP)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    common.add_role_options(p)
    p.add_argument("--module", type=int, default=0, metavar="K",
                   help="which module of a file split by '// -----' (default 0)")
    p.add_argument("--all-params", action="store_true", help="list every entry parameter (default: first 40)")
    p.set_defaults(func=cmd_inspect)


def cmd_inspect(args: argparse.Namespace) -> int:
    from hlomap.report.inspect import format_inspect

    cap = common.load_capture(args, module_index=args.module)
    report = api.inspect_capture(cap)
    if args.json:
        common.print_json(report, indent=2)
    else:
        for renderable in format_inspect(report, max_params=0 if args.all_params else 40):
            common.console().print(renderable)
    return 0
