"""What `hlomap run` shows: the runner's cuts and stages of a pipeline plan, each comparison with
the unsharded step in words, and the verdict."""

from __future__ import annotations

from typing import Any

from rich.text import Text

from hlomap.report.pipeline import _short_path
from hlomap.report.units import counted

__all__ = ["format_run_check", "run_check_json"]


def format_description(description: Any) -> list[Any]:
    """The runner's cuts with the layer names `hlomap explore --task pipeline` printed, and what
    each stage runs."""
    from rich.table import Table

    n_logical = len(description.stages)
    stage_count = (counted(n_logical, "stage") if description.repeats == 1 else
                   f"{n_logical} logical stages on {n_logical // description.repeats} device stages "
                   f"({'circular' if description.schedule == 'gpipe' else 'interleaved'}, {description.repeats} rounds)")
    kind = "SPMD, one program" if description.executor == "spmd" else "one program per stage"
    out: list[Any] = [Text(f"pipeline on {counted(description.devices, 'device')}: {stage_count}, executor "
                            f"{description.executor} ({kind}), {description.schedule}, "
                            f"{counted(description.microbatches, 'microbatch')}; mesh {description.mesh}")]
    cuts = Table(title="Cuts", show_edge=False)
    for column in ("#", "after HLO instruction", "layer (metadata)", "nearest layer", "source", "jaxpr equation",
                   "match"):
        cuts.add_column(column, justify="right" if column == "#" else "left")
    for k, mapping in enumerate(description.cuts):
        cut = mapping.cut
        cuts.add_row(str(k), cut.instruction, cut.layer, cut.scope or "-",
                     _short_path(cut.source) if cut.source else "-", mapping.equation,
                     "exact" if mapping.exact else f"[yellow]snapped[/yellow]: {mapping.note}")
    out.append(cuts)
    stages = Table(title="Stages", show_edge=False)
    for column in ("stage", "devices", "mesh", "first .. last equation", "parameters", "receives"):
        stages.add_column(column)
    for stage in description.stages:
        ids = list(stage.devices)
        devices = (f"{ids[0]}-{ids[-1]}" if len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1))
                   else ",".join(map(str, ids)))
        stages.add_row(str(stage.index), devices, ",".join(f"{k}={v}" for k, v in stage.mesh.items()),
                       f"{stage.first} .. {stage.last}", str(stage.parameters), " ".join(stage.receives) or "-")
    out.append(stages)
    if description.matched_equations:
        matched, total = description.matched_equations
        out.append(Text(f"{matched} of the loss's {total} equations found their HLO instruction"))
    out += [Text.from_markup(f"[yellow]note:[/yellow] {note}") for note in description.notes]
    return out


def format_check(check: Any) -> list[Any]:
    """Each comparison of a `StepCheck` in words, then what explains a float32 difference."""
    out: list[Any] = []
    for comparison in (*check.comparisons, *check.float64):
        style = "green" if comparison.ok else "red"
        out.append(Text(comparison.words(), style=style))
    if check.reference_float32 is not None:
        out.append(Text(check.reference_float32.words().replace("to the unsharded step's",
                                                                 "to the unsharded float64 step's")))
    if check.rounding:
        out.append(Text("the float32 difference is float32 rounding amplified by an ill-conditioned step (the plan "
                         "agrees in float64, and the unsharded float32 step is as far from float64): not a wrong "
                         "plan"))
    for comparison in check.microbatching:
        if not comparison.ok:
            why = ("each aux output is the mean over the microbatches: a sum, count or maximum over the batch is "
                   "not the whole batch's" if comparison.what.startswith("aux outputs")
                   else "batch statistics or a loss that is not a mean over examples")
            out.append(Text(f"note: microbatching changes the step by design: {comparison.words()} ({why})"))
    return out


def format_run_check(checked: Any, *, rtol: float, atol: float) -> list[Any]:
    """Report items for an `api.RunCheck`: the pipeline's description, the comparisons, the
    verdict line."""
    where = f"{checked.source} under {checked.plan_where} on {counted(checked.devices, checked.platform + ' device')}"
    out: list[Any] = []
    if checked.note is not None:
        out.append(Text(f"note: {checked.note}"))
    if checked.outputs is not None:
        report = checked.outputs
        verdict = "[green]equal[/green]" if report.ok else "[red]DIFFERENT[/red]"
        out.append(Text.from_markup(
            f"{where}: outputs {verdict} to the unsharded step (rtol {rtol:g}, atol {atol:g}); max abs error "
            f"{report.max_abs_err:.3g}, max rel error {report.max_rel_err:.3g} (over elements beyond atol)"
            + (f" at {report.worst_leaf}" if report.worst_leaf else "")
            + f"; sharded step {report.seconds * 1e3:.1f} ms"))
        return out
    check = checked.check
    if checked.description is not None:
        out += format_description(checked.description)
    out += format_check(check)
    verdict = ("[green]equal[/green]" if check.exact else "[green]equal in float64[/green] (float32 rounding)"
               if check.rounding else "[red]DIFFERENT[/red]")
    kind = "pipelined" if checked.description is not None else "sharded"
    out.append(Text.from_markup(f"{where}: {verdict} to the unsharded step (loss and gradients before the "
                                 f"optimizer); {kind} step {check.seconds * 1e3:.1f} ms"))
    return out


def run_check_json(checked: Any) -> dict[str, Any]:
    """An `api.RunCheck` as JSON-ready data (`hlomap run --json`)."""
    if checked.outputs is not None:
        return dict(checked.outputs._asdict())
    description = checked.description
    return {"plan": checked.plan_where, "source": checked.source,
            "description": description.to_json() if description is not None else None, **checked.check.to_json()}
