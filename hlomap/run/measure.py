"""Measured selection: compile candidate plans on the present devices, time them in interleaved
rounds (`hlomap.verify.timing`) and keep the measured fastest.

    prepare = step_preparer(step, example_args)          # compiles a plan, returns a runnable
    chosen = measure_candidates(candidates, prepare, rounds=10, budget_seconds=60)
    chosen.plan, chosen.measurement                      # the fastest, and every candidate's figures

A candidate that fails to compile or run is recorded with its error and left out of the timing;
only when every candidate fails is it an error (`MeasureError`). How a plan becomes a runnable,
the clock and the wait are arguments, so that tests drive the whole selection with a fake clock
and runnables that cost what the test says, and never read wall time.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hlomap.plan import MeasuredCandidate, Measurement, Plan
from hlomap.tasks.candidates import Candidate
from hlomap.verify.timing import TimedRun, block_until_ready, load_average, stateful_step, time_interleaved

__all__ = ["DEFAULT_MEASURE", "MeasureError", "MeasureSettings", "MeasuredSelection", "Prepare", "measure_candidates",
           "measures_elsewhere", "runs_where_planned", "step_preparer"]

#: A plan -> a zero-argument runnable of one step under it, already compiled and run once.
Prepare = Callable[[Plan], Callable[[], Any]]


def runs_where_planned(cluster_devices: Sequence[str], device_kind: str, platform: str) -> bool:
    """Whether a plan priced on a cluster of devices named `cluster_devices` runs where it was
    planned, on present devices of this kind and platform: every priced device is named as the
    present ones (JAX's `device_kind` or platform, case aside), as a cluster calibrated on this
    machine is (`hlomap calibrate`, `cluster="local"`). A preset of V100s priced while JAX runs on
    CPUs is not: timing its candidates here would not say which is fastest there."""
    present = {device_kind.strip().lower(), platform.strip().lower()}
    return bool(cluster_devices) and all(name.strip().lower() in present for name in cluster_devices)


def measures_elsewhere(cluster: Any, device_kind: str, platform: str, devices: int) -> str | None:
    """Why timing candidates priced on `cluster` on the present devices (`devices` of this kind
    and platform) would not choose among them for the cluster they were planned for, or None when
    the plan runs where it was planned (`runs_where_planned`)."""
    names = [d.name for d in cluster.devices]
    if runs_where_planned(names, device_kind, platform):
        return None
    return (f"measuring times the candidates on this machine's {devices} {platform} device(s), but they were planned "
            f"for cluster {cluster.name!r} ({names[0] if names else 'no devices'}): the plan chosen will be the "
            f"fastest here, not necessarily there (plan on the `local` cluster for these devices)")


class MeasureError(RuntimeError):
    """Every candidate failed to compile or run: there is nothing to choose from."""


@dataclass(frozen=True)
class MeasureSettings:
    """How candidates are timed: `count` candidates (raised to one per family and the pick,
    `select_candidates`), up to `rounds` interleaved rounds of `repeats` steps each, stopping
    after the round that crosses `budget_seconds` of timing (compiles not counted; at least
    `min_rounds`). `clock`, `wait` and `prepare` replace the real ones in tests."""

    count: int = 0
    rounds: int = 10
    repeats: int = 3
    budget_seconds: float | None = 60.0
    min_rounds: int = 2
    clock: Callable[[], float] = time.perf_counter
    wait: Callable[[Any], Any] = block_until_ready
    prepare: Prepare | None = None

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 0:
            raise ValueError(f"measure = {self.count!r}: give the number of candidates to time (0: do not measure)")
        for name, value in (("measure_rounds", self.rounds), ("measure_repeats", self.repeats)):
            if value < 1:
                raise ValueError(f"{name} = {value!r}: must be >= 1")
        if self.budget_seconds is not None and self.budget_seconds <= 0:
            raise ValueError(f"measure_budget_seconds = {self.budget_seconds!r}: must be positive (or None)")

    @property
    def enabled(self) -> bool:
        return self.count > 0


#: No measuring (`hlomap.explore`'s default).
DEFAULT_MEASURE = MeasureSettings()


@dataclass(frozen=True)
class MeasuredSelection:
    """The measured fastest candidate's plan (its `measured` section filled in) and the record;
    `measurement` None when there was one distinct candidate: nothing to choose, nothing timed."""

    plan: Plan
    chosen: Candidate
    measurement: Measurement | None


def step_preparer(step: Callable[..., Any], example_args: Sequence[Any]) -> Prepare:
    """A `Prepare` that runs `step(params, opt_state, *rest)` under a plan with
    `hlomap.parallelize`: each plan gets its own host copy of the example arguments (the step
    donates its state, and the user's arrays must survive), is placed, compiled and run once."""
    import jax
    import numpy as np

    host = tuple(jax.tree.map(np.asarray, tuple(example_args)))

    def prepare(plan: Plan) -> Callable[[], Any]:
        from hlomap.run import parallelize

        fresh = jax.tree.map(lambda x: np.array(x, copy=True), host)
        parallel = parallelize(step, plan, example_args=fresh if plan.pipeline is not None else None)
        params, opt_state = parallel.place(fresh[0], fresh[1])
        run = stateful_step(parallel, params, opt_state, *fresh[2:])
        block_until_ready(run())  # compiles; an error here is the candidate's
        return run

    return prepare


def _error_text(err: BaseException) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first}"[:500]


def measure_candidates(candidates: Sequence[Candidate], prepare: Prepare, settings: MeasureSettings, *,
                       devices: int, platform: str,
                       on_round: Callable[[int, int], None] | None = None) -> MeasuredSelection:
    """Prepare every candidate (failures recorded), time the rest in interleaved rounds and return
    the measured fastest, with every candidate's predicted and measured figures. Raises
    MeasureError when every candidate fails."""
    start = settings.clock()
    runs: dict[str, Callable[[], Any]] = {}
    errors: dict[str, str] = {}
    for candidate in candidates:
        try:
            runs[candidate.name] = prepare(candidate.plan)
        except Exception as err:  # noqa: BLE001 - a candidate that cannot run is reported, not fatal
            errors[candidate.name] = _error_text(err)
    if not runs:
        raise MeasureError("no candidate plan compiled and ran on the present devices: "
                           + "; ".join(f"{name}: {text}" for name, text in errors.items()))
    # The preparation ran each step once (compiling it); one more untimed call settles the
    # donated buffers' layout before the first timed round.
    timed = time_interleaved(runs, rounds=settings.rounds, repeats=settings.repeats, warmup=1,
                             budget_seconds=settings.budget_seconds, min_rounds=settings.min_rounds,
                             clock=settings.clock, wait=settings.wait, on_round=on_round)
    records = tuple(_record(c, timed.get(c.name), errors.get(c.name)) for c in candidates)
    fastest = min((c for c in candidates if c.name in timed), key=lambda c: timed[c.name].median)
    measurement = Measurement(records, fastest.name, devices, platform, load_average(), settings.clock() - start)
    return MeasuredSelection(dataclasses.replace(fastest.plan, measured=measurement), fastest, measurement)


def _record(candidate: Candidate, timed: TimedRun | None, error: str | None) -> MeasuredCandidate:
    if timed is None:
        return MeasuredCandidate(candidate.name, candidate.family.value, candidate.predicted_seconds, error=error)
    return MeasuredCandidate(candidate.name, candidate.family.value, candidate.predicted_seconds, timed.median,
                             timed.iqr, len(timed.rounds))
