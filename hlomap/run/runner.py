"""`hlomap.parallelize(train_step, plan)`: any plan hlomap finds, as a runnable step.

    step = hlomap.parallelize(train_step, plan)          # same signature as train_step
    params, opt_state = step.place(params, opt_state)    # optional: put the state where the plan wants it
    params, opt_state, loss = step(params, opt_state, batch)   # the user's pytrees in and out, any plan
    params, opt_state = step.gather(params, opt_state)   # as numpy arrays on the host

SPMD plans run as `jax.jit` with the plan's shardings (`spmd`). Pipeline plans run with one of
two executors, picked by the plan's schedule unless `executor=` says otherwise:

- `Executor.SPMD` (`pipeline.spmd_executor`): GPipe as one SPMD program; runs across processes.
- `Executor.MPMD` (`pipeline.mpmd_executor`): one program per stage and a Python scheduler; any
  schedule (1F1B by default for 1F1B plans); one controller process.

A pipelined step marks its loss with `hlomap.value_and_grad` (`hlomap.run.grad`). The runner
needs the batch's shapes to cut the step, so for pipeline plans `place` keeps the state as given
until the first call (or give `example_args` to `parallelize`).
"""

from __future__ import annotations

import contextlib
import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax

from hlomap.cost.pipeline.stages import Schedule, default_executor
from hlomap.run.errors import RunError
from hlomap.run.pipeline.cuts import CutMapping
from hlomap.run.pipeline.prepare import PipelineProgram, prepare
from hlomap.run.pipeline.section import STAGE_AXIS, pipeline_section
from hlomap.run.program import describe_eqn
from hlomap.run.spmd import SpmdStep
from hlomap.verify.mesh import DeviceError, device_positions, ordered_devices

__all__ = ["Executor", "ParallelStep", "RunnerDescription", "StageDescription", "parallelize"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _devices_as_run_errors() -> Iterator[None]:
    """Too few devices for the plan, or a placement on devices JAX does not see, is the user's
    error like every other the runner reports: a RunError."""
    try:
        yield
    except DeviceError as err:
        raise RunError(str(err)) from None


class Executor(enum.Enum):
    """How a pipeline plan runs (module docstring)."""

    SPMD = "spmd"  # one SPMD program over a `stage` axis, GPipe, multi-host
    MPMD = "mpmd"  # one program per stage, any schedule, single controller

    @classmethod
    def parse(cls, value: Executor | str) -> Executor:
        """An executor from its name, or a RunError listing the names (an argument of
        `parallelize`, so a typo is the user's and gets a sentence, not a bare ValueError)."""
        try:
            return cls(value)
        except ValueError:
            raise RunError(f"unknown executor {value!r}; the pipeline executors are "
                           f"{', '.join(e.value for e in cls)}") from None


def choose_executor(schedule: Schedule, uniform: bool, requested: Executor | str | None,
                    repeats: int = 1, splits_state: bool = False, recomputes: bool = False,
                    layered_recompute: bool = False) -> Executor:
    """GPipe runs on the spmd executor unless the stages' meshes differ, a stage splits its
    optimizer state over its data axis (`splits_state`: inside the spmd executor's one program
    XLA would reshard it between stages), a stage recomputes (`recomputes`: the joint planner
    prices recomputing stages on the mpmd executor; `layered_recompute`, a stage checkpointed
    layer by layer, runs there only, as the spmd executor rematerializes whole stage calls) or
    the mpmd one is asked for; 1F1B, interleaved 1F1B and ZB-H1 need the mpmd executor; a
    circular pipeline (gpipe with `repeats` > 1) runs on the spmd executor only."""
    if layered_recompute and requested is not None and Executor.parse(requested) is Executor.SPMD:
        raise RunError("the spmd executor recomputes a stage as a whole; this plan checkpoints stages layer by layer "
                       "(their recompute_cuts): use the mpmd executor")
    if (recomputes or layered_recompute) and requested is None and repeats == 1:
        return Executor.MPMD
    if splits_state:
        if repeats > 1 and schedule is Schedule.GPIPE:
            raise RunError("a circular pipeline runs on the spmd executor, which cannot keep a stage's optimizer "
                           "state split over its data axis; drop the stages' state_axes (and their specs' data splits)")
        if requested is not None and Executor.parse(requested) is Executor.SPMD:
            raise RunError("the spmd executor cannot keep a stage's optimizer state split over its data axis (XLA "
                           "reshards it between stages inside its one program); use the mpmd executor")
        return Executor.MPMD
    if repeats > 1 and schedule is Schedule.GPIPE:
        if not uniform:
            raise RunError(f"a circular pipeline (repeats {repeats}) runs on the spmd executor, which needs every "
                           "stage to have the same mesh and parameter specs; this plan's stages differ")
        if requested is not None and Executor.parse(requested) is Executor.MPMD:
            raise RunError(f"the mpmd executor does not run circular pipelines (gpipe with repeats {repeats}); use the "
                           "spmd executor, or the interleaved-1f1b schedule on the mpmd executor")
        return Executor.SPMD
    if requested is not None:
        executor = Executor.parse(requested)
        if executor is Executor.SPMD and schedule is not Schedule.GPIPE:
            raise RunError(f"the spmd executor runs GPipe only; a plan with schedule {schedule.value} needs the mpmd executor")
        if executor is Executor.SPMD and not uniform:
            raise RunError("the spmd executor needs every stage to have the same mesh and parameter specs; this "
                           "plan's stages differ, use the mpmd executor")
        return executor
    return Executor(default_executor(schedule, uniform, repeats))


@dataclass(frozen=True)
class StageDescription:
    index: int
    devices: tuple[int, ...]  # positions in jax.devices() of the devices it runs on (as a placement names them)
    mesh: dict[str, int]
    first: str  # the first and last of the stage's own loss equations
    last: str
    parameters: int  # trainable leaves the stage reads
    receives: tuple[str, ...]  # shapes of what crosses into the stage
    sends: tuple[str, ...]


@dataclass(frozen=True)
class RunnerDescription:
    """What `parallelize` built, for reports (the CLI renders it)."""

    kind: str  # "spmd" or "pipeline"
    devices: int
    mesh: dict[str, int]
    executor: str | None = None
    microbatches: int | None = None
    schedule: str | None = None
    stages: tuple[StageDescription, ...] = ()  # logical stages (more than device stages when circular)
    cuts: tuple[CutMapping, ...] = ()
    matched_equations: tuple[int, int] | None = None  # (matched, of the loss's own)
    notes: tuple[str, ...] = field(default=())
    repeats: int = 1

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "devices": self.devices, "mesh": self.mesh, "executor": self.executor,
            "microbatches": self.microbatches, "schedule": self.schedule, "repeats": self.repeats,
            "stages": [{"index": s.index, "devices": list(s.devices), "mesh": s.mesh, "first": s.first,
                        "last": s.last, "parameters": s.parameters, "receives": list(s.receives),
                        "sends": list(s.sends)} for s in self.stages],
            "cuts": [c.to_json() for c in self.cuts],
            "matched_equations": list(self.matched_equations) if self.matched_equations else None,
            "notes": list(self.notes),
        }


def positional_arguments(step: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    """`args` and `kwargs` of a call of `step` as positional arguments, in its signature's order:
    a parallel step takes what the train step takes, and runs it on flat positional leaves. A
    call the train step would refuse raises its TypeError, named after the step."""
    if not kwargs:
        return args
    import inspect

    name = getattr(step, "__name__", type(step).__name__)
    try:
        bound = inspect.signature(step).bind(*args, **kwargs)
    except TypeError as err:
        raise TypeError(f"{name}(): {err}") from None
    except ValueError:  # no signature to read (a builtin): the step is called as given
        raise TypeError(f"{name}(): pass its arguments by position (its signature cannot be read)") from None
    if bound.kwargs:
        raise TypeError(f"{name}(): keyword-only arguments {sorted(bound.kwargs)} cannot be sharded by position; "
                        "make them positional")
    return tuple(bound.args)


class ParallelStep:
    """A train step under a plan (module docstring). Build with `parallelize`."""

    def __init__(self, step: Callable[..., Any], plan: Any, *, executor: Executor | str | None = None,
                 devices: Sequence[Any] | None = None, example_args: Sequence[Any] | None = None,
                 compiler_options: Mapping[str, Any] | None = None, check_source: bool = True):
        self.step = step
        self.check_source = check_source  # off only to re-run a float32 plan in float64 (same instructions)
        self.compiler_options = dict(compiler_options or {})
        self.plan = plan
        with _devices_as_run_errors():
            self.order = ordered_devices(plan, devices)
        self.section = pipeline_section(plan) if plan.pipeline is not None else None
        self.executor: Executor | None = None
        if self.section is not None:
            self.executor = choose_executor(self.section.schedule, self.section.uniform, executor,
                                            self.section.repeats, self.section.splits_state,
                                            bool(self.section.recompute), self.section.layered_recompute)
            if self.executor is Executor.MPMD and jax.process_count() > 1:
                raise RunError(f"the mpmd executor is single-controller: one Python process drives every stage, but "
                               f"{jax.process_count()} processes run; use the spmd executor (GPipe) across hosts")
        elif executor is not None:
            raise RunError(f"executor {Executor.parse(executor).value!r} applies to pipeline plans; this plan has no "
                           "pipeline section")
        with _devices_as_run_errors():
            self._spmd = SpmdStep(step, plan, self.order, self.compiler_options) if self.section is None else None
        self._runner: Any = None
        if example_args is not None and self.section is not None:
            self._build(example_args)

    # -- building ---------------------------------------------------------------------------------
    @property
    def program(self) -> PipelineProgram | None:
        return None if self._runner is None else self._runner.program

    def _build(self, args: Sequence[Any]) -> None:
        from hlomap.hlo.capture import capture

        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tuple(args))
        cap = capture(self.step, *abstract)
        difference = self.plan.source.mismatch(cap) if self.check_source else None
        if difference is not None:
            raise RunError(f"the plan was made for another module than this step ({difference}): the step, its "
                           "argument shapes or the JAX version changed; explore again")
        assert self.section is not None
        program = prepare(self.step, abstract, cap, self.section, widen=self.executor is Executor.SPMD)
        with _devices_as_run_errors():
            if self.executor is Executor.SPMD:
                from hlomap.run.pipeline.spmd_executor import SpmdPipeline

                self._runner = SpmdPipeline(program, self.order, self.compiler_options)
            else:
                from hlomap.run.pipeline.mpmd_executor import MpmdPipeline

                self._runner = MpmdPipeline(program, self.order, self.compiler_options)

    # -- the step ---------------------------------------------------------------------------------
    def place(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """The user's pytrees where the plan wants them: SPMD plans by the plan's shardings, pipeline
        plans each leaf on its home stage (before the first call of a pipeline plan, as given: the
        first call lays them out)."""
        if self._spmd is not None:
            return self._spmd.place(params, opt_state)
        if self._runner is None:
            return params, opt_state
        return self._runner.place(params, opt_state)

    def _ready(self, params: Any, opt_state: Any, rest: Sequence[Any]) -> None:
        """Cut the step at its first call (the batch's shapes decide the microbatches)."""
        if self._runner is None:
            self._build((params, opt_state, *rest))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args = positional_arguments(self.step, args, kwargs)
        if len(args) < 2:
            raise TypeError(f"a parallel step is called as the train step: params, optimizer state, then the rest; "
                            f"got {len(args)} argument(s)")
        params, opt_state, *rest = args
        if self._spmd is not None:
            return self._spmd(params, opt_state, *rest)
        self._ready(params, opt_state, rest)
        return self._runner(params, opt_state, *rest)

    def direct(self) -> Callable[..., Any] | None:
        """What the last call ran when it is the whole step (an SPMD plan: `SpmdStep.direct`);
        None for a pipeline plan, whose executor is the step."""
        return self._spmd.direct() if self._spmd is not None else None

    def gather(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """The user's pytrees of params and opt_state, as numpy arrays on the host."""
        if self._spmd is not None:
            return self._spmd.gather(params, opt_state)
        if self._runner is None:
            return jax.tree.map(_host, params), jax.tree.map(_host, opt_state)
        return self._runner.gather(params, opt_state)

    def arg_shardings(self, args: Sequence[Any]) -> tuple[Any, ...]:
        """SPMD plans: the NamedSharding pytree of every argument (the plan's specs)."""
        if self._spmd is None:
            raise RunError("arg_shardings applies to SPMD plans; a pipeline plan's stages have their own")
        return self._spmd.arg_shardings(args)

    def value_and_grad(self, params: Any, opt_state: Any, *rest: Any) -> tuple[Any, list[Any], list[Any]]:
        """(loss, aux leaves, gradient leaves) of the marked call as the pipeline computes them,
        before the optimizer (host arrays); for checking numerics."""
        if self._spmd is not None:
            raise RunError("value_and_grad of the runner applies to pipeline plans")
        self._ready(params, opt_state, rest)
        return self._runner.value_and_grad(params, opt_state, *rest)

    def describe(self, example_args: Sequence[Any] | None = None) -> RunnerDescription:
        """What runs where; pipeline plans need the step cut (after a call, or `example_args`)."""
        if self._spmd is not None:
            mesh = dict(self._spmd.mesh.shape)
            return RunnerDescription("spmd", self._spmd.mesh.devices.size, mesh)
        if self._runner is None:
            if example_args is None:
                raise RunError("describe() of a pipeline step needs example_args before the first call")
            self._build(example_args)
        return _describe(self._runner, self.section, self.executor, self.order)


def _host(x: Any) -> Any:
    import numpy as np

    return np.asarray(x)


def _describe(runner: Any, section: Any, executor: Executor, order: Sequence[Any]) -> RunnerDescription:
    program: PipelineProgram = runner.program
    eqns = program.traced.loss.jaxpr.eqns
    stages = []
    for stage in program.split.stages:
        ids, inner = section.devices[stage.index % section.n_stages], section.inner[stage.index % section.n_stages]
        trainable = {program.traced.loss_inputs[p].leaf for p in stage.params}
        stages.append(StageDescription(
            stage.index, device_positions([order[i] for i in ids]), dict(inner),
            describe_eqn(eqns[stage.first]) if stage.first is not None else "-",
            describe_eqn(eqns[stage.last]) if stage.last is not None else "-",
            len(trainable), tuple(v.aval.str_short() for v in stage.receives),
            tuple(v.aval.str_short() for v in stage.sends)))
    mesh = {STAGE_AXIS: section.n_stages, **dict(section.inner[0])} if section.uniform else {STAGE_AXIS: section.n_stages}
    return RunnerDescription(
        "pipeline", sum(len(ids) for ids in section.devices), mesh, executor.value, section.microbatches,
        section.schedule.value, tuple(stages), program.assignment.cuts,
        (program.assignment.matched, program.assignment.on_loss), program.assignment.notes, section.repeats)


def parallelize(train_step: Callable[..., Any], plan: Any, *, executor: Executor | str | None = None,
                devices: Sequence[Any] | None = None, example_args: Sequence[Any] | None = None,
                compiler_options: Mapping[str, Any] | None = None) -> ParallelStep:
    """Run `train_step` under `plan` (module docstring).

    executor: for pipeline plans, "spmd" (A) or "mpmd" (B); default by the plan's schedule.
    devices: the device order plan device ids index (default: the plan's placement, else
      `jax.devices()`).
    example_args: arguments (real or `jax.ShapeDtypeStruct`) to cut a pipelined step now rather
      than at its first call.
    compiler_options: XLA options for every program the runner compiles (`jax.jit`'s).

    `plan` may also be a saved plan's path (`Plan.load`).
    """
    from pathlib import Path

    from hlomap.plan import Plan

    if not callable(train_step):
        raise TypeError(f"parallelize: train_step must be the step function, got {type(train_step).__name__}")
    if isinstance(plan, (str, Path)):
        if not Path(plan).is_file():
            raise FileNotFoundError(f"parallelize: no plan file {str(plan)!r} (give a path saved by hlomap explore or "
                                    "Plan.save, or a Plan: hlomap.explore's, Plan.load's, Plan.from_specs')")
        plan = Plan.load(plan)
    if not isinstance(plan, Plan):
        raise TypeError(f"parallelize: plan must be a hlomap.Plan or a plan file's path, got {type(plan).__name__}")
    return ParallelStep(train_step, plan, executor=executor, devices=devices, example_args=example_args,
                        compiler_options=compiler_options)
