"""Timing competing runnables fairly on a shared, noisy machine.

Plans are compared by running each one's step in interleaved rounds: every round times each
runnable `repeats` times (after `warmup` untimed calls in the first round) and keeps the median,
and the order of the runnables rotates from round to round, so that drift in the machine's load
and position effects (caches, the allocator) hit every candidate alike. A runnable's figure is the
median of its round medians; the interquartile range of the round medians says how far to trust it.

    runs = {"data=8": stateful_step(dp_step, params, opt_state, batch), ...}
    timed = time_interleaved(runs, rounds=20)
    timed["data=8"].median, timed["data=8"].iqr

The clock and the way a result is waited for are arguments, so that tests drive the loop with a
fake clock and never assert on wall time.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

#: Untimed calls of every runnable before the first timed round: the first compiles, the second
#: touches the donated buffers' new layout.
DEFAULT_WARMUP = 2


@dataclass(frozen=True)
class TimedRun:
    """The round medians of one runnable, in seconds, in round order."""

    name: str
    rounds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.rounds)

    @property
    def iqr(self) -> float:
        """Interquartile range of the round medians (0 for fewer than two rounds)."""
        if len(self.rounds) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.rounds, n=4, method="inclusive")
        return q3 - q1

    @property
    def relative_spread(self) -> float:
        """IQR over median: a noise figure comparable across runnables of different speeds."""
        return self.iqr / self.median if self.median > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "median_seconds": self.median, "iqr_seconds": self.iqr,
                "rounds": list(self.rounds)}


def pooled(runs: Mapping[str, TimedRun], same_as: Mapping[str, str]) -> dict[str, TimedRun]:
    """Every run with the round medians of all the runs of its plan: `same_as` maps a run to an
    earlier run of the same plan (a pick that is another entry's plan is timed in its own row,
    compiled once). One plan timed twice is one plan: its two rows' medians differ by noise only
    (eight host devices on two cores timed one step 15.04 and 16.75 ms in two rows), and comparing
    the rows as two plans would call a plan slower than itself. Runs keep their own names; the
    pooled rounds are the group's, in the order of `runs`."""
    root = {name: same_as.get(name, name) for name in runs}
    while any(root.get(r, r) != r for r in root.values()):  # a twin of a twin: follow to the first
        root = {name: root.get(r, r) for name, r in root.items()}
    groups: dict[str, list[float]] = {}
    for name, run in runs.items():
        groups.setdefault(root[name], []).extend(run.rounds)
    return {name: TimedRun(name, tuple(groups[root[name]])) for name in runs}


def block_until_ready(value: Any) -> Any:
    """Wait for JAX arrays in `value` (imported late: this module is importable without JAX)."""
    import jax

    return jax.block_until_ready(value)


def rotated(names: Sequence[str], round_index: int) -> list[str]:
    """`names` started at position `round_index` (mod len): round r times the r-th name first."""
    if not names:
        return []
    shift = round_index % len(names)
    return list(names[shift:]) + list(names[:shift])


def time_interleaved(runs: Mapping[str, Callable[[], Any]], *, rounds: int, repeats: int = 3,
                     warmup: int = DEFAULT_WARMUP, budget_seconds: float | None = None, min_rounds: int = 1,
                     clock: Callable[[], float] = time.perf_counter,
                     wait: Callable[[Any], Any] = block_until_ready,
                     on_round: Callable[[int, int], None] | None = None) -> dict[str, TimedRun]:
    """Time every runnable in `runs` in up to `rounds` interleaved rounds (module docstring).

    budget_seconds: stop after the round that crosses this much time spent timing (warm-up
      included), but never before `min_rounds` rounds; None: no limit.
    on_round(done, rounds): called after each round (a progress bar's hook).
    Returns a TimedRun per name, in the order of `runs`.
    """
    if rounds < 1 or repeats < 1:
        raise ValueError(f"rounds = {rounds!r} and repeats = {repeats!r} must be >= 1")
    names = list(runs)
    start = clock()
    for name in names:
        for _ in range(warmup):
            wait(runs[name]())
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in rotated(names, r):
            times = []
            for _ in range(repeats):
                t0 = clock()
                wait(runs[name]())
                times.append(clock() - t0)
            samples[name].append(statistics.median(times))
        if on_round is not None:
            on_round(r + 1, rounds)
        if budget_seconds is not None and r + 1 >= min_rounds and clock() - start >= budget_seconds:
            break
    return {name: TimedRun(name, tuple(samples[name])) for name in names}


def stateful_step(step: Callable[..., Any], params: Any, opt_state: Any, *rest: Any) -> Callable[[], Any]:
    """A zero-argument runnable calling `step(params, opt_state, *rest)` on its own previous
    outputs: the step donates its state, so each call must be handed the last call's."""
    state = [params, opt_state]

    def run() -> Any:
        out = step(state[0], state[1], *rest)
        state[0], state[1] = out[0], out[1]
        return out

    return run


def load_average() -> tuple[float, float, float]:
    """The 1-, 5- and 15-minute load averages (zeros where the platform has none)."""
    try:
        return os.getloadavg()
    except (AttributeError, OSError):
        return (0.0, 0.0, 0.0)
