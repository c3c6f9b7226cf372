"""Device placements as text: what `hlomap place` prints, the placement line and the pipeline
estimate of `hlomap simulate`, and the benchmark's tables."""

from __future__ import annotations

from typing import Any, Sequence

from hlomap.plan import Placement
from hlomap.cost.pipeline.costs import latency_method
from hlomap.report.units import counted, human_seconds
from hlomap.tasks.placement.place import PipelineEstimate
from hlomap.tasks.placement.problem import JointLayout, MeshLayout, PlacementProblem, StageLayout
from hlomap.search.tracker import SearchResult

__all__ = ["format_pipeline_estimate", "format_placement", "placement_line", "solver_table"]

#: Devices listed per stage or mesh row before the rest is elided.
SHOWN_DEVICES = 16


def _devices(devices: Sequence[int]) -> str:
    shown = ", ".join(str(d) for d in devices[:SHOWN_DEVICES])
    return f"[{shown}{', ...' if len(devices) > SHOWN_DEVICES else ''}]"


def _gain(step: float, identity: float) -> str:
    """The placed step against the identity order's, in words (a signed percentage read either way)."""
    if not identity > 0:
        return "-"
    change = 100 * (step / identity - 1)
    if abs(change) < 0.05:
        return "the same"
    return f"{abs(change):.1f}% {'less' if change < 0 else 'more'} time"


def format_placement(problem: PlacementProblem, result: SearchResult) -> Any:
    """A rich renderable: a placement search's step time against the identity's, and the device
    order (per stage, or per row of the mesh's first axis)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    placed = result.plan
    layout = problem.layout
    # what the search minimised: a pipeline's schedule by its closed form (simulate also runs the
    # event timeline and adds the executor's own cost), a joint plan's L
    priced = (f" by the {latency_method(layout.schedule, layout.repeats)}" if isinstance(layout, StageLayout)
              else " by the joint planner's L" if isinstance(layout, JointLayout) else "")
    head = Text.assemble((problem.name, "bold"), f"  placed by {result.driver.value}: step "
                         f"{human_seconds(placed.step_seconds)}{priced} (identity order "
                         f"{human_seconds(placed.identity_seconds)}"
                         f"; placed: {_gain(placed.step_seconds, placed.identity_seconds)}); "
                         f"{counted(result.evaluations, 'evaluation')} "
                         f"in {result.seconds:.1f} s" + (", optimal" if result.optimal else ""))
    table = Table(show_edge=False)
    devices = list(placed.devices)
    if isinstance(layout, MeshLayout):
        first, size = layout.axes[0]
        width = len(devices) // size
        table.add_column(first, justify="right")
        table.add_column(f"devices along {', '.join(n for n, _ in layout.axes[1:]) or '-'}")
        for i in range(size):
            table.add_row(str(i), _devices(devices[i * width:(i + 1) * width]))
    else:
        table.add_column("stage", justify="right")
        table.add_column("devices")
        for s, positions in enumerate(layout.stage_positions()):
            table.add_row(str(s), _devices([devices[p] for p in positions]))
    return Group(head, table)


def placement_line(placement: Placement, step: float, identity_step: float) -> str:
    """One line for `hlomap simulate` on a placed plan."""
    return (f"placement ({placement.solver or 'given'}, chosen for {placement.cluster or 'an unnamed cluster'}): "
            f"step {human_seconds(step)}; identity order {human_seconds(identity_step)} "
            f"(placed: {_gain(step, identity_step)})")


def format_pipeline_estimate(est: PipelineEstimate, cluster: str, placement: Placement | None) -> str:
    """`hlomap simulate` on a pipeline plan: the simulated batch and the closed form, on the
    placement and on the identity order."""
    plan = est.placed.plan
    stages = (f"{plan.device_stages} stages x {plan.repeats} model chunks" if plan.repeats > 1
              else counted(plan.n_stages, "stage"))
    lines = [f"pipeline plan on cluster {cluster}: {stages}, {counted(plan.microbatches, 'microbatch')}, "
             f"{plan.schedule.value}",
             f"step {human_seconds(est.placed.length)} simulated, {human_seconds(est.placed_model_seconds)} by the "
             f"{latency_method(plan.schedule, plan.repeats)}"]
    for s, stage in enumerate(plan.stages[:plan.device_stages]):  # busy: all of a device stage's chunks
        lines.append(f"  stage {s}: devices {_devices(stage.devices)}, busy "
                     f"{human_seconds(est.placed.busy_time(s))}")
    if placement is not None:
        lines.append(placement_line(placement, est.placed.length, est.identity.length)
                     + f" simulated; {latency_method(plan.schedule, plan.repeats)} "
                     + _gain(est.placed_model_seconds, est.identity_model_seconds))
    for violation in est.placed.violations:
        lines.append(f"out of memory: {violation}")
    return "\n".join(lines)


def solver_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> Any:
    """A rich table of strings, the first column left-aligned and the rest right-aligned."""
    from rich.table import Table

    table = Table(title=title, show_edge=False)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    return table
