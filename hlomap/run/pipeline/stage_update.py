"""Run the part of a train step around its marked gradient per stage.

Everything outside the marked `value_and_grad` (the optimizer update, metrics) runs on each
stage with that stage's state, as in Megatron-LM and DeepSpeed's pipeline engines: stage s
updates the parameters its loss equations read, with their gradients and the optimizer state
that goes with them. Which optimizer-state leaf goes with which parameter is not declared
anywhere; it is read off the step by following values through it:

- A value's *home* is the set of stages that hold it; the empty set means "any stage" (the
  loss, batch leaves, constants). Parameters, other state the loss reads and their gradients
  live on the stages whose loss equations read them; aux outputs on the stage computing them.
- An equation's home is the one home among its operands'; operands of two different homes mean
  the step combines state of two stages (a global gradient norm, say) and cannot run per stage
  (SplitError, naming the equation and both values).
- A state leaf the loss does not read (Adam's `mu`, `nu`, the step count) lives where its new
  value is computed: `mu` of a parameter with that parameter, the count on every stage.

Then stage s runs the equations needed for the state it keeps and for the other outputs homed
on it (outputs homed anywhere, such as the loss, are computed by the last stage).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hlomap.run.errors import SplitError
from hlomap.run.pipeline.loss_split import LossSplit
from hlomap.run.program import describe_eqn, free_vars, is_literal, jaxpr_function, needed_eqns
from hlomap.run.trace import TracedStep

__all__ = ["Source", "UpdateInput", "UpdatePlan", "UpdateProgram", "plan_update"]

#: A home is a frozenset of stage indices; the empty set means any stage.
ANYWHERE: frozenset[int] = frozenset()


class Source(enum.Enum):
    """Where an input of a stage's update comes from."""

    STATE = "state"  # a state leaf the stage keeps (flat step argument index)
    ARGUMENT = "argument"  # a non-state argument of the step, whole (batch, rest)
    LOSS = "loss"  # the loss (mean over microbatches)
    AUX = "aux"  # aux output j of the marked function (mean over microbatches)
    GRAD = "grad"  # gradient leaf g of the marked call


@dataclass(frozen=True)
class UpdateInput:
    """One input of a stage's update program."""

    source: Source
    index: int  # flat argument index (STATE, ARGUMENT), aux or gradient number; 0 for LOSS


@dataclass(frozen=True, eq=False)
class UpdateProgram:
    """One stage's part of the step outside the marked call: `run(*inputs) -> outputs`."""

    stage: int
    inputs: tuple[UpdateInput, ...]
    outputs: tuple[int, ...]  # flat step result indices
    run: Callable[..., list[Any]]


@dataclass(frozen=True, eq=False)
class UpdatePlan:
    """Where every state leaf lives and each stage's update program.

    residence[i]: the stages holding state leaf i (params then opt_state leaves, flat).
    owner[o]: the stage returning non-state result o.
    """

    residence: tuple[frozenset[int], ...]
    owner: dict[int, int]
    programs: tuple[UpdateProgram, ...]


def plan_update(traced: TracedStep, split: LossSplit, *, widen: bool = False) -> UpdatePlan:
    """Homes and per-stage update programs (module docstring). `widen`: a value held by several
    stages is held by all (the spmd executor keeps such leaves in every stage's row)."""
    n_stages = split.n_stages
    every = frozenset(range(n_stages))

    def widened(home: frozenset[int]) -> frozenset[int]:
        return every if widen and len(home) > 1 else home

    jaxpr = traced.step.jaxpr
    marker = jaxpr.eqns[traced.marker]
    n_state = traced.state_leaves
    homes: dict[Any, frozenset[int]] = {}
    origin: dict[Any, str] = {}
    inputs: dict[Any, UpdateInput] = {}
    unknown: list[int] = []
    for leaf, v in enumerate(jaxpr.invars):
        if leaf < n_state:
            inputs[v] = UpdateInput(Source.STATE, leaf)
            if leaf in split.readers:
                homes[v] = widened(split.readers[leaf])
                origin[v] = traced.paths[leaf]
            else:
                unknown.append(leaf)
        else:
            inputs[v] = UpdateInput(Source.ARGUMENT, leaf)
            homes[v] = ANYWHERE
    loss_out, aux_out, grad_out = marker.outvars[0], marker.outvars[1:1 + traced.n_aux], marker.outvars[1 + traced.n_aux:]
    inputs[loss_out] = UpdateInput(Source.LOSS, 0)
    homes[loss_out] = ANYWHERE
    for j, (v, source) in enumerate(zip(aux_out, split.aux)):
        inputs[v] = UpdateInput(Source.AUX, j)
        if source.stage is not None:
            homes[v], origin[v] = frozenset({source.stage}), f"aux output {j}"
        elif source.loss_input is not None and traced.loss_inputs[source.loss_input].leaf is not None:
            leaf = traced.loss_inputs[source.loss_input].leaf
            homes[v] = widened(split.readers.get(leaf, ANYWHERE)) if leaf < n_state else ANYWHERE
            origin[v] = traced.paths[leaf]
        else:
            homes[v] = ANYWHERE
    for g, (v, position) in enumerate(zip(grad_out, traced.grads)):
        inputs[v] = UpdateInput(Source.GRAD, g)
        leaf = traced.loss_inputs[position].leaf
        homes[v] = widened(split.readers.get(leaf, ANYWHERE))
        origin[v] = f"the gradient of {traced.paths[leaf]}"

    others = [e for i, e in enumerate(jaxpr.eqns) if i != traced.marker]
    _propagate(others, homes, origin)
    for leaf in unknown:  # state the loss does not read lives where its new value is made
        out = jaxpr.outvars[leaf]
        home = ANYWHERE if is_literal(out) else homes.get(out, ANYWHERE)
        homes[jaxpr.invars[leaf]] = home
        origin[jaxpr.invars[leaf]] = traced.paths[leaf]
    _propagate(others, homes, origin)

    residence = []
    for leaf in range(n_state):
        held = homes[jaxpr.invars[leaf]] or every
        out = jaxpr.outvars[leaf]
        made = ANYWHERE if is_literal(out) else homes.get(out, ANYWHERE)
        if made and made != held:
            raise SplitError(f"{traced.paths[leaf]} is held by stage(s) {_stages(held)} but its new value is computed "
                             f"from {origin.get(out, 'values')} of stage(s) {_stages(made)}; a per-stage update cannot "
                             "produce it")
        residence.append(held)
    owner = {}
    for o, v in enumerate(jaxpr.outvars):
        if o >= n_state:
            home = ANYWHERE if is_literal(v) else homes.get(v, ANYWHERE)
            owner[o] = min(home) if home else n_stages - 1
    programs = tuple(_program(s, traced, others, homes, origin, inputs, residence, owner)
                     for s in range(n_stages))
    return UpdatePlan(tuple(residence), owner, programs)


def _stages(home: frozenset[int]) -> str:
    return ", ".join(str(s) for s in sorted(home))


def _propagate(eqns: Sequence[Any], homes: dict[Any, frozenset[int]], origin: dict[Any, str]) -> None:
    for eqn in eqns:
        home, why = ANYWHERE, ""
        for v in eqn.invars:
            if is_literal(v):
                continue
            h = homes.get(v, ANYWHERE)
            if not h:
                continue
            if home and h != home:
                raise SplitError(f"{describe_eqn(eqn)} combines {why} (stage(s) {_stages(home)}) with "
                                 f"{origin.get(v, 'a value')} (stage(s) {_stages(h)}); the step cannot run per stage "
                                 "(a global reduction over the gradients, such as clip_by_global_norm, needs every "
                                 "stage's values)")
            home, why = h, origin.get(v, "a value")
        for v in eqn.outvars:
            homes[v] = home
            if home:
                origin[v] = why


def _program(stage: int, traced: TracedStep, eqns: Sequence[Any], homes: dict[Any, frozenset[int]],
             origin: dict[Any, str], inputs: dict[Any, UpdateInput], residence: Sequence[frozenset[int]],
             owner: dict[int, int]) -> UpdateProgram:
    jaxpr = traced.step.jaxpr
    wanted = [o for o, v in enumerate(jaxpr.outvars)
              if (stage in residence[o] if o < traced.state_leaves else owner[o] == stage)]
    outvars = [jaxpr.outvars[o] for o in wanted]
    chosen = [eqns[i] for i in needed_eqns(eqns, outvars)]
    for eqn in chosen:
        home = homes.get(eqn.outvars[0], ANYWHERE) if eqn.outvars else ANYWHERE
        if home and stage not in home:
            raise SplitError(f"stage {stage} would have to compute {describe_eqn(eqn)}, which needs "
                             f"{origin.get(eqn.outvars[0], 'values')} of stage(s) {_stages(home)}")
    consts = dict(zip(jaxpr.constvars, traced.step.consts))
    free = [v for v in free_vars(chosen, outvars) if v not in consts]
    needed = []
    for v in free:
        item = inputs.get(v)
        if item is None:
            raise SplitError(f"stage {stage}'s update reads a value the step computes inside the marked call; "
                             "this is a bug in the split")
        if item.source is Source.STATE and stage not in residence[item.index]:
            raise SplitError(f"stage {stage}'s update reads {traced.paths[item.index]}, which stage(s) "
                             f"{_stages(residence[item.index])} hold")
        home = homes.get(v, ANYWHERE)
        if item.source in (Source.GRAD, Source.AUX) and home and stage not in home:
            raise SplitError(f"stage {stage}'s update reads {origin.get(v, 'a value')}, which stage(s) "
                             f"{_stages(home)} compute")
        needed.append(item)
    used = {v: consts[v] for v in free_vars(chosen, outvars) if v in consts}
    run = jaxpr_function(chosen, free, outvars, used)
    return UpdateProgram(stage, tuple(needed), tuple(wanted), run)
