"""Reports on explored sharding plans: convergence plots (Auto-MAP's Figure 16 style), baseline
tables and the per-layer summary the CLI prints; the search's progress bar (from
`report.progress`) is re-exported for the CLI.

Rich and matplotlib are imported inside the functions that draw, so the library stays importable
(and fast to import) without a display.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from os import PathLike
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Sequence

import numpy as np

from hlomap.report.progress import progress_bar
from hlomap.report.units import counted, human_bytes
from hlomap.search.tracker import SearchResult
from hlomap.tasks.sharding.compare import layer_of

if TYPE_CHECKING:
    from hlomap.plan import Plan

log = logging.getLogger(__name__)

__all__ = ["baseline_rows", "format_baselines", "format_plan_summary", "plot_convergence", "progress_bar"]

# ---------------------------------------------------------------------------------------------
# Convergence plot
# ---------------------------------------------------------------------------------------------


def plot_convergence(results: Sequence[SearchResult], path: str | PathLike[str], *, title: str = "",
                     optimum: float | None = None) -> None:
    """PNG of score per episode (light) and best so far (bold) for each result, like the
    paper's Figure 16; a dashed line at `optimum` when known."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        if not len(r.curve):
            continue
        x = np.arange(1, len(r.curve) + 1)
        line, = ax.plot(x, r.best_curve, lw=2, label=f"{r.driver.value} (best {r.score.value:.4g})")
        ax.plot(x, r.curve, lw=0.6, alpha=0.35, color=line.get_color())
    if optimum is not None:
        ax.axhline(optimum, ls="--", color="k", lw=1, label=f"optimum {optimum:.4g}")
    ax.set_xlabel("episode / evaluated plan")
    ax.set_ylabel(f"score ({results[0].reward} reward)" if results else "score")
    if title:
        ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------


class BaselineRow(NamedTuple):
    driver: str
    score: float
    evaluations: int
    seconds: float
    optimal: bool
    gap: float | None  # optimum - score, when the optimum is known


def baseline_rows(results: Sequence[SearchResult], optimum: float | None = None) -> list[BaselineRow]:
    return [BaselineRow(r.driver.value, r.score.value, r.evaluations, r.seconds, r.optimal,
                        None if optimum is None else optimum - r.score.value) for r in results]


def format_baselines(rows: Sequence[BaselineRow]) -> str:
    """Markdown table of drivers at equal budget."""
    lines = ["| driver | best score | gap to optimum | evaluations | seconds |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        gap = "-" if r.gap is None else f"{r.gap:.4g}"
        lines.append(f"| {r.driver}{' (optimal)' if r.optimal else ''} | {r.score:.4g} | {gap} | "
                     f"{r.evaluations} | {r.seconds:.1f} |")
    return "\n".join(lines)


def _spec_text(spec: Sequence[Any]) -> str:
    return "(" + ", ".join("-" if s is None else ("x".join(s) if isinstance(s, (tuple, list)) else str(s))
                           for s in spec) + ")"


def spec_splits(spec: Sequence[Any], sizes: Mapping[str, int]) -> bool:
    """Whether a spec splits its variable: some entry names mesh axes of more than one device in
    all (an axis of size 1, as every axis of a one-device plan, splits nothing)."""
    def devices(entry: Any) -> int:
        names = (entry,) if isinstance(entry, str) else tuple(entry)
        return math.prod(sizes.get(name, 1) for name in names)

    return any(devices(entry) > 1 for entry in spec if entry is not None)


def format_plan_summary(plan: Plan, *, roles: dict[str, str] | None = None) -> Any:
    """A rich renderable: each variable's spec, grouped by layer.

    Shows the parameters whose path does not start with `opt_state` (the optimizer state
    mirrors the parameters); `roles` (path -> role) when given selects trainable and data ones.
    """
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    rows: OrderedDict[str, list[Any]] = OrderedDict()
    for p in sorted(plan.parameters, key=lambda q: q.index):
        if roles is not None:
            if roles.get(p.path) not in ("trainable", "data"):
                continue
        elif p.path.startswith(("opt_state", "optimizer_state")):
            continue
        rows.setdefault(layer_of(p.path), []).append(p)
    table = Table(title="plan", show_lines=False, header_style="bold")
    table.add_column("layer")
    table.add_column("variable")
    table.add_column("shape", justify="right")
    table.add_column("spec")
    sharded_vars = 0
    total_vars = 0
    sizes = dict(plan.mesh)
    for layer, params in rows.items():
        for i, p in enumerate(params):
            # as placed: an FSDP plan stores its parameters split over the data axes too
            spec = plan.state_sharding.spec_of(p) if getattr(plan, "state_sharding", None) is not None else p.spec
            sharded = spec_splits(spec, sizes)
            sharded_vars += sharded
            total_vars += 1
            name = p.path.split("/", 1)[1] if "/" in p.path else p.path
            table.add_row(layer if i == 0 else "", name[len(layer) + 1:] if name.startswith(layer + "/") else name,
                          "x".join(str(d) for d in p.shape), Text(_spec_text(spec), style="green" if sharded else "dim"))
        table.add_section()
    mesh = ", ".join(f"{k}={v}" for k, v in plan.mesh)
    devices = math.prod(size for _, size in plan.mesh)
    # a search may well return it (the cost model can price it fastest), but it surprises: say so
    replicated = (f": every one of the {devices} devices runs the whole step (fully replicated)"
                  if sharded_vars == 0 and devices > 1 else "")
    lines = [Text(f"mesh {{{mesh}}}: {sharded_vars} of {total_vars} variables sharded{replicated}")]
    search = getattr(plan, "search", None)
    if search:
        lines.append(Text(f"found by {search.get('driver')} ({search.get('reward')} reward) in "
                          f"{counted(int(search.get('evaluations') or 0), 'evaluation')}, {search.get('seconds')} s, "
                          f"seed {search.get('seed')}"))
        if search.get("driver") == "exact" and search.get("optimal") is False:
            # the budget stopped it: say how far it got, so nobody takes the plan for the optimum
            notes = "; ".join(str(n) for n in search.get("notes") or ())
            lines.append(Text(f"not proven optimal: the budget ran out ({notes})" if notes
                              else "not proven optimal: the budget ran out", style="yellow"))
    state = getattr(plan, "state_sharding", None)
    if state is not None:
        over = ",".join(state.axes)
        # which listed leaves are parameters: by their roles when known, else by their paths
        parameters = {p.index for p in plan.parameters
                      if (roles.get(p.path) == "trainable" if roles is not None
                          else not p.path.startswith(("opt_state", "optimizer_state")))}
        if state.splits_any(parameters):
            lines.append(Text(f"parameters and optimizer state: {len(state.dims)} leaves stored split over {over} "
                              "(FSDP / ZeRO-3); XLA gathers each parameter before its use"))
        else:
            lines.append(Text(f"optimizer state: {len(state.dims)} leaves split over {over} (ZeRO-1); "
                              "each replica updates its slice and all-gathers the parameters"))
    est = plan.estimate or {}
    if "step_seconds" in est:
        mem = est.get("memory", {})
        fits = mem.get("fits")
        on = f" on cluster {est['cluster']}" if est.get("cluster") else ""
        lines.append(Text(f"estimate{on}: step {est['step_seconds'] * 1e3:.3f} ms"
                          + (f", memory {human_bytes(mem.get('total', 0))} per device"
                             + ("" if fits is None else (" (fits)" if fits else " (DOES NOT FIT)")) if mem else "")))
    if getattr(plan, "measured", None) is not None:
        from hlomap.report.measure import format_measurement

        lines.append(format_measurement(plan.measured))
    return Group(table, *lines)
