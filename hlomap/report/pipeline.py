"""Pipeline results as tables: the cuts (HLO instruction, layer, source line, like Auto-MAP's
Table 7), the stages with their devices, replication and memory, and L."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hlomap.cost.pipeline.costs import latency_method
from hlomap.report.units import counted, human_bytes
from hlomap.tasks.pipeline.explore import PipelineResult

__all__ = ["format_pipeline_result", "gantt_title"]


def gantt_title(result: PipelineResult, name: str | None = None) -> str:
    """The title of a pipeline result's timeline chart."""
    plan = result.plan
    return (f"{name or result.source}: {result.agent.value}, {plan.schedule.value}, {counted(plan.n_stages, 'stage')}, "
            f"M = {plan.microbatches}, L = {result.latency * 1e3:.4g} ms")


def _short_path(source: str) -> str:
    """`file:line` relative to the working directory when the file lies under it."""
    try:
        return str(Path(source).relative_to(Path.cwd()))
    except ValueError:
        return source


def format_pipeline_result(result: PipelineResult) -> Any:
    """A rich renderable: the cuts (instruction and layer, like Auto-MAP's Table 7), the stages
    with devices, replication and memory, and L."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    plan = result.plan
    head = Text.assemble(
        (f"{result.source}", "bold"),
        f"  pipeline by {result.agent.value}: {counted(plan.n_stages, 'stage')}, "
        f"{counted(plan.microbatches, 'microbatch')}, {plan.schedule.value}",
    )
    cuts = Table(title="Cuts", show_edge=False)
    with_source = any(cut.source for cut in result.cuts)
    columns = ["#", "after HLO instruction", "layer (metadata)", "nearest layer"]
    columns += ["source"] if with_source else []
    for column in (*columns, "crossing"):
        cuts.add_column(column, justify="right" if column in ("#", "crossing") else "left")
    for k, cut in enumerate(result.cuts):
        row = [str(k), cut.instruction, cut.layer, cut.scope or "-"]
        row += [_short_path(cut.source) if cut.source else "-"] if with_source else []
        cuts.add_row(*row, human_bytes(cut.crossing_bytes))
    stages = Table(title="Stages", show_edge=False)
    for column in ("stage", "layers", "devices", "replication", "memory / device", "capacity"):
        stages.add_column(column, justify="left" if column in ("layers", "devices") else "right")
    for s, (stage, mem, cap) in enumerate(zip(plan.stages, result.stage_memory,
                                               result.device_memory)):
        devices = f"{stage.devices[0]}-{stage.devices[-1]}" if len(stage.devices) > 1 else str(
            stage.devices[0])
        style = "red" if mem > cap else ""
        stages.add_row(str(s), f"[{stage.start}, {stage.stop})", devices,
                       str(stage.replication), Text(human_bytes(mem), style=style),
                       human_bytes(cap))
    lines = [
        Text(f"device cuts: {list(result.device_cuts)}" + (
            "" if result.on_node_boundaries is None
            else f" ({'on' if result.on_node_boundaries else 'not all on'} server boundaries)")) if result.cuts
        else Text("one stage: no cuts"),
        # the first from the event simulator layer by layer, the second what the search minimised
        Text(f"L = {result.latency * 1e3:.4g} ms simulated, {result.model_latency * 1e3:.4g} ms by the search's "
             f"{latency_method(result.plan.schedule, result.plan.repeats)}; bottleneck "
             f"{result.cost.bottleneck * 1e3:.4g} ms per microbatch"),
        Text(f"on the {result.executor} executor (what `hlomap run` runs): step {result.step_seconds * 1e3:.4g} ms "
             + ("in lockstep ticks" if result.executor == "spmd" else "as scheduled")
             + ", with the executor's own cost where the cluster measures it (a calibrated one)"),
        Text(f"search: {result.search_seconds:.1f} s"
             + (f", {result.episodes} episodes" if result.episodes else "")),
    ]
    if result.downset_states:
        how = ("cut at downsets of the layer DAG" if result.order is not None
               else "the chain's order is as good as its downsets")
        straight = result.straight_value if result.straight_value is not None else math.nan
        lines.append(Text(f"{how}: the downset DP over {result.downset_states} cut states against "
                          f"{straight * 1e3:.4g} ms cutting the chain's order"))
    if result.gap is not None and result.optimum is not None:
        lines.append(Text(f"DP optimum {result.optimum * 1e3:.4g} ms: gap "
                          f"{100 * result.gap:.3f}%"))
    if result.feasible:
        lines.append(Text("memory: every stage fits its devices"))
    for violation in result.simulation.violations:
        lines.append(Text(f"out of memory: {violation}", style="bold red"))
    return Group(head, *([cuts] if result.cuts else []), stages, *lines)


