"""`hlomap calibrate [--devices N] [-o cluster.json | --local] [--quick]`: measure the present devices and
write the cluster file they describe; `hlomap calibrate --check [CLUSTER]`: time a calibration's compute
samples again and say how far the devices moved from it."""

from __future__ import annotations

import argparse
from pathlib import Path

from hlomap import api
from hlomap.cli import common

DESCRIPTION = ("Measure the present devices (CPU, GPU or TPU) with microbenchmarks: matmul throughput per dtype over "
               "a sweep of sizes, memory bandwidth, each collective over message and group sizes, program dispatch "
               "and device-to-device transfers; fit latency, bandwidth and efficiency, and write an ordinary cluster "
               "file (the fits and raw samples kept under its \"calibration\" key) that --cluster FILE reads. With --local, "
               "measure every device JAX sees and keep the result as the cached `local` cluster (what --cluster local "
               "and auto_shard's default read; they measure it themselves on first use). With --check, measure nothing new: "
               "time a calibration's compute samples again and say how much slower or faster the devices run than "
               "when it was made (a shared machine's speed moves; plans priced on a stale calibration read off by as "
               "much).")
EPILOG = ("examples:\n  hlomap calibrate -o local.json\n  hlomap calibrate --quick --devices 2 -o quick.json\n"
          "  hlomap calibrate --check         # does the cached local calibration still hold?\n"
          "  hlomap simulate zoo:gpt-tiny --plan dp --cluster local.json\n"
          "  hlomap calibrate --local          # measure again what --cluster local reads")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure the present devices and write a cluster file",
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=common.positive_int, default=None, metavar="N",
                   help="measure the first N devices (default: every device JAX sees; a CPU-only machine simulates "
                        f"N host devices, {api.LOCAL_CPU_DEVICES} by default)")
    p.add_argument("-o", "--output", type=Path, default=None, metavar="FILE.json",
                   help="the cluster file to write (default cluster.json)")
    p.add_argument("--local", action="store_true",
                   help="store the result as the cached `local` cluster instead of FILE.json (all devices JAX sees)")
    p.add_argument("--quick", action="store_true",
                   help="fewer sizes and repeats, one pass: about 15 s instead of 40-55, and rough figures (for trying "
                        "the command and for tests; not with --local)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--check", nargs="?", const="local", default=None, metavar="CLUSTER",
                   help="measure nothing new: time a calibration's compute samples again (about 10 s on 8 CPU "
                        "devices) and say how much slower or faster the devices run now; CLUSTER is `local` "
                        "(the default) or a file hlomap calibrate wrote")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    if args.check is not None:
        return _check(args)
    # before anything imports JAX (the reports below do): a CPU-only machine then shows N devices
    # (harmless elsewhere: the flag only sizes the host platform)
    api.ensure_host_devices(args.devices or api.LOCAL_CPU_DEVICES)
    from hlomap.report.calibration import format_calibration
    from hlomap.report.progress import calibration_bar

    if args.local:
        given = [flag for flag, on in (("--devices", args.devices is not None), ("-o", args.output is not None)) if on]
        if given:
            raise common.CliError(f"--local measures every device JAX sees and keeps the result where --cluster local "
                                  f"reads it; {' and '.join(given)} does not apply")
        if args.quick:
            raise common.CliError("--quick measures fewer and smaller samples, once: rough figures to try the command, "
                                  "too rough for the `local` cluster that auto_shard and --cluster local plan on; "
                                  "write it to a file instead (-o FILE.json)")
    output = api.local_cluster_path() if args.local else (args.output or Path("cluster.json"))
    if args.local:  # the cache is ours to make: a fresh machine has no ~/.cache/hlomap/clusters yet
        api.check_cache_folder(output.parent)
    api.check_writable(output, "cluster.json")  # before measuring: never measure for a minute, then fail to save
    if not args.local:  # the cache's file is ours: --local measures it again whatever it holds
        api.check_replaceable_cluster_file(output)
    with calibration_bar(not args.quiet) as on_progress:
        cluster, calibration = api.calibrate(args.devices, quick=args.quick, on_progress=on_progress)
    common.show(*format_calibration(cluster, calibration))
    busy = calibration.busy_warning()
    if busy:
        common.warn(busy)
    if args.devices is None and calibration.backend == "cpu" and not args.quiet:
        common.note(f"a CPU-only machine: measured {calibration.n_devices} simulated host devices "
                    "(--devices N for another count)")
    if args.local:
        path = api.save_calibration(calibration, output, name="local")
        common.say(f"wrote {path}: the `local` cluster ({cluster.n_devices} device(s)); use it with --cluster local")
        return 0
    path = api.save_calibration(calibration, output)
    common.say(f"wrote {path}: cluster {cluster.name!r} ({cluster.n_devices} device(s)); use it with --cluster {path}")
    return 0


def _check(args: argparse.Namespace) -> int:
    given = [flag for flag, on in (("--local", args.local), ("--devices", args.devices is not None),
                                   ("--quick", args.quick), ("-o", args.output is not None)) if on]
    if given:
        raise common.CliError(f"--check times an existing calibration again and writes nothing; {', '.join(given)} "
                              "does not apply")
    api.read_calibration(args.check)  # before the reports import JAX: the calibration's host devices
    from hlomap.report.calibration import format_check
    from hlomap.report.progress import calibration_bar

    with calibration_bar(not args.quiet) as on_progress:
        check = api.check_calibration(args.check, on_progress=on_progress)
    source = "the local cluster" if args.check == "local" else args.check
    common.show(*format_check(check, source))
    return 0
