"""`hlomap run PLAN.json --source ...`: run a step under a plan on this machine's devices and
check it against the unsharded step (the module is not named `run`: that is the package's entry
function)."""

from __future__ import annotations

import argparse
import sys

from hlomap import api
from hlomap.cli import common
from hlomap.cli.interrupts import interrupts_of

DESCRIPTION = ("Run a train step under a plan on this machine's devices and check it computes what the unsharded "
               "step computes. The step runs under the plan with hlomap.parallelize (SPMD plans: jax.jit with the "
               "plan's NamedShardings; pipeline plans: a pipeline executor) and its loss and gradients are compared "
               "with the unsharded step's before the optimizer (Adam's first step would turn gradients that are zero "
               "up to rounding into +-lr), each gradient leaf within 1e-4 of its own scale; for SPMD plans also the "
               "updated parameters where the gradient is above rounding noise. When float32 differs, both run again "
               "in float64 to tell rounding from a wrong plan. A step that does not mark its loss with "
               "hlomap.value_and_grad has its outputs compared instead (|sharded - plain| <= atol + rtol |plain|). "
               "On a CPU-only machine the CPU backend is given as many devices as the plan needs. Exit status 3 when "
               "they differ, 2 on a user error.")
EPILOG = ("a FILE.py:FUNCTION source names a function of no arguments returning (train_step, example_args); a "
          "pipelined step takes its gradient with hlomap.value_and_grad")


#: The outputs' tolerances unless told (steps without a marked loss).
RTOL, ATOL = 1e-4, 1e-5


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run a step under a plan and check it against the unsharded step",
                       description=DESCRIPTION, epilog=EPILOG)
    p.add_argument("plan", metavar="PLAN.json", help="a plan saved by hlomap explore or Plan.save")
    p.add_argument("--source", required=True, metavar="zoo:NAME|FILE.py:FUNCTION",
                   help="the train step the plan was made for: a zoo step, or a function of yours returning "
                        "(train_step, example_args)")
    p.add_argument("--executor", choices=("spmd", "mpmd"), default=None,
                   help="pipeline plans: spmd (one SPMD program, GPipe, multi-host) or mpmd (one program per "
                        "stage, any schedule); default: spmd for gpipe on alike stages, mpmd for 1f1b, "
                        "interleaved-1f1b and zb-h1")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="seed of a zoo model's example arguments (default 0; FILE.py:FUNCTION returns its own)")
    p.add_argument("--rtol", type=common.tolerance, default=RTOL,
                   help="steps without a marked loss: relative tolerance of the outputs (default 1e-4)")
    p.add_argument("--atol", type=common.tolerance, default=ATOL,
                   help="steps without a marked loss: absolute tolerance of the outputs (default 1e-5)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress messages (shown on a terminal: loading, building, compiling, running)")
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    if args.seed != 0 and api.is_step_file(args.source):
        raise common.CliError(f"--seed {args.seed}: {args.source} returns its own example arguments; the seed draws "
                              "a zoo model's")
    plan = api.load_plan_file(args.plan)
    # before anything imports JAX (the reports below do): a CPU-only machine then shows as many
    # devices as the plan needs
    api.ensure_host_devices(max(api.plan_devices(plan), 1))

    from hlomap.report.progress import phase_reporter
    from hlomap.report.run import format_run_check, run_check_json

    interrupts = interrupts_of(args)
    # phases on a terminal, as progress bars are: a log or a test reads the verdict alone
    with phase_reporter(not args.quiet and sys.stderr.isatty()) as on_phase:

        def phase(name: str) -> None:
            interrupts.check()  # between phases: where stopping is safe
            if on_phase is not None:
                on_phase(name)

        checked = api.check_run(plan, args.source, executor=args.executor, seed=args.seed, rtol=args.rtol,
                                atol=args.atol, where=args.plan, on_phase=phase)
    given = [flag for flag, value, default in (("--rtol", args.rtol, RTOL), ("--atol", args.atol, ATOL))
             if value != default]
    if given and checked.outputs is None and not args.json:  # known only once the step is captured
        common.note(f"{' and '.join(given)} did not apply: the step marks its loss, so its loss and gradients were "
                    "compared, each within its own tolerance of its scale (--rtol and --atol are for outputs)")
    if args.json:
        common.print_json(run_check_json(checked))
    else:
        common.show(*format_run_check(checked, rtol=args.rtol, atol=args.atol))
    return 0 if checked.ok else common.EXIT_MISMATCH
