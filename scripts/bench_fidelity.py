"""How well the cost model orders plans it did not choose: predicted against measured step times.

For each zoo model, a set of at least 12 plans of every kind hlomap makes is priced by the cost
model (`hlomap.estimate` on `--cluster`) and run on this machine's devices with
`hlomap.parallelize`, all of a model's plans timed together in interleaved rounds
(`hlomap.verify.timing.time_interleaved`: every round times each plan `--repeats` times and keeps
the median, the order rotating from round to round; a plan's figure is the median of its round
medians, with their interquartile range; a pick that is another row's plan keeps its own row, and
the rows of one plan pool their round medians into one figure). The set:

- built-in plans: data=8, Megatron on model=8, data x model Megatron on 2x4 and 4x2;
- every parameter replicated on 8 devices;
- pipelines of 2 and 4 stages cut by the exact DP, GPipe on the spmd executor and 1F1B on the mpmd
  executor (the most microbatches up to `--microbatches` whose microbatch splits over a stage);
- the explorer's picks on `--cluster`: opp (model=8), adp (data=8), hybrid (data=2 x model=4),
  all with the cost reward, and the joint `auto` plan; none measured (`measure=0`): they are the
  cost model's choices;
- the `auto` plan of `explore(measure=K)` (`--measure`, default 4; 0 leaves it out): the best K
  candidates timed on these devices during the search and the fastest kept, timed again here;
- two random valid hybrid plans (2x4 and 4x2), drawn uniformly position by position.

A plan that cannot be built for a model (no Megatron layout, a pipeline the model cannot be cut
into, a step that fails to compile) is reported as skipped with the reason. Per model it prints
the predicted and measured table, the Spearman rank correlation over every plan kind, each pick's
slowdown against the fastest measured plan (and for an opp, adp or hybrid pick against the fastest
plan of the set its own single-mesh space holds: the built-in and random plans on its mesh and the
replicated plan), the load average before and after, and how many pipelines were predicted within
25% of their measured step. Just before a model's plans are timed, the calibration they are priced
on has its compute samples timed again (`hlomap calibrate --check`): its now / then says how much
slower (above 1) or faster the devices run than the calibration prices them, a drift every
prediction of that model carries. Goals: Spearman
>= 0.9 on every model; every pick within 5% of the fastest measured plan of its set. Nothing is
asserted: this is a benchmark. Every figure goes to DIR/fidelity.json, and a log-log scatter of
predicted against measured time per model to DIR/fidelity.png.

    python scripts/bench_fidelity.py [--models gpt-tiny,haiku-mlp,bert-tiny,t5-tiny,resnet50-tiny]
        [--rounds 20] [--repeats 3] [--cluster local] [--out bench_fidelity] [--budget-seconds 20]
        [--compile-cache DIR] [--measure 4]

`--cluster` should describe the devices the plans run on: `local` (calibrated on the devices JAX
sees), or a file written by `hlomap calibrate -o FILE`. On a machine without an accelerator the
plans run on 8 simulated host devices sharing the CPU cores, so measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from rich.text import Text  # noqa: E402

from hlomap import api, zoo  # noqa: E402
from hlomap.plan import Plan, reference_plan  # noqa: E402
from hlomap.propagation.conflicts import MeshAxes  # noqa: E402
from hlomap.propagation.graph import FactorGraph  # noqa: E402
from hlomap.run import parallelize  # noqa: E402
from hlomap.tasks.sharding.exact import ExactTooLarge  # noqa: E402
from hlomap.tasks.sharding.space import hybrid_space  # noqa: E402
from hlomap.verify.fidelity import (  # noqa: E402
    EVERY_SPACE,
    FidelityReport,
    PlanFigures,
    fidelity_report,
    pipeline_microbatches,
    random_conflict_free_choices,
)
from hlomap.verify.timing import load_average, pooled, stateful_step, time_interleaved  # noqa: E402

DEFAULT_MODELS = ("gpt-tiny", "haiku-mlp", "bert-tiny", "t5-tiny", "resnet50-tiny")
DEVICES = 8
#: Goals of issue #22: the rank correlation on every model, and each pick's slowdown.
SPEARMAN_GOAL = 0.9
PICK_SLOWDOWN_GOAL = 0.05


@dataclass(frozen=True)
class Candidate:
    """A plan of the set, before it is run. executor: the pipeline executor asked for (None: an
    SPMD plan, or a pipeline whose schedule picks it)."""

    name: str
    kind: str
    plan: Plan
    executor: str | None = None
    pick: bool = False
    note: str = ""
    twin: str | None = None  # an earlier plan of the set that shards alike: its compiled step is reused
    space: str | None = None  # the single-mesh search space holding it (`PlanFigures.space`)


@dataclass(frozen=True)
class Skipped:
    """A plan of the set that could not be built or run, and why."""

    name: str
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "reason": self.reason}


@dataclass(frozen=True)
class Prepared:
    """A candidate compiled and run once, with the zero-argument step the timing loop calls."""

    candidate: Candidate
    executor: str
    predicted_seconds: float
    step: Any  # the ParallelStep
    run: Callable[[], Any]


def reason_of(err: BaseException) -> str:
    """One line saying why a plan was skipped (a compiler's message can run to pages)."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first}"[:300]


def mesh_text(mesh: dict[str, int]) -> str:
    return ",".join(f"{name}={size}" for name, size in mesh.items())


# ---------------------------------------------------------------------------------------------
# The plan set
# ---------------------------------------------------------------------------------------------


def built_in_candidates(cap: Any, graph: FactorGraph) -> list[Candidate | Skipped]:
    out: list[Candidate | Skipped] = []
    for kind, mesh in (("dp", {"data": DEVICES}), ("megatron", {"model": DEVICES}),
                       ("dp+megatron", {"data": 2, "model": 4}), ("dp+megatron", {"data": 4, "model": 2})):
        name = f"{kind} {mesh_text(mesh)}"
        try:
            array, axes = reference_plan(graph, kind, mesh)
            out.append(Candidate(name, "built-in", Plan.from_groups(cap, graph, array, axes), space=mesh_text(mesh)))
        except Exception as err:  # a model without what the plan needs: reported, the set goes on
            out.append(Skipped(name, reason_of(err)))
    return out


def replicated_candidate(cap: Any, graph: FactorGraph) -> Candidate:
    """Every parameter and input replicated: each device runs the whole step on the whole batch."""
    axes = MeshAxes.from_mesh({"data": DEVICES})
    plan = Plan.from_groups(cap, graph, np.full(graph.num_groups, -1, dtype=np.int8), axes)
    return Candidate(f"replicated x{DEVICES}", "replicated", plan, space=EVERY_SPACE)


def pipeline_candidates(cap: Any, cluster: Any, preferred_microbatches: int) -> list[Candidate | Skipped]:
    """2 and 4 stages cut by the exact DP: GPipe on the spmd executor (the only schedule it
    runs), 1F1B on the mpmd one."""
    batch = int(cap.batch_size)
    out: list[Candidate | Skipped] = []
    for stages in (2, 4):
        microbatches = pipeline_microbatches(batch, stages, DEVICES, preferred_microbatches)
        if microbatches is None:  # no count uses every device: the DP narrows the stages itself
            microbatches = max((m for m in range(1, preferred_microbatches + 1) if batch % m == 0), default=1)
        for schedule, executor in (("gpipe", "spmd"), ("1f1b", "mpmd")):
            name = f"pipeline S={stages} M={microbatches} {schedule}"
            try:
                plan = api.explore(cap, task="pipeline", agent="dp", stages=stages, microbatches=microbatches,
                                   schedule=schedule, cluster=cluster)
                devices = "+".join(str(len(s.devices)) for s in plan.pipeline.stages)
                out.append(Candidate(name, "pipeline", plan, executor, note=f"devices {devices}"))
            except Exception as err:
                out.append(Skipped(name, reason_of(err)))
    return out


def sharding_pick(cap: Any, task: str, mesh: dict[str, int], cluster: Any, agent: str, budget_seconds: float,
                  seed: int) -> Candidate:
    """The explorer's plan under the cost reward; exact search falls back to greedy on a space
    too large to enumerate (noted on the row)."""
    note = agent
    try:
        plan = api.explore(cap, task=task, mesh=mesh, cluster=cluster, agent=agent, reward="cost",
                           budget_seconds=budget_seconds, seed=seed)
    except ExactTooLarge:
        note = "greedy (too many plans for exact)"
        plan = api.explore(cap, task=task, mesh=mesh, cluster=cluster, agent="greedy", reward="cost",
                           budget_seconds=budget_seconds, seed=seed)
    search = plan.search or {}
    if note == "exact" and search.get("optimal") is False:  # the budget stopped the enumeration
        enumerated = [n for n in search.get("notes") or () if str(n).startswith("enumerated")]
        note = f"exact, not proven optimal ({enumerated[-1] if enumerated else 'budget ran out'})"
    return Candidate(f"{task} pick {mesh_text(mesh)}", "pick", plan, pick=True, note=note, space=mesh_text(mesh))


def pick_candidates(cap: Any, cluster: Any, agent: str, budget_seconds: float, seed: int, measure: int = 0,
                    runnable: tuple[Any, Sequence[Any]] | None = None) -> list[Candidate | Skipped]:
    """The opp, adp and hybrid picks, the auto pick, and with `measure` > 0 the auto pick that
    timed its best `measure` candidates on these devices (`explore(measure=K)`, running
    `runnable`: the train step and its example arguments)."""
    out: list[Candidate | Skipped] = []
    for task, mesh in (("opp", {"model": DEVICES}), ("adp", {"data": DEVICES}), ("hybrid", {"data": 2, "model": 4})):
        try:
            out.append(sharding_pick(cap, task, mesh, cluster, agent, budget_seconds, seed))
        except Exception as err:
            out.append(Skipped(f"{task} pick {mesh_text(mesh)}", reason_of(err)))
    try:
        plan = api.explore(cap, task="auto", cluster=cluster)
        out.append(Candidate("auto pick", "pick", plan, pick=True, note=auto_note(plan)))
    except Exception as err:
        out.append(Skipped("auto pick", reason_of(err)))
    if measure > 0:
        name = f"auto pick measure={measure}"
        try:
            plan = api.explore(cap, task="auto", cluster=cluster, measure=measure, runnable=runnable, seed=seed)
            timed = len(plan.measured.candidates) if plan.measured is not None else 0
            out.append(Candidate(name, "pick", plan, pick=True,
                                 note=f"{auto_note(plan)}; fastest of {timed} timed"))
        except Exception as err:
            out.append(Skipped(name, reason_of(err)))
    return out


def auto_note(plan: Plan) -> str:
    """An auto plan's shape: its stages and their devices, or its one mesh."""
    if plan.pipeline is None:  # one stage, one microbatch: written as an SPMD plan
        return f"1 stage, mesh {mesh_text(plan.mesh_shape)}"
    stages = plan.pipeline.stages
    return f"{len(stages)} stage{'s' if len(stages) > 1 else ''}, devices {'+'.join(str(len(s.devices)) for s in stages)}"


def random_candidates(cap: Any, graph: FactorGraph, seed: int) -> list[Candidate | Skipped]:
    """One uniformly drawn valid hybrid plan on each of 2x4 and 4x2."""
    out: list[Candidate | Skipped] = []
    for k, mesh in enumerate(({"data": 2, "model": 4}, {"data": 4, "model": 2})):
        name = f"random {k + 1} {mesh_text(mesh)}"
        try:
            space = hybrid_space(graph, MeshAxes.from_mesh(mesh))
            choices = random_conflict_free_choices(space, np.random.default_rng([seed, k]))
            out.append(Candidate(name, "random", Plan.from_groups(cap, graph, space.plan_of(choices), space.axes),
                                 space=mesh_text(mesh)))
        except Exception as err:
            out.append(Skipped(name, reason_of(err)))
    return out


def plan_set(cap: Any, cluster: Any, *, agent: str, budget_seconds: float, seed: int,
             microbatches: int, measure: int = 0, runnable: tuple[Any, Sequence[Any]] | None = None
             ) -> list[Candidate | Skipped]:
    graph = FactorGraph.from_capture(cap)
    return [*built_in_candidates(cap, graph), replicated_candidate(cap, graph),
            *pipeline_candidates(cap, cluster, microbatches),
            *pick_candidates(cap, cluster, agent, budget_seconds, seed, measure, runnable),
            *random_candidates(cap, graph, seed)]


def same_spmd_plan(a: Plan, b: Plan) -> bool:
    """Whether two SPMD plans shard alike over as many devices (two fully replicated plans do,
    whatever their mesh's axes; the step on one device is not the step replicated on eight)."""
    if a.pipeline is not None or b.pipeline is not None:
        return False
    if math.prod(a.mesh_shape.values()) != math.prod(b.mesh_shape.values()):
        return False
    specs_a, specs_b = [p.spec for p in a.parameters], [p.spec for p in b.parameters]
    replicated = all(s is None for spec in specs_a + specs_b for s in spec)
    return specs_a == specs_b and (replicated or a.mesh == b.mesh)


def with_twins(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Each plan that shards as an earlier one of the set (a pick that is the replicated plan)
    names it: both are still timed, but its step is compiled once, and the two rows' round
    medians are pooled into one figure (`hlomap.verify.timing.pooled`)."""
    out = []
    for i, c in enumerate(candidates):
        twin = next((o.name for o in candidates[:i] if same_spmd_plan(o.plan, c.plan)), None)
        note = "; ".join(x for x in (c.note, f"same plan as {twin}" if twin else "") if x)
        out.append(dataclasses.replace(c, note=note, twin=twin))
    return out


# ---------------------------------------------------------------------------------------------
# Predicting and running
# ---------------------------------------------------------------------------------------------


def predict(cap: Any, plan: Plan, cluster: Any, executor: str) -> float:
    """The cost model's step time of `plan` on `cluster`, run by `executor` ("spmd" or "mpmd"):
    the two pipeline executors cost differently. An SPMD plan has no executor to price."""
    pipelined = plan.pipeline is not None
    return float(api.estimate(cap, plan, cluster=cluster, executor=executor if pipelined else None).step_seconds)


def prepare(model: Any, cap: Any, cluster: Any, candidate: Candidate, host_args: tuple[Any, ...],
            step: Any = None) -> Prepared:
    """Build the plan's step (or take `step`, its twin's), give it its own copy of the state (the
    step donates it), and run it once: compiles it, and a plan that fails to run is skipped before
    the timing starts."""
    if step is None:
        pipelined = candidate.plan.pipeline is not None
        step = parallelize(model.train_step(), candidate.plan, executor=candidate.executor,
                           example_args=host_args if pipelined else None)
    executor = step.executor.value if step.executor is not None else "spmd"
    params, opt_state = step.place(host_args[0], host_args[1])
    # Every plan is handed the host batch, as a training loop hands it (the pipeline executors
    # split it into microbatches on the host); the batch of a tiny model is a few hundred KiB.
    run = stateful_step(step, params, opt_state, *host_args[2:])
    jax.block_until_ready(run())
    return Prepared(candidate, executor, predict(cap, candidate.plan, cluster, executor), step, run)


@dataclass(frozen=True)
class ModelResult:
    model: str
    report: FidelityReport | None
    rows: tuple[tuple[Prepared, Any], ...]  # (prepared plan, its TimedRun)
    skipped: tuple[Skipped, ...]
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    setup_seconds: float  # capture, searches, compiles
    timing_seconds: float
    drift: Any = None  # the calibration timed again just before the plans (`check_drift`), or None

    def to_json(self) -> dict[str, Any]:
        notes = {p.candidate.name: p.candidate.note for p, _ in self.rows}
        report = self.report.to_json() if self.report is not None else {"plans": []}
        for row, (_, timed) in zip(report["plans"], self.rows):
            row["note"] = notes[row["name"]]
            row["rounds_seconds"] = list(timed.rounds)
        return {"model": self.model, **report, "skipped": [s.to_json() for s in self.skipped],
                "plans_timed": len(self.rows), "load_average_before": list(self.load_before),
                "load_average_after": list(self.load_after), "setup_seconds": self.setup_seconds,
                "timing_seconds": self.timing_seconds,
                "calibration_drift": None if self.drift is None else {
                    "speed_ratio": self.drift.speed_ratio,
                    "groups": {g.group: g.ratio for g in self.drift.groups()}}}


def bench_model(name: str, cluster: Any, args: argparse.Namespace, console: Console) -> ModelResult:
    load_before = load_average()
    start = time.perf_counter()
    model = zoo.get(name)
    cap = api.load_source(f"zoo:{name}")
    host_args = tuple(jax.tree.map(np.asarray, tuple(model.example_args(args.seed))))
    built = plan_set(cap, cluster, agent=args.agent, budget_seconds=args.budget_seconds, seed=args.seed,
                     microbatches=args.microbatches, measure=args.measure, runnable=(model.train_step(), host_args))
    skipped = [b for b in built if isinstance(b, Skipped)]
    prepared: list[Prepared] = []
    console.print(f"  plan set built in {time.perf_counter() - start:.0f} s", style="dim")
    for candidate in with_twins([b for b in built if isinstance(b, Candidate)]):
        compile_start = time.perf_counter()
        twin = next((p.step for p in prepared if p.candidate.name == candidate.twin), None)
        try:
            prepared.append(prepare(model, cap, cluster, candidate, host_args, twin))
            console.print(f"  compiled {candidate.name} in {time.perf_counter() - compile_start:.1f} s", style="dim")
        except Exception as err:
            skipped.append(Skipped(candidate.name, reason_of(err)))
            console.print(f"  skipped {candidate.name}: {skipped[-1].reason}", style="dim")
    setup_seconds = time.perf_counter() - start
    drift = check_drift(args.cluster, console)
    start = time.perf_counter()
    timed = {}
    if prepared:
        timed = time_interleaved({p.candidate.name: p.run for p in prepared}, rounds=args.rounds, repeats=args.repeats,
                                 on_round=lambda done, total: console.print(f"  round {done}/{total}", style="dim"))
    timing_seconds = time.perf_counter() - start
    load_after = load_average()
    # a pick that is another row's plan was timed in its own row: one plan, one figure
    timed = pooled(timed, {p.candidate.name: p.candidate.twin for p in prepared if p.candidate.twin})
    rows = tuple((p, timed[p.candidate.name]) for p in prepared)
    figures = [PlanFigures(p.candidate.name, p.candidate.kind, p.executor, p.predicted_seconds, t.median, t.iqr,
                           p.candidate.pick, p.candidate.space) for p, t in rows]
    report = fidelity_report(figures) if figures else None
    return ModelResult(name, report, rows, tuple(skipped), load_before, load_after, setup_seconds, timing_seconds,
                       drift)


def check_drift(cluster_argument: str, console: Console) -> Any:
    """The calibration the plans are priced on, its compute samples timed again just before the
    plans are (`api.check_calibration`): how much slower or faster the devices run now than it
    prices them, which every prediction of the model carries. None for a cluster that was not
    measured (a preset, a topology string)."""
    try:
        check = api.check_calibration(cluster_argument)
    except api.InputError:
        return None
    groups = ", ".join(f"{g.group} {g.ratio:.2f}x" for g in check.groups())
    console.print(f"  the calibration timed again: now / then {check.speed_ratio:.2f}x ({groups})", style="dim")
    return check


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------


def print_model(result: ModelResult, console: Console) -> None:
    load = "load average (1, 5, 15 min) before {:.2f} {:.2f} {:.2f}, after {:.2f} {:.2f} {:.2f}".format(
        *result.load_before, *result.load_after)
    console.print(f"{result.model}: {len(result.rows)} plans timed, {len(result.skipped)} skipped; "
                  f"setup {result.setup_seconds:.0f} s, timing {result.timing_seconds:.0f} s; {load}", style="bold")
    report = result.report
    if report is not None:
        table = Table(show_edge=False)
        for column in ("plan", "kind", "executor", "predicted ms", "measured ms", "IQR ms", "rank pred.", "rank meas.",
                       "note"):
            table.add_column(column, justify="right" if ("ms" in column or "rank" in column) else "left")
        for plan, rank_p, rank_m, (prepared, _) in zip(report.plans, report.predicted_ranks, report.measured_ranks,
                                                       result.rows):
            cells = (plan.name, plan.kind, plan.executor, f"{plan.predicted_seconds * 1e3:.2f}",
                     f"{plan.measured_seconds * 1e3:.2f}", f"{plan.iqr_seconds * 1e3:.2f}", str(rank_p), str(rank_m),
                     prepared.candidate.note)
            table.add_row(*(Text(cell) for cell in cells))  # Text: a name's brackets are no markup
        console.print(table)
        rho = "undefined" if math.isnan(report.spearman) else f"{report.spearman:.3f}"
        met = not math.isnan(report.spearman) and report.spearman >= SPEARMAN_GOAL
        console.print(f"  Spearman over all {len(report.plans)} plans: {rho} (goal >= {SPEARMAN_GOAL}: "
                      f"{'met' if met else 'NOT met'}); fastest measured: {report.fastest}")
        for name, slowdown in report.slowdowns.items():
            own = report.space_slowdowns.get(name)
            within = f"; {100 * own[1]:+.1f}% against the fastest its space holds ({own[0]})" if own else ""
            console.print(f"  {name}: {100 * slowdown:+.1f}% against the fastest (goal <= "
                          f"+{100 * PICK_SLOWDOWN_GOAL:.0f}%: {'met' if slowdown <= PICK_SLOWDOWN_GOAL else 'NOT met'})"
                          f"{within}")
    for skip in result.skipped:
        console.print(f"  skipped {skip.name}: {skip.reason}")


#: How close a pipeline's predicted step must come to its measured one (issue 22, part 3).
PIPELINE_GOAL = 0.25


def print_goals(results: Sequence[ModelResult], console: Console) -> None:
    """Per model: its Spearman and its slowest pick against the goals, how many pipelines were
    predicted within `PIPELINE_GOAL` of their measured step, and the calibration's drift."""
    console.print("goals: Spearman >= {:.2f} on every model, every pick within +{:.0f}% of the fastest plan".format(
        SPEARMAN_GOAL, 100 * PICK_SLOWDOWN_GOAL), style="bold")
    for result in results:
        report = result.report
        if report is None:
            console.print(f"  {result.model}: no plan timed")
            continue
        rho = "undefined" if math.isnan(report.spearman) else f"{report.spearman:.3f}"
        worst = max(report.slowdowns.items(), key=lambda item: item[1], default=None)
        slowest = f"slowest pick {worst[0]} {100 * worst[1]:+.1f}%" if worst is not None else "no pick timed"
        met = (not math.isnan(report.spearman) and report.spearman >= SPEARMAN_GOAL
               and all(v <= PICK_SLOWDOWN_GOAL for v in report.slowdowns.values()))
        own = report.space_slowdowns.values()
        within = sum(slowdown <= PICK_SLOWDOWN_GOAL for _, slowdown in own)
        own_text = f"; single-mesh picks within +{100 * PICK_SLOWDOWN_GOAL:.0f}% of their own space's fastest: " \
                   f"{within} of {len(own)}" if own else ""
        console.print(f"  {result.model}: Spearman {rho}, {slowest}: {'met' if met else 'NOT met'}{own_text}")
        ratios = [p.predicted_seconds / p.measured_seconds for p in report.plans if p.kind == "pipeline"]
        if ratios:
            within = sum(abs(r - 1.0) <= PIPELINE_GOAL for r in ratios)
            drift = "" if result.drift is None else f"; the calibration timed again ran {result.drift.speed_ratio:.2f}x"
            console.print(f"    pipelines predicted within {100 * PIPELINE_GOAL:.0f}% of measured: {within} of "
                          f"{len(ratios)} (predicted / measured {min(ratios):.2f}-{max(ratios):.2f}){drift}")


def draw_scatter(results: Sequence[ModelResult], path: Path) -> None:
    """Predicted against measured time per model, log-log, one marker per plan kind, with the
    line where the two agree."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator

    shown = [r for r in results if r.report is not None]
    if not shown:
        return
    figure = Figure(figsize=(4.2 * len(shown), 4.2))
    FigureCanvasAgg(figure)
    markers = {"built-in": "o", "replicated": "s", "pipeline": "^", "pick": "*", "random": "x"}
    for i, result in enumerate(shown):
        axes = figure.add_subplot(1, len(shown), i + 1)
        plans = result.report.plans
        for kind, marker in markers.items():
            of_kind = [p for p in plans if p.kind == kind]
            if of_kind:
                axes.scatter([p.predicted_seconds * 1e3 for p in of_kind], [p.measured_seconds * 1e3 for p in of_kind],
                             marker=marker, label=kind, s=60 if kind == "pick" else 30)
        low = min(min(p.predicted_seconds, p.measured_seconds) for p in plans) * 1e3
        high = max(max(p.predicted_seconds, p.measured_seconds) for p in plans) * 1e3
        axes.plot([low, high], [low, high], color="grey", linewidth=0.8, linestyle="--")
        axes.set_xscale("log")
        axes.set_yscale("log")
        plain = FuncFormatter(lambda value, _: f"{value:g}")
        for axis in (axes.xaxis, axes.yaxis):  # 10, 20, 50, 100 ms: the default's 2x10^1 labels crowd
            axis.set_minor_locator(LogLocator(base=10, subs=(2.0, 5.0)))
            axis.set_major_formatter(plain)
            axis.set_minor_formatter(plain)
        rho = result.report.spearman
        axes.set_title(f"{result.model} (Spearman {'n/a' if math.isnan(rho) else f'{rho:.2f}'})", fontsize=10)
        axes.set_xlabel("predicted ms")
        if i == 0:
            axes.set_ylabel("measured ms (median)")
            axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not 0 or a positive integer")
    return int(text)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help=f"comma-separated zoo models (default {','.join(DEFAULT_MODELS)})")
    parser.add_argument("--rounds", type=positive_int, default=20, help="interleaved timing rounds (default 20)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="timed steps of each plan per round, their median kept (default 3)")
    parser.add_argument("--cluster", default="local",
                        help="the cluster the cost model prices plans on and the picks are explored on: local, a "
                             "preset, a topology string or a JSON file from hlomap calibrate (default local)")
    parser.add_argument("--out", default="bench_fidelity", help="directory for fidelity.json and fidelity.png "
                                                                "(default bench_fidelity)")
    parser.add_argument("--budget-seconds", type=positive_float, default=20.0,
                        help="time limit of each opp, adp and hybrid search (default 20)")
    parser.add_argument("--agent", choices=("exact", "greedy", "dqn", "random"), default="exact",
                        help="the search of the opp, adp and hybrid picks; exact falls back to greedy where the "
                             "space is too large to enumerate (default exact)")
    parser.add_argument("--microbatches", type=positive_int, default=4,
                        help="most microbatches of the pipeline plans (default 4)")
    parser.add_argument("--measure", type=count, default=4, metavar="K",
                        help="also time the auto pick of explore(measure=K), which times its best K candidates "
                             "on these devices and keeps the fastest (default 4; 0: no such row)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the example batch, searches and random plans")
    parser.add_argument("--compile-cache", metavar="DIR",
                        help="keep compiled steps in JAX's persistent cache in DIR, so that a second run compiles "
                             "only the plans that changed (default: off)")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in zoo.names()]
    if not models or unknown:
        parser.error(f"--models {args.models}: unknown zoo model(s) {', '.join(unknown) or '(none given)'}; known: "
                     f"{', '.join(zoo.names())}")
    args.models = models
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # A pipe gets 80 columns from rich, too few for the table: a log is read in an editor. No
    # markup: plan names, notes and compiler messages hold brackets (f32[8,32]).
    console = Console(markup=False) if sys.stdout.isatty() else Console(markup=False, width=200)
    try:
        cluster = api.resolve_cluster(args.cluster).cluster
    except api.user_errors() as err:
        where = "" if "--cluster" in str(err) else f"--cluster {args.cluster}: "  # most messages name it
        print(f"bench_fidelity: {where}{err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        api.check_writable(out / "fidelity.json")
    except (OSError, api.InputError) as err:
        print(f"bench_fidelity: --out {args.out}: {err}", file=sys.stderr)
        return 2
    if cluster.n_devices < DEVICES or jax.device_count() < DEVICES:
        print(f"bench_fidelity: the plans need {DEVICES} devices; --cluster {args.cluster} has "
              f"{cluster.n_devices} and JAX sees {jax.device_count()}", file=sys.stderr)
        return 2
    if args.compile_cache:
        # Compiling dominates a run (tens of seconds per resnet50-tiny plan on a CPU); the cache
        # holds the executables, so the timings are the same with it.
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    device = jax.devices()[0]
    console.print(f"{jax.device_count()} x {device.platform} ({device.device_kind}); cluster {cluster.name}; "
                  f"{args.rounds} rounds of {args.repeats} steps per plan")
    started = time.perf_counter()
    results = []
    for name in args.models:
        console.print(f"{name}: building and compiling the plan set", style="bold")
        results.append(bench_model(name, cluster, args, console))
        print_model(results[-1], console)
    total = time.perf_counter() - started
    record = {"devices": jax.device_count(), "platform": device.platform, "device_kind": device.device_kind,
              "cluster": cluster.name, "cluster_argument": args.cluster, "rounds": args.rounds, "repeats": args.repeats,
              "agent": args.agent, "budget_seconds": args.budget_seconds, "seed": args.seed,
              "jax_version": jax.__version__, "total_seconds": total, "models": [r.to_json() for r in results]}
    (out / "fidelity.json").write_text(json.dumps(record, indent=1) + "\n")
    draw_scatter(results, out / "fidelity.png")
    print_goals(results, console)
    console.print(f"total {total:.0f} s; wrote {out / 'fidelity.json'} and {out / 'fidelity.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
