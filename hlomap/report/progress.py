"""Progress for the library's progress callbacks: bars for a search's (`search.tracker.Progress`)
and an agent's training loop's (`agents.loop.LoopProgress`), and a line per phase of a long job
that has no fraction to show (`hlomap run`: building, compiling, running, comparing).

Each is a context manager yielding the callback to pass on (None when disabled), so the library
itself only reports and the caller decides whether anything is drawn:

    with training_bar(not quiet) as on_progress:
        run_loop(env, agent, config, on_progress=on_progress)

Rich is imported inside the functions that draw, so the library stays importable (and fast to
import) without it.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Callable, Iterator

from hlomap.agents.loop import LoopProgress
from hlomap.report.units import counted
from hlomap.search.tracker import Progress

__all__ = ["calibration_bar", "measure_bar", "phase_reporter", "progress_bar", "training_bar"]


@contextlib.contextmanager
def progress_bar(enabled: bool = True, *, description: str = "explore") -> Iterator[Callable[[Progress], None] | None]:
    """A rich progress bar fed by a driver's `on_progress` callback; yields None when disabled.

        with progress_bar(not quiet) as on_progress:
            explore_detailed(cap, ..., on_progress=on_progress)
    """
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress as Bar, TextColumn, TimeElapsedColumn

    # on stderr: stdout may carry the result (`--json`), which must stay parseable
    bar = Bar(TextColumn(f"[bold]{description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
              TimeElapsedColumn(), TextColumn("{task.fields[stats]}"), transient=False, console=Console(stderr=True))
    task = bar.add_task(description, total=1000, stats="")

    def update(p: Progress) -> None:
        bar.update(task, completed=int(1000 * p.fraction),
                   stats=f"{p.driver.value}: best {p.best:.4g}, last {p.last:.4g}, {counted(p.evaluations, 'evaluation')}")

    with bar:
        yield update
        bar.update(task, completed=1000)


def training_stats(p: LoopProgress) -> str:
    """`ep 12  return 3.5  best 7  loss 0.012  epsilon 0.41  replay 48`: what the bar shows."""
    parts = [f"ep {p.episodes}"]
    if p.mean_return is not None:
        parts.append(f"return {p.mean_return:.3g}")
    if p.best_return is not None:
        parts.append(f"best {p.best_return:.3g}")
    if p.loss is not None:
        parts.append(f"loss {p.loss:.3g}")
    parts += [f"{name} {value:.3g}" for name, value in p.metrics.items()]
    return "  ".join(parts)


@contextlib.contextmanager
def training_bar(enabled: bool = True, *, description: str = "train",
                 console: Any = None) -> Iterator[Callable[[LoopProgress], None] | None]:
    """A rich progress bar (steps of the run, mean return, best, loss, the agent's metrics) fed by
    `run_loop`'s `on_progress`; yields None when disabled. `console`: a rich Console to draw on,
    so that what the caller prints on it appears above the bar."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

    bar = Bar(TextColumn(f"[bold]{description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
              TextColumn("{task.fields[stats]}"), console=console)
    # The total is known from the first report (a resumed run also starts part-way).
    task = bar.add_task(description, total=None, stats="")

    def update(p: LoopProgress) -> None:
        bar.update(task, total=p.total, completed=p.step, stats=training_stats(p))

    with bar:
        yield update


def phase_line(phase: str, started: float, now: float) -> str:
    """`[  12.3 s] compiling the plan ...`: the time since the job started, then the phase."""
    return f"[{now - started:7.1f} s] {phase} ..."


@contextlib.contextmanager
def phase_reporter(enabled: bool = True, *, stream: Any = None) -> Iterator[Callable[[str], None] | None]:
    """A callback that writes one line per phase as it starts, on stderr (stdout may carry
    `--json`); yields None when disabled. For jobs that sit minutes in one call (compiling a
    big step), so that the user sees what is going on."""
    if not enabled:
        yield None
        return
    out = stream if stream is not None else sys.stderr
    started = time.monotonic()

    def report(phase: str) -> None:
        print(phase_line(phase, started, time.monotonic()), file=out, flush=True)

    yield report


@contextlib.contextmanager
def calibration_bar(enabled: bool = True) -> Iterator[Callable[[Any], None] | None]:
    """A rich progress bar fed by `api.calibrate`'s `on_progress` (a `verify.devices.BenchProgress`:
    samples done of all, the last one's name), on stderr; yields None when disabled."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

    bar = Bar(TextColumn("[bold]calibrate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
              TextColumn("{task.fields[label]}"), console=Console(stderr=True))
    task = bar.add_task("calibrate", total=None, label="")

    def update(p: Any) -> None:
        bar.update(task, total=p.total, completed=p.done, label=p.label)

    with bar:
        yield update


@contextlib.contextmanager
def measure_bar(enabled: bool = True, *, description: str = "measure") -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar fed by a measured selection's `on_round(done, rounds)`, on stderr;
    yields None when disabled. Compiling the candidates comes before the first round."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

    bar = Bar(TextColumn(f"[bold]{description}"), BarColumn(), MofNCompleteColumn(), TextColumn("rounds"),
              TimeElapsedColumn(), console=Console(stderr=True))
    task = bar.add_task(description, total=None)

    def update(done: int, rounds: int) -> None:
        bar.update(task, total=rounds, completed=done)

    with bar:
        yield update
