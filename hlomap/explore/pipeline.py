"""The pipeline task as a `Plan`: `hlomap.explore(cap, task="pipeline", ...)`.

`hlomap.pipeline.explore.explore_pipeline` finds the stage cuts; this module wraps its result in
the plan format of DESIGN.md: every parameter replicated inside its stage (the pipeline task
decides cuts, stage devices and replication, not tensor sharding), the `pipeline` section with
the stages, microbatches and schedule, the `estimate` with L and the memory per stage, and
`search` with how the cuts were found.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hlomap.hlo.capture import Capture
    from hlomap.pipeline.explore import PipelineResult
    from hlomap.plan import Plan

__all__ = ["pipeline_plan"]


def _pipeline_section(result: PipelineResult) -> dict[str, Any]:
    data = result.to_json()
    return {key: data[key] for key in ("stages", "microbatches", "schedule", "cuts", "device_cuts",
                                       "on_node_boundaries")}


def _estimate_section(result: PipelineResult) -> dict[str, Any]:
    memory = [float(m) for m in result.stage_memory]
    fits = all(m <= c for m, c in zip(memory, result.device_memory))
    return {
        "step_seconds": float(result.latency),
        "model_step_seconds": float(result.model_latency),
        "bottleneck_seconds": float(result.cost.bottleneck),
        "memory": {"per_stage": memory, "total": max(memory, default=0.0), "fits": fits},
        "memory_violations": [str(v) for v in result.simulation.violations],
    }


def pipeline_plan(cap: Capture, result: PipelineResult, *, seed: int = 0) -> Plan:
    """The `Plan` of a pipeline result found for `cap`."""
    from hlomap.plan import ParameterSpec, Plan, PlanSource

    parameters = tuple(ParameterSpec(p.index, p.path, tuple(p.shape.dims), (None,) * len(p.shape.dims))
                       for p in cap.parameters)
    search = {"task": "pipeline", "driver": result.agent.value, "reward": result.objective.value,
              "episodes": result.episodes, "evaluations": result.episodes,
              "seconds": round(result.search_seconds, 3), "seed": seed}
    if result.optimum is not None:
        search["optimum"] = result.optimum
    plan = Plan(mesh=(), parameters=parameters, source=PlanSource(cap.source, cap.text_sha256))
    return dataclasses.replace(plan, pipeline=_pipeline_section(result), estimate=_estimate_section(result),
                               search=search)
