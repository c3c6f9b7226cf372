"""What both pipeline executors share: the step split into stages, and the plan read for them.

`prepare` traces the step (`trace`), maps the plan's HLO cuts to loss equations (`cuts`), cuts
the loss into stage programs (`loss_split`) and the rest of the step into per-stage updates
(`stage_update`); the executors only schedule and move what these describe.

Microbatches. The batch argument's leaves are split on their leading dim into M equal
microbatches, microbatch m holding examples [m mb, (m + 1) mb). The step's loss is the mean of
the microbatch losses and its gradient the mean of theirs: with a loss that is a mean over
examples this is the loss and gradient of the whole batch. Aux outputs (batch-norm running
statistics) are averaged over microbatches (integer ones: the last microbatch's). Every
microbatch's forward sees the state as it was before the step, so a batch-norm layer normalizes
each microbatch with that microbatch's statistics (as data-parallel replicas without
cross-replica batch norm do) and its running statistics become the mean over microbatches of
what each microbatch's forward computed: for the usual update `r' = m r + (1 - m) s` that is the
update with the microbatch-mean statistics `s`. `reference_gradients` computes the same thing
without a pipeline.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import jax
import numpy as np

from hlomap.cost.pipeline.stages import splits_batch
from hlomap.plan.sections import Recompute
from hlomap.run.errors import RunError
from hlomap.run.pipeline.cuts import StageAssignment, assign_stages
from hlomap.run.pipeline.loss_split import LossSplit, checkpointed_layers, split_loss
from hlomap.run.pipeline.section import DATA_AXIS, PipelineSection
from hlomap.run.pipeline.stage_update import UpdatePlan, plan_update
from hlomap.run.trace import STATE_ARGS, InputKind, TracedStep, microbatch_args, trace_step

if TYPE_CHECKING:
    from hlomap.hlo.capture import Capture
    from hlomap.plan import ParameterSpec

__all__ = ["PipelineProgram", "batch_axes", "leaf_specs", "prepare"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class PipelineProgram:
    """A train step cut for a pipeline plan."""

    traced: TracedStep  # at the whole batch: the step around the loss, and what the plan's HLO is of
    micro: TracedStep  # at one microbatch: what the stages run
    assignment: StageAssignment
    split: LossSplit
    update: UpdatePlan
    section: PipelineSection
    microbatch: int  # examples per microbatch

    @property
    def n_stages(self) -> int:
        """Device stages; `split.stages` has `section.logical_stages` (more under a circular schedule)."""
        return self.section.n_stages

    @property
    def microbatches(self) -> int:
        return self.section.microbatches

    def loss_leaf(self, position: int) -> int | None:
        return self.traced.loss_inputs[position].leaf

    def check_batch_leaf(self, value: Any) -> None:
        """A batch leaf of a call has the batch size the step was cut for."""
        shape = tuple(np.shape(value))
        if shape[:1] != (self.traced.batch_size,):
            raise RunError(f"the pipeline was cut for batches of {self.traced.batch_size} examples ({self.microbatches} "
                           f"microbatches of {self.microbatch}); this call's batch has a leaf of shape {shape}: build "
                           "another `parallelize` step for this batch size")

    def check_arguments(self, rest: Sequence[Any]) -> None:
        """RunError naming the first argument after the state that is not what the step was cut
        for: another structure (a key missing or renamed, an argument more or less), or a leaf of
        another shape or dtype. The stages' programs take the leaves in the order the cut step
        flattened them, so a renamed key would run on the wrong leaf, and a missing one fail deep
        inside the executor. Python numbers are checked by shape only (they take the step's dtype)."""
        traced = self.traced
        expected = jax.tree_util.treedef_tuple(traced.arg_tree.children()[STATE_ARGS:])
        flat, got = jax.tree_util.tree_flatten_with_path(tuple(rest))
        if got != expected:
            raise RunError(f"the arguments after the state are {got}, but the pipeline was cut for {expected}: call "
                           "the step with the batch (and later arguments) shaped as the step that made the plan")
        n_state = traced.state_leaves
        for j, (path, value) in enumerate(flat):
            aval = traced.step.jaxpr.invars[n_state + j].aval
            where = f"argument [{STATE_ARGS + path[0].idx}]{jax.tree_util.keystr(tuple(path[1:]))}"
            shape = tuple(np.shape(value))
            if shape != tuple(aval.shape):
                if shape[1:] == tuple(aval.shape)[1:] and tuple(aval.shape)[:1] == (traced.batch_size,):
                    self.check_batch_leaf(value)  # another batch size: its own message
                raise RunError(f"{where} is shaped {list(shape)}, but the pipeline was cut for {list(aval.shape)} there")
            dtype = getattr(value, "dtype", None)
            if dtype is not None and np.dtype(dtype) != np.dtype(aval.dtype):
                raise RunError(f"{where} is {np.dtype(dtype).name}, but the pipeline was cut for "
                               f"{np.dtype(aval.dtype).name} there")

    def data_inputs(self) -> tuple[int, ...]:
        """Loss inputs of the batch and later arguments (every stage may read them)."""
        return tuple(p for p, item in enumerate(self.traced.loss_inputs)
                     if item.kind in (InputKind.DATA, InputKind.BROADCAST))


def prepare(step: Any, args: Sequence[Any], cap: Capture, section: PipelineSection, *,
            widen: bool) -> PipelineProgram:
    """Trace `step(*args)` and cut it as `section` says (module docstring)."""
    paths = [p.path for p in cap.parameters]
    traced = trace_step(step, args, paths)
    m = section.microbatches
    if not splits_batch(traced.batch_size, m, 1):
        raise RunError(f"the batch of {traced.batch_size} examples cannot be split into {m} equal microbatches "
                       f"({traced.batch_size} is not a multiple of {m})")
    microbatch = traced.batch_size // m
    micro = traced if m == 1 else trace_step(step, microbatch_args(args, microbatch, traced.batch_size), paths)
    _check_same_loss(traced, micro)
    assignment = assign_stages(cap, traced, section.cuts)
    split = split_loss(micro, assignment.stage_of_eqn, section.logical_stages)
    if section.layered_recompute:
        split = _checkpointed_by_layer(cap, traced, micro, assignment, section, split)
    update = plan_update(traced, split, widen=widen)
    return PipelineProgram(traced, micro, assignment, split, update, section, microbatch)


#: The `jax.checkpoint` policy of each recomputation a plan's stage may ask for.
CHECKPOINT_POLICIES = {Recompute.SELECTIVE: jax.checkpoint_policies.dots_saveable,
                       Recompute.FULL: jax.checkpoint_policies.nothing_saveable}


def _checkpointed_by_layer(cap: Capture, traced: TracedStep, micro: TracedStep, assignment: StageAssignment,
                           section: PipelineSection, split: LossSplit) -> LossSplit:
    """`split` with each stage that lists recompute cuts run layer by layer, each layer
    checkpointed with the stage's policy (`loss_split.checkpointed_layers`). The layers are the
    stages of the loss cut at every stage cut and recompute cut together; since both cut the same
    forward chain in order, their stages group into the plan's (checked)."""
    cuts: list[Any] = []
    owner: list[int] = []  # the plan's stage of each layer
    for s, inner in enumerate(section.recompute_cuts):
        cuts += inner
        owner += [s] * (len(inner) + 1)
        if s + 1 < section.n_stages:
            cuts.append(section.cuts[s])
    try:
        fine = assign_stages(cap, traced, cuts)
    except RunError as err:  # its cut numbers count the recompute cuts and stage cuts together
        raise RunError(f"the stages' recompute_cuts, taken in forward order with the stage cuts between them: "
                       f"{err}") from None
    if [owner[k] for k in fine.stage_of_eqn] != list(assignment.stage_of_eqn):
        raise RunError("the plan's recompute cuts move loss equations across its stage cuts; are they the cuts "
                       "between each stage's layers, in forward order?")
    layers = split_loss(micro, fine.stage_of_eqn, len(owner))
    stages = list(split.stages)
    for s, inner in enumerate(section.recompute_cuts):
        if inner:
            own = [layer for k, layer in enumerate(layers.stages) if owner[k] == s]
            stages[s] = checkpointed_layers(stages[s], own, CHECKPOINT_POLICIES[section.recomputes(s)])
    return dataclasses.replace(split, stages=tuple(stages))


def _check_same_loss(whole: TracedStep, micro: TracedStep) -> None:
    """The stages run the loss traced at one microbatch, cut where the whole batch's is: both
    traces must be the same program up to batch sizes."""
    a, b = whole.loss.jaxpr.eqns, micro.loss.jaxpr.eqns
    if len(a) != len(b) or any(x.primitive is not y.primitive for x, y in zip(a, b)):
        raise RunError(f"the loss traces to another program at one microbatch ({len(b)} equations) than at the "
                       f"whole batch ({len(a)}): its Python code depends on the batch size; the pipeline cannot cut it")
    for j, (x, y) in enumerate(zip(whole.loss.jaxpr.outvars[1:], micro.loss.jaxpr.outvars[1:])):
        if x.aval.shape != y.aval.shape:
            raise RunError(f"aux output {j} of the loss has shape {x.aval.shape} for the batch but {y.aval.shape} for "
                           "a microbatch; the pipeline averages aux outputs over microbatches, so they cannot "
                           "depend on the batch size")


def leaf_specs(parameters: Sequence[ParameterSpec], n_leaves: int) -> dict[int, Any]:
    """Flat argument index -> PartitionSpec of a stage's parameters (`PipelineSection.parameters`)."""
    out = {}
    for p in parameters:
        if p.index < n_leaves and any(s is not None for s in p.spec):
            out[p.index] = p.partition_spec()
    return out


def batch_axes(parameters: Sequence[ParameterSpec], traced: TracedStep, mesh_axes: Mapping[str, int],
               microbatch: int) -> tuple[str, ...]:
    """Mesh axes that split a microbatch's examples inside a stage: the stage's spec of the batch
    leaves' leading dim, else the `data` axis when the mesh has one. Raises RunError when the
    microbatch does not divide among them."""
    axes: tuple[str, ...] = ()
    for p in parameters:
        if traced.arg_of(p.index) == 2 and p.spec and p.spec[0]:
            axes = tuple(p.spec[0])
            break
    if not axes and DATA_AXIS in mesh_axes:
        axes = (DATA_AXIS,)
    unknown = [a for a in axes if a not in mesh_axes]
    if unknown:
        raise RunError(f"the plan splits the batch on mesh axes {unknown}, which the stage mesh {dict(mesh_axes)} "
                       "does not have")
    ways = 1
    for a in axes:
        ways *= mesh_axes[a]
    if not splits_batch(microbatch, 1, ways):
        raise RunError(f"a microbatch of {microbatch} examples cannot be split over the {ways} devices of mesh axes "
                       f"{list(axes)} inside a stage; use fewer microbatches or a larger batch")
    return axes
