"""The `hlomap` command: one module per command, each parsing its arguments, calling
`hlomap.api` and printing through `hlomap.report`.

Every command has --help. Errors a user can cause (bad file, bad HLO, unknown zoo name, bad
option) print one clear message on stderr and exit with status 2; nothing prints a traceback
unless HLOMAP_DEBUG=1 is set. Ctrl-C is cooperative (`hlomap.cli.interrupts`), from the first
moment: the handler is installed before the command modules (and through them the api, numpy
and JAX) are imported.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Callable, Sequence, TextIO

from hlomap.cli.interrupts import InterruptWatch

__all__ = ["build_parser", "main", "run"]


def build_parser() -> argparse.ArgumentParser:
    from hlomap.cli import calibrate, common, explore, inspect, place, replan, run_step, simulate, zoo

    commands = (inspect, simulate, explore, run_step, place, replan, calibrate, zoo)  # in the order --help lists them
    parser = common.Parser(prog="hlomap",
                           description="Find distributed execution plans for JAX train steps on XLA's HLO.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=common.Parser)
    sub.required = True
    for command in commands:
        command.add_parser(sub)
    return parser


def run(argv: Sequence[str] | None = None) -> int:
    """Run one `hlomap` command; returns its exit status. Ctrl-C is cooperative while it runs
    (`cli.interrupts`), and the caller's SIGINT handler is back afterwards."""
    interrupts = InterruptWatch()
    interrupts.install()
    try:
        with warnings.catch_warnings():
            warnings.showwarning = one_line_warnings(warnings.showwarning)
            return _run(argv, interrupts)
    finally:
        interrupts.uninstall()


#: The package's folder: warnings raised in it are hlomap's own, written for the user.
_PACKAGE = Path(__file__).resolve().parents[1]


def one_line_warnings(previous: Callable[..., None]) -> Callable[..., None]:
    """A `warnings.showwarning` that prints hlomap's own warnings as the CLI's other warnings, one
    line on stderr (`warning: ...`), without the file, line and source line Python's default adds,
    and hands everyone else's to `previous` (Python's own, or a test runner's recorder)."""

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:
        if Path(filename).resolve().is_relative_to(_PACKAGE):
            print(f"warning: {message}", file=file or sys.stderr)
            return
        previous(message, category, filename, lineno, file, line)

    return show


class _PlainFormatter(logging.Formatter):
    """`warning: message`, as `common.warn` prints its own."""

    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {record.getMessage()}"


def _run(argv: Sequence[str] | None, interrupts: InterruptWatch) -> int:
    from hlomap import api
    from hlomap.cli import common

    parser = build_parser()
    args = parser.parse_args(argv)
    args.interrupts = interrupts
    # without -v, a library warning reads as the CLI's own ("warning: ..."); -v names its module
    logging.basicConfig(level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
                        format="%(levelname)s %(name)s: %(message)s" if args.verbose else "%(message)s")
    if not args.verbose:
        logging.getLogger().handlers[0].setFormatter(_PlainFormatter())
    func: Callable[[argparse.Namespace], int] = args.func
    wants_local = getattr(args, "wants_local", None)
    if api.is_local(getattr(args, "cluster", None)) or (wants_local is not None and wants_local(args)):
        # before anything starts JAX: a CPU-only machine then shows the host devices `local` means
        api.ensure_host_devices(api.LOCAL_CPU_DEVICES)
    if os.environ.get("HLOMAP_DEBUG") == "1":
        return func(args)
    try:
        interrupts.check()  # Ctrl-C while starting
        return func(args)
    except KeyboardInterrupt:
        print("hlomap: interrupted before a plan was found; nothing was written", file=sys.stderr)
        return common.EXIT_INTERRUPTED
    except BrokenPipeError:  # `hlomap inspect --json | head`: the reader has what it wanted
        return _stdout_closed()
    except (common.CliError, *api.user_errors()) as err:
        text = err.cli_text() if isinstance(err, api.OptionError) else str(err)
        print(f"hlomap {args.command}: error: {text}", file=sys.stderr)
        return common.EXIT_USAGE
    except Exception as err:  # noqa: BLE001 - last resort: one line, not a traceback
        print(f"hlomap {args.command}: internal error: {type(err).__name__}: {err}\n"
              "(set HLOMAP_DEBUG=1 for the traceback, and please report it)", file=sys.stderr)
        return 1


def _stdout_closed() -> int:
    """Exit as a command killed by SIGPIPE would, without Python's complaint at shutdown about
    flushing a closed pipe (stdout is pointed at /dev/null first)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return EXIT_BROKEN_PIPE


#: 128 + SIGPIPE: what a shell reports for a command whose reader went away.
EXIT_BROKEN_PIPE = 141


def main() -> None:
    status = run()
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        status = _stdout_closed()
    sys.exit(status)


if __name__ == "__main__":
    main()
