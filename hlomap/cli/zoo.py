"""`hlomap zoo list|dump`: the built-in benchmark train steps."""

from __future__ import annotations

import argparse
import sys

from hlomap import api
from hlomap.cli import common


def add_parser(sub: argparse._SubParsersAction) -> None:
    zoo = sub.add_parser("zoo", help="list or dump the built-in benchmark train steps",
                         description="The model zoo: GPT, BERT, T5, VGG-19, ResNet-50, MoE and a Haiku MLP.")
    zsub = zoo.add_subparsers(dest="zoo_command", metavar="ZOO_COMMAND")
    zsub.required = True
    zl = zsub.add_parser("list", help="list the zoo's models",
                         description="List the zoo's models with their compute dtype. Parameters and optimizer "
                                     "state are float32; a SOURCE zoo:NAME:float32 or zoo:NAME:bfloat16 runs a "
                                     "transformer (gpt, bert, t5, moe) in the other compute dtype.")
    zl.add_argument("--json", action="store_true", help="print as JSON")
    zl.set_defaults(func=cmd_zoo_list)
    zd = zsub.add_parser("dump", help="write a zoo model's train step as HLO text",
                         description="Lower a zoo train step abstractly (no weights allocated) and write its HLO.")
    zd.add_argument("name", metavar="NAME", help="a zoo model, optionally NAME:float32 or NAME:bfloat16")
    zd.add_argument("-o", "--output", required=True, metavar="FILE.hlo", help="the file to write; - prints the HLO")
    zd.set_defaults(func=cmd_zoo_dump)


def cmd_zoo_list(args: argparse.Namespace) -> int:
    from hlomap.report.zoo import format_zoo

    entries = api.zoo_entries()
    if args.json:
        common.print_json([{"name": e.name, "family": e.family, "parameters": e.parameters,
                            "compute_dtype": e.compute_dtype, "description": e.description} for e in entries],
                          indent=2)
        return 0
    common.console().print(format_zoo(entries))
    return 0


def cmd_zoo_dump(args: argparse.Namespace) -> int:
    if args.output == "-":  # to a pipe: the text alone
        sys.stdout.write(api.zoo_hlo(args.name))
        return 0
    dumped = api.dump_zoo(args.name, args.output)
    common.say(f"wrote {dumped.path} ({dumped.instructions} instructions, {dumped.characters} characters)")
    return 0
