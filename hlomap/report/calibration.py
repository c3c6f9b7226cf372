"""What `hlomap calibrate` shows: the fitted figures of a calibration and the cluster they give."""

from __future__ import annotations

import math
from typing import Any

from hlomap.cost.calibration import COMBINED, DISPATCH, LAUNCH, ClusterCalibration
from hlomap.cost.cluster import Cluster
from hlomap.verify.recheck import STALE_RATIO
from hlomap.report.units import human_bytes, human_flops, human_seconds

__all__ = ["format_calibration"]


def _rate(bytes_per_second: float) -> str:
    return "-" if not math.isfinite(bytes_per_second) else f"{human_bytes(bytes_per_second)}/s"


def format_calibration(cluster: Cluster, calibration: ClusterCalibration) -> list[Any]:
    """Rich tables: the device's roofline figures and its narrow curves, then latency and bandwidth per
    communication kind and group size, then the measured overheads (kernel launch, the pipeline
    executors, shared hardware), then what went into the cluster's links."""
    from rich.table import Table

    device = cluster.devices[0]
    title = (f"{calibration.n_devices} x {calibration.device_kind} ({calibration.backend}), "
             f"measured in {calibration.wall_seconds:.1f} s, JAX {calibration.jax_version}")
    compute = Table(title=title, show_edge=False)
    compute.add_column("matmul dtype")
    compute.add_column("fitted peak", justify="right")
    compute.add_column("overhead", justify="right")
    compute.add_column("achieved (smallest .. largest)", justify="right")
    compute.add_column("cluster peak x efficiency", justify="right")
    for curve in calibration.matmul_curves:
        low, high = curve.points[0][1], curve.points[-1][1]
        compute.add_row(curve.dtype, f"{human_flops(curve.peak_flops)}/s", human_seconds(curve.overhead_seconds),
                        f"{human_flops(low)}/s .. {human_flops(high)}/s",
                        f"{human_flops(device.flops_for(curve.dtype))}/s x {device.efficiency:.2f}")
    figures = calibration.figures()
    compute.add_row("memory", _rate(figures["memory bandwidth B/s"]), human_seconds(calibration.memory_fit.alpha),
                    "", _rate(device.hbm_bandwidth))
    narrow = Table(show_edge=False)
    narrow.add_column("narrow product")
    narrow.add_column("narrowest side", justify="right")
    narrow.add_column("share of the matrix rate", justify="right")
    for kind, curve in device.narrow.items():
        for i, (width, share) in enumerate(curve.points):
            narrow.add_row(kind if i == 0 else "", f"{width:g}", f"{share:.0%}" if share >= 0.01 else f"{share:.1%}")
    comm = Table(show_edge=False)
    comm.add_column("communication")
    comm.add_column("devices", justify="right")
    comm.add_column("latency", justify="right")
    comm.add_column("bandwidth", justify="right")
    comm.add_column("samples", justify="right")
    for fit in calibration.comm_fits:
        if fit.kind in (LAUNCH, COMBINED):  # their "bytes" count kernels or buffers: shown below per item
            continue
        comm.add_row(fit.kind, str(fit.group), human_seconds(fit.latency),
                     "-" if fit.kind == DISPATCH else _rate(fit.bandwidth), str(fit.samples))
    overheads = Table(show_edge=False)
    overheads.add_column("overhead")
    overheads.add_column("fixed", justify="right")
    overheads.add_column("per unit", justify="right")
    measured = cluster.measured
    if measured is not None:
        overheads.add_row("kernel launch (per kernel, all devices busy)", "", human_seconds(measured.kernel_seconds))
        if measured.combined_operands:
            for group, seconds in measured.combined_operands.items():
                overheads.add_row(f"combined all-reduce over {group} devices (per buffer)", "", human_seconds(seconds))
        else:
            overheads.add_row("combined all-reduce (per buffer)", "", human_seconds(measured.combined_operand_seconds))
        for name, fit in measured.executors.items():
            unit = "stage x microbatch" if name == "mpmd" else "tick (M + S - 1)"
            overheads.add_row(f"{name} pipeline executor (per {unit})", human_seconds(fit.latency),
                              human_seconds(fit.seconds_per_byte))
        for name, seconds in measured.executor_buffers.items():
            what = "buffer its passes move" if name == "mpmd" else "state leaf it hands back"
            overheads.add_row(f"{name} pipeline executor (per {what}, per device)", "", human_seconds(seconds))
        overheads.add_row("one device alone vs all busy", f"{measured.solo_speedup:.2f}x faster", "")
        for label, points, unit, scale in (("matmuls", measured.alone_dot, "MFLOP", 1e6),
                                           ("memory-bound ops", measured.alone_memory, "MiB", 2**20)):
            if points:
                overheads.add_row(f"one device alone, {label} (one-device plans)",
                                  ", ".join(f"{size / scale:.3g} {unit}: {speedup:.1f}x" for size, speedup in points), "")
    links = (f"cluster {cluster.name!r}: {cluster.n_devices} device(s) of {human_bytes(device.memory_bytes)}"
             + (f", links {human_seconds(float(cluster.latency[0, 1]))} + bytes / "
                f"{_rate(float(cluster.bandwidth[0, 1]))}" if cluster.n_devices > 1 else "")
             + ("; collectives priced by their own fits" if measured is not None and measured.collectives else ""))
    return [compute, *([narrow] if device.narrow else []), comm, overheads, links]


def format_check(check: Any, source: str) -> list[Any]:
    """`hlomap calibrate --check`: per kind of sample, how many were timed again and their time
    now over their time in the calibration of `source` (geometric mean and range), then the
    verdict: the calibration holds, or the devices run this much slower (or faster) than it prices."""
    from rich.table import Table

    table = Table(title=f"{source}, calibrated {check.measured_at or 'at an unknown time'}; load average now "
                        f"{check.load_average:.2f}", show_edge=False)
    table.add_column("samples timed again")
    table.add_column("count", justify="right")
    table.add_column("now / then", justify="right")
    table.add_column("range", justify="right")
    for group in check.groups():
        table.add_row(group.group, str(group.samples), f"{group.ratio:.2f}x",
                      f"{group.lowest:.2f}x .. {group.highest:.2f}x")
    table.add_row("all", str(len(check.drifts)), f"{check.speed_ratio:.2f}x", "")
    return [table, check_verdict(check)]


def check_verdict(check: Any) -> str:
    """One line: how far the devices moved from the calibration, and what to do about it."""
    ratio = check.speed_ratio
    pace = f"{ratio:.2f}x slower" if ratio >= 1 else f"{1 / ratio:.2f}x faster"
    if not check.stale:
        return (f"the devices run {pace} than calibrated: within {STALE_RATIO:.2f}x (about what a shared machine "
                "moves from minute to minute), the calibration holds")
    return (f"the devices run {pace} than calibrated: plans priced on this calibration read about as much "
            f"{'fast' if ratio > 1 else 'slow'}; measure again (hlomap calibrate --local, or -o FILE) when the "
            "machine runs as it will for your jobs")
