"""Sharding propagation on HLO: per-opcode factor rules, the factor graph (Auto-MAP's linkage
groups), plan arrays over groups, vectorized conflict checks, and XLA as the oracle.

    graph = FactorGraph.from_capture(cap)              # groups, computed once
    axes = MeshAxes.from_mesh({"data": 2, "model": 4})
    plan = combine(data_parallel_plan(graph, "data", axes), megatron_plan(graph, "model", axes))
    ConflictChecker(graph, axes).ok(plans)             # many plans at once
    hlomap.plan.Plan.from_groups(cap, graph, plan, axes).partition_specs()
"""

from hlomap.propagation.conflicts import (
    REPLICATED,
    Conflict,
    ConflictChecker,
    ConflictKind,
    MeshAxes,
    PlanConflict,
)
from hlomap.propagation.factors import FactorKind, OpRule, format_rule
from hlomap.propagation.graph import DimRef, FactorGraph, GroupConstraints, TrainableDim
from hlomap.propagation.plans import (
    backbone_group,
    combine,
    data_parallel_plan,
    empty_plan,
    instruction_shardings,
    megatron_plan,
    parameter_options,
    partial_reductions,
    random_plans,
    tensor_options,
)
from hlomap.propagation.rules import RULES, rule_for

__all__ = [
    "REPLICATED",
    "RULES",
    "Conflict",
    "ConflictChecker",
    "ConflictKind",
    "DimRef",
    "FactorGraph",
    "FactorKind",
    "GroupConstraints",
    "MeshAxes",
    "OpRule",
    "PlanConflict",
    "TrainableDim",
    "backbone_group",
    "combine",
    "data_parallel_plan",
    "empty_plan",
    "format_rule",
    "instruction_shardings",
    "megatron_plan",
    "parameter_options",
    "partial_reductions",
    "random_plans",
    "rule_for",
    "tensor_options",
]
