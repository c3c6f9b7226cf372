"""Whether a calibration still describes the devices: its compute samples timed again now.

A calibrated cluster prices plans at the speed the devices had while `hlomap calibrate` ran. On a
shared machine that speed moves: three calibrations of 8 host CPU devices on a 2-core machine,
made within 25 minutes of each other, fitted an f32 matmul rate of 16.6, 18.9 and 21.4 GFLOP/s
and a memory bandwidth of 1.9, 2.4 and 3.1 GB/s per device, and priced the zoo models' plans
1.5-2.2x apart. `recheck` times the calibration's compute samples again with the same probes,
order and statistics (`reference_plan`; `hlomap.verify.devices`: the median of interleaved
passes), without the collectives. Each `Drift` is one sample's time now over its time then;
`CalibrationCheck.speed_ratio` is their geometric mean, and `groups` the same per kind of sample.
A check is as noisy as a calibration (`STALE_RATIO`): it tells a calibration made on a much
slower or faster machine from one that holds, not a 10% drift.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from statistics import geometric_mean
from typing import Callable

from hlomap.cost.calibration import (
    ALONE_SUFFIX,
    DISPATCH,
    LAUNCH,
    CalibrationError,
    ClusterCalibration,
    Measurement,
)
from hlomap.verify.devices import QUICK_PLAN, BenchPlan, BenchProgress, default_plan, measure_devices

__all__ = ["CalibrationCheck", "Drift", "GroupDrift", "STALE_RATIO", "recheck", "reference_plan"]

#: A calibration whose devices now run this much slower or faster prices plans off by about as
#: much: past it, `CalibrationCheck.stale` says to measure again. Not less: on 8 host CPU devices
#: of a 2-core machine, two full calibrations in one process minutes apart differed by 14% in the
#: geometric mean of their compute samples, and checks right after a calibration read 0.75-0.87x
#: and 1.19x of it: the machine moves that much from minute to minute.
STALE_RATIO = 1.4

#: Runs a reduced calibration (`measure_devices` by default): the device count and the plan.
Measure = Callable[[int, BenchPlan, Callable[[BenchProgress], None] | None], ClusterCalibration]

#: The kinds of sample a check reports apart, in the order it shows them.
GROUPS = ("matmul", "matmul alone", "narrow product", "memory-bound op", "memory-bound op alone", "kernel-launch step",
          "dispatch")


@dataclass(frozen=True)
class Drift:
    """One reference sample: its seconds in the calibration and now."""

    label: str
    group: str  # one of GROUPS
    calibrated_seconds: float
    now_seconds: float

    @property
    def ratio(self) -> float:
        """now / then: above 1 the devices run slower than the calibration prices them."""
        return self.now_seconds / self.calibrated_seconds


@dataclass(frozen=True)
class GroupDrift:
    """The drifts of one kind of sample: how many, their geometric mean, lowest and highest."""

    group: str
    samples: int
    ratio: float
    lowest: float
    highest: float


@dataclass(frozen=True)
class CalibrationCheck:
    """What a check found (`recheck`): each reference sample then and now, when the calibration
    was made, and the load average as the check started."""

    drifts: tuple[Drift, ...]
    measured_at: str
    load_average: float

    @property
    def speed_ratio(self) -> float:
        """The geometric mean of the samples' now / then (1: as calibrated)."""
        return geometric_mean([d.ratio for d in self.drifts])

    def groups(self) -> tuple[GroupDrift, ...]:
        """The drifts per kind of sample (`GROUPS` order)."""
        out = []
        for group in GROUPS:
            ratios = [d.ratio for d in self.drifts if d.group == group]
            if ratios:
                out.append(GroupDrift(group, len(ratios), geometric_mean(ratios), min(ratios), max(ratios)))
        return tuple(out)

    @property
    def stale(self) -> bool:
        """Whether the devices run more than `STALE_RATIO` slower or faster than calibrated."""
        return not 1.0 / STALE_RATIO <= self.speed_ratio <= STALE_RATIO


def reference_plan(calibration: ClusterCalibration) -> BenchPlan:
    """The reduced calibration a check runs: every compute sample of the plan that made
    `calibration` (the quick plan when its largest matmul is the quick plan's, else the default
    plan of its backend): matmuls, narrow products, memory-bound ops and launch steps, in the same
    interleaved passes, so that each runs after the same neighbours and finds the caches as the
    calibration did (the memory-bound op of 2 MiB per device, timed again among five samples only,
    read 1.4-2.0x its calibrated time in three checks); and the dispatch, but no collective."""
    sides = [round((m.flops / 2.0) ** (1.0 / 3.0)) for m in calibration.kernels if m.kind == "dot" and not m.width]
    quick = bool(sides) and max(sides) == max(QUICK_PLAN.matmul_sizes)
    plan = QUICK_PLAN if quick else default_plan(calibration.backend)
    return replace(plan, message_sizes=(), combined_buffers=())


def _drifts(then: ClusterCalibration, now: ClusterCalibration) -> tuple[Drift, ...]:
    """Each sample of `now` that `then` also holds: kernels by name, launch steps by kernel
    count, the dispatch."""
    kernels = {m.name: m for m in then.kernels}
    out = [Drift(m.name, _kernel_group(m), kernels[m.name].seconds, m.seconds) for m in now.kernels if m.name in kernels]
    comm = {(s.kind, s.nbytes): s for s in then.comm if s.kind in (LAUNCH, DISPATCH)}
    for s in now.comm:
        if (s.kind, s.nbytes) in comm:
            group, label = (("dispatch", "dispatch") if s.kind == DISPATCH
                            else ("kernel-launch step", f"launch step of {s.nbytes:g} kernels"))
            out.append(Drift(label, group, comm[(s.kind, s.nbytes)].seconds, s.seconds))
    return tuple(out)


def _kernel_group(m: Measurement) -> str:
    if not m.matrix:
        return "memory-bound op alone" if m.name.endswith(ALONE_SUFFIX) else "memory-bound op"
    if m.width:
        return "narrow product"
    return "matmul alone" if m.name.endswith(ALONE_SUFFIX) else "matmul"


def _measure(count: int, plan: BenchPlan, on_progress: Callable[[BenchProgress], None] | None) -> ClusterCalibration:
    return measure_devices(count, plan=plan, on_progress=on_progress)


def recheck(calibration: ClusterCalibration, *, on_progress: Callable[[BenchProgress], None] | None = None,
            measure: Measure = _measure) -> CalibrationCheck:
    """Time `calibration`'s reference samples again on the same number of the present devices
    (`reference_plan`). CalibrationError when JAX sees fewer devices or another backend, or when
    nothing of the calibration could be timed again."""
    import jax

    from hlomap.verify.timing import load_average

    if not any(m.matrix and m.fit for m in calibration.kernels):
        raise CalibrationError("the calibration holds no matmul samples, the figures every plan's compute is priced "
                               "by: nothing to time again that would say whether it holds")
    backend = jax.default_backend()
    if backend != calibration.backend:
        raise CalibrationError(f"the calibration measured {calibration.backend} devices; JAX runs on {backend}")
    now = measure(calibration.n_devices, reference_plan(calibration), on_progress)
    drifts = _drifts(calibration, now)
    if not drifts:
        raise CalibrationError("none of the calibration's samples could be timed again (a calibration of another "
                               "hlomap version?)")
    return CalibrationCheck(drifts, calibration.measured_at, (now.load_average or (load_average()[0],))[0])
