"""What `hlomap simulate` shows for each kind of simulation (`hlomap.api.simulate_plan`): an SPMD
plan's estimate, a pipeline plan's placed step, a joint plan's stages."""

from __future__ import annotations

from typing import Any

from hlomap.cost.pipeline.costs import latency_method
from hlomap.report.estimate import format_estimate, instruction_calls
from hlomap.report.joint import format_joint_result, stage_devices
from hlomap.report.placement import format_pipeline_estimate, placement_line
from hlomap.report.units import human_seconds

__all__ = ["format_simulation", "simulation_json"]


def format_simulation(simulation: Any, *, top: int = 10, name: str | None = None) -> list[Any]:
    """Report items, in order: plain-text strings and rich renderables."""
    if hasattr(simulation, "result"):  # a joint plan
        placement = simulation.placement
        out = [format_joint_result(simulation.result, name=name,
                                   devices=None if placement is None else placement.devices)]
        if placement is not None:
            out.append(placement_line(placement, simulation.result.cost.latency, simulation.identity_seconds))
        if simulation.executor:
            out.append(joint_executor_line(simulation))
        return out
    if hasattr(simulation, "cluster_name"):  # a pipeline plan
        return [format_pipeline_estimate(simulation.estimate, simulation.cluster_name, simulation.placement),
                executor_line(simulation)]
    out: list[Any] = [format_estimate(simulation.estimate, top=top)]
    if simulation.identity is not None:
        out.append(placement_line(simulation.placement, simulation.estimate.step_seconds,
                                  simulation.identity.step_seconds))
    return out


def executor_line(simulation: Any) -> str:
    """The step as the plan's executor runs it (`PipelineSimulation.step_seconds`): the spmd
    executor's lockstep ticks or the simulated schedule, plus the executor's own cost."""
    if simulation.lockstep_seconds is not None:
        how = f"{human_seconds(simulation.lockstep_seconds)} in lockstep ticks"
    else:
        how = f"{human_seconds(simulation.estimate.placed.length)} as simulated"
    return (f"on the {simulation.executor} executor: step {human_seconds(simulation.step_seconds)} ({how} + "
            f"{human_seconds(simulation.executor_seconds)} of the executor's own)")


def joint_executor_line(simulation: Any) -> str:
    """A joint plan's step on the executor it was priced for (`JointSimulation.step_seconds`):
    the model's L over the stages (`latency_method`), plus that executor's own cost."""
    cost = simulation.result.cost
    return (f"on the {simulation.executor} executor: step {human_seconds(simulation.step_seconds)} "
            f"({human_seconds(cost.latency - cost.executor_seconds)} by the "
            f"{latency_method(simulation.result.plan.schedule)} + "
            f"{human_seconds(simulation.executor_seconds)} of the executor's own)")


def simulation_json(simulation: Any, *, top: int | None = None) -> dict[str, Any]:
    """The simulation as JSON-ready data (`hlomap simulate --json`); with `top`, an SPMD plan's
    `top` slowest instructions too (`slowest_instructions`; `call` [k, n] for the k-th of the n
    calls of a computation called from several places, else null)."""
    if hasattr(simulation, "result"):
        cost = simulation.result.cost
        data = {"step_seconds": cost.latency, "bottleneck_seconds": cost.bottleneck,
                "stage_seconds": list(cost.stage_seconds), "stage_memory_bytes": list(cost.stage_memory),
                "transfer_seconds": list(cost.transfer_seconds), "fits": cost.fits,
                "executor": simulation.executor, "executor_seconds": simulation.executor_seconds,
                "executor_step_seconds": simulation.step_seconds}
        if simulation.placement is not None:
            data |= {"stages": [list(devices) for devices in stage_devices(simulation.result.plan, simulation.placement.devices)],
                     "identity_order_step_seconds": simulation.identity_seconds}
        return data
    if hasattr(simulation, "cluster_name"):
        est = simulation.estimate
        return {"cluster": simulation.cluster_name, "step_seconds": est.placed.length,
                "model_step_seconds": est.placed_model_seconds, "identity_order_step_seconds": est.identity.length,
                "stages": [list(stage.devices) for stage in est.placed.plan.stages],
                "executor": simulation.executor, "executor_seconds": simulation.executor_seconds,
                "lockstep_seconds": simulation.lockstep_seconds, "executor_step_seconds": simulation.step_seconds,
                "memory_violations": [str(v) for v in est.placed.violations]}
    data = simulation.estimate.to_json()
    if simulation.identity is not None:
        data["identity_order_step_seconds"] = simulation.identity.step_seconds
    if top is not None:
        rows = simulation.estimate.instructions
        data["slowest_instructions"] = [
            {"instruction": i.name, "computation": i.computation, "call": None if call is None else list(call),
             "opcode": i.opcode, "phase": i.phase.value, "split": i.degree, "count": i.count, "flops": i.flops,
             "bytes": i.bytes_accessed, "seconds": i.seconds}
            for i, call in zip(rows[:top], instruction_calls(rows))]
    return data
