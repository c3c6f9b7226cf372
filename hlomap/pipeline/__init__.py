"""Pipeline parallelism: per-layer profiles, a GPipe/1F1B simulator, and exact plan search.

Modules:
  profile     `PipelineProfile`: per-layer compute, crossing bytes, parameters, stash
  links       `Links`: alpha-beta links, nodes and device memory (adapts `hlomap.cost.Cluster`)
  stages      `PipelinePlan`, `Stage`, `Schedule` (GPipe, 1F1B)
  costmodel   closed-form latency / bottleneck / memory of a plan (`evaluate_plan`)
  simulator   event simulation of one global batch (`simulate`) -> timeline, L, memory
  gantt       `draw_gantt`: the timeline as a PNG
  space       `SearchSpace`, `Objective`: what a search may choose and minimizes
  dp          `solve`: exact DP over cuts, replication, linear device order
  bruteforce  `brute_force`: enumeration, the DP's oracle on small cases
  pipedream   PipeDream profiled layer graphs as input (`load_profile`)

Nothing here imports JAX or `hlomap.cost`.
"""

from hlomap.pipeline.bruteforce import brute_force
from hlomap.pipeline.costmodel import (
    CommModel,
    CostOptions,
    MemoryViolation,
    PlanCost,
    evaluate_plan,
)
from hlomap.pipeline.dp import solve
from hlomap.pipeline.gantt import draw_gantt
from hlomap.pipeline.links import Links
from hlomap.pipeline.pipedream import PipeDreamParseError, load_profile, parse_graph, to_profile
from hlomap.pipeline.profile import PipelineProfile, merge_layers, scale_batch, uniform_profile
from hlomap.pipeline.simulator import (
    PipelineMemoryError,
    SimulationResult,
    Span,
    SpanKind,
    simulate,
)
from hlomap.pipeline.solution import NoFeasiblePlan, Solution
from hlomap.pipeline.space import Objective, SearchSpace
from hlomap.pipeline.stages import PipelinePlan, Schedule, Stage

__all__ = [
    "CommModel",
    "CostOptions",
    "Links",
    "MemoryViolation",
    "NoFeasiblePlan",
    "Objective",
    "PipeDreamParseError",
    "PipelineMemoryError",
    "PipelinePlan",
    "PipelineProfile",
    "PlanCost",
    "Schedule",
    "SearchSpace",
    "SimulationResult",
    "Solution",
    "Span",
    "SpanKind",
    "Stage",
    "brute_force",
    "draw_gantt",
    "evaluate_plan",
    "load_profile",
    "merge_layers",
    "parse_graph",
    "scale_batch",
    "simulate",
    "solve",
    "to_profile",
    "uniform_profile",
]
