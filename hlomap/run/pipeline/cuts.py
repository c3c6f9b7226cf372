"""From the HLO cuts of a pipeline plan to the equations of the loss jaxpr.

The pipeline explorer cuts the forward chain of the step's HLO after an instruction (the plan
records its name, layer name, nearest scope and `file:line`): chain instructions up to the
first cut are stage 0, and so on. The runner assigns every equation of the loss jaxpr to a
stage the same way, by finding each equation's HLO instruction:

- HLO metadata is made from the equation (`hlomap.run.program`), so an instruction and its
  equation share a key `(layer, file:line)` and the output shape.
- Among the equations the loss depends on with one key and shape, the j-th in program order is
  the j-th of the chain instructions with that key, shape and opcode, ordered by the numeric
  suffix of their names (the HLO converter numbers each name in program order, which is the
  jaxpr's order). Of several opcodes the one with as many instructions as there are equations
  is the equation's own op (broadcasts and reshapes of its operands share its metadata).
  Where no opcode fits (more equations than instructions), data flow decides: an instruction
  whose operands are the own ops of equations E belongs to the equation of its key and kind
  that reads E (`_match_by_operands`).
- An equation with no such instruction (one equation lowered to several ops of one kind, a
  custom-derivative call whose HLO is named after its inside), and every equation the loss does
  not depend on (batch-statistics updates), goes to the latest stage of the equations it reads.

A cut at a downset of a branching step's layer DAG (`PipelineCut.downset`) lists the runs of
chain instructions before it instead of a prefix: an instruction's stage is then the number of
cuts whose runs do not hold it.

The stages are then a partition of the jaxpr that follows the plan's instruction order, not a
prefix of the jaxpr's own order: XLA may order independent branches differently (T5's decoder
self-attention of layer 0 comes before the encoder in its HLO), and a prefix could not hold the
parameters the plan priced. A cut is exact when its instruction is an equation's own op; a cut
inside an equation (after a broadcast of an operand) or after an unmatched instruction snaps to
the nearest equation boundary, and the mapping says so. If a stage then reads other parameters
than its HLO instructions do, that is reported too.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from hlomap.hlo.source_info import source_location, source_tables
from hlomap.plan import Pipeline, PipelineCut
from hlomap.run.errors import RunError
from hlomap.run.program import describe_eqn, eqn_label, eqn_layer, eqn_source, is_literal, needed_eqns
from hlomap.run.trace import InputKind, TracedStep
from hlomap.cost.pipeline.chain import forward_chain, layer_name

if TYPE_CHECKING:
    from hlomap.hlo.capture import Capture

__all__ = ["CutMapping", "StageAssignment", "assign_stages", "cut_records"]

log = logging.getLogger(__name__)

_SUFFIX = re.compile(r"\.(\d+)$")


def cut_records(pipeline: Pipeline, where: str = "plan") -> tuple[PipelineCut, ...]:
    """The cuts of a plan's pipeline section, checked against its (logical) stage count."""
    cuts = pipeline.cuts
    stages, repeats = pipeline.n_stages, pipeline.repeats
    logical = stages * repeats
    if len(cuts) != logical - 1:
        what = (f"{stages} stage{'s' if stages != 1 else ''}" if repeats == 1
                else f"{stages} stages x {repeats} repeats = {logical} logical stages")
        need = f"{'needs' if logical == 1 else 'need'} {logical - 1} cut{'s' if logical != 2 else ''}"
        raise RunError(f"{where}: {what} {need}; the pipeline section has {len(cuts)}")
    return cuts


@dataclass(frozen=True)
class CutMapping:
    """Where one HLO cut lands in the loss jaxpr: `equation` (index `eqn`) is the equation of the
    cut instruction, or the last equation before the boundary when the cut has none of its own."""

    cut: PipelineCut
    eqn: int
    equation: str  # `layers_0/add (gpt.py:81)`
    exact: bool
    note: str = ""  # why the cut was snapped, when it was

    def to_json(self) -> dict[str, Any]:
        return {"instruction": self.cut.instruction, "layer": self.cut.layer, "scope": self.cut.scope,
                "source": self.cut.source, "equation_index": self.eqn, "equation": self.equation,
                "exact": self.exact, "note": self.note}


@dataclass(frozen=True)
class StageAssignment:
    """Every loss equation's stage, how each cut mapped, and what did not match."""

    stage_of_eqn: tuple[int, ...]
    cuts: tuple[CutMapping, ...]
    matched: int  # equations the loss depends on that found their HLO instruction
    on_loss: int  # equations the loss depends on
    notes: tuple[str, ...] = ()  # parameter sets that differ from the plan's, per stage


def _suffix(name: str) -> int:
    match = _SUFFIX.search(name)
    return int(match.group(1)) if match else -1


def _dims(shape: Any) -> tuple[int, ...] | None:
    dims = getattr(shape, "dims", None)
    return tuple(dims) if dims is not None else None


def _out_shape(eqn: Any) -> tuple[int, ...] | None:
    for v in eqn.outvars:
        shape = getattr(v.aval, "shape", None)
        if shape is not None:
            return tuple(shape)
    return None


def _match(cap: Capture, traced: TracedStep, chain: Sequence[Any]) -> dict[int, int]:
    """Loss equation index -> chain position of its own HLO instruction (module docstring)."""
    tables = source_tables(cap.module)
    by_key: dict[tuple[Any, ...], list[int]] = {}
    for q, inst in enumerate(chain):
        key = (layer_name(inst.metadata), source_location(inst, tables), _dims(inst.shape))
        by_key.setdefault(key, []).append(q)
    eqns = traced.loss.jaxpr.eqns
    on_loss = needed_eqns(eqns, traced.loss.jaxpr.outvars[:1])
    by_eqn_key: dict[tuple[Any, ...], list[int]] = {}
    for i in on_loss:
        layer, source = eqn_layer(eqns[i]), eqn_source(eqns[i])
        # A call's own op is the HLO `call`, whose shape is a tuple of its results.
        called = eqn_label(eqns[i]) != eqns[i].primitive.name and (layer, source, None) in by_key
        by_eqn_key.setdefault((layer, source, None if called else _out_shape(eqns[i])), []).append(i)
    matched: dict[int, int] = {}
    ambiguous: list[tuple[list[int], list[int]]] = []
    for key, equations in by_eqn_key.items():
        positions = by_key.get(key, [])
        by_opcode: dict[str, list[int]] = {}
        for q in positions:
            by_opcode.setdefault(chain[q].opcode, []).append(q)
        fitting = [sorted(qs, key=lambda q: _suffix(chain[q].name)) for qs in by_opcode.values()
                   if len(qs) == len(equations)]
        if fitting:
            # The equation's own op is emitted after the broadcasts of its operands: highest numbers.
            own = max(fitting, key=lambda qs: sum(_suffix(chain[q].name) for q in qs))
            matched.update(zip(equations, own))
            continue
        ambiguous.append((equations, positions))
    _match_by_operands(chain, eqns, ambiguous, matched)
    return matched


#: The HLO opcode a primitive lowers to when it lowers to one op of its own (the common ones).
_OWN_OPCODE = {
    "add": "add", "sub": "subtract", "mul": "multiply", "div": "divide", "neg": "negate",
    "max": "maximum", "min": "minimum", "exp": "exponential", "log": "log", "tanh": "tanh",
    "logistic": "logistic", "rsqrt": "rsqrt", "sqrt": "sqrt", "abs": "abs", "erf": "erf",
    "pow": "power", "dot_general": "dot", "reshape": "reshape", "squeeze": "reshape",
    "expand_dims": "reshape", "broadcast_in_dim": "broadcast", "transpose": "transpose",
    "reduce_sum": "reduce", "reduce_max": "reduce", "reduce_min": "reduce",
    "convert_element_type": "convert", "select_n": "select", "concatenate": "concatenate",
    "slice": "slice", "dynamic_slice": "dynamic-slice", "gather": "gather",
    "conv_general_dilated": "convolution", "eq": "compare", "ne": "compare", "lt": "compare",
    "le": "compare", "gt": "compare", "ge": "compare",
}


def _match_by_operands(chain: Sequence[Any], eqns: Sequence[Any],
                       ambiguous: Sequence[tuple[Sequence[int], Sequence[int]]], matched: dict[int, int]) -> None:
    """Match what counting could not, by data flow: an instruction whose operands are the own
    ops of equations E is the own op of the one equation of its key and kind that reads E.

    A key can hold more equations than instructions: how finely JAX tells frames apart depends
    on the interpreter (a system Python counts site-packages as its standard library and gives a
    library's equations its caller's line), and an equation can lower to nothing. Rounds go on
    while they match something, since each match can resolve the operands of the next."""
    producer = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars}
    name_position = {inst.name: q for q, inst in enumerate(chain)}
    progress = True
    while progress:
        progress = False
        eqn_of_position = {q: i for i, q in matched.items()}
        for equations, positions in ambiguous:
            for q in positions:
                if q in eqn_of_position:
                    continue
                reads = {eqn_of_position.get(name_position.get(op, -1)) for op in chain[q].operands}
                if not reads or None in reads:
                    continue  # an operand that is no equation's own op says nothing
                candidates = [i for i in equations if i not in matched
                              and _OWN_OPCODE.get(eqns[i].primitive.name) == chain[q].opcode
                              and {producer.get(v) for v in eqns[i].invars if not is_literal(v)} - {None} == reads]
                if len(candidates) == 1:
                    matched[candidates[0]] = q
                    eqn_of_position[q] = candidates[0]
                    progress = True


def assign_stages(cap: Capture, traced: TracedStep, cuts: Sequence[PipelineCut]) -> StageAssignment:
    """The stage of every loss equation under a plan's HLO cuts (module docstring). Raises
    RunError when a cut names no forward instruction of `cap` or the cuts are out of order."""
    chain = forward_chain(cap.module.entry)
    tables = source_tables(cap.module)
    position = {inst.name: q for q, inst in enumerate(chain)}
    cut_positions = []
    for number, cut in enumerate(cuts):
        if cut.instruction not in position:
            raise RunError(f"cut {number} of the plan is after HLO instruction {cut.instruction!r} ({cut.layer}), "
                           f"which is not in the forward pass of {cap.source}; was the plan made for this step?")
        cut_positions.append(position[cut.instruction])
    chain_stage = _chain_stages(cuts, cut_positions, position, cap.source)

    def hlo_stage(q: int) -> int:
        return int(chain_stage[q])

    eqns = traced.loss.jaxpr.eqns
    matched = _match(cap, traced, chain)
    stages = _eqn_stages(eqns, {i: hlo_stage(q) for i, q in matched.items()})
    eqn_of_position = {q: i for i, q in matched.items()}
    mappings = []
    for number, (cut, q) in enumerate(zip(cuts, cut_positions)):
        inst = chain[q]
        own = eqn_of_position.get(q)
        if own is None and inst.opcode == "get-tuple-element" and inst.operands[0] in position:
            own = eqn_of_position.get(position[inst.operands[0]])  # unpacking a call's result
        if own is not None and stages[own] == number:
            mappings.append(CutMapping(cut, own, describe_eqn(eqns[own]), True))
            continue
        before = [i for i in range(len(eqns)) if stages[i] <= number]
        last = max(before) if before else 0
        key = (layer_name(inst.metadata), source_location(inst, tables))
        owner = next((i for i in range(len(eqns)) if stages[i] > number
                      and (eqn_layer(eqns[i]), eqn_source(eqns[i])) == key), None)
        why = (f"{inst.name} is a {inst.opcode} inside equation {describe_eqn(eqns[owner])}"
               if owner is not None else f"{inst.name} ({inst.opcode}) has no equation of its own")
        note = f"{why}; the stage ends at the equation boundary before it"
        mappings.append(CutMapping(cut, last, describe_eqn(eqns[last]), False, note))
        log.warning("pipeline cut %d after %s (%s) has no exact jaxpr counterpart: %s", number, cut.instruction,
                    cut.layer, note)
    notes = _parameter_notes(cap, traced, chain, stages, [hlo_stage(q) for q in range(len(chain))])
    for note in notes:
        log.warning("%s", note)
    on_loss = needed_eqns(eqns, traced.loss.jaxpr.outvars[:1])
    return StageAssignment(tuple(stages), tuple(mappings), len(matched), len(on_loss), tuple(notes))


def _chain_stages(cuts: Sequence[PipelineCut], cut_positions: Sequence[int], position: Mapping[str, int],
                  source: str) -> np.ndarray:
    """The stage of every chain position: after the prefix cuts, or, when a cut lists its
    downset's runs, the number of cuts that do not hold the position (the sets must nest)."""
    n = len(position)
    if not any(cut.downset for cut in cuts):
        if cut_positions != sorted(set(cut_positions)):
            raise RunError(f"the plan's cuts after {', '.join(c.instruction for c in cuts)} are not in forward order")
        return np.searchsorted(np.asarray(cut_positions), np.arange(n), side="left")
    before = np.zeros((len(cuts), n), dtype=bool)
    for number, (cut, q) in enumerate(zip(cuts, cut_positions)):
        if not cut.downset:
            before[number, :q + 1] = True
        for first, last in cut.downset:
            missing = [name for name in (first, last) if name not in position]
            if missing or position[first] > position[last]:
                why = (f"names {missing[0]!r}, which is not in the forward pass of {source}" if missing
                       else f"runs from {first!r} back to the earlier {last!r}")
                raise RunError(f"cut {number} of the plan: its downset run [{first}, {last}] {why}")
            before[number, position[first]:position[last] + 1] = True
        if not before[number, q]:
            raise RunError(f"cut {number} of the plan is after {cut.instruction!r}, which its downset does not hold")
        if number and (before[number - 1] & ~before[number]).any():
            raise RunError(f"the plan's cut {number} does not hold everything before cut {number - 1}: the sets "
                           "of instructions before the cuts must nest")
    return (~before).sum(axis=0)


def _eqn_stages(eqns: Sequence[Any], placed: Mapping[int, int]) -> list[int]:
    """Stages of all equations from those of the matched ones (`placed`): an equation that
    depends on a placed one runs on the latest stage of what it reads; one that reads only loss
    inputs (a reshape of a parameter, the momentum term of a running statistic) runs on the
    earliest stage that uses it, so that it travels with its user instead of its data."""
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    operands = [[producer[v] for v in e.invars if not is_literal(v) and v in producer] for e in eqns]
    stages: list[int | None] = []
    for i in range(len(eqns)):
        earlier = [stages[j] for j in operands[i] if stages[j] is not None]
        anchored = i in placed or len(earlier) > 0
        stages.append(max([placed.get(i, 0), *earlier]) if anchored else None)
    users: list[list[int]] = [[] for _ in eqns]
    for i, ops in enumerate(operands):
        for j in ops:
            users[j].append(i)
    for i in range(len(eqns) - 1, -1, -1):
        if stages[i] is None:
            stages[i] = min((stages[u] for u in users[i] if stages[u] is not None), default=0)
    return [int(s) for s in stages]  # type: ignore[arg-type]


def _parameter_notes(cap: Capture, traced: TracedStep, chain: Sequence[Any], stages: Sequence[int],
                     chain_stages: Sequence[int]) -> list[str]:
    """One line per stage whose loss equations read other parameters than its HLO instructions."""
    jaxpr = traced.loss.jaxpr
    param_leaf = {v: item.leaf for v, item in zip(jaxpr.invars, traced.loss_inputs) if item.kind is InputKind.PARAM}
    index = {p.name: p.index for p in cap.parameters if p.index in set(param_leaf.values())}
    n_stages = max(max(stages, default=0), max(chain_stages, default=0)) + 1
    hlo = [set() for _ in range(n_stages)]
    for inst, s in zip(chain, chain_stages):
        hlo[s].update(index[o] for o in inst.operands if o in index)
    runner = [set() for _ in range(n_stages)]
    for eqn, s in zip(jaxpr.eqns, stages):
        runner[s].update(param_leaf[v] for v in eqn.invars if not is_literal(v) and v in param_leaf)
    notes = []
    for s in range(n_stages):
        if hlo[s] != runner[s]:
            differ = sorted(cap.parameters[i].path for i in hlo[s] ^ runner[s])
            notes.append(f"stage {s} reads other parameters than the plan's HLO cut gives it: "
                         f"{', '.join(differ[:4])}{' ...' if len(differ) > 4 else ''}")
    return notes
