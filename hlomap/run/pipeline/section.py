"""Meshes from a plan: the device order, the SPMD mesh, the pipeline's stages and their meshes.

A pipeline plan's `pipeline` section lists its stages with the (plan) device ids each uses (with
`"repeats": V`, a circular schedule: the model is cut into S V logical stages and logical stage k
runs on the devices of stage k mod S, each microbatch going round the stages V times); the
mesh inside a stage is the stage's own `mesh` entry when it has one, else the plan's top-level
mesh (its parameters' PartitionSpecs then apply inside every stage: tensor parallelism), else
one `data` axis over the stage's devices (the explorer's replicated stages). The PartitionSpecs
inside a stage are the stage's own `specs` entry when it has one (a joint plan's: one per plan
parameter, in the order of `plan.parameters`, over the stage's mesh), else the plan's top-level
parameters. Plan device i is the i-th device of the plan's device order (`verify.mesh`, the one
rule for every mesh a plan runs or is compiled on).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from hlomap.cost.pipeline.stages import Schedule
from hlomap.plan import ParameterSpec, Plan
from hlomap.run.errors import RunError
from hlomap.run.pipeline.cuts import CutRecord, cut_records

__all__ = [
    "DATA_AXIS",
    "STAGE_AXIS",
    "PipelineSection",
    "pipeline_section",
    "stage_parameters",
]

STAGE_AXIS = "stage"
DATA_AXIS = "data"


@dataclass(frozen=True)
class PipelineSection:
    """A plan's pipeline: per stage its plan device ids, inner mesh and the plan's parameters
    with the specs that apply inside it; cuts, M, schedule."""

    devices: tuple[tuple[int, ...], ...]
    inner: tuple[tuple[tuple[str, int], ...], ...]
    cuts: tuple[CutRecord, ...]
    microbatches: int
    schedule: Schedule
    parameters: tuple[tuple[ParameterSpec, ...], ...]
    repeats: int = 1  # circular schedule: each stage's devices run this many of the model's stages

    @property
    def n_stages(self) -> int:
        """Device stages (groups of devices)."""
        return len(self.devices)

    @property
    def logical_stages(self) -> int:
        """Stages of the model: logical stage k runs on device stage k mod S (k // S-th round)."""
        return len(self.devices) * self.repeats

    @property
    def uniform(self) -> bool:
        """Every stage has the same inner mesh and specs (what one SPMD program over a `stage`
        axis needs: each parameter sits at the same place of every stage's row)."""
        return len(set(self.inner)) == 1 and len(set(self.parameters)) == 1


def pipeline_section(plan: Any, where: str = "plan") -> PipelineSection:
    """Read and check `plan.pipeline` (module docstring)."""
    data: Mapping[str, Any] = plan.pipeline
    stages = data.get("stages") or []
    if not stages:
        raise RunError(f"{where}: the pipeline section has no stages")
    try:
        schedule = Schedule(data.get("schedule", Schedule.GPIPE.value))
    except ValueError:
        raise RunError(f"{where}: unknown pipeline schedule {data.get('schedule')!r}; the runner takes "
                       f"{', '.join(s.value for s in Schedule)}") from None
    microbatches = int(data.get("microbatches", 1))
    if microbatches < 1:
        raise RunError(f"{where}: {microbatches} microbatches; need at least 1")
    repeats = data.get("repeats", 1)
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise RunError(f"{where}: 'repeats' is {repeats!r}; the circular schedule needs a whole number >= 1")
    if repeats > 1 and schedule is not Schedule.GPIPE:
        raise RunError(f"{where}: a circular pipeline (repeats {repeats}) runs the gpipe schedule, not "
                       f"{schedule.value}")
    if repeats > 1 and microbatches < len(stages):
        raise RunError(f"{where}: a circular pipeline needs at least as many microbatches as stages (a microbatch "
                       f"comes back to stage 0 after {len(stages)} ticks); it has {microbatches} microbatches and "
                       f"{len(stages)} stages")
    top = tuple((str(k), int(v)) for k, v in plan.mesh)
    devices, inner, parameters = [], [], []
    for s, stage in enumerate(stages):
        ids = tuple(int(d) for d in stage.get("devices", ()))
        if not ids:
            raise RunError(f"{where}: stage {s} lists no devices")
        mesh = tuple((str(k), int(v)) for k, v in (stage.get("mesh") or {}).items()) or top or ((DATA_AXIS, len(ids)),)
        if math.prod(size for _, size in mesh) != len(ids):
            raise RunError(f"{where}: stage {s} has {len(ids)} devices but its mesh {dict(mesh)} has "
                           f"{math.prod(size for _, size in mesh)}")
        if any(name == STAGE_AXIS for name, _ in mesh):
            raise RunError(f"{where}: stage {s}'s mesh uses the axis name {STAGE_AXIS!r}, which the runner reserves")
        devices.append(ids)
        inner.append(mesh)
        parameters.append(stage_parameters(plan, stage.get("specs"), mesh, f"{where}: stage {s}"))
    used = [d for ids in devices for d in ids]
    if len(set(used)) != len(used):
        raise RunError(f"{where}: a device is in two stages ({used})")
    return PipelineSection(tuple(devices), tuple(inner), cut_records(data, where, repeats), microbatches, schedule,
                           tuple(parameters), repeats)


def stage_parameters(plan: Any, specs: Sequence[Any] | None, mesh: tuple[tuple[str, int], ...],
                     where: str) -> tuple[ParameterSpec, ...]:
    """The plan's parameters with a stage's own `specs` (JSON PartitionSpecs, one per parameter,
    in order), checked against the stage's mesh; without them the top-level parameters."""
    if specs is None:
        return tuple(plan.parameters)
    if not isinstance(specs, Sequence) or len(specs) != len(plan.parameters):
        count = len(specs) if isinstance(specs, Sequence) else type(specs).__name__
        raise RunError(f"{where}: 'specs' has {count} entries; the plan has {len(plan.parameters)} parameters "
                       "and a stage gives one PartitionSpec for each, in order")
    out = []
    for p, spec in zip(plan.parameters, specs):
        if not isinstance(spec, Sequence) or isinstance(spec, str) or len(spec) != len(p.shape):
            raise RunError(f"{where}: the spec {spec!r} of parameter {p.path!r} does not give one entry per dim of "
                           f"its shape {p.shape}")
        try:
            out.append(ParameterSpec.from_json({**p.to_json(), "spec": list(spec)}))
        except (TypeError, ValueError) as err:
            raise RunError(f"{where}: the spec {spec!r} of parameter {p.path!r} is malformed ({err})") from None
    try:
        Plan(mesh=mesh, parameters=tuple(out)).check_specs(where=where)
    except ValueError as err:
        raise RunError(str(err)) from None
    return tuple(out)
