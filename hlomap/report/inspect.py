"""What `hlomap inspect` shows: a module's computations, opcodes, entry parameters and FLOPs."""

from __future__ import annotations

from typing import Any, Mapping

from hlomap.report.units import human_bytes, human_count, human_flops

__all__ = ["format_inspect"]

MAX_COMPUTATION_ROWS = 12


def format_inspect(report: Mapping[str, Any], max_params: int) -> list[Any]:
    """Rich renderables, in order, for `api.inspect_capture`'s report; `max_params` 0 lists
    every parameter."""
    from rich.table import Table

    out: list[Any] = [f"[bold]{report['module']}[/bold]  from {report['source']}  "
                      f"({report['instructions']} instructions)"]
    # The entry first, then the largest: a train step has dozens of 3-instruction reducers.
    ordered = sorted(report["computations"], key=lambda c: (not c["entry"], -c["instructions"], c["name"]))
    comps = Table(title=f"Computations ({len(ordered)})", show_edge=False)
    comps.add_column("name", overflow="fold")
    comps.add_column("instructions", justify="right")
    comps.add_column("entry")
    for c in ordered[:MAX_COMPUTATION_ROWS]:
        comps.add_row(c["name"], str(c["instructions"]), "ENTRY" if c["entry"] else "")
    out.append(comps)
    if len(ordered) > MAX_COMPUTATION_ROWS:
        rest = ordered[MAX_COMPUTATION_ROWS:]
        out.append(f"... {len(rest)} more computations with {sum(c['instructions'] for c in rest)} instructions")

    ops = Table(title="Instructions by opcode", show_edge=False)
    ops.add_column("opcode")
    ops.add_column("count", justify="right")
    for opcode, count in report["opcodes"].items():
        ops.add_row(opcode, str(count))
    out.append(ops)

    params = Table(title="Entry parameters", show_edge=False)
    params.add_column("#", justify="right")
    params.add_column("path / name", overflow="fold")
    for col in ("shape", "dtype", "role"):
        params.add_column(col, no_wrap=True)
    params.add_column("bytes", justify="right", no_wrap=True)
    shown = report["parameters"][:max_params] if max_params > 0 else report["parameters"]
    for p in shown:
        params.add_row(str(p["index"]), p["path"], "[" + ",".join(map(str, p["shape"])) + "]", p["dtype"], p["role"],
                       human_bytes(p["bytes"]))
    out.append(params)
    hidden = len(report["parameters"]) - len(shown)
    if hidden > 0:
        out.append(f"... {hidden} more parameters (use --all-params or --json)")

    out.append(f"Parameter bytes: {human_bytes(report['parameter_bytes'])}"
               + "".join(f"; {role} {human_bytes(b)}" for role, b in report["parameter_bytes_by_role"].items()))
    if report["has_roles"]:
        out.append(f"Trainable parameters: {human_count(report['trainable_parameter_count'])}")
    else:
        out.append("[yellow]The entry parameters have no roles[/yellow] (a bare HLO dump): pass --trainable "
                   "INDICES to name the trainable ones, or capture the step from JAX.")
    out.append(f"FLOPs per run: {human_flops(report['flops'])} (dots {human_flops(report['dot_flops'])}, "
               f"convolutions {human_flops(report['convolution_flops'])}; while loops times their trip counts)")
    return out
