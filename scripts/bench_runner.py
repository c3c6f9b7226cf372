"""Measure the runner (`hlomap.parallelize`) on this machine's devices; prints figures, asserts nothing.

1. SPMD plans: a step through `parallelize` against a hand-written `jax.jit(in_shardings=...)`
   of the same plan (goal: at most 5% slower).
2. Pipelines of one stage and one microbatch (the spmd and mpmd executors) against the plain step jitted
   on the same devices with the same data parallelism (goal: at most 10% slower).
3. The mpmd executor's measured event order (device-side timestamps per stage and microbatch) against
   the simulator's predicted order, and a Gantt chart of both (goal: the same order per stage).
4. Peak activation bytes held per stage, 1F1B against GPipe, from the scheduler's count of live
   residual buffers (goal: 1F1B holds at most S - s microbatches on stage s, GPipe all M).
5. Each schedule's bubble fraction on the mpmd executor (stages cut evenly, S = 4, M = 8; interleaved
   1F1B with V = 2), measured from the device timestamps of the recorded passes
   (`dispatch.measured_bubble`: 1 - busy / (S x step)), against the simulator's for equal stages and
   the analytic (S - 1) / (V M + S - 1) (goal: within 5 percentage points for GPipe, 1F1B and
   interleaved; ZB-H1's measured bubble below 1F1B's).

    python scripts/bench_runner.py [--model gpt-tiny] [--repeats 30] [--out bench_runner] [--only 5] [--quick]

`--quick` shrinks everything (S = 2, M = 4, 2 repeats) to check the script runs, not to measure.

Runs on 8 host CPU devices when no accelerator is present (timings then say little about GPUs:
the 8 "devices" share the machine's cores). Section 5 in particular needs several accelerators:
XLA:CPU runs each program across every core, so the passes of host devices do not overlap and the
measured bubble comes out near 1 - 1/S whatever the schedule (0.77-0.96 on a 16-core host).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import hlomap  # noqa: E402
from hlomap import zoo  # noqa: E402
from hlomap.api import load_source  # noqa: E402
from hlomap.cost.pipeline.simulator import SimulationResult, Span, SpanKind  # noqa: E402
from hlomap.cost.pipeline.stages import Pass, PipelinePlan, Schedule  # noqa: E402
from hlomap.plan import ParameterSpec, Plan, PlanSource, reference_plan  # noqa: E402
from hlomap.propagation.graph import FactorGraph  # noqa: E402
from hlomap.report.gantt import draw_gantt  # noqa: E402
from hlomap.run.pipeline.dispatch import dispatch_order, measured_bubble, predicted_schedule, same_order  # noqa: E402
from hlomap.cost.pipeline.chain import step_chain  # noqa: E402
from hlomap.verify.mesh import mesh_of  # noqa: E402


def median_seconds(run: Callable[[], Any], repeats: int) -> float:
    jax.block_until_ready(run())  # compile and warm up
    jax.block_until_ready(run())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved(runs: dict[str, Callable[[], Any]], repeats: int, rounds: int = 3) -> dict[str, float]:
    """Median seconds of each, measured in alternating rounds so drift hits all alike."""
    out: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            out[name].append(median_seconds(run, repeats))
    return {name: min(values) for name, values in out.items()}


def stateful(step: Callable[..., Any], params: Any, opt_state: Any, *rest: Any) -> Callable[[], Any]:
    """A closure running `step` on its own previous outputs (the state is donated)."""
    state = [params, opt_state]

    def run() -> Any:
        out = step(state[0], state[1], *rest)
        state[0], state[1] = out[0], out[1]
        return out[2]

    return run


def section_spmd(model: Any, cap: Any, repeats: int) -> None:
    args = tuple(model.example_args())
    graph = FactorGraph.from_capture(cap)
    array, axes = reference_plan(graph, "dp+megatron", {"data": 2, "model": 4})
    plan = Plan.from_groups(cap, graph, array, axes)
    step = hlomap.parallelize(model.train_step(), plan)
    mesh = mesh_of(jax.devices()[:8], (("data", 2), ("model", 4)))
    shardings = plan.shardings(mesh, like=args)
    hand = jax.jit(model.train_step(), in_shardings=shardings, out_shardings=(shardings[0], shardings[1], None),
                   donate_argnums=(0, 1))
    placed = jax.device_put(args, shardings)
    # both get the batch already on the devices (a host batch would time its transfer in one of them)
    times = interleaved({"parallelize": stateful(step, *step.place(args[0], args[1]), placed[2]),
                         "hand-written jit": stateful(hand, jax.tree.map(jax.numpy.copy, placed[0]),
                                                      jax.tree.map(jax.numpy.copy, placed[1]), placed[2])}, repeats)
    ratio = times["parallelize"] / times["hand-written jit"]
    print(f"[1] SPMD plan dp+megatron data=2 x model=4, {model.name}: parallelize {times['parallelize'] * 1e3:.2f} ms, "
          f"hand-written jit(in_shardings=...) {times['hand-written jit'] * 1e3:.2f} ms per step: "
          f"overhead {100 * (ratio - 1):+.1f}% (goal <= +5%)")


def one_stage_plan(cap: Any, devices: int, schedule: str) -> Plan:
    parameters = tuple(ParameterSpec(p.index, p.path, tuple(p.shape.dims), (None,) * len(p.shape.dims))
                       for p in cap.parameters)
    return Plan(mesh=(), parameters=parameters, source=PlanSource(cap.source, cap.text_sha256),
                pipeline={"stages": [{"devices": list(range(devices))}], "microbatches": 1, "schedule": schedule,
                          "cuts": []})


def section_one_stage(model: Any, cap: Any, repeats: int) -> None:
    # numpy arguments: a training loop hands the step host batches (a batch on one device would
    # time a device-to-device reshard instead)
    args = jax.tree.map(np.asarray, tuple(model.example_args()))
    mesh = mesh_of(jax.devices()[:8], (("data", 8),))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    shardings = (jax.tree.map(lambda _: replicated, args[0]), jax.tree.map(lambda _: replicated, args[1]),
                 jax.tree.map(lambda _: batch, args[2]))
    plain = jax.jit(model.train_step(), in_shardings=shardings, out_shardings=(shardings[0], shardings[1], None),
                    donate_argnums=(0, 1))
    placed = jax.device_put(args, shardings)
    # every step gets the host batch, as a training loop hands it (the executors split it into
    # microbatches on the host), so each timing includes the batch's transfer
    runs = {"plain jit (data=8)": stateful(plain, placed[0], placed[1], args[2])}
    for executor, schedule in (("spmd", "gpipe"), ("mpmd", "1f1b")):
        step = hlomap.parallelize(model.train_step(), one_stage_plan(cap, 8, schedule), executor=executor,
                                  example_args=args)
        runs[f"executor {executor}"] = stateful(step, *step.place(args[0], args[1]), args[2])
    times = interleaved(runs, repeats)
    base = times["plain jit (data=8)"]
    for name, seconds in times.items():
        extra = "" if name.startswith("plain") else f": overhead {100 * (seconds / base - 1):+.1f}% (goal <= +10%)"
        print(f"[2] S=1, M=1, {model.name}: {name} {seconds * 1e3:.2f} ms per step{extra}")


def measured_result(events: list[Any], plan: PipelinePlan) -> SimulationResult:
    origin = min(e.start for e in events)
    kinds = {Pass.FORWARD: SpanKind.FORWARD, Pass.BACKWARD: SpanKind.BACKWARD, Pass.WEIGHT: SpanKind.WEIGHT}
    spans = tuple(Span(kinds[e.event.kind], e.event.stage, e.event.microbatch, e.start - origin, e.end - origin)
                  for e in events)
    return SimulationResult(plan=plan, length=max(s.end for s in spans), spans=spans, peak_in_flight=(),
                            stage_memory=(0.0,) * plan.n_stages, violations=())


def section_schedule(model: Any, cap: Any, out: Path, stages: int, microbatches: int) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.image import imread

    args = tuple(model.example_args())
    chain = step_chain(cap)
    n = len(chain.pivots)
    pivots = [int(n * (k + 1) / stages) for k in range(stages - 1)]
    per_stage = max(1, min(8 // stages, model.config.batch_size // microbatches))  # examples per device >= 1
    bytes_by_schedule = {}
    for schedule in (Schedule.ONE_F_ONE_B, Schedule.GPIPE):
        parameters = tuple(ParameterSpec(p.index, p.path, tuple(p.shape.dims), (None,) * len(p.shape.dims))
                           for p in cap.parameters)
        cuts = [{"instruction": chain.pivots[k].instruction, "layer": chain.pivots[k].layer} for k in pivots]
        plan = Plan(mesh=(), parameters=parameters, source=PlanSource(cap.source, cap.text_sha256),
                    pipeline={"stages": [{"devices": list(range(s * per_stage, (s + 1) * per_stage))}
                                         for s in range(stages)],
                              "microbatches": microbatches, "schedule": schedule.value, "cuts": cuts})
        step = hlomap.parallelize(model.train_step(), plan, executor="mpmd", example_args=args)
        runner = step._runner
        params, opt_state = step.place(args[0], args[1])
        for _ in range(2):  # compile the recording programs, then measure
            params, opt_state, _ = runner(params, opt_state, args[2], record=True)
        events = runner.stats.events
        predicted = dispatch_order(schedule, stages, microbatches)
        print(f"[3] {schedule.value}, S={stages}, M={microbatches}, {model.name}: measured order per stage "
              f"{'EQUALS' if same_order(events, predicted) else 'DIFFERS FROM'} the simulator's")
        for s in range(stages):
            ran = [f"{e.event.kind.value}{e.event.microbatch}" for e in sorted(events, key=lambda e: e.start)
                   if e.event.stage == s]
            print(f"      stage {s}: {' '.join(ran)}")
        pipeline_plan = PipelinePlan.linear(range(stages + 1), (per_stage,) * stages, microbatches=microbatches,
                                            schedule=schedule)
        measured_png = out / f"measured_{schedule.value}.png"
        predicted_png = out / f"predicted_{schedule.value}.png"
        draw_gantt(measured_result(events, pipeline_plan), measured_png,
                   title=f"measured: mpmd executor, {schedule.value}, {model.name}, S={stages}, M={microbatches}")
        draw_gantt(predicted_schedule(schedule, stages, microbatches), predicted_png,
                   title=f"predicted by the simulator (forward 1, backward 2 units), {schedule.value}")
        figure = Figure(figsize=(12, 7))
        FigureCanvasAgg(figure)
        for row, png in enumerate((predicted_png, measured_png)):
            axes = figure.add_subplot(2, 1, row + 1)
            axes.imshow(imread(png))
            axes.axis("off")
        figure.tight_layout()
        both = out / f"gantt_{schedule.value}.png"
        figure.savefig(both, dpi=120)
        print(f"      Gantt: {both} (predicted above measured)")
        bytes_by_schedule[schedule] = (runner.stats.peak_in_flight, runner.stats.peak_residual_bytes)
    for schedule, (flight, peak) in bytes_by_schedule.items():
        print(f"[4] {schedule.value}: peak microbatches in flight per stage {flight}, peak residual bytes per stage "
              f"{[f'{b / 2**20:.2f} MiB' for b in peak]}")
    one, gpipe = bytes_by_schedule[Schedule.ONE_F_ONE_B], bytes_by_schedule[Schedule.GPIPE]
    bound = [min(stages - s, microbatches) for s in range(stages)]
    print(f"    1F1B holds at most S - s microbatches: {'yes' if list(one[0]) == bound else 'NO'} ({list(one[0])} vs "
          f"bound {bound}); GPipe holds M = {microbatches}: {list(gpipe[0])}; 1F1B / GPipe peak bytes per stage: "
          f"{[f'{a / b:.2f}' for a, b in zip(one[1], gpipe[1])]}")


#: The schedules section 5 compares, with the chunks per device stage each runs.
BUBBLE_SCHEDULES = ((Schedule.GPIPE, 1), (Schedule.ONE_F_ONE_B, 1), (Schedule.INTERLEAVED, 2), (Schedule.ZERO_BUBBLE, 1))


def even_plan(cap: Any, stages: int, microbatches: int, schedule: Schedule, repeats: int, per_stage: int) -> Plan:
    """S device stages of `per_stage` replicas, the step cut evenly along its chain into S V logical stages."""
    chain = step_chain(cap)
    logical = stages * repeats
    n = len(chain.pivots)
    pivots = [int(n * (k + 1) / logical) for k in range(logical - 1)]
    if len(set(pivots)) != len(pivots):
        raise SystemExit(f"{cap.source} has {n} cut points, too few for {logical} logical stages")
    parameters = tuple(ParameterSpec(p.index, p.path, tuple(p.shape.dims), (None,) * len(p.shape.dims))
                       for p in cap.parameters)
    cuts = [{"instruction": chain.pivots[k].instruction, "layer": chain.pivots[k].layer} for k in pivots]
    section = {"stages": [{"devices": list(range(s * per_stage, (s + 1) * per_stage))} for s in range(stages)],
               "microbatches": microbatches, "schedule": schedule.value, "cuts": cuts}
    if repeats > 1:
        section["repeats"] = repeats
    return Plan(mesh=(), parameters=parameters, source=PlanSource(cap.source, cap.text_sha256), pipeline=section)


def section_bubbles(model: Any, cap: Any, stages: int, microbatches: int, steps: int) -> None:
    """Part 5: measured, simulated and analytic bubble fraction of each schedule (module docstring)."""
    args = tuple(model.example_args())
    per_stage = max(1, min(8 // stages, model.config.batch_size // microbatches))
    rows = []
    for schedule, repeats in BUBBLE_SCHEDULES:
        if schedule is Schedule.INTERLEAVED and microbatches % stages:
            print(f"[5] {schedule.value}: skipped, M = {microbatches} is not a multiple of S = {stages}")
            continue
        plan = even_plan(cap, stages, microbatches, schedule, repeats, per_stage)
        step = hlomap.parallelize(model.train_step(), plan, executor="mpmd", example_args=args)
        runner = step._runner
        params, opt_state = step.place(args[0], args[1])
        params, opt_state, _ = runner(params, opt_state, args[2], record=True)  # compiles the recording programs
        measured = []
        for _ in range(steps):
            params, opt_state, _ = runner(params, opt_state, args[2], record=True)
            measured.append(measured_bubble(runner.stats.events, stages))
        simulated = predicted_schedule(schedule, stages, microbatches, repeats).bubble_fraction()
        analytic = (stages - 1) / (repeats * microbatches + stages - 1)
        rows.append((schedule, repeats, statistics.median(measured), simulated, analytic))
        # each schedule as it finishes: a run stopped by a time limit keeps what it measured
        print(f"[5] {schedule.value}: measured {rows[-1][2]:.3f} (steps {', '.join(f'{m:.3f}' for m in measured)}), "
              f"simulated {simulated:.3f}, analytic {analytic:.3f}", flush=True)
    print(f"[5] bubble fraction, mpmd executor, {model.name}, S={stages}, M={microbatches}, {per_stage} device(s) per "
          f"stage, median of {steps} recorded steps")
    if jax.devices()[0].platform == "cpu":
        print("    (host CPU devices: each program takes every core, so passes of different stages do not overlap and "
              "the measured bubble says nothing about the schedule)")
    print(f"    {'schedule':<18} {'V':>2} {'measured':>9} {'simulated':>10} {'analytic':>9}  goal")
    by_schedule = {schedule: measured for schedule, _, measured, _, _ in rows}
    for schedule, repeats, measured, simulated, analytic in rows:
        if schedule is Schedule.ZERO_BUBBLE:
            reference = by_schedule.get(Schedule.ONE_F_ONE_B)
            met = reference is not None and measured < reference
            goal = f"below 1F1B's measured: {'yes' if met else 'NO'}"
            analytic_text = "-"  # ZB-H1 has no (S - 1) / (V M + S - 1) form
        else:
            goal = f"within 5 points of analytic: {'yes' if abs(measured - analytic) <= 0.05 else 'NO'}"
            analytic_text = f"{analytic:9.3f}"
        print(f"    {schedule.value:<18} {repeats:>2} {measured:9.3f} {simulated:10.3f} {analytic_text:>9}  {goal}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-tiny", help="zoo model (default gpt-tiny)")
    parser.add_argument("--repeats", type=int, default=30, help="timed steps per round (default 30)")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--out", default="bench_runner", help="directory for the Gantt charts")
    parser.add_argument("--only", choices=("1", "2", "3", "5"), help="run one section (3 includes 4)")
    parser.add_argument("--bubble-steps", type=int, default=5, help="recorded steps per schedule in section 5")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny configuration (S=2, M=4, 2 repeats, 1 recorded step) to check the script runs")
    args = parser.parse_args()
    if args.quick:
        args.stages, args.microbatches, args.repeats, args.bubble_steps = 2, 4, 2, 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = zoo.get(args.model)
    cap = load_source(f"zoo:{args.model}")
    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform} ({jax.devices()[0].device_kind}); "
          f"no GPU was lent to this run" if jax.devices()[0].platform == "cpu" else "")
    if args.only in (None, "1"):
        section_spmd(model, cap, args.repeats)
    if args.only in (None, "2"):
        section_one_stage(model, cap, args.repeats)
    if args.only in (None, "3"):
        section_schedule(model, cap, out, args.stages, args.microbatches)
    if args.only in (None, "5"):
        section_bubbles(model, cap, args.stages, args.microbatches, args.bubble_steps)


if __name__ == "__main__":
    main()
