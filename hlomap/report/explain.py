"""Why a plan shards each variable as it does: a row per variable with its spec, the linkage group
of each dim (the dims that must share one sharding, Auto-MAP section 3.2) and, for a dim left
whole, what keeps it whole (an instruction that needs it whole, a size the mesh does not divide)
or that the search chose so.

    rows = explain_plan(plan, cap)                # data
    print_explanation(plan, cap, origin="cache")  # the rich table `auto_shard(...).explain()` shows
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from hlomap.hlo.capture import Role

if TYPE_CHECKING:
    from hlomap.hlo.capture import Capture
    from hlomap.plan import Plan
    from hlomap.propagation.graph import FactorGraph

__all__ = ["DimReason", "VariableExplanation", "explain_plan", "format_explanation", "print_explanation"]

#: Group-mates named in a reason before "and N more".
SHOWN_LINKS = 2


@dataclass(frozen=True)
class DimReason:
    dim: int
    size: int
    group: int
    axes: tuple[str, ...] | None  # None: whole
    why: str


@dataclass(frozen=True)
class VariableExplanation:
    path: str
    role: str
    shape: tuple[int, ...]
    spec: str  # "(-, model)"; for a pipeline plan one per stage: "s0 (-, model) | s1 (-, -)"
    dims: tuple[DimReason, ...]

    @property
    def sharded(self) -> bool:
        return any(d.axes for d in self.dims)


def _spec_text(spec: Sequence[Any]) -> str:
    parts = ["-" if s is None else ("x".join(s) if isinstance(s, (list, tuple)) else str(s)) for s in spec]
    return "(" + ", ".join(parts) + ")"


def _axes(entry: Any) -> tuple[str, ...] | None:
    if entry is None:
        return None
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _specs_by_stage(plan: Plan) -> list[list[Any]] | None:
    stages = plan.pipeline.stages if plan.pipeline is not None else ()
    specs = [stage.specs for stage in stages]
    return specs if specs and all(s is not None for s in specs) else None


def _members(graph: FactorGraph, cap: Capture) -> dict[int, list[str]]:
    """group -> `path:dim` of the weight and data dims in it (the optimizer state mirrors them)."""
    out: dict[int, list[str]] = {}
    for param in cap.parameters:
        if param.role in (Role.TRAINABLE, Role.DATA):
            for d, group in enumerate(graph.parameter_groups(param.index)):
                out.setdefault(int(group), []).append(f"{param.path}:{d}")
    return out


def _links(members: dict[int, list[str]], group: int, path: str, dim: int) -> str:
    mates = [m for m in members.get(group, ()) if m != f"{path}:{dim}"]
    if not mates:
        return "alone in its group"
    more = f" and {len(mates) - SHOWN_LINKS} more" if len(mates) > SHOWN_LINKS else ""
    return f"with {', '.join(mates[:SHOWN_LINKS])}{more}"


def _whole_reason(graph: FactorGraph, group: int, size: int, smallest_axis: int | None) -> str:
    constraints = graph.constraints
    if size == 1:
        return "size 1"
    for kind, nodes in (("needs it whole", constraints.need_replication_node),
                        ("splits it two ways at once", constraints.self_conflict_node),
                        ("reshapes it as a minor factor", constraints.compound_node)):
        if nodes[group] >= 0:
            inst = graph.nodes[int(nodes[group])].instruction
            return f"whole: {inst.opcode} {inst.name} {kind}"
    if smallest_axis is not None and int(constraints.gcd_effective[group]) % smallest_axis:
        return f"whole: its group's size does not divide by {smallest_axis}"
    return "whole: the search's choice"


def explain_plan(plan: Plan, cap: Capture, graph: FactorGraph | None = None) -> list[VariableExplanation]:
    """A row per trainable and data variable (the optimizer state mirrors the weights)."""
    from hlomap.propagation.graph import FactorGraph

    graph = graph if graph is not None else FactorGraph.from_capture(cap)
    staged = _specs_by_stage(plan)
    sizes = [v for _, v in plan.mesh] or [v for stage in (plan.pipeline.stages if plan.pipeline else ())
                                         for _, v in stage.mesh if v > 1]
    smallest = min((v for v in sizes if v > 1), default=None)
    by_index = {p.index: p for p in plan.parameters}
    members = _members(graph, cap)
    rows = []
    for param in cap.parameters:
        if param.role not in (Role.TRAINABLE, Role.DATA) or param.index not in by_index:
            continue
        spec = by_index[param.index].spec
        text = (" | ".join(f"s{k} {_spec_text(s[param.index])}" for k, s in enumerate(staged)) if staged
                else _spec_text(spec))
        first = spec if not staged else [_axes(e) for e in staged[0][param.index]]
        dims = []
        for d, group in enumerate(graph.parameter_groups(param.index)):
            size = int(param.shape.dims[d])
            axes = first[d] if d < len(first) else None
            why = (f"group {group} on {'x'.join(axes)}; {_links(members, group, param.path, d)}" if axes
                   else _whole_reason(graph, group, size, smallest))
            dims.append(DimReason(d, size, int(group), tuple(axes) if axes else None, why))
        rows.append(VariableExplanation(param.path, param.role.value, tuple(param.shape.dims), text, tuple(dims)))
    return rows


def _origin_line(plan: Plan, origin: str, path: Path | None) -> str:
    where = f" ({path})" if path else ""
    search = plan.search or {}
    how = {"explored": "explored now", "cache": "read from the cache", "file": "read from the plan file"}.get(origin, origin)
    found = f"; found by {search.get('driver')} in {search.get('seconds')} s" if search.get("driver") else ""
    est = (plan.estimate or {}).get("step_seconds")
    return f"plan {how}{where}{found}" + (f"; estimated step {est * 1e3:.3f} ms" if est else "")


def format_explanation(rows: Sequence[VariableExplanation], plan: Plan, *, origin: str = "",
                       path: Path | None = None) -> Any:
    """A rich renderable: the table (variable, role, shape, spec, why for each dim) and where
    the plan came from."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    mesh = ", ".join(f"{k}={v}" for k, v in plan.mesh)
    stages = plan.pipeline.n_stages if plan.pipeline is not None else 0
    title = f"plan: mesh {{{mesh}}}" if mesh else f"plan: {stages} pipeline stages"
    table = Table(title=title, header_style="bold", show_lines=False)
    for name, justify in (("variable", "left"), ("role", "left"), ("shape", "right"), ("spec", "left"),
                          ("why (per dim)", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        why = "\n".join(f"{d.dim}: {d.why}" for d in row.dims if d.size > 1) or "scalar"
        table.add_row(row.path, row.role, "x".join(map(str, row.shape)) or "()",
                      Text(row.spec, style="green" if row.sharded else "dim"), why)
    return Group(table, Text(_sharded_line(rows, plan)), Text(_origin_line(plan, origin, path)))


def _axis_sizes(plan: Plan) -> dict[str, int]:
    """Each mesh axis's largest size in the plan (its mesh, or any stage's for a pipeline)."""
    sizes = dict(plan.mesh)
    for stage in plan.pipeline.stages if plan.pipeline is not None else ():
        for axis, size in stage.mesh:
            sizes[axis] = max(size, sizes.get(axis, 1))
    return sizes


def _sharded_line(rows: Sequence[VariableExplanation], plan: Plan) -> str:
    """How many variables are split: an axis of one device splits nothing (one device's plans
    name axes of size 1, and every variable on them is whole)."""
    from hlomap.report.sharding import spec_splits

    sizes = _axis_sizes(plan)
    count = sum(spec_splits([d.axes for d in row.dims], sizes) for row in rows)
    named = sum(r.sharded for r in rows)
    if named > count:
        return (f"{count} of {len(rows)} variables sharded ({named - count} more name mesh axes of one device, "
                "which split nothing)")
    return f"{count} of {len(rows)} variables sharded"


def print_explanation(plan: Plan, cap: Capture, *, origin: str = "", path: Path | None = None,
                      console: Any = None) -> list[VariableExplanation]:
    """Print `format_explanation` (on `console`, default stdout) and return the rows."""
    from rich.console import Console

    rows = explain_plan(plan, cap)
    (console or Console()).print(format_explanation(rows, plan, origin=origin, path=path))
    return rows
