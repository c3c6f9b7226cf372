"""XLA as the oracle of the cost model: compile a captured step under a plan and read what XLA
itself decided.

On the host's CPU devices (tests force 8 of them), `xla_reference(cap, plan)` compiles the step
with `verify.compile.compile_plan` (`jax.jit(in_shardings=..., out_shardings=...,
donate_argnums=...)`) and returns:
- the collectives in `compiled.as_text()`, by kind, with per-device result bytes (tuple results
  summed, `-start`/`-done` pairs counted once, ops in while bodies times their trip count);
- `compiled.cost_analysis()["flops"]`: FLOPs per device of the partitioned module;
- `compiled.memory_analysis()`: argument, output, alias and temporary bytes per device.

`compare(estimate, reference)` lines these up with a `StepEstimate` as rows of relative errors.
Nothing here is tuned to XLA's choices: where XLA combines or splits collectives differently the
rows say so (op counts differ while bytes agree, or a kind appears on one side only).

Output shardings are derived from the plan like everything else (the groups of the entry root's
leaves), so the new parameters and optimizer state come back sharded as they went in and the
donated input buffers can be reused for them, as in a real training loop.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, NamedTuple

import numpy as np

from hlomap.cost.collectives import Collective
from hlomap.cost.compute import while_trip_count
from hlomap.hlo.capture import Capture
from hlomap.hlo.ir import Computation, Instruction, Module
from hlomap.verify.compile import compile_plan, donated_arguments, output_specs

if TYPE_CHECKING:
    from hlomap.cost.estimate import StepEstimate
    from hlomap.plan import Plan
    from hlomap.propagation.graph import FactorGraph

log = logging.getLogger(__name__)

COLLECTIVE_OPCODES = frozenset(k.value for k in Collective)


# ---------------------------------------------------------------------------------------------
# Reading collectives out of a (compiled) module
# ---------------------------------------------------------------------------------------------


class ObservedCollective(NamedTuple):
    """One collective instruction of a compiled module, on one device."""

    kind: Collective
    name: str
    computation: str
    nbytes: int  # per-device result bytes, tuple leaves summed
    operands: int  # arrays it carries (a combined all-reduce carries several)
    group_size: int  # devices per replica group (0 when the module does not say)
    count: int  # executions per step (while trip counts), usually 1


class KindTotal(NamedTuple):
    """All collectives of one kind: instructions, arrays carried, executions and bytes."""

    ops: int
    operands: int
    executions: int
    nbytes: float


_MESH_GROUPS_RE = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=\((?P<ids>\[[\d,\s]+\](?:<=\[[\d,\s]+\])?(?:T\([\d,\s]+\))?)\))?"
    r"\s*\{(?P<sel>[^}]*)\}")
_AXIS_RE = re.compile(r"'([^']+)'\s*=\s*(\d+)")
_IDS_RE = re.compile(r"^\[([\d,\s]+)\](?:<=\[([\d,\s]+)\])?(?:T\(([\d,\s]+)\))?$")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def _mesh_groups(match: re.Match[str]) -> str:
    """`replica_groups=mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}` (newer XLA) as the
    explicit `replica_groups={{...},...}` every HLO parser knows."""
    axes = [(name, int(size)) for name, size in _AXIS_RE.findall(match.group("axes"))]
    names = [a for a, _ in axes]
    shape = [s for _, s in axes]
    total = math.prod(shape)
    ids_text = match.group("ids")
    if ids_text:
        ids_match = _IDS_RE.match(ids_text.strip())
        if ids_match is None:
            raise ValueError(f"unsupported device_ids {ids_text!r} in {match.group(0)!r}")
        dims = _ints(ids_match.group(2) or ids_match.group(1))
        ids = np.arange(math.prod(dims)).reshape(dims)
        if ids_match.group(3):
            ids = ids.transpose(_ints(ids_match.group(3)))
        ids = ids.reshape(-1)
    else:
        ids = np.arange(total)
    selected = [s.strip().strip("'") for s in match.group("sel").split(",") if s.strip()]
    unknown = [s for s in selected if s not in names]
    if unknown:
        raise ValueError(f"replica group axes {unknown} (sub-axes are not supported) in {match.group(0)!r}")
    grid = ids.reshape(shape)
    picked = [names.index(s) for s in selected]
    moved = np.moveaxis(grid, picked, list(range(len(shape) - len(picked), len(shape))))
    rows = moved.reshape(-1, math.prod(shape[i] for i in picked) if picked else 1)
    return "replica_groups={" + ",".join("{" + ",".join(str(int(x)) for x in r) + "}" for r in rows) + "}"


def normalize_replica_groups(text: str) -> str:
    """Rewrite the mesh form of replica groups that newer XLA prints into the explicit form."""
    return _MESH_GROUPS_RE.sub(_mesh_groups, text)


def _done_shape_bytes(comp: Computation, start: Instruction, users: Mapping[str, list[Instruction]]) -> int:
    """Result bytes of an async collective: those of its `-done` (a `-start` returns a tuple of
    operand and result buffers)."""
    for user in users.get(start.name, ()):
        if user.opcode.endswith("-done"):
            return user.shape.byte_size
    return start.shape.byte_size


def collectives_in(module: Module) -> tuple[ObservedCollective, ...]:
    """Every collective reachable from the entry, in program order, with executions per step."""
    out: list[ObservedCollective] = []

    def walk(comp: Computation, count: int, seen: tuple[str, ...]) -> None:
        users: dict[str, list[Instruction]] = {}
        for inst in comp.instructions:
            for o in inst.operands:
                users.setdefault(o, []).append(inst)
        for inst in comp.instructions:
            base = inst.base_opcode
            if base in COLLECTIVE_OPCODES and not inst.opcode.endswith(("-done", "-update")):
                nbytes = (_done_shape_bytes(comp, inst, users) if inst.opcode.endswith("-start")
                          else inst.shape.byte_size)
                groups = inst.replica_groups
                size = len(groups[0]) if groups else 0
                n_ops = len(inst.operands)
                out.append(ObservedCollective(Collective(base), inst.name, comp.name, nbytes, n_ops, size, count))
            if inst.opcode == "fusion":
                continue  # fused computations hold no collectives
            times = while_trip_count(inst, comp, module) if inst.opcode == "while" else 1
            for callee in inst.called_computations:
                if callee in seen or callee not in module.by_name:
                    continue
                walk(module.computation(callee), count * times, seen + (callee,))

    walk(module.entry, 1, (module.entry_name,))
    return tuple(out)


def collective_totals(items: Iterable[Any]) -> dict[Collective, KindTotal]:
    """Per kind: ops, arrays, executions and bytes. Accepts `ObservedCollective`s or the
    estimate's `CollectiveEstimate`s (anything with kind, nbytes and optionally count/operands)."""
    acc: dict[Collective, list[float]] = {}
    for c in items:
        count = int(getattr(c, "count", 1))
        row = acc.setdefault(c.kind, [0, 0, 0, 0.0])
        row[0] += 1
        row[1] += int(getattr(c, "operands", 1))
        row[2] += count
        row[3] += float(c.nbytes) * count
    return {k: KindTotal(int(v[0]), int(v[1]), int(v[2]), float(v[3])) for k, v in acc.items()}


# ---------------------------------------------------------------------------------------------
# What XLA compiled for a plan
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class XlaMemory:
    """`compiled.memory_analysis()` per device. `peak` is what the step needs at once: arguments,
    outputs not aliased to donated arguments, and temporaries."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int

    @property
    def peak(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


@dataclass(frozen=True, eq=False)
class XlaReference:
    """What XLA compiled for one plan: its collectives, FLOPs and memory per device."""

    collectives: tuple[ObservedCollective, ...]
    flops: float
    memory: XlaMemory
    module: Module
    mesh: tuple[tuple[str, int], ...]

    @property
    def totals(self) -> dict[Collective, KindTotal]:
        return collective_totals(self.collectives)


def xla_reference(cap: Capture, plan: Plan, graph: FactorGraph | None = None, *,
                  donate: bool = True) -> XlaReference:
    """Compile `plan` for `cap` on the host devices as a training loop runs it (outputs pinned to
    the plan's shardings, parameters and optimizer state donated unless `donate=False`) and read
    collectives, FLOPs and memory."""
    from hlomap.hlo.parser import parse
    from hlomap.propagation.graph import FactorGraph

    if cap.step is None or cap.args is None:
        raise ValueError(f"capture {cap.source!r} has no JAX step (a bare HLO dump); XLA cannot recompile it")
    graph = graph if graph is not None else FactorGraph.from_capture(cap)
    compiled = compile_plan(cap.step, cap.args, plan, outputs=output_specs(graph, plan),
                            donate=donated_arguments(cap) if donate else ()).compiled
    module = parse(normalize_replica_groups(compiled.as_text()), filename="<compiled>")
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older jax returned one dict per program
        analysis = analysis[0]
    stats = compiled.memory_analysis()
    memory = XlaMemory(int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes),
                       int(stats.alias_size_in_bytes), int(stats.temp_size_in_bytes))
    return XlaReference(collectives_in(module), float(analysis.get("flops", 0.0)), memory, module, plan.mesh)


# ---------------------------------------------------------------------------------------------
# Comparing
# ---------------------------------------------------------------------------------------------


class XlaComparison(NamedTuple):
    """One quantity, predicted and measured, with the relative error (None when both are 0)."""

    quantity: str
    predicted: float
    measured: float

    @property
    def error(self) -> float | None:
        if self.measured == 0:
            return None if self.predicted == 0 else math.inf
        return (self.predicted - self.measured) / self.measured


def compare(est: StepEstimate, ref: XlaReference) -> tuple[XlaComparison, ...]:
    """Collective bytes per kind (every kind seen on either side), FLOPs and peak memory per
    device. Collective bytes are per-device result bytes on both sides."""
    ours = collective_totals(est.collectives)
    theirs = ref.totals
    rows = [XlaComparison(f"{k.value} bytes", ours.get(k, KindTotal(0, 0, 0, 0.0)).nbytes,
                       theirs.get(k, KindTotal(0, 0, 0, 0.0)).nbytes)
            for k in Collective if k in ours or k in theirs]
    rows.append(XlaComparison("flops", est.flops, ref.flops))
    rows.append(XlaComparison("memory", float(est.memory.total), float(ref.memory.peak)))
    return tuple(rows)


class PlanCheck(NamedTuple):
    """A plan estimated and compiled: the estimate, XLA's reference and the comparison rows."""

    model: str
    plan: str
    estimate: StepEstimate
    reference: XlaReference
    rows: tuple[XlaComparison, ...]

    def row(self, quantity: str) -> XlaComparison | None:
        return next((r for r in self.rows if r.quantity == quantity), None)


def check_plan_against_xla(cap: Capture, graph: FactorGraph, plan: Any, mesh: Mapping[str, int] | None = None,
                           *, model: str = "", name: str | None = None, cluster: str = "A") -> PlanCheck:
    """Estimate `plan` (a Plan, a built-in plan name or a plan array with its `mesh`) and compile
    it with XLA on the host devices; return both and their comparison."""
    from hlomap.cost.estimate import estimate
    from hlomap.plan import Plan, resolve_plan

    array, axes, label = resolve_plan(graph, plan, mesh)
    est = estimate(cap, array, axes, cluster=cluster, graph=graph, plan_name=label)
    ref = xla_reference(cap, Plan.from_groups(cap, graph, array, axes), graph)
    return PlanCheck(model, name or label, est, ref, compare(est, ref))
