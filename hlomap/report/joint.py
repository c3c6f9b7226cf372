"""A joint plan as tables: its stages (layers, devices, mesh, plan and whether the stage recomputes,
time per microbatch, memory) and L, beside the expert grid's configurations priced by the same model."""

from __future__ import annotations

from typing import Any, Sequence

from hlomap.cost.pipeline.costs import latency_method
from hlomap.report.units import counted, human_bytes, human_seconds
from hlomap.tasks.joint.costs import RECOMPUTED_WORDS
from hlomap.tasks.joint.explore import JointResult

__all__ = ["format_joint_result"]


#: How the plan column reads a stage's split state: ZeRO-1, FSDP.
STATE_WORDS = {(False, False, False): "", (True, False, False): ", ZeRO-1", (True, True, False): ", ZeRO-2",
               (True, False, True): ", FSDP"}


def stage_devices(plan: Any, order: Sequence[int]) -> list[list[int]]:
    """Each stage's devices when the plan's positions, stage by stage, are on `order` (a
    placement's device order)."""
    found, start = [], 0
    for stage in plan.stages:
        found.append([int(d) for d in order[start:start + len(stage.devices)]])
        start += len(stage.devices)
    return found


def device_list(devices: Sequence[int], shown: int = 8) -> str:
    return "[" + ", ".join(str(d) for d in devices[:shown]) + (", ...]" if len(devices) > shown else "]")


def format_joint_result(result: JointResult, *, grid_rows: int = 8, name: str | None = None,
                        devices: Sequence[int] | None = None) -> Any:
    """The stages, L and the search; `devices`: a placement's device order (the stages' positions
    in order), shown instead of each stage's own device range."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    model, plan, cost = result.model, result.plan, result.cost
    names = model.layer_names
    held = [device_list(group) for group in stage_devices(plan, devices)] if devices is not None else []
    stages = Table(title=f"{name or model.cap.source} on {model.cluster.name}: {counted(plan.n_stages, 'stage')}, "
                         f"{counted(plan.microbatches, 'microbatch')}, {plan.schedule.value}", show_edge=False)
    for column in ("stage", "layers", "devices", "mesh", "plan", "time / microbatch", "memory / device", "capacity"):
        stages.add_column(column, justify="right" if column in ("stage", "time / microbatch", "memory / device",
                                                                "capacity") else "left")
    for s, stage in enumerate(plan.stages):
        option = stage.option
        over = cost.stage_memory[s] > cost.device_memory[s]
        layers = names[stage.start] if stage.stop - stage.start == 1 else f"{names[stage.start]} .. {names[stage.stop - 1]}"
        stages.add_row(str(s), layers,
                       held[s] if held else (str(stage.first_device) if option.devices == 1
                                             else f"{stage.first_device}-{stage.first_device + option.devices - 1}"),
                       f"data={option.data} x model={option.model}",
                       option.kind.value + RECOMPUTED_WORDS[option.recompute] + STATE_WORDS[
                           (option.split_state, option.shard_gradients, option.shard_parameters)],
                       human_seconds(cost.stage_seconds[s]),
                       Text(human_bytes(cost.stage_memory[s]), style="red" if over else ""),
                       human_bytes(cost.device_memory[s]))
    # L as the schedule prices it, then the executor's own cost where the cluster measured one, so
    # that the line agrees with the executor line `hlomap simulate` prints under it
    length = (f"L = {human_seconds(cost.latency - cost.executor_seconds)} per step ({latency_method(plan.schedule)})"
              + (f" + {human_seconds(cost.executor_seconds)} of the executor's own = {human_seconds(cost.latency)}"
                 if cost.executor_seconds else ""))
    lines = [Text(f"{length}; bottleneck "
                  f"{human_seconds(cost.bottleneck)} per microbatch; transfers "
                  + (", ".join(human_seconds(t) for t in cost.transfer_seconds) or "none")),
             Text(f"search: {result.driver}, {result.options} stage options over {model.n_layers} layers, "
                  f"{result.seconds:.1f} s") if result.options else
             Text(f"a saved plan priced again on {model.cluster.name} ({model.n_layers} layers, {result.seconds:.1f} s)")]
    feasible = sorted((g for g in result.grid if g.cost is not None), key=lambda g: g.cost.latency)  # type: ignore[union-attr]
    if feasible:
        best = feasible[0]
        gain = best.cost.latency / cost.latency  # type: ignore[union-attr]
        lines.append(Text(f"expert grid (Megatron-LM pp x tp x dp, uniform layers): best {best.label}, "
                          f"M = {best.plan.microbatches}, L = {human_seconds(best.cost.latency)}"  # type: ignore[union-attr]
                          f" -> the joint plan is {gain:.2f}x faster"))
        grid = Table(title="expert grid (same cost model)", show_edge=False)
        for column in ("config", "microbatches", "L"):
            grid.add_column(column, justify="left" if column == "config" else "right")
        for g in feasible[:grid_rows]:
            grid.add_row(g.label, str(g.plan.microbatches), human_seconds(g.cost.latency))  # type: ignore[union-attr]
        return Group(stages, *lines, grid)
    return Group(stages, *lines)
