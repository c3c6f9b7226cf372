"""Pipeline plans for the runner's tests, made from a zoo step's HLO chain."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from hlomap.plan import ParameterSpec, Plan, PlanSource
from hlomap.tasks.pipeline.chain import StepChain, step_chain


def chain_of(cap: Any) -> StepChain:
    return step_chain(cap)


def pivots_at(chain: StepChain, fractions: Sequence[float]) -> list[int]:
    """Pivot indices at these fractions of the forward chain (cuts anywhere, inside layers too)."""
    n = len(chain.pivots)
    return [min(int(f * n), n - 1) for f in fractions]


def boundary_pivots(chain: StepChain, count: int) -> list[int]:
    """`count` pivots where one tensor crosses and the layer scope changes right after (between
    layers), spread over the chain."""
    pivots = chain.pivots
    candidates = [k for k in range(len(pivots) - 1)
                  if pivots[k].live_tensors <= 1 and pivots[k].scope.split("/")[0] != pivots[k + 1].scope.split("/")[0]]
    if len(candidates) < count:
        candidates = [k for k in range(len(pivots)) if pivots[k].live_tensors <= 1]
    step = len(candidates) / (count + 1)
    return [candidates[int(step * (i + 1))] for i in range(count)]


def pipeline_plan(cap: Any, chain: StepChain, pivots: Sequence[int], *, microbatches: int,
                  schedule: str = "gpipe", devices_per_stage: int = 1, mesh: Mapping[str, int] | None = None,
                  specs: Mapping[int, Sequence[Any]] | None = None) -> Plan:
    """A plan with stages cut after chain pivots `pivots`; `mesh` the mesh inside each stage (the
    plan's top-level mesh) and `specs` per flat parameter index, else replicated stages (a `data`
    axis over each stage's devices)."""
    n_stages = len(pivots) + 1
    specs = specs or {}
    parameters = tuple(ParameterSpec(p.index, p.path, tuple(p.shape.dims),
                                     tuple(specs.get(p.index, (None,) * len(p.shape.dims))))
                       for p in cap.parameters)
    stages, start = [], 0
    bounds = [*pivots, len(chain.pivots)]
    for s in range(n_stages):
        stages.append({"layers": [start, bounds[s] + 1],
                       "devices": list(range(s * devices_per_stage, (s + 1) * devices_per_stage))})
        start = bounds[s] + 1
    cuts = [{"pivot": k, "instruction": chain.pivots[k].instruction, "layer": chain.pivots[k].layer,
             "scope": chain.pivots[k].scope, "source": chain.pivots[k].source,
             "crossing_bytes": chain.pivots[k].crossing_bytes} for k in pivots]
    return Plan(mesh=tuple((mesh or {}).items()), parameters=parameters,
                source=PlanSource(cap.source, cap.text_sha256),
                pipeline={"stages": stages, "microbatches": microbatches, "schedule": schedule, "cuts": cuts})
