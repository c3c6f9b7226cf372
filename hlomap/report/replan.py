"""Re-planning as tables and a plot: the decisions a policy took over a trace, the total training
time of every policy, and the estimated throughput of each over time."""

from __future__ import annotations

import math
from os import PathLike
from typing import Any, Mapping, Sequence

from hlomap.report.units import human_bytes, human_seconds
from hlomap.tasks.replan.policies import PolicyRun, ReplanPolicy
from hlomap.tasks.replan.trace import Event, Trace

__all__ = ["format_decisions", "format_totals", "plot_throughput", "replan_json"]


def _clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "never"
    hours, rest = divmod(int(round(seconds)), 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def _change(events: Sequence[Event]) -> str:
    parts = []
    for e in events:
        if e.gpus is not None:
            parts.append(f"gpus {list(e.gpus)}")
        if e.links:
            shown = ", ".join(f"{a}-{b} {b_ / 1e9:.2g} GB/s" for a, b, b_ in e.links[:3])
            parts.append(f"links {shown}" + (f" +{len(e.links) - 3}" if len(e.links) > 3 else ""))
        if e.speed:
            parts.append("speed " + ", ".join(f"device {d} x{f:g}" for d, f in e.speed))
    return "; ".join(parts) or "start"


def format_decisions(trace: Trace, run: PolicyRun) -> Any:
    """A rich table: one row per change of the trace, what changed and what the policy did."""
    from rich.table import Table

    table = Table(title=f"{run.policy.value} on trace {trace.name}", show_edge=False)
    for column in ("time", "change", "decision", "running plan", "new step", "migration", "moved", "plan"):
        table.add_column(column, justify="left" if column in ("change", "decision", "plan") else "right",
                         overflow="fold")
    by_time: dict[float, list[Event]] = {}
    for e in trace.events:
        by_time.setdefault(e.time, []).append(e)
    for k, d in enumerate(run.decisions):
        changed = k == 0 or d.plan != run.decisions[k - 1].plan
        table.add_row(_clock(d.time), _change(by_time.get(d.time, [])), d.option.value,
                      human_seconds(d.keep_seconds) if math.isfinite(d.keep_seconds) else "cannot run",
                      human_seconds(d.step_seconds), human_seconds(d.migration_seconds) if d.migration_seconds else "-",
                      human_bytes(d.moved_bytes) if d.moved_bytes else "-", d.plan.describe() if changed else "")
    return table


def format_totals(trace: Trace, runs: Mapping[ReplanPolicy, PolicyRun], agreement: float | None = None) -> Any:
    """A rich table: per policy, the total training time, throughput against the static plan's,
    iterations by the horizon, and the migrations."""
    from rich.table import Table

    static = runs.get(ReplanPolicy.STATIC)
    table = Table(title=f"trace {trace.name}: {len(runs[next(iter(runs))].decisions)} changes over "
                        f"{_clock(trace.horizon)}; workload {next(iter(runs.values())).iterations:.0f} iterations",
                  show_edge=False)
    for column in ("policy", "total training time", "throughput vs static", "iterations by horizon", "switches",
                   "migration"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for policy, run in runs.items():
        gain = (f"{100 * (static.total_seconds / run.total_seconds - 1):+.1f}%"
                if static is not None and math.isfinite(run.total_seconds) else "-")
        switches = sum(1 for d in run.decisions if d.migration_seconds > 0)
        name = policy.value + (f" (agrees with arbiter {100 * agreement:.0f}%)"
                               if policy is ReplanPolicy.META and agreement is not None else "")
        table.add_row(name, _clock(run.total_seconds), gain, f"{run.horizon_iterations:.0f}", str(switches),
                      human_seconds(run.migration_seconds))
    return table


def plot_throughput(trace: Trace, runs: Mapping[ReplanPolicy, PolicyRun], path: str | PathLike[str]) -> None:
    """PNG: estimated iterations per second of each policy over the trace (zero while migrating
    or stalled), and the mean bandwidth share and GPU share of the cluster underneath."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    hours = 3600.0
    styles = ["-", "--", "-.", ":", (0, (5, 1))]
    for k, (policy, run) in enumerate(runs.items()):
        xs, ys = [], []
        for seg in run.segments:
            end = min(seg.end, trace.horizon)
            if seg.start >= end:
                continue
            rate = 1.0 / seg.step_seconds if math.isfinite(seg.step_seconds) else 0.0
            blocked = min(seg.start + seg.blocked, end)
            if blocked > seg.start:  # migrating: no training
                xs += [seg.start / hours, blocked / hours]
                ys += [0.0, 0.0]
            xs += [blocked / hours, end / hours]
            ys += [rate, rate]
        top.plot(xs, ys, label=policy.value, linewidth=2.2 - 0.3 * k, linestyle=styles[k % len(styles)])
    top.set_ylabel("iterations / s (estimated)")
    top.set_title(f"re-planning on trace {trace.name}")
    top.legend(loc="lower left", fontsize="small")
    times = [t for t, _ in trace.states()] + [trace.horizon]
    states = [s for _, s in trace.states()]
    bottom.step([t / hours for t in times], [s.bandwidth_share() for s in states] + [states[-1].bandwidth_share()],
                where="post", label="mean link bandwidth share")
    bottom.step([t / hours for t in times], [s.gpu_share() for s in states] + [states[-1].gpu_share()],
                where="post", label="GPU share")
    if any(s.speed for s in states):
        bottom.step([t / hours for t in times], [s.speed_share() for s in states] + [states[-1].speed_share()],
                    where="post", label="mean speed of the available GPUs")
    bottom.set_xlabel("hours")
    bottom.set_ylim(0, 1.3)
    bottom.legend(loc="lower left", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replan_json(trace: Trace, report: Any) -> dict[str, Any]:
    """Every policy's run of a `ReplanReport` as JSON-ready data (`hlomap replan --json`)."""
    return {"trace": trace.name, "agreement": report.agreement, "policies": {
        p.value: {"total_seconds": r.total_seconds, "iterations": r.iterations,
                  "horizon_iterations": r.horizon_iterations, "migration_seconds": r.migration_seconds,
                  "decisions": [{"time": d.time, "option": d.option.value, "step_seconds": d.step_seconds,
                                 "migration_seconds": d.migration_seconds, "moved_bytes": d.moved_bytes,
                                 "plan": d.plan.describe()} for d in r.decisions]}
        for p, r in report.runs.items()}}
