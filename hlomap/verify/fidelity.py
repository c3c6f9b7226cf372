"""How well the cost model orders plans: predicted against measured step times of one model's plans.

`scripts/bench_fidelity.py` prices every plan of a set with the cost model, times them all with
`hlomap.verify.timing.time_interleaved`, and summarizes each model with `fidelity_report`: the
Spearman rank correlation of predicted and measured times over every plan kind, each plan's rank
under both, and how much slower than the fastest measured plan each explorer's pick ran.

    figures = [PlanFigures("data=8", "built-in", "spmd", predicted, timed.median, timed.iqr), ...]
    report = fidelity_report(figures)
    report.spearman, report.slowdowns["opp pick"], report.space_slowdowns["opp pick"]

The helpers the script needs to build its plan set live here too, where tests reach them:
`pipeline_microbatches` (a microbatch count whose microbatches split over a stage's devices) and
`random_conflict_free_choices` (a uniformly drawn valid plan of a sharding search space).
Nothing here imports JAX.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

__all__ = ["EVERY_SPACE", "FidelityReport", "PlanFigures", "fidelity_report", "pipeline_microbatches",
           "random_conflict_free_choices", "ranks", "space_slowdowns", "spearman"]

#: `PlanFigures.space` of a plan every search space holds (every tensor replicated).
EVERY_SPACE = "*"


@dataclass(frozen=True)
class PlanFigures:
    """One plan of a fidelity set: what the cost model predicted and what its step measured.

    kind: where the plan came from ("built-in", "replicated", "pipeline", "pick", "random");
    executor: what ran it ("spmd" for SPMD plans and the spmd pipeline executor, "mpmd");
    pick: whether an explorer chose it (its slowdown against the fastest plan is a goal).
    space: the search space that holds the plan, for a single-mesh explorer's pick the space it
    searched (such as "model=8"); `EVERY_SPACE` for a plan every space holds (all replicated);
    None for one no single-mesh explorer could choose (pipelines, auto's picks).
    """

    name: str
    kind: str
    executor: str
    predicted_seconds: float
    measured_seconds: float
    iqr_seconds: float
    pick: bool = False
    space: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "executor": self.executor,
                "predicted_seconds": self.predicted_seconds, "measured_seconds": self.measured_seconds,
                "iqr_seconds": self.iqr_seconds, "pick": self.pick, "space": self.space}


@dataclass(frozen=True)
class FidelityReport:
    """A model's plans with their ranks (1: fastest), the rank correlation and the picks' slowdowns."""

    plans: tuple[PlanFigures, ...]
    predicted_ranks: tuple[int, ...]
    measured_ranks: tuple[int, ...]
    spearman: float  # NaN when fewer than two plans, or one side has a single value
    fastest: str  # the fastest measured plan
    slowdowns: Mapping[str, float]  # pick name -> its measured time over the fastest one's, minus 1
    # pick name -> (the fastest measured plan its own space holds, the pick's slowdown against it):
    # an opp pick on model=8 cannot match a faster data x model plan its explorer never saw
    space_slowdowns: Mapping[str, tuple[str, float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"plans": [dict(p.to_json(), predicted_rank=r, measured_rank=m)
                          for p, r, m in zip(self.plans, self.predicted_ranks, self.measured_ranks)],
                "spearman": None if math.isnan(self.spearman) else self.spearman,
                "fastest": self.fastest, "slowdowns": dict(self.slowdowns),
                "space_slowdowns": {name: {"fastest": fastest, "slowdown": slowdown}
                                    for name, (fastest, slowdown) in self.space_slowdowns.items()}}


def ranks(values: Sequence[float]) -> tuple[int, ...]:
    """Rank of each value, 1 for the smallest; equal values share the best (lowest) rank of their
    tie, as a table reader expects ("1, 1, 3")."""
    order = sorted(values)
    return tuple(order.index(v) + 1 for v in values)


def spearman(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Spearman's rank correlation of the two (scipy's, average ranks for ties); NaN where it is
    undefined (fewer than two plans, or every value on one side equal) rather than scipy's warning."""
    if len(predicted) != len(measured):
        raise ValueError(f"{len(predicted)} predicted times against {len(measured)} measured ones")
    if len(predicted) < 2 or len(set(predicted)) < 2 or len(set(measured)) < 2:
        return math.nan
    from scipy.stats import spearmanr

    return float(spearmanr(predicted, measured).statistic)


def fidelity_report(plans: Iterable[PlanFigures]) -> FidelityReport:
    """Ranks, Spearman and the picks' slowdowns of one model's timed plans."""
    plans = tuple(plans)
    if not plans:
        raise ValueError("no plan was timed: nothing to compare")
    predicted = [p.predicted_seconds for p in plans]
    measured = [p.measured_seconds for p in plans]
    fastest = min(plans, key=lambda p: p.measured_seconds)
    slowdowns = {p.name: p.measured_seconds / fastest.measured_seconds - 1.0 for p in plans if p.pick}
    return FidelityReport(plans, ranks(predicted), ranks(measured), spearman(predicted, measured), fastest.name,
                          slowdowns, space_slowdowns(plans))


def space_slowdowns(plans: Sequence[PlanFigures]) -> dict[str, tuple[str, float]]:
    """Each single-mesh pick's slowdown against the fastest measured plan of its own space: the
    plans of the same `space`, and those every space holds."""
    out = {}
    for pick in plans:
        if not pick.pick or pick.space is None or pick.space == EVERY_SPACE:
            continue
        peers = [p for p in plans if p.space in (pick.space, EVERY_SPACE)]
        fastest = min(peers, key=lambda p: p.measured_seconds)
        out[pick.name] = (fastest.name, pick.measured_seconds / fastest.measured_seconds - 1.0)
    return out


def pipeline_microbatches(batch: int, stages: int, devices: int, preferred: int = 4) -> int | None:
    """The most microbatches, at most `preferred`, that split `batch` evenly and leave each
    microbatch divisible by a stage's share of the devices (`devices // stages`), so that a
    pipeline can use every device; None when no count does (the pipeline explorer then narrows
    the stages itself, and the caller may still use `preferred` if it divides `batch`)."""
    if batch < 1 or stages < 1 or devices < stages or preferred < 1:
        raise ValueError(f"batch {batch}, stages {stages}, devices {devices}, preferred {preferred}: need "
                         "batch >= 1, 1 <= stages <= devices and preferred >= 1")
    per_stage = devices // stages
    for count in range(min(preferred, batch), 0, -1):
        if batch % count == 0 and (batch // count) % per_stage == 0:
            return count
    return None


def random_conflict_free_choices(space: Any, rng: np.random.Generator) -> np.ndarray:
    """A valid plan drawn from a sharding search space (`hlomap.tasks.sharding.space.ShardingSpace`):
    positions decided in the space's order, each uniformly among the actions that conflict with
    nothing decided before it (replicating always does not). Unlike the random search driver,
    which keeps the best of its draws under the cost model, this is one draw, whatever it costs;
    and unlike an episode it never stops at a conflict, so later positions are drawn too."""
    choices = space.empty_choices()
    plan = space.plan_of(choices)
    for position in range(space.num_positions):
        legal = np.flatnonzero(space.legal_now(plan, position))
        choice = int(rng.choice(legal)) - 1 if legal.size else -1  # action 0 replicates, k is option k - 1
        choices[position] = choice
        space.set_choice(plan, position, choice)
    return choices
