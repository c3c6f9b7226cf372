"""Plans as data: the `Plan` (mesh, per-parameter PartitionSpecs, optional pipeline, placement and
estimate) with its versioned JSON, the typed sections of a plan file, and the built-in plans."""

from hlomap.plan.errors import PlanError
from hlomap.plan.model import PLAN_VERSION, Plan, write_atomic, write_problem
from hlomap.plan.reference import ReferencePlan, parse_mesh_text, reference_plan, resolve_plan
from hlomap.plan.sections import (
    GroupAssignment,
    MeasuredCandidate,
    Measurement,
    ParameterSpec,
    Pipeline,
    PipelineCut,
    PipelineKind,
    PipelineStage,
    Placement,
    PlanSource,
    Recompute,
    StateSharding,
)
from hlomap.propagation.conflicts import PlanConflict

__all__ = ["PLAN_VERSION", "GroupAssignment", "MeasuredCandidate", "Measurement", "ParameterSpec", "Pipeline",
           "PipelineCut", "PipelineKind",
           "PipelineStage", "Placement", "Plan", "PlanConflict", "PlanError", "PlanSource", "Recompute", "ReferencePlan",
           "StateSharding",
           "parse_mesh_text", "reference_plan", "resolve_plan", "write_atomic", "write_problem"]
