"""Gantt chart of a simulated pipeline timeline, as a PNG (matplotlib's Agg canvas).

The figure is built on `matplotlib.figure.Figure` with an explicit Agg canvas rather than
pyplot, so drawing never touches global pyplot state or the process's chosen backend.
"""

from __future__ import annotations

from pathlib import Path

from hlomap.cost.pipeline.simulator import SimulationResult, SpanKind
from hlomap.report.units import counted

__all__ = ["draw_gantt"]

_COLORS = {
    SpanKind.FORWARD: "#4c72b0",
    SpanKind.BACKWARD: "#dd8452",
    SpanKind.WEIGHT: "#937860",
    SpanKind.SEND_ACTIVATION: "#55a868",
    SpanKind.SEND_GRADIENT: "#c44e52",
    SpanKind.ALLREDUCE: "#8172b3",
    SpanKind.UPDATE: "#8c8c8c",
}


def _row_of(kind: SpanKind, stage: int, groups: int) -> int:
    """Compute and all-reduce on device stage g's row 2g; both link directions between device
    stages g and g + 1 on 2g + 1; under interleaving, the link from the last device stage back
    to the first on the last row, 2S - 1."""
    if kind is SpanKind.SEND_GRADIENT:
        return 2 * ((stage - 1) % groups) + 1
    if kind is SpanKind.SEND_ACTIVATION:
        return 2 * (stage % groups) + 1
    return 2 * (stage % groups)


def _devices(devices: tuple[int, ...]) -> str:
    """`0-7` for a contiguous block of devices (replicated stages have many), else the list."""
    if len(devices) > 2 and devices == tuple(range(devices[0], devices[-1] + 1)):
        return f"devices {devices[0]}-{devices[-1]}"
    return "devices " + ", ".join(str(d) for d in devices)


def draw_gantt(result: SimulationResult, path: str | Path, *, title: str | None = None) -> Path:
    """Draw the timeline of `result` to a PNG at `path`; returns the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    n_stages = result.plan.device_stages
    n_rows = 2 * n_stages - 1 + (result.plan.repeats > 1)
    figure = Figure(figsize=(12, 0.6 * n_rows + 1.9))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    scale, unit = (1e3, "ms") if result.length < 10 else (1.0, "s")
    for span in result.spans:
        row = _row_of(span.kind, span.stage, n_stages)
        # The two directions of a link share a row: activations on the upper half.
        if span.kind is SpanKind.SEND_ACTIVATION:
            y, height = row - 0.4, 0.4
        elif span.kind is SpanKind.SEND_GRADIENT:
            y, height = row, 0.4
        else:
            y, height = row - 0.4, 0.8
        width = (span.end - span.start) * scale
        axes.broken_barh(
            [(span.start * scale, width)], (y, height),
            facecolors=_COLORS[span.kind], edgecolor="white", linewidth=0.3,
        )
        if span.microbatch >= 0 and width > result.length * scale / 80:
            axes.text(
                span.start * scale + width / 2, y + height / 2, str(span.microbatch),
                ha="center", va="center", fontsize=6, color="white",
            )
    labels = []
    for row in range(n_rows):
        s = row // 2
        labels.append(f"stage {s} ({_devices(result.plan.stages[s].devices)})" if row % 2 == 0
                      else f"link {s}<->{(s + 1) % n_stages}")
    axes.set_yticks(range(n_rows), labels=labels, fontsize=7)
    axes.set_ylim(n_rows - 0.4, -0.6)
    axes.set_xlim(0, result.length * scale * 1.01)
    axes.set_xlabel(f"time ({unit})")
    schedule = result.plan.schedule.value
    axes.set_title(
        title
        or f"{schedule}: {counted(n_stages, 'stage')}, {counted(result.plan.microbatches, 'microbatch')}, "
        f"L = {result.length * scale:.4g} {unit}"
    )
    axes.legend(
        handles=[Patch(color=color, label=kind.value) for kind, color in _COLORS.items()],
        loc="upper center", bbox_to_anchor=(0.5, -0.12), fontsize=7, ncols=6, frameon=False,
    )
    figure.tight_layout()
    out = Path(path)
    figure.savefig(out, format="png", dpi=120)
    return out
