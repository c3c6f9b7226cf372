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
  hlo_profile `profile_from_capture`: a captured train step's forward chain, candidate pivots
              and C / A / W arrays (`HloProfile`)

Searches with the DQN (they import JAX through `hlomap.agents`; import them from their modules):
  cutenv      `CutEnv`, `CutTask`: Auto-MAP's pipeline-cut environment (sections 3.4, 3.5)
  dqn_search  `dqn_search`: online DQN training on one model, best plan found
  normalize   `coarsen` to 128 points, `random_task` / `RandomCutEnv` for the inference network
  infer       `train_policy`, `load_policy`, `infer_cuts`: the inference network (section 3.5)
  explore     `explore_pipeline`, `format_pipeline_result`: what `hlomap explore --task pipeline`
              calls
  acceptance  `run_case`: issue #7's DQN-against-DP table (scripts/reproduce_pipeline.py)

The modules of the first list import neither JAX nor, except `hlo_profile`, `hlomap.cost`.
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
from hlomap.pipeline.hlo_profile import HloProfile, Pivot, PivotOptions, profile_from_capture
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
    "HloProfile",
    "Links",
    "MemoryViolation",
    "NoFeasiblePlan",
    "Objective",
    "PipeDreamParseError",
    "PipelineMemoryError",
    "PipelinePlan",
    "PipelineProfile",
    "Pivot",
    "PivotOptions",
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
    "profile_from_capture",
    "scale_batch",
    "simulate",
    "solve",
    "to_profile",
    "uniform_profile",
]
