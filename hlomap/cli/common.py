"""What every `hlomap` command shares: the one-line error, exit statuses, option types and
help texts, the console, and reading SOURCE, --cluster and --mesh through `hlomap.api`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

from hlomap import api

EXIT_USAGE = 2
EXIT_MISMATCH = 3  # the plan's step differs from the unsharded one, or the plan does not fit
EXIT_OOM = 3
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """An error to report to the user as one line, without a traceback."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (naming the option and where to look)
    and exit status 2, like every other user error of hlomap."""

    def error(self, message: str) -> Any:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# -- option types ------------------------------------------------------------------------------


def number_type(parse: Callable[[str], Any], noun: str, *, zero_allowed: bool) -> Callable[[str], Any]:
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


positive_float = number_type(float, "a number", zero_allowed=False)
positive_int = number_type(int, "an integer", zero_allowed=False)
seconds = number_type(float, "a number", zero_allowed=True)  # a number of seconds >= 0
count = number_type(int, "an integer", zero_allowed=True)
tolerance = number_type(float, "a number", zero_allowed=True)  # a tolerance >= 0


TRAINABLE_HELP = ("for a bare HLO dump: the trainable entry parameters, as indices, ranges and HLO names "
                  "(0-11,15,name); a dump of a JAX step without it takes roles from its parameters' names")
PREFIX_HELP = "for a bare HLO dump: trainable are the entry parameters whose path or name starts with PREFIX"
CLUSTER_METAVAR = "local|A|B|C|TOPOLOGY|FILE.json"
CLUSTER_HELP = ("cluster: local (the devices JAX sees, measured once and cached: plan for the machine you run on), "
                "a preset (A, B, C: 2, 3, 4 servers of 8 V100s, as in Auto-MAP), a topology (torus:8x8x8, mesh:4x4, "
                "hier:4x8 servers x GPUs, random:64:SEED random-block, uniform:16[:SEED]; @DEVICE picks the device) "
                "or a cluster JSON file")
PROFILE_HELP = ("calibration profile (written by scripts/calibrate_gpu.py): the cluster's devices of the "
                "profiled kind get its fitted compute efficiency and HBM bandwidth")
SOURCE_HELP = ("an HLO text file, zoo:NAME (see `hlomap zoo list`; zoo:NAME:float32 or zoo:NAME:bfloat16 picks "
               "the compute dtype), or FILE.py:FUNCTION returning (train_step, example_args)")


def add_role_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trainable", metavar="LIST", help=TRAINABLE_HELP)
    p.add_argument("--trainable-prefix", metavar="PREFIX", action="append", help=PREFIX_HELP)


def parse_trainable(text: str | None) -> list[int | str] | None:
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


# -- reading arguments through the api ---------------------------------------------------------


def load_capture(args: argparse.Namespace, *, module_index: int = 0) -> Any:
    """The Capture of SOURCE with the roles the options name; a notice on stderr when the roles
    were inferred from a dump's parameter names."""
    cap = api.load_source(args.source, trainable=parse_trainable(getattr(args, "trainable", None)),
                          trainable_prefix=tuple(getattr(args, "trainable_prefix", None) or ()),
                          module_index=module_index)
    if cap.role_source == "argument names":
        note(f"{args.source} is a bare dump; roles were inferred from its parameters' names (params -> trainable, "
             "opt_state -> optimizer state, batch -> data); to override, " + api.ROLE_HELP)
    return cap


def cluster_argument(cluster: str, profile: str | None) -> Any:
    """The Cluster --cluster names (loaded now, so a bad preset or file fails before any work),
    with a --profile's efficiencies applied to the devices it was measured on."""
    try:
        choice = api.resolve_cluster(cluster, profile)
    except api.CalibrationProfileError as err:
        raise CliError(f"--profile {err.profile}: {err}" if err.profile else f"--profile: {err}") from None
    for warning in choice.warnings:
        warn(warning)
    return choice.cluster


def mesh_argument(text: str) -> Any:
    try:
        return api.parse_mesh_text(text)
    except ValueError as err:
        raise CliError(f"--mesh: {err}") from None


def beside(output: Path, suffix: str) -> Path:
    """`plan.json` -> `plan.<suffix>`: reports land next to the plan they describe."""
    return output.with_name(f"{output.stem}.{suffix}")


def check_outputs(*paths: Path) -> None:
    """Every output path is checked before any work, so a long search never ends unable to save."""
    for path in paths:
        api.check_writable(path)


# -- printing ----------------------------------------------------------------------------------


def add_budget_options(p: argparse.ArgumentParser, *, seconds_help: str, evaluations_help: str) -> None:
    """--budget-seconds, --budget-evaluations and --seed: every searching command's budget."""
    p.add_argument("--budget-seconds", type=positive_float, default=60.0, metavar="N", help=seconds_help)
    p.add_argument("--budget-evaluations", type=positive_int, default=None, metavar="N", help=evaluations_help)
    p.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")


def console() -> Any:
    """A rich console; when output is not a terminal, tables 140 columns wide and text lines never
    folded (a script greps a whole sentence)."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=140, soft_wrap=True)


def print_json(data: Any, *, indent: int = 1, default: Callable[[Any], Any] | None = None) -> None:
    import json

    json.dump(data, sys.stdout, indent=indent, default=default)
    sys.stdout.write("\n")


def note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


def warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr)


def say(text: str) -> None:
    """A status line on stderr (stdout may carry --json output)."""
    print(text, file=sys.stderr)


def show(*items: Any) -> None:
    """Print each report item: plain text as it is (no markup, no folding), rich renderables on
    the console."""
    out = None
    for item in items:
        if isinstance(item, str):
            print(item)
        else:
            out = out or console()
            out.print(item)
