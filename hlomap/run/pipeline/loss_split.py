"""Cut the loss jaxpr into stage programs.

Stage s runs the loss equations after cut s - 1 up to and including cut s (`cuts.map_cuts`).
Values a later stage reads cross the cuts in between: stage s receives what crosses cut s - 1
and sends what crosses cut s (a value read two stages later passes through the stage between,
as the encoder output of an encoder-decoder does). Three kinds of values never cross:

- parameters and other state: every stage that reads a leaf holds its own copy (a leaf read by
  two stages, such as a tied embedding, is held by both and its gradients are summed);
- batch leaves and constants: every stage gets the microbatch;
- values computed from batch leaves and constants alone (masks, one-hot targets, positions):
  every stage that reads one recomputes it instead of receiving it, as Megatron does with its
  attention masks. Only values that depend on parameters travel between stages.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hlomap.run.errors import SplitError
from hlomap.run.program import describe_eqn, free_vars, is_literal, jaxpr_function, needed_eqns
from hlomap.run.trace import InputKind, TracedStep

__all__ = ["AuxSource", "LossSplit", "StageProgram", "checkpointed_layers", "split_loss"]

#: Loss inputs every stage can be given (not state the stage keeps).
_SHARED_KINDS = frozenset({InputKind.DATA, InputKind.BROADCAST, InputKind.CONST})


@dataclass(frozen=True, eq=False)
class StageProgram:
    """The loss equations of one stage as a function of what the stage holds and receives.

    run(params, state, data, received) -> (sent, aux, loss): params/state/data are tuples of the
    loss inputs listed in `params`/`state`/`data` (positions among the loss inputs), received and
    sent follow `receives`/`sends`, aux the aux outputs listed in `aux`; loss is None except on
    the stage that computes it.
    """

    index: int
    params: tuple[int, ...]
    state: tuple[int, ...]
    data: tuple[int, ...]
    receives: tuple[Any, ...]
    sends: tuple[Any, ...]
    aux: tuple[int, ...]
    computes_loss: bool
    own: tuple[int, ...]  # the stage's own loss equations (indices)
    run: Callable[..., tuple[tuple[Any, ...], tuple[Any, ...], Any]]
    #: `run` checkpoints the stage's layers one by one (`checkpointed_layers`): the executor
    #: must not checkpoint the stage again as a whole
    checkpointed: bool = False

    @property
    def first(self) -> int | None:
        return self.own[0] if self.own else None

    @property
    def last(self) -> int | None:
        return self.own[-1] if self.own else None


@dataclass(frozen=True)
class AuxSource:
    """Where aux output j comes from: a stage's program, a loss input passed through, or a
    constant."""

    stage: int | None = None
    loss_input: int | None = None
    constant: Any = None


@dataclass(frozen=True, eq=False)
class LossSplit:
    """The stage programs of a loss, and which stages hold which state leaves."""

    stages: tuple[StageProgram, ...]
    aux: tuple[AuxSource, ...]
    #: flat step leaf -> stages whose loss equations read it (params and other state)
    readers: dict[int, frozenset[int]]

    @property
    def n_stages(self) -> int:
        return len(self.stages)


def split_loss(traced: TracedStep, stage_of: Sequence[int], n_stages: int) -> LossSplit:
    """Stage programs when loss equation i runs on stage `stage_of[i]` (`cuts.assign_stages`)."""
    jaxpr = traced.loss.jaxpr
    eqns = list(jaxpr.eqns)
    inputs = {v: item for v, item in zip(jaxpr.invars, traced.loss_inputs)}
    position = {v: i for i, v in enumerate(jaxpr.invars)}
    if len(stage_of) != len(eqns) or any(not 0 <= s < n_stages for s in stage_of):
        raise SplitError(f"a stage assignment of {len(stage_of)} equations to stages 0..{n_stages - 1} does not "
                         f"fit a loss of {len(eqns)} equations")

    replicable: set[Any] = {v for v, item in inputs.items() if item.kind in _SHARED_KINDS}
    bound: list[bool] = []  # per equation: reads something stage-specific
    for eqn in eqns:
        is_bound = any(not is_literal(v) and v not in replicable for v in eqn.invars)
        bound.append(is_bound)
        if not is_bound:
            replicable.update(eqn.outvars)

    defined = {v: stage_of[i] for i, eqn in enumerate(eqns) if bound[i] for v in eqn.outvars}
    last_reader: dict[Any, int] = {}
    readers: dict[int, set[int]] = {}
    needs: list[set[Any]] = [set() for _ in range(n_stages)]  # replicable values each stage reads
    for i, eqn in enumerate(eqns):
        if not bound[i]:
            continue
        s = stage_of[i]
        for v in eqn.invars:
            if is_literal(v):
                continue
            if v in defined:
                if defined[v] > s:
                    raise SplitError(f"{describe_eqn(eqn)} runs on stage {s} but reads a value of stage {defined[v]} "
                                     f"({_definer(eqns, v)}): stages may only read earlier stages")
                last_reader[v] = max(last_reader.get(v, s), s)
            elif v in inputs and inputs[v].kind in (InputKind.PARAM, InputKind.STATE):
                readers.setdefault(inputs[v].leaf, set()).add(s)
            else:
                needs[s].add(v)

    loss_var = jaxpr.outvars[0]
    if is_literal(loss_var) or loss_var not in defined:
        raise SplitError("the loss does not depend on the parameters (it is a constant or a function of the "
                         "batch alone); there is nothing to pipeline")
    last = n_stages - 1
    last_reader[loss_var] = last
    aux_sources = []
    aux_of_stage: list[list[int]] = [[] for _ in range(n_stages)]
    for j, v in enumerate(jaxpr.outvars[1:]):
        if is_literal(v):
            aux_sources.append(AuxSource(constant=v.val))
        elif v in inputs:
            aux_sources.append(AuxSource(loss_input=position[v]))
        elif v in defined:
            aux_sources.append(AuxSource(stage=defined[v]))
            aux_of_stage[defined[v]].append(j)
        else:  # made of batch leaves and constants: the last stage computes it
            aux_sources.append(AuxSource(stage=last))
            aux_of_stage[last].append(j)
            needs[last].add(v)

    crossing = [[v for v in defined if defined[v] <= c < last_reader.get(v, -1)] for c in range(n_stages - 1)]
    stages = []
    for s in range(n_stages):
        receives = tuple(crossing[s - 1]) if s > 0 else ()
        sends = tuple(crossing[s]) if s < last else ()
        aux_vars = [jaxpr.outvars[1 + j] for j in aux_of_stage[s]]
        outvars = list(sends) + aux_vars + ([loss_var] if s == last else [])
        own = [i for i in range(len(eqns)) if bound[i] and stage_of[i] == s]
        replicated = needed_eqns(eqns, needs[s])
        chosen = sorted(set(own) | set(replicated))
        free = free_vars((eqns[i] for i in chosen), outvars)
        received = set(receives)
        stray = [v for v in free if v not in received and v not in inputs]
        if stray:
            raise SplitError(f"stage {s} reads a value no stage sends it (defined by "
                             f"{_definer(eqns, stray[0])}); this is a bug in the stage split")
        params = tuple(position[v] for v in free if v in inputs and inputs[v].kind is InputKind.PARAM)
        state = tuple(position[v] for v in free if v in inputs and inputs[v].kind is InputKind.STATE)
        data = tuple(position[v] for v in free
                     if v in inputs and inputs[v].kind in (InputKind.DATA, InputKind.BROADCAST))
        consts = {v: inputs[v].value for v in free if v in inputs and inputs[v].kind is InputKind.CONST}
        invars = [jaxpr.invars[p] for p in params + state + data] + list(receives)
        run = _stage_function(jaxpr_function([eqns[i] for i in chosen], invars, outvars, consts),
                              len(sends), len(aux_vars), s == last)
        stages.append(StageProgram(s, params, state, data, receives, sends, tuple(aux_of_stage[s]), s == last,
                                   tuple(own), run))
    return LossSplit(tuple(stages), tuple(aux_sources), {k: frozenset(v) for k, v in readers.items()})


def _definer(eqns: Sequence[Any], v: Any) -> str:
    for eqn in eqns:
        if v in eqn.outvars:
            return describe_eqn(eqn)
    return "an input"


def _stage_function(fn: Callable[..., list[Any]], n_sends: int, n_aux: int,
                    computes_loss: bool) -> Callable[..., tuple[tuple[Any, ...], tuple[Any, ...], Any]]:
    def run(params: Sequence[Any], state: Sequence[Any], data: Sequence[Any],
            received: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...], Any]:
        out = fn(*params, *state, *data, *received)
        sent, aux = tuple(out[:n_sends]), tuple(out[n_sends:n_sends + n_aux])
        return sent, aux, out[-1] if computes_loss else None

    return run


def checkpointed_layers(stage: StageProgram, layers: Sequence[StageProgram], policy: Any) -> StageProgram:
    """`stage` run as `layers`, the programs of its equations split at the cuts between its layers
    (`split_loss` of a finer assignment), each under `jax.checkpoint` with `policy`: the backward
    keeps every layer's inputs (and what the policy saves) and runs one layer's forward again at a
    time, where checkpointing the stage whole runs all of it again at once. Raises SplitError when
    the layers do not run exactly the stage's equations."""
    import jax

    own = sorted(i for layer in layers for i in layer.own)
    if own != sorted(stage.own):
        raise SplitError(f"the layers of stage {stage.index} run {len(own)} loss equations, the stage {len(stage.own)}: "
                         "its recompute cuts do not split the stage's equations")
    runs = [jax.checkpoint(layer.run, policy=policy) for layer in layers]

    def run(params: Sequence[Any], state: Sequence[Any], data: Sequence[Any],
            received: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...], Any]:
        inputs = dict(zip(stage.params, params)) | dict(zip(stage.state, state)) | dict(zip(stage.data, data))
        values = dict(zip(stage.receives, received))
        aux: dict[int, Any] = {}
        loss = None
        for layer, layer_run in zip(layers, runs):
            sent, layer_aux, layer_loss = layer_run(tuple(inputs[p] for p in layer.params),
                                                    tuple(inputs[p] for p in layer.state),
                                                    tuple(inputs[p] for p in layer.data),
                                                    tuple(values[v] for v in layer.receives))
            values = dict(zip(layer.sends, sent))
            aux |= dict(zip(layer.aux, layer_aux))
            loss = layer_loss if layer.computes_loss else loss
        return tuple(values[v] for v in stage.sends), tuple(aux[j] for j in stage.aux), loss

    return dataclasses.replace(stage, run=run, checkpointed=True)
