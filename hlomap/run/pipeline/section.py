"""Meshes from a plan: the device order, the SPMD mesh, the pipeline's stages and their meshes.

A pipeline plan's `pipeline` section (`hlomap.plan.Pipeline`, typed and checked by the plan)
lists its stages with the (plan) device ids each uses (with `"repeats": V`, the model is cut into
S V logical stages and logical stage k runs on the devices of stage k mod S, each microbatch going
round the stages V times: a circular schedule under gpipe, interleaved 1F1B under
interleaved-1f1b); the
mesh inside a stage is the stage's own `mesh` entry when it has one, else the plan's top-level
mesh (its parameters' PartitionSpecs then apply inside every stage: tensor parallelism), else
one `data` axis over the stage's devices (the explorer's replicated stages). The PartitionSpecs
inside a stage are the stage's own `specs` entry when it has one (a joint plan's: one per plan
parameter, in the order of `plan.parameters`, over the stage's mesh), else the plan's top-level
parameters. Plan device i is the i-th device of the plan's device order (`verify.mesh`, the one
rule for every mesh a plan runs or is compiled on).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

from hlomap.cost.pipeline.stages import Schedule, schedule_problem
from hlomap.plan import ParameterSpec, Pipeline, PipelineCut, Plan
from hlomap.plan.sections import Recompute, Spec
from hlomap.run.errors import RunError
from hlomap.run.pipeline.cuts import cut_records

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
    cuts: tuple[PipelineCut, ...]
    microbatches: int
    schedule: Schedule
    parameters: tuple[tuple[ParameterSpec, ...], ...]
    repeats: int = 1  # circular or interleaved: each stage's devices run this many of the model's stages
    recompute: tuple[Recompute, ...] = ()  # per device stage: what its backward runs again (empty: nothing)
    splits_state: bool = False  # some stage splits its optimizer state over its data axis (ZeRO-1)
    #: per device stage: the cuts between the layers it checkpoints one by one (empty: none does)
    recompute_cuts: tuple[tuple[PipelineCut, ...], ...] = ()
    #: per device stage: the plan's parameters with their gradients' specs where the stage splits
    #: its gradients (ZeRO-2), else None (empty: no stage does)
    gradients: tuple[tuple[ParameterSpec, ...] | None, ...] = ()

    @property
    def layered_recompute(self) -> bool:
        """Some stage is checkpointed layer by layer (which the mpmd executor runs)."""
        return any(self.recompute_cuts)

    def recomputes(self, stage: int) -> Recompute:
        """What logical stage `stage` (on device stage `stage` mod S) recomputes of its forward."""
        return self.recompute[stage % self.n_stages] if self.recompute else Recompute.NONE

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
    """The runner's view of `plan.pipeline` (module docstring): the typed section, which the plan
    has checked, resolved to each stage's inner mesh and parameters, with what only the runner
    requires (a circular pipeline runs GPipe with at least as many microbatches as stages)."""
    section: Pipeline = plan.pipeline
    schedule, microbatches, repeats = section.schedule, section.microbatches, section.repeats
    if repeats > 1 and schedule not in (Schedule.GPIPE, Schedule.INTERLEAVED):
        raise RunError(f"{where}: repeats {repeats} (model chunks per stage) runs the gpipe schedule (circular, on the "
                       f"spmd executor) or interleaved-1f1b (on the mpmd executor), not {schedule.value}")
    problem = schedule_problem(schedule, section.n_stages, microbatches, repeats)
    if problem is not None:
        raise RunError(f"{where}: {problem}")
    if repeats > 1 and schedule is Schedule.GPIPE and microbatches < section.n_stages:
        raise RunError(f"{where}: a circular pipeline needs at least as many microbatches as stages (a microbatch "
                       f"comes back to stage 0 after {section.n_stages} ticks); it has {microbatches} microbatches "
                       f"and {section.n_stages} stages")
    top = tuple((str(k), int(v)) for k, v in plan.mesh)
    devices, inner, parameters, gradients = [], [], [], []
    for s, stage in enumerate(section.stages):
        ids = stage.devices
        mesh = stage.mesh or top or ((DATA_AXIS, len(ids)),)
        if math.prod(size for _, size in mesh) != len(ids):
            raise RunError(f"{where}: stage {s} has {len(ids)} devices but its mesh {dict(mesh)} has "
                           f"{math.prod(size for _, size in mesh)}")
        if any(name == STAGE_AXIS for name, _ in mesh):
            raise RunError(f"{where}: stage {s}'s mesh uses the axis name {STAGE_AXIS!r}, which the runner reserves")
        devices.append(ids)
        inner.append(mesh)
        parameters.append(stage_parameters(plan, stage.specs, mesh, f"{where}: stage {s}"))
        gradients.append(stage_parameters(plan, stage.gradient_specs, mesh, f"{where}: stage {s}'s gradients")
                         if stage.shard_gradients else None)
    recompute = tuple(stage.recompute for stage in section.stages)
    layered = tuple(stage.recompute_cuts for stage in section.stages)
    if any(layered) and repeats > 1:
        raise RunError(f"{where}: stages checkpointed layer by layer (recompute_cuts) run one chunk per stage; this "
                       f"plan has repeats {repeats}")
    return PipelineSection(tuple(devices), tuple(inner), cut_records(section, where), microbatches, schedule,
                           tuple(parameters), repeats,
                           recompute if any(r is not Recompute.NONE for r in recompute) else (),
                           any(stage.state_axes for stage in section.stages), layered if any(layered) else (),
                           tuple(gradients) if any(g is not None for g in gradients) else ())


def stage_parameters(plan: Any, specs: Sequence[Spec] | None, mesh: tuple[tuple[str, int], ...],
                     where: str) -> tuple[ParameterSpec, ...]:
    """The plan's parameters with a stage's own specs (one per parameter, in order, which the
    plan has matched to the parameters' ranks), checked against the stage's mesh; without them
    the top-level parameters."""
    if specs is None:
        return tuple(plan.parameters)
    out = tuple(dataclasses.replace(p, spec=tuple(spec) + (None,) * (len(p.shape) - len(spec)))
                for p, spec in zip(plan.parameters, specs))
    try:
        Plan(mesh=mesh, parameters=out).check_specs(where=where)
    except ValueError as err:
        raise RunError(str(err)) from None
    return out
