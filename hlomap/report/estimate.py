"""The cost model's estimate of a step as a plain-text report (`hlomap simulate`)."""

from __future__ import annotations

from typing import Sequence

from hlomap.cost.collectives import Collective
from hlomap.cost.estimate import CollectiveEstimate, InstructionEstimate, KindRow, StepEstimate
from hlomap.report.units import human_bytes, human_flops, human_seconds

__all__ = ["format_estimate", "instruction_calls", "instruction_labels"]


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _plan_title(name: str) -> str:
    """`plan dp` for a built-in plan, `the plan` for a saved or given one (not `plan plan`)."""
    if name == "plan" or name.startswith("plan, "):
        return "the " + name
    return f"plan {name}"


def instruction_calls(instructions: Sequence[InstructionEstimate]) -> list[tuple[int, int] | None]:
    """For each instruction in a computation called from several places, which call it is and of
    how many ((k, n), k from 1); None for the rest. The step runs such an instruction once per
    call site, so its name alone would list one instruction twice."""
    calls: dict[str, set[int]] = {}
    for inst in instructions:
        if inst.instance:
            calls.setdefault(inst.computation, set()).add(inst.instance)
    order = {comp: sorted(instances) for comp, instances in calls.items()}

    def call(inst: InstructionEstimate) -> tuple[int, int] | None:
        instances = order.get(inst.computation, [])
        return (instances.index(inst.instance) + 1, len(instances)) if inst.instance and len(instances) > 1 else None

    return [call(inst) for inst in instructions]


def instruction_labels(instructions: Sequence[InstructionEstimate]) -> list[str]:
    """Each instruction's name, with the call it is where its computation is called from several
    places (`name (in f, call 2 of 3)`, `instruction_calls`)."""
    return [inst.name if call is None else f"{inst.name} (in {inst.computation}, call {call[0]} of {call[1]})"
            for inst, call in zip(instructions, instruction_calls(instructions))]


def format_estimate(est: StepEstimate, *, top: int = 10, top_kinds: int = 8) -> str:
    """A plain-text report: step time, the by-kind table (the `top_kinds` slowest opcodes, the
    rest summed, then every collective kind), the `top` slowest instructions, the collectives
    (grouped by kind, reason and axes) and the memory per device."""
    mesh = ", ".join(f"{k}={v}" for k, v in est.mesh)
    lines = [
        f"{_plan_title(est.plan)} on mesh {{{mesh}}}, cluster {est.cluster} ({est.device}); per device:",
        f"step {human_seconds(est.step_seconds)} = compute {human_seconds(est.compute_seconds)} + exposed "
        f"communication {human_seconds(est.exposed_communication_seconds)} (of "
        f"{human_seconds(est.communication_seconds)}; overlap assumed: {est.overlap.value})"
        + (f" + dispatch {human_seconds(est.dispatch_seconds)}" if est.dispatch_seconds else "")
        + f"; {human_flops(est.flops)}",
        "",
        "by kind:",
    ]
    total = est.compute_seconds + est.communication_seconds or 1.0
    collective_kinds = {k.value for k in Collective}
    kinds = est.by_kind()
    compute_rows = [r for r in kinds if r.kind not in collective_kinds]
    shown = list(compute_rows[:top_kinds])
    rest = compute_rows[top_kinds:]
    if rest:
        shown.append(KindRow(f"({len(rest)} other opcodes)", sum(r.count for r in rest), sum(r.flops for r in rest),
                             sum(r.nbytes for r in rest), sum(r.seconds for r in rest)))
    shown += [r for r in kinds if r.kind in collective_kinds]
    rows = [[r.kind, str(r.count), human_flops(r.flops) if r.flops else "-", human_bytes(r.nbytes),
             human_seconds(r.seconds), f"{100 * r.seconds / total:.1f}%"] for r in shown]
    lines += _table(["kind", "count", "flops", "bytes", "time", "share"], rows,
                    [False, True, True, True, True, True])
    lines += ["", f"slowest {min(top, len(est.instructions))} instructions:"]
    labels = instruction_labels(est.instructions)
    rows = [[label, i.opcode, i.phase.value, str(i.degree), human_flops(i.flops), human_bytes(i.bytes_accessed),
             human_seconds(i.seconds)] for i, label in zip(est.instructions[:top], labels)]
    lines += _table(["instruction", "opcode", "phase", "split", "flops", "bytes", "time"], rows,
                    [False, False, False, True, True, True, True])
    groups: dict[tuple[str, str, tuple[str, ...]], list[CollectiveEstimate]] = {}
    for c in est.collectives:
        groups.setdefault((c.kind.value, c.reason.value, c.axes), []).append(c)
    lines += ["", "collectives:" if groups else "collectives: none"]
    if groups:
        rows = [[kind, reason, ",".join(axes), str(sum(c.count for c in cs)),
                 human_bytes(sum(c.nbytes * c.count for c in cs)), human_seconds(sum(c.total_seconds for c in cs)),
                 cs[0].detail if len(cs) == 1 else f"e.g. {cs[0].detail}"]
                for (kind, reason, axes), cs in sorted(groups.items(), key=lambda kv: -sum(c.total_seconds for c in kv[1]))]
        lines += _table(["kind", "reason", "axes", "count", "bytes", "time", "detail"], rows,
                        [False, False, False, True, True, True, False])
    m = est.memory
    lines += [
        "",
        f"memory per device: parameters {human_bytes(m.parameters)}, optimizer {human_bytes(m.optimizer)}, "
        f"inputs {human_bytes(m.inputs)}, gradients {human_bytes(m.gradients)}, activations "
        f"{human_bytes(m.activations)}, outputs {human_bytes(m.outputs)} (peak at {m.peak_instruction or '-'})",
        f"each at its own high point: gradients {human_bytes(m.max_gradients)}, activations "
        f"{human_bytes(m.max_activations)}",
        f"total {human_bytes(m.total)} of {human_bytes(m.capacity)}: "
        + ("fits" if m.fits else f"DOES NOT FIT, short by {human_bytes(m.shortfall)}"),
    ]
    return "\n".join(lines)
