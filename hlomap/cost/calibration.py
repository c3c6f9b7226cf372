"""Calibration profiles: efficiency factors of a device preset fitted to measured kernel times.

The roofline of `hlomap.cost.compute` prices a kernel at max(flops / (peak x efficiency),
bytes / hbm_bandwidth). Datasheet peaks are never reached, so a profile carries the two factors
that turn them into what a real device achieves, fitted from timed kernels:

    profile = fit_calibration(measurements, device_preset("H100-80GB"), backend="gpu", ...)
    profile.save("h100.json")
    cluster = apply_calibration(load_cluster("cluster.json"), load_calibration("h100.json"))

- `compute_efficiency` replaces `DeviceSpec.efficiency`: achieved / peak FLOP/s of compute-bound
  kernels (large dots);
- `bandwidth_efficiency` scales `DeviceSpec.hbm_bandwidth`: achieved / datasheet bytes/s of
  memory-bound kernels (elementwise ops, reductions, skinny dots).

`scripts/calibrate_gpu.py` times the kernels and writes a profile; `hlomap simulate` and
`hlomap explore` load one with `--profile FILE`.

A whole-cluster calibration (`hlomap calibrate`, `ClusterCalibration`) measures the present
devices instead of correcting a preset: matmul efficiency curves per dtype (`fit_matmul_curves`),
the memory bandwidth (`fit_memory_bandwidth`) and each collective, transfer and dispatch as an
alpha-beta fit per group size (`fit_comm`); `calibrated_cluster` maps the fits onto an ordinary
Cluster, and the cluster file keeps the fits and raw samples under its "calibration" key.

JSON (units: FLOPs, bytes, seconds):
    {"format": "hlomap-calibration", "version": 1, "device": "H100-80GB",
     "compute_efficiency": 0.71, "bandwidth_efficiency": 0.88,
     "backend": "gpu", "device_kind": "NVIDIA H100 80GB HBM3", "jax_version": "0.4.35",
     "measured_at": "2025-01-01T00:00:00+00:00", "notes": ["..."],
     "measurements": [{"name": "dot_bf16_4096", "kind": "dot", "dtype": "bf16",
                       "flops": 1.37e11, "bytes": 1.0e8, "seconds": 2.0e-4, "fit": true}, ...]}
"""

from __future__ import annotations

import enum
import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from hlomap.cost.cluster import Cluster
from hlomap.cost.collectives import AlphaBeta, Collective
from hlomap.cost.compute import flop_rate
from hlomap.cost.devices import MATRIX_KINDS, DeviceSpec, NarrowCurve
from hlomap.cost.measured import EXECUTORS, Fit, executor_units, measured_costs

#: The "format" field of a profile file, so that a cluster or plan JSON passed by mistake is
#: recognized as such rather than failing on a missing field.
FORMAT = "hlomap-calibration"
VERSION = 1


#: A kernel counts as compute- (memory-) bound when its roofline compute time is at least this
#: many times its memory time (or the reverse). Kernels near the ridge point are limited by both
#: (and by latency), so neither factor can be read off their time; they are left out of the fit.
RIDGE_MARGIN = 2.0

#: Rounds of classify-then-fit. Classes usually settle in two or three rounds; the cap only
#: guards against a pathological data set flipping one kernel back and forth.
MAX_ROUNDS = 20

#: Smallest efficiency a profile stores: DeviceSpec needs a positive factor, and anything this
#: small is a broken measurement (or a CPU timed against a GPU preset), not a device.
MIN_EFFICIENCY = 1e-6

_PROFILE_FIELDS = ("format", "version", "device", "compute_efficiency", "bandwidth_efficiency", "measurements",
                   "backend", "device_kind", "jax_version", "measured_at", "notes")
_REQUIRED_FIELDS = ("device", "compute_efficiency", "bandwidth_efficiency", "measurements")
_MEASUREMENT_FIELDS = ("name", "kind", "dtype", "flops", "bytes", "seconds", "fit", "width")


class CalibrationError(ValueError):
    """A calibration profile (file, fit or application) that cannot be used; says which and why."""


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    """One timed kernel (or a whole step): what it does and how long it took.

    `dtype` is the HLO element type whose peak applies (the operand type of a dot); `kind` says
    whether that is the matrix-unit rate (`MATRIX_KINDS`) or the vector rate. `fit` False keeps
    a measurement out of the fit (whole train steps, diagnostics) but in the file, so that the
    report it backs can be checked later.
    """

    name: str
    kind: str
    dtype: str
    flops: float
    bytes_accessed: float
    seconds: float
    fit: bool = True
    width: int = 0  # a narrow matrix sample's narrowest side (`fit_narrow_curves`); 0: none

    def __post_init__(self) -> None:
        for label, value in (("flops", self.flops), ("bytes", self.bytes_accessed)):
            if not (math.isfinite(value) and value >= 0):
                raise CalibrationError(f"measurement {self.name!r}: {label} = {value!r} must be finite and >= 0")
        if not (math.isfinite(self.seconds) and self.seconds > 0):
            raise CalibrationError(f"measurement {self.name!r}: seconds = {self.seconds!r} must be finite and positive")

    @property
    def matrix(self) -> bool:
        return self.kind in MATRIX_KINDS

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "dtype": self.dtype, "flops": self.flops,
                "bytes": self.bytes_accessed, "seconds": self.seconds, "fit": self.fit,
                **({"width": self.width} if self.width else {})}

    @classmethod
    def from_json(cls, data: Any, *, where: str) -> Measurement:
        if not isinstance(data, Mapping):
            raise CalibrationError(f"{where}: expected an object, got {data!r}")
        missing = [k for k in _MEASUREMENT_FIELDS if k not in data and k not in ("fit", "width")]
        if missing:
            raise CalibrationError(f"{where}: missing field(s) {missing}")
        unknown = sorted(set(data) - set(_MEASUREMENT_FIELDS))
        if unknown:
            raise CalibrationError(f"{where}: unknown field(s) {unknown}")
        fit = data.get("fit", True)
        if not isinstance(fit, bool):
            raise CalibrationError(f"{where}.fit: expected true or false, got {fit!r}")
        try:
            return cls(name=_string(data["name"], f"{where}.name"), kind=_string(data["kind"], f"{where}.kind"),
                       dtype=_string(data["dtype"], f"{where}.dtype"),
                       flops=_number(data["flops"], f"{where}.flops"),
                       bytes_accessed=_number(data["bytes"], f"{where}.bytes"),
                       seconds=_number(data["seconds"], f"{where}.seconds"), fit=fit,
                       width=int(_number(data.get("width", 0), f"{where}.width")))
        except CalibrationError as err:
            msg = str(err)
            raise CalibrationError(msg if msg.startswith(where) else f"{where}: {msg}") from None


@dataclass(frozen=True)
class Calibration:
    """Fitted efficiency factors of one device kind, with the measurements behind them.

    `device` is the DeviceSpec name the profile applies to. `backend`, `device_kind`,
    `jax_version` and `measured_at` say where and when it was measured (JAX's
    `default_backend()`, `devices()[0].device_kind`, an ISO 8601 time); `notes` what the fit
    decided (kernels left out, factors clamped, warnings).
    """

    device: str
    compute_efficiency: float
    bandwidth_efficiency: float
    measurements: tuple[Measurement, ...] = ()
    backend: str = ""
    device_kind: str = ""
    jax_version: str = ""
    measured_at: str = ""
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "measurements", tuple(self.measurements))
        object.__setattr__(self, "notes", tuple(self.notes))
        for label, value in (("compute_efficiency", self.compute_efficiency),
                             ("bandwidth_efficiency", self.bandwidth_efficiency)):
            if not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise CalibrationError(f"field {label!r}: expected a number in (0, 1], got {value!r}")
        if not self.device:
            raise CalibrationError("field 'device': expected a device name, got an empty string")

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "device": self.device,
            "compute_efficiency": self.compute_efficiency, "bandwidth_efficiency": self.bandwidth_efficiency,
            "backend": self.backend, "device_kind": self.device_kind, "jax_version": self.jax_version,
            "measured_at": self.measured_at, "notes": list(self.notes),
            "measurements": [m.to_json() for m in self.measurements],
        }

    @classmethod
    def from_json(cls, data: Any, *, source: str = "<dict>") -> Calibration:
        """Build from the object of `to_json`; errors name `source` and the field."""
        return _profile_from_json(data, source)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def load_calibration(path: str | Path) -> Calibration:
    """Read a profile written by `Calibration.save`; errors name the file and the field."""
    path = Path(path)
    if not path.is_file():
        raise CalibrationError(f"{path}: no such profile file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CalibrationError(f"{path}:{err.lineno}:{err.colno}: invalid JSON: {err.msg}") from None
    except UnicodeDecodeError as err:
        raise CalibrationError(f"{path}: not a text file ({err.reason} at byte {err.start})") from None
    return Calibration.from_json(data, source=str(path))


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise CalibrationError(f"{where}: expected a string, got {value!r}")
    return value


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalibrationError(f"{where}: expected a number, got {value!r}")
    return float(value)


def _profile_from_json(data: Any, source: str) -> Calibration:
    if not isinstance(data, Mapping):
        raise CalibrationError(f"{source}: expected a JSON object, got {type(data).__name__}")
    if data.get("format", FORMAT) != FORMAT:
        raise CalibrationError(f"{source}: field 'format': expected {FORMAT!r}, got {data['format']!r} "
                               f"(is this a calibration profile?)")
    if data.get("version", VERSION) != VERSION:
        raise CalibrationError(f"{source}: field 'version': this hlomap reads version {VERSION}, "
                               f"got {data['version']!r}")
    missing = [k for k in _REQUIRED_FIELDS if k not in data]
    if missing:
        raise CalibrationError(f"{source}: missing field(s) {missing}")
    unknown = sorted(set(data) - set(_PROFILE_FIELDS))
    if unknown:
        raise CalibrationError(f"{source}: unknown field(s) {unknown}")
    raw = data["measurements"]
    if not isinstance(raw, list):
        raise CalibrationError(f"{source}: field 'measurements': expected a list, got {type(raw).__name__}")
    notes = data.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise CalibrationError(f"{source}: field 'notes': expected a list of strings, got {notes!r}")
    text = {k: _string(data.get(k, ""), f"{source}: field {k!r}")
            for k in ("device", "backend", "device_kind", "jax_version", "measured_at")}
    measurements = tuple(Measurement.from_json(m, where=f"{source}: field 'measurements'[{i}]")
                         for i, m in enumerate(raw))
    efficiency = {k: _number(data[k], f"{source}: field {k!r}")
                  for k in ("compute_efficiency", "bandwidth_efficiency")}
    try:
        return Calibration(measurements=measurements, notes=tuple(notes), **text, **efficiency)
    except CalibrationError as err:
        raise CalibrationError(f"{source}: {err}") from None


# ---------------------------------------------------------------------------------------------
# Fitting
# ---------------------------------------------------------------------------------------------


class Bound(enum.Enum):
    """Which side of the roofline limits a kernel."""

    COMPUTE = "compute"
    MEMORY = "memory"
    RIDGE = "ridge"  # within RIDGE_MARGIN of the ridge point: left out of the fit


def ideal_seconds(m: Measurement, device: DeviceSpec) -> tuple[float, float]:
    """(compute, memory) seconds of `m` at the device's datasheet peak and bandwidth, the
    efficiency-free parts of the roofline in `hlomap.cost.compute`."""
    return m.flops / flop_rate(device, m.dtype, m.matrix), m.bytes_accessed / device.hbm_bandwidth


def predicted_seconds(m: Measurement, device: DeviceSpec, compute_efficiency: float,
                      bandwidth_efficiency: float) -> float:
    """The roofline time of `m` with the given factors."""
    compute, memory = ideal_seconds(m, device)
    return max(compute / compute_efficiency, memory / bandwidth_efficiency)


def classify(m: Measurement, device: DeviceSpec, compute_efficiency: float, bandwidth_efficiency: float,
             margin: float = RIDGE_MARGIN) -> Bound:
    """The bound of `m` under the given factors (a kernel with no work of one kind is bound by
    the other, however small)."""
    compute, memory = ideal_seconds(m, device)
    compute, memory = compute / compute_efficiency, memory / bandwidth_efficiency
    if compute >= margin * memory and compute > 0:
        return Bound.COMPUTE
    if memory >= margin * compute and memory > 0:
        return Bound.MEMORY
    return Bound.RIDGE


def _median_efficiency(ms: Sequence[Measurement], device: DeviceSpec, side: int) -> float:
    """Median over `ms` of ideal time / measured time on one side (0 compute, 1 memory). The
    median, not a mean or least squares: one kernel hit by a clock dip or a cold cache should
    not move the factor that every other kernel agrees on."""
    return statistics.median(ideal_seconds(m, device)[side] / m.seconds for m in ms)


def _clamped(raw: float, label: str, what: str) -> tuple[float, list[str]]:
    if raw > 1:
        return 1.0, [f"{label} {raw:.3g} > 1 clamped to 1: the {what} ran faster than the preset's datasheet "
                     f"figure (a preset peak too low for them, e.g. f32 dots on TF32 tensor cores, data "
                     f"resident in cache, or a timing error)"]
    if raw < MIN_EFFICIENCY:
        return MIN_EFFICIENCY, [f"{label} {raw:.3g} raised to {MIN_EFFICIENCY:g}: a device this far below "
                                f"its preset is a wrong preset or a broken measurement"]
    return raw, []


def fit_calibration(measurements: Iterable[Measurement], device: DeviceSpec, *, margin: float = RIDGE_MARGIN,
                backend: str = "", device_kind: str = "", jax_version: str = "",
                measured_at: str = "") -> Calibration:
    """Fit the compute and bandwidth efficiencies of `device` to timed kernels.

    Compute-bound kernels give the compute efficiency (ideal compute time / measured time),
    memory-bound ones the bandwidth efficiency (ideal memory time / measured time), each the
    median over its kernels. Which side bounds a kernel depends on the factors being fitted (a
    dot just past the datasheet ridge point is memory-bound when the tensor cores reach 70% and
    HBM 95%), so classification and fit alternate until the classes settle, starting from the
    datasheet roofline. A side with no kernels keeps the preset's value (compute: the device's
    efficiency; bandwidth: 1, the cost model's assumption). Factors are clamped to
    (MIN_EFFICIENCY, 1], because the cost model treats the datasheet as an upper bound; the
    profile's notes say when and why.
    """
    all_ms = tuple(measurements)
    used = [m for m in all_ms if m.fit]
    if not used:
        raise CalibrationError(f"no measurements to fit for {device.name!r} "
                               f"({len(all_ms)} given, none marked fit)")
    if margin < 1:
        raise CalibrationError(f"margin = {margin!r} must be >= 1")
    compute_eff, bandwidth_eff = 1.0, 1.0
    classes: tuple[Bound, ...] = ()
    converged = False
    for _ in range(MAX_ROUNDS):
        new = tuple(classify(m, device, compute_eff, bandwidth_eff, margin) for m in used)
        if new == classes:
            converged = True
            break
        classes = new
        compute_ms = [m for m, b in zip(used, classes) if b is Bound.COMPUTE]
        memory_ms = [m for m, b in zip(used, classes) if b is Bound.MEMORY]
        compute_eff = _median_efficiency(compute_ms, device, 0) if compute_ms else device.efficiency
        bandwidth_eff = _median_efficiency(memory_ms, device, 1) if memory_ms else 1.0
    notes = _fit_notes(used, classes, device, compute_eff, bandwidth_eff, margin, len(all_ms) - len(used))
    if not converged:
        notes.append(f"kernel classes still changing after {MAX_ROUNDS} rounds; the last round's fit is kept")
    compute_final, why = _clamped(compute_eff, "compute efficiency", "compute-bound kernels")
    notes += why
    bandwidth_final, why = _clamped(bandwidth_eff, "bandwidth efficiency", "memory-bound kernels")
    notes += why
    return Calibration(device=device.name, compute_efficiency=compute_final,
                              bandwidth_efficiency=bandwidth_final, measurements=all_ms, backend=backend,
                              device_kind=device_kind, jax_version=jax_version, measured_at=measured_at,
                              notes=tuple(notes))


def _fit_notes(used: Sequence[Measurement], classes: Sequence[Bound], device: DeviceSpec, compute_eff: float,
               bandwidth_eff: float, margin: float, excluded: int) -> list[str]:
    """What the fit rests on, one line per side, plus what it left out."""
    notes: list[str] = []
    for bound, side, value, label in ((Bound.COMPUTE, 0, compute_eff, "compute efficiency"),
                                      (Bound.MEMORY, 1, bandwidth_eff, "bandwidth efficiency")):
        ms = [m for m, b in zip(used, classes) if b is bound]
        if not ms:
            kept = f"the preset's {device.efficiency:g}" if side == 0 else "1 (full datasheet bandwidth)"
            notes.append(f"{label}: no {bound.value}-bound kernel measured; kept at {kept}")
            continue
        each = [ideal_seconds(m, device)[side] / m.seconds for m in ms]
        notes.append(f"{label} {value:.3g}: median of {len(ms)} {bound.value}-bound kernel(s), "
                     f"range {min(each):.3g}..{max(each):.3g}")
    ridge = [m.name for m, b in zip(used, classes) if b is Bound.RIDGE]
    if ridge:
        notes.append(f"left out, within {margin:g}x of the ridge point: {', '.join(ridge)}")
    if excluded:
        notes.append(f"{excluded} measurement(s) marked fit=false (steps, diagnostics) not fitted")
    return notes


# ---------------------------------------------------------------------------------------------
# Applying
# ---------------------------------------------------------------------------------------------


def calibrated_device(device: DeviceSpec, profile: Calibration) -> DeviceSpec:
    """`device` with the profile's compute efficiency and its HBM bandwidth scaled by the
    profile's bandwidth efficiency (the cost model reads bytes / hbm_bandwidth, so scaling the
    bandwidth is how a bandwidth efficiency enters it). The name is kept: reports still say
    which hardware it is."""
    return replace(device, efficiency=profile.compute_efficiency,
                   hbm_bandwidth=device.hbm_bandwidth * profile.bandwidth_efficiency)


def apply_calibration(cluster: Cluster, profile: Calibration) -> Cluster:
    """`cluster` with every device named like the profile's (case-insensitive) calibrated; the
    links are untouched. Raises CalibrationError when no device matches. Apply a profile once:
    the bandwidth is scaled, so a second application would scale it again."""
    wanted = profile.device.lower()
    if not any(d.name.lower() == wanted for d in cluster.devices):
        kinds = ", ".join(sorted({d.name for d in cluster.devices}))
        raise CalibrationError(f"calibration profile for {profile.device!r} matches no device of cluster "
                               f"{cluster.name!r} (its devices: {kinds})")
    devices = tuple(calibrated_device(d, profile) if d.name.lower() == wanted else d for d in cluster.devices)
    return replace(cluster, devices=devices)


# ---------------------------------------------------------------------------------------------
# Whole-cluster calibration (`hlomap calibrate`): fits of microbenchmarks on the present devices
# ---------------------------------------------------------------------------------------------

#: What a `CommSample` times besides the five collectives: a `jax.device_put` from one device to
#: another (a stage-to-stage send) and a trivial jitted call (the fixed cost of one dispatch).
TRANSFER = "transfer"
DISPATCH = "dispatch"
#: A train step of tiny layers on every device at once: its `nbytes` is hlomap's count of its kernels,
#: so the fit's seconds per "byte" is the cost of launching one kernel inside a program.
LAUNCH = "launch"
#: One all-reduce of many small buffers, as XLA's combiner makes of the gradients: its `nbytes`
#: counts the buffers, so the fit's seconds per "byte" is what each buffer adds (on host CPU
#: devices the buffers are reduced one after another; NCCL reduces them as one).
COMBINED = "combined-all-reduce"
COMM_KINDS = frozenset({c.value for c in Collective} | {TRANSFER, DISPATCH, LAUNCH, COMBINED})


@dataclass(frozen=True)
class CommSample:
    """One timed communication (or dispatch): `kind` (a Collective's value, TRANSFER or
    DISPATCH), over `group` devices, `nbytes` per device's buffer, median `seconds` of repeats."""

    kind: str
    group: int
    nbytes: float
    seconds: float

    def __post_init__(self) -> None:
        if self.kind not in COMM_KINDS:
            raise CalibrationError(f"sample kind {self.kind!r}: expected one of {sorted(COMM_KINDS)}")
        if self.group < 1:
            raise CalibrationError(f"{self.kind} sample: group = {self.group!r} must be >= 1")
        if not (math.isfinite(self.nbytes) and self.nbytes >= 0):
            raise CalibrationError(f"{self.kind} sample: nbytes = {self.nbytes!r} must be finite and >= 0")
        if not (math.isfinite(self.seconds) and self.seconds > 0):
            raise CalibrationError(f"{self.kind} sample: seconds = {self.seconds!r} must be finite and positive")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "group": self.group, "bytes": self.nbytes, "seconds": self.seconds}


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
    """Least-squares `t = alpha + beta * n` over samples (n, t), weighted by 1/t so that every
    size counts by its relative error (samples span orders of magnitude; unweighted, the largest
    would decide alone). A negative intercept (noise on a pure bandwidth curve) is refitted
    through the origin and a negative slope (a size-independent time) through a flat line: the
    model's terms are non-negative."""
    if len(sizes) != len(seconds) or not sizes:
        raise CalibrationError(f"alpha-beta fit needs matching, non-empty samples (got {len(sizes)} sizes, "
                               f"{len(seconds)} times)")
    n = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    w = 1.0 / t
    if len(set(n.tolist())) >= 2:
        design = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
        (alpha, beta), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    else:
        alpha, beta = -1.0, -1.0
    if alpha >= 0 and beta >= 0:
        return AlphaBeta(float(alpha), float(beta))
    slope = float(np.sum(w * w * n * t) / np.sum(w * w * n * n)) if np.any(n > 0) else 0.0
    if alpha < 0 and slope > 0 and beta >= 0:
        return AlphaBeta(0.0, slope)
    return AlphaBeta(float(np.sum(w * w * t) / np.sum(w * w)), 0.0)


def rate_of(fit: AlphaBeta, sizes: Sequence[float], seconds: Sequence[float]) -> float:
    """1 / beta (bytes or FLOPs per second), or, when the fit found no size-dependent term, the
    best rate a sample achieved: a finite figure the cluster file can hold."""
    if fit.beta > 0:
        return 1.0 / fit.beta
    return max(n / s for n, s in zip(sizes, seconds))


@dataclass(frozen=True)
class MatmulCurve:
    """The fitted matmul efficiency curve of one dtype: `t = overhead + flops / peak`, so the
    achieved rate `flops / t` rises with size towards `peak` (one number would misprice either
    the small or the large dots). `points` are (flops, achieved FLOP/s) of the samples."""

    dtype: str
    peak_flops: float
    overhead_seconds: float
    points: tuple[tuple[float, float], ...]

    def rate(self, flops: float) -> float:
        """Fitted achieved FLOP/s of a matmul of `flops` FLOPs."""
        return flops / (self.overhead_seconds + flops / self.peak_flops)

    def efficiency(self, flops: float) -> float:
        """Fitted achieved / peak at `flops`."""
        return self.rate(flops) / self.peak_flops

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "peak_flops": self.peak_flops, "overhead_seconds": self.overhead_seconds,
                "points": [list(p) for p in self.points]}


def fit_matmul_curves(measurements: Iterable[Measurement]) -> tuple[MatmulCurve, ...]:
    """One curve per dtype of the matrix-kind measurements, sorted by dtype."""
    by_dtype: dict[str, list[Measurement]] = {}
    for m in measurements:
        if m.matrix and m.fit and not m.width:  # narrow samples have a curve of their own
            by_dtype.setdefault(m.dtype, []).append(m)
    curves = []
    for dtype, ms in sorted(by_dtype.items()):
        flops = [m.flops for m in ms]
        times = [m.seconds for m in ms]
        fit = fit_alpha_beta(flops, times)
        points = tuple(sorted((m.flops, m.flops / m.seconds) for m in ms))
        curves.append(MatmulCurve(dtype, rate_of(fit, flops, times), fit.alpha, points))
    return tuple(curves)


#: A narrow sample whose compute time is within this factor of its memory time is explained by
#: the roofline's memory side and says nothing about the matrix rate.
NARROW_MEMORY_MARGIN = 1.5


def narrow_shares(measurements: Iterable[Measurement], device: DeviceSpec, overhead: float,
                  kind: str) -> list[tuple[int, float]]:
    """(width, share of the matrix rate) of each narrow `kind` sample (`Measurement.width`) the
    roofline's memory side does not explain: its time less `overhead` (what the program around
    one kernel costs: the matmul curve's intercept) against `device`'s rate, at most 1."""
    points = []
    for m in measurements:
        if m.kind != kind or not m.width or not m.fit:
            continue
        compute = max(m.seconds - overhead, 1e-12)
        if compute <= NARROW_MEMORY_MARGIN * m.bytes_accessed / device.hbm_bandwidth:
            continue
        share = m.flops / (compute * flop_rate(device, m.dtype, True) * device.efficiency)
        points.append((m.width, min(1.0, share)))
    return sorted(points)


def fit_narrow_curve(points: Sequence[tuple[int, float]]) -> NarrowCurve | None:
    """The `NarrowCurve` through measured (width, share) points: the geometric mean share per
    width, made non-decreasing in width (the running maximum: a narrower product is never
    faster, so a dip is noise). None without points, or when every width ran at full rate."""
    by_width: dict[int, list[float]] = {}
    for width, share in points:
        by_width.setdefault(int(width), []).append(max(share, 1e-9))
    curve = []
    best = 0.0
    for width in sorted(by_width):
        best = max(best, float(np.exp(np.mean(np.log(by_width[width])))))
        curve.append((float(width), min(1.0, best)))
    if not curve or curve[0][1] >= 1.0:
        return None
    return NarrowCurve(tuple(curve))


def fit_narrow_curves(measurements: Sequence[Measurement], device: DeviceSpec, overhead: float,
                      reference_width: float) -> dict[str, NarrowCurve]:
    """The narrow curve of each matrix kind whose narrow samples show one (`fit_narrow_curve`).
    The dots' curve ends at the square matmul of side `reference_width` that set the matrix
    rate (share 1 by definition)."""
    curves = {}
    for kind in MATRIX_KINDS:
        points = narrow_shares(measurements, device, overhead, kind)
        if kind == "dot" and points and reference_width > max(w for w, _ in points):
            points.append((int(reference_width), 1.0))
        curve = fit_narrow_curve(points)
        if curve is not None:
            curves[kind] = curve
    return curves


def fit_memory_bandwidth(measurements: Iterable[Measurement]) -> AlphaBeta:
    """Alpha-beta fit of the memory-bound (non-matrix) measurements' bytes against time: beta is
    seconds per byte of the device memory, alpha the fixed cost of a kernel."""
    ms = [m for m in measurements if not m.matrix and m.fit]
    if not ms:
        raise CalibrationError("no memory-bound measurement to fit a bandwidth to")
    return fit_alpha_beta([m.bytes_accessed for m in ms], [m.seconds for m in ms])


@dataclass(frozen=True)
class CommFit:
    """Latency and bandwidth of one kind of communication over one group size."""

    kind: str
    group: int
    latency: float
    bandwidth: float
    samples: int

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "group": self.group, "latency": self.latency, "bandwidth": self.bandwidth,
                "samples": self.samples}


def fit_comm(samples: Iterable[CommSample]) -> tuple[CommFit, ...]:
    """An alpha-beta fit per (kind, group size), in the order of COMM_KINDS' sorted names and
    group size. DISPATCH samples fit too (bandwidth then says nothing; latency is the overhead)."""
    groups: dict[tuple[str, int], list[CommSample]] = {}
    for s in samples:
        groups.setdefault((s.kind, s.group), []).append(s)
    fits = []
    for (kind, group), ss in sorted(groups.items()):
        sizes = [s.nbytes for s in ss]
        times = [s.seconds for s in ss]
        fit = fit_alpha_beta(sizes, times)
        bandwidth = rate_of(fit, sizes, times) if any(sizes) else math.inf
        fits.append(CommFit(kind, group, fit.alpha, bandwidth, len(ss)))
    return tuple(fits)


#: The name suffix of a kernel timed on one device while the others idle (the other kernels run on
#: every device at once).
ALONE_SUFFIX = "_alone"


def alone_pairs(kernels: Iterable[Measurement]) -> list[tuple[Measurement, float]]:
    """Each kernel timed alone (`ALONE_SUFFIX`) whose all-busy twin was timed too, with how much
    faster it ran alone (the twin's seconds over its own; at least 1)."""
    by_name = {m.name: m for m in kernels}
    return [(m, max(1.0, by_name[name.removesuffix(ALONE_SUFFIX)].seconds / m.seconds))
            for name, m in by_name.items()
            if name.endswith(ALONE_SUFFIX) and name.removesuffix(ALONE_SUFFIX) in by_name]


def solo_speedup(kernels: Iterable[Measurement]) -> float:
    """How much faster one device ran the largest matmul alone than while every device ran one
    (>= 1; 1 without such a pair): devices that share hardware (host CPU devices share cores)
    compute faster when fewer of them work."""
    matmuls = [(m.flops, speedup) for m, speedup in alone_pairs(kernels) if m.matrix]
    return max(matmuls)[1] if matmuls else 1.0


def alone_curves(kernels: Iterable[Measurement]) -> tuple[tuple[tuple[float, float], ...], ...]:
    """(matmul points (flops, speedup), memory-bound points (bytes, speedup)) of the kernels timed
    alone and all busy (`MeasuredCosts.alone_dot`, `alone_memory`); a size timed twice keeps its
    first pair. Each curve never falls with size: a point above a larger kernel's speedup takes
    that one. Why: the smallest samples time the programs' start more than their kernels (eight
    devices starting a program of a 32 KiB op on 2 cores took 225 us, one alone 9 us: 25x, where
    128 KiB gained 4.6x), and in a step that start is paid once, not per kernel."""
    dot: dict[float, float] = {}
    memory: dict[float, float] = {}
    for m, speedup in alone_pairs(kernels):
        if m.matrix:
            dot.setdefault(m.flops, speedup)
        else:
            memory.setdefault(m.bytes_accessed, speedup)
    return _never_falling(dot), _never_falling(memory)


def _never_falling(points: Mapping[float, float]) -> tuple[tuple[float, float], ...]:
    """`points` by size, each speedup at most every larger size's (the minimum from the right)."""
    out: list[tuple[float, float]] = []
    lowest = math.inf
    for size, speedup in sorted(points.items(), reverse=True):
        lowest = min(lowest, speedup)
        out.append((size, lowest))
    return tuple(reversed(out))


@dataclass(frozen=True)
class ExecutorSample:
    """One timed pipeline step of a near-empty model (`hlomap.run.calibrate`): `executor` ("spmd"
    or "mpmd") over `stages` stages and `microbatches` microbatches took `seconds`; the model's
    passes move `buffers` per microbatch (`hlomap.cost.estimate.pass_buffers`) on stages of
    `stage_devices` devices."""

    executor: str
    stages: int
    microbatches: int
    seconds: float
    buffers: float = 0.0
    stage_devices: float = 1.0  # devices per stage, on average

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise CalibrationError(f"executor sample: executor {self.executor!r}, expected one of {sorted(EXECUTORS)}")
        if self.stages < 1 or self.microbatches < 1:
            raise CalibrationError(f"{self.executor} executor sample: stages = {self.stages!r} and microbatches = "
                                   f"{self.microbatches!r} must be >= 1")
        if not (math.isfinite(self.seconds) and self.seconds > 0):
            raise CalibrationError(f"{self.executor} executor sample: seconds = {self.seconds!r} must be finite and positive")
        if not (math.isfinite(self.buffers) and self.buffers >= 0):
            raise CalibrationError(f"{self.executor} executor sample: buffers = {self.buffers!r} must be >= 0")
        if not (math.isfinite(self.stage_devices) and self.stage_devices >= 1):
            raise CalibrationError(f"{self.executor} executor sample: stage_devices = {self.stage_devices!r} must be "
                                   ">= 1")

    @property
    def units(self) -> int:
        return executor_units(self.executor, self.stages, self.microbatches)

    @property
    def moved(self) -> float:
        """Buffers the step's passes moved, one per device of a stage: `buffers` per microbatch
        on each of `stage_devices` devices."""
        return self.microbatches * self.buffers * self.stage_devices

    def to_json(self) -> dict[str, Any]:
        return {"executor": self.executor, "stages": self.stages, "microbatches": self.microbatches,
                "seconds": self.seconds, "buffers": self.buffers, "stage_devices": self.stage_devices}


@dataclass(frozen=True)
class ExecutorFit:
    """An executor's cost per step: `fixed + per_unit x units + per_buffer x buffers moved`."""

    step: Fit  # latency = fixed, bandwidth = 1 / per_unit
    per_buffer: float


def fit_executor_terms(samples: Iterable[ExecutorSample]) -> dict[str, ExecutorFit]:
    """`fixed + per_unit x units + per_buffer x moved` per executor
    (`hlomap.cost.measured.executor_units`, `ExecutorSample.moved`). An executor timed on models
    of one buffer count only gets no per-buffer term: the relative-error alpha-beta fit of
    `fixed + per_unit x units` (one sample: no per-unit term either). With two or more counts,
    least squares on all three terms weighted by 1 / seconds; a term that comes out negative is
    dropped and the rest fitted again (the model's terms are non-negative)."""
    by_executor: dict[str, list[ExecutorSample]] = {}
    for s in samples:
        by_executor.setdefault(s.executor, []).append(s)
    fits = {}
    for name, ss in sorted(by_executor.items()):
        if len({s.buffers for s in ss}) < 2:
            fit = fit_alpha_beta([float(s.units) for s in ss], [s.seconds for s in ss])
            fits[name] = ExecutorFit(Fit(fit.alpha, math.inf if fit.beta <= 0 else 1.0 / fit.beta), 0.0)
            continue
        fits[name] = _three_term_fit(ss)
    return fits


def _three_term_fit(samples: Sequence[ExecutorSample]) -> ExecutorFit:
    t = np.asarray([s.seconds for s in samples])
    columns = np.stack([np.ones_like(t), [float(s.units) for s in samples], [s.moved for s in samples]], axis=1)
    kept = [0, 1, 2]
    while True:
        design = columns[:, kept] / t[:, None]
        coefficients, *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
        if np.all(coefficients >= 0) or len(kept) == 1:
            break
        kept.pop(int(np.argmin(coefficients)))
    terms = dict.fromkeys(range(3), 0.0) | {k: max(0.0, float(c)) for k, c in zip(kept, coefficients)}
    return ExecutorFit(Fit(terms[0], math.inf if terms[1] <= 0 else 1.0 / terms[1]), terms[2])


@dataclass(frozen=True)
class HandBackSample:
    """The spmd executor handing a step's state back as the user's pytrees, timed on its own
    (`hlomap.run.calibrate`): `leaves` arrays, each sliced out of the executor's rows onto the
    `stage_devices` devices of its stage, took `seconds`."""

    leaves: float
    stage_devices: float
    seconds: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.leaves) and self.leaves >= 1):
            raise CalibrationError(f"hand-back sample: leaves = {self.leaves!r} must be >= 1")
        if not (math.isfinite(self.stage_devices) and self.stage_devices >= 1):
            raise CalibrationError(f"hand-back sample: stage_devices = {self.stage_devices!r} must be >= 1")
        if not (math.isfinite(self.seconds) and self.seconds > 0):
            raise CalibrationError(f"hand-back sample: seconds = {self.seconds!r} must be finite and positive")

    @property
    def buffers(self) -> float:
        """One buffer per leaf and device of its stage."""
        return self.leaves * self.stage_devices

    def to_json(self) -> dict[str, Any]:
        return {"leaves": self.leaves, "stage_devices": self.stage_devices, "seconds": self.seconds}


def fit_hand_back(samples: Iterable[HandBackSample]) -> float:
    """Seconds per buffer of the spmd executor's hand-back (`HandBackSample.buffers`): the slope
    of a least-squares line through the samples (its intercept, a cost per call whatever the
    state, is already in the executor's fixed cost, timed on a model of few leaves); 0 where
    fewer than two buffer counts were timed or the slope comes out negative."""
    samples = list(samples)
    if len({s.buffers for s in samples}) < 2:
        return 0.0
    slope = float(np.polyfit([s.buffers for s in samples], [s.seconds for s in samples], 1)[0])
    return max(0.0, slope)


def fit_executors(samples: Iterable[ExecutorSample]) -> dict[str, Fit]:
    """`fixed + per_unit x units` per executor (`fit_executor_terms`, without the per-buffer term)."""
    return {name: fit.step for name, fit in fit_executor_terms(samples).items()}


#: The key of a calibrated cluster file that holds the fits and the raw samples; `load_cluster`
#: reads the rest of the file as an ordinary cluster and ignores it.
CLUSTER_CALIBRATION_KEY = "calibration"
#: The "format" of that object: not a profile (`FORMAT`), which `load_calibration` would read.
CLUSTER_FORMAT = "hlomap-cluster-calibration"
#: 2: kernels timed on every device at once; the cluster carries its measured collectives.
#: 3: kernel launches timed on a train step of tiny layers, counted as the estimate counts them
#: (version 2 timed a chain of tiny matmuls; its files still load, and their launch fit is theirs).
#: 4: each sample is the lower quartile of its timed calls, not the median (less moved by load).
#: 5: narrow dots and convolutions timed (`fit_narrow_curves`).
#: 6: the combined all-reduce timed over every group size, not only all devices; the mpmd
#: executor also on a model of many buffers; host devices' solo speedup at most devices / cores.
#: 7: convolutions whose window reaches past their input timed too (`OVERSIZED_CONVOLUTION`).
#: 8: the cluster of host CPU devices records the cores they share (`MeasuredCosts.cores`).
#: 9: the compute samples are the median of interleaved passes (`hlomap.verify.devices`).
#: 10: the spmd executor's hand-back of the state timed on its own (`HandBackSample`).
#: 11: every matmul and memory-bound op also timed on one device alone (`alone_curves`).
CLUSTER_VERSION = 11


#: Load average per core above which a calibration's start counts as busy (`busy_warning`).
BUSY_LOAD_PER_CORE = 0.5


@dataclass(frozen=True)
class ClusterCalibration:
    """Everything one calibration of the present devices measured, and where and when.

    `kernels` are the matmuls (kind "dot") and memory-bound ops timed on one device; `comm` the
    collectives, transfers and dispatches. The fits are derived, not stored, so they always
    agree with the samples. `memory_bytes` is what the backend says one device may allocate.
    """

    backend: str
    device_kind: str
    n_devices: int
    memory_bytes: float
    kernels: tuple[Measurement, ...]
    comm: tuple[CommSample, ...]
    jax_version: str = ""
    hlomap_version: str = ""
    measured_at: str = ""
    wall_seconds: float = 0.0
    executors: tuple[ExecutorSample, ...] = ()
    hand_backs: tuple[HandBackSample, ...] = ()
    load_average: tuple[float, ...] = ()  # the 1-minute load average when it started and when it ended
    cores: int = 0  # the host's CPU cores (what a load average is measured against)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernels", tuple(self.kernels))
        object.__setattr__(self, "comm", tuple(self.comm))
        object.__setattr__(self, "executors", tuple(self.executors))
        object.__setattr__(self, "hand_backs", tuple(self.hand_backs))
        if self.n_devices < 1:
            raise CalibrationError(f"n_devices = {self.n_devices!r} must be >= 1")
        if not (math.isfinite(self.memory_bytes) and self.memory_bytes > 0):
            raise CalibrationError(f"memory_bytes = {self.memory_bytes!r} must be finite and positive")

    @property
    def matmul_curves(self) -> tuple[MatmulCurve, ...]:
        return fit_matmul_curves(self.kernels)

    def busy_warning(self) -> str | None:
        """A warning when the host was busy as this calibration started (1-minute load average
        above half its cores): other work only adds time, so every sample, and every plan priced
        on them, reads slower than the devices are. None when it was idle or nothing was recorded."""
        if not self.load_average or self.cores < 1 or self.load_average[0] <= BUSY_LOAD_PER_CORE * self.cores:
            return None
        return (f"the machine was busy when the calibration started (1-minute load average "
                f"{self.load_average[0]:.2f} on {self.cores} cores): other work slows the samples, so the cluster "
                "prices every plan slower than the devices are; calibrate again on an idle machine")

    @property
    def solo_speedup(self) -> float:
        """How much faster one device computes alone than with all busy, as the cluster prices it:
        the largest matmul's ratio (`solo_speedup`), on host CPU devices at most devices / cores.
        A host device runs a step's kernels on about one thread, so n devices on c cores each get
        c / n of a core when all work and one core alone; only a large matmul spreads over every
        core. On 8 devices of a 2-core machine two calibrations timed the matmul 4.7x and 10.2x
        faster alone, while whole train steps on one device (bert-tiny, resnet50-tiny at batches of 2
        and 8) measured what a speedup of 3.9-4.4 prices: the matmul's figure priced a one-device
        stage up to twice too fast."""
        measured = solo_speedup(self.kernels)
        if self.backend != "cpu" or self.cores < 1:
            return measured
        return max(1.0, min(measured, self.n_devices / self.cores))

    @property
    def memory_fit(self) -> AlphaBeta:
        return fit_memory_bandwidth(self.kernels)

    @property
    def comm_fits(self) -> tuple[CommFit, ...]:
        return fit_comm(self.comm)

    @property
    def executor_fits(self) -> dict[str, Fit]:
        return fit_executors(self.executors)

    def figures(self) -> dict[str, float]:
        """The fitted figures by name (what a report table shows and two runs are compared on)."""
        out: dict[str, float] = {}
        for curve in self.matmul_curves:
            out[f"matmul {curve.dtype} peak FLOP/s"] = curve.peak_flops
            out[f"matmul {curve.dtype} overhead s"] = curve.overhead_seconds
        memory = self.memory_fit
        fitted = [m for m in self.kernels if not m.matrix and m.fit]
        out["memory bandwidth B/s"] = rate_of(memory, [m.bytes_accessed for m in fitted], [m.seconds for m in fitted])
        for fit in self.comm_fits:
            if fit.kind == DISPATCH:
                out["dispatch s"] = fit.latency
                continue
            if fit.kind in (LAUNCH, COMBINED):
                # the launch step runs on every device; the combined all-reduce over each group size
                label = ("kernel launch s" if fit.kind == LAUNCH
                         else f"combined all-reduce x{fit.group} per buffer s")
                out[label] = 1.0 / fit.bandwidth if math.isfinite(fit.bandwidth) else 0.0
                continue
            out[f"{fit.kind} x{fit.group} latency s"] = fit.latency
            out[f"{fit.kind} x{fit.group} bandwidth B/s"] = fit.bandwidth
        out["solo speedup"] = self.solo_speedup
        out["solo speedup of the largest matmul"] = solo_speedup(self.kernels)
        dot, memory_points = alone_curves(self.kernels)
        for flops, speedup in dot:
            out[f"alone speedup of a {flops / 1e6:.3g} MFLOP matmul"] = speedup
        for nbytes, speedup in memory_points:
            out[f"alone speedup of a {nbytes / 2**20:.3g} MiB memory-bound op"] = speedup
        if any(m.width for m in self.kernels):
            device = roofline_device(self, out["memory bandwidth B/s"])
            for kind, curve in _narrow_curves(self, device).items():
                for width, share in curve.points:
                    out[f"{kind} of width {width:g} share of rate"] = share
        for name, executor in fit_executor_terms(self.executors).items():
            out[f"{name} executor fixed s"] = executor.step.latency
            out[f"{name} executor per unit s"] = executor.step.seconds_per_byte
            if executor.per_buffer:
                out[f"{name} executor per buffer s"] = executor.per_buffer
        if self.hand_backs:
            out["spmd executor hand-back per buffer s"] = fit_hand_back(self.hand_backs)
        return out

    def to_json(self) -> dict[str, Any]:
        figures = self.figures()
        return {
            "format": CLUSTER_FORMAT, "version": CLUSTER_VERSION, "backend": self.backend, "device_kind": self.device_kind,
            "n_devices": self.n_devices, "memory_bytes": self.memory_bytes, "jax_version": self.jax_version,
            "hlomap_version": self.hlomap_version, "measured_at": self.measured_at,
            "wall_seconds": self.wall_seconds, "load_average": list(self.load_average), "cores": self.cores,
            "figures": figures,
            "fits": {"matmul": [c.to_json() for c in self.matmul_curves],
                     "memory": {"latency": self.memory_fit.alpha, "bandwidth": figures["memory bandwidth B/s"]},
                     "comm": [f.to_json() for f in self.comm_fits],
                     "executors": {name: f.to_json() for name, f in self.executor_fits.items()}},
            "samples": {"kernels": [m.to_json() for m in self.kernels], "comm": [s.to_json() for s in self.comm],
                        "executors": [s.to_json() for s in self.executors],
                        "hand_backs": [s.to_json() for s in self.hand_backs]},
        }

    @classmethod
    def from_json(cls, data: Any, *, source: str = "<dict>") -> ClusterCalibration:
        """The calibration a cluster file keeps under its "calibration" key (`to_json`), rebuilt
        from its raw samples: the fits are derived again, so a file's figures can be checked
        against what was measured."""
        where = f"{source}: calibration"
        if not isinstance(data, Mapping) or data.get("format") != CLUSTER_FORMAT:
            raise CalibrationError(f"{where}: expected an object of format {CLUSTER_FORMAT!r}")
        version = data.get("version", CLUSTER_VERSION)
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= CLUSTER_VERSION:
            raise CalibrationError(f"{where}.version: {version!r}; this hlomap reads calibrations of versions 1 to "
                                   f"{CLUSTER_VERSION} (a newer hlomap's file? calibrate again)")
        samples = data.get("samples")
        if not isinstance(samples, Mapping):
            raise CalibrationError(f"{where}.samples: expected an object of kernels, comm and executors")
        kernels = tuple(Measurement.from_json(m, where=f"{where}.samples.kernels[{i}]")
                        for i, m in enumerate(_sample_list(samples, "kernels", where)))
        comm = tuple(_comm_sample(s, f"{where}.samples.comm[{i}]")
                     for i, s in enumerate(_sample_list(samples, "comm", where)))
        executors = tuple(_executor_sample(s, f"{where}.samples.executors[{i}]")
                          for i, s in enumerate(_sample_list(samples, "executors", where)))
        hand_backs = tuple(_hand_back_sample(s, f"{where}.samples.hand_backs[{i}]")
                           for i, s in enumerate(_sample_list(samples, "hand_backs", where)))
        loads = data.get("load_average", ())
        if not isinstance(loads, Sequence) or isinstance(loads, str):
            raise CalibrationError(f"{where}.load_average: expected a list of numbers, got {loads!r}")
        return _built(where, lambda: cls(
            _string(_field(data, "backend", where), f"{where}.backend"),
            _string(_field(data, "device_kind", where), f"{where}.device_kind"),
            _whole(_field(data, "n_devices", where), f"{where}.n_devices"),
            _number(_field(data, "memory_bytes", where), f"{where}.memory_bytes"), kernels, comm,
            jax_version=_string(data.get("jax_version", ""), f"{where}.jax_version"),
            hlomap_version=_string(data.get("hlomap_version", ""), f"{where}.hlomap_version"),
            measured_at=_string(data.get("measured_at", ""), f"{where}.measured_at"),
            wall_seconds=_number(data.get("wall_seconds", 0.0), f"{where}.wall_seconds"), executors=executors,
            hand_backs=hand_backs,
            load_average=tuple(_number(x, f"{where}.load_average[{i}]") for i, x in enumerate(loads)),
            cores=_whole(data.get("cores", 0), f"{where}.cores")))


def _field(data: Mapping[str, Any], key: str, where: str) -> Any:
    """`data[key]`, or an error naming the missing field."""
    if key not in data:
        raise CalibrationError(f"{where}: missing field {key!r}")
    return data[key]


def _whole(value: Any, where: str) -> int:
    """A JSON integer (5 or 5.0), or an error naming `where`."""
    number = _number(value, where)
    if not number.is_integer():
        raise CalibrationError(f"{where}: expected a whole number, got {value!r}")
    return int(number)


def _sample_list(samples: Mapping[str, Any], key: str, where: str) -> Sequence[Any]:
    """The list of samples under `key` (none when absent), or an error naming it."""
    found = samples.get(key, ())
    if not isinstance(found, Sequence) or isinstance(found, str):
        raise CalibrationError(f"{where}.samples.{key}: expected a list of samples, got {type(found).__name__}")
    return found


def _built(where: str, build: Callable[[], Any]) -> Any:
    """`build()`, with the errors of its own checks (`__post_init__`: a kind, a group, a time out
    of range) and of the fits it derives prefixed with `where`, so that they name the sample."""
    try:
        return build()
    except ValueError as err:  # CalibrationError among them
        message = str(err) if isinstance(err, CalibrationError) else f"{type(err).__name__}: {err}"
        raise CalibrationError(message if message.startswith(where) else f"{where}: {message}") from None


def _comm_sample(data: Any, where: str) -> CommSample:
    """One communication sample of a cluster file, each field checked by name."""
    if not isinstance(data, Mapping):
        raise CalibrationError(f"{where}: expected an object, got {data!r}")
    return _built(where, lambda: CommSample(_string(_field(data, "kind", where), f"{where}.kind"),
                                            _whole(_field(data, "group", where), f"{where}.group"),
                                            _number(_field(data, "bytes", where), f"{where}.bytes"),
                                            _number(_field(data, "seconds", where), f"{where}.seconds")))


def _executor_sample(data: Any, where: str) -> ExecutorSample:
    """One pipeline-executor sample of a cluster file, each field checked by name."""
    if not isinstance(data, Mapping):
        raise CalibrationError(f"{where}: expected an object, got {data!r}")
    return _built(where, lambda: ExecutorSample(
        _string(_field(data, "executor", where), f"{where}.executor"),
        _whole(_field(data, "stages", where), f"{where}.stages"),
        _whole(_field(data, "microbatches", where), f"{where}.microbatches"),
        _number(_field(data, "seconds", where), f"{where}.seconds"),
        _number(data.get("buffers", 0.0), f"{where}.buffers"),
        _number(data.get("stage_devices", 1.0), f"{where}.stage_devices")))


def _hand_back_sample(data: Any, where: str) -> HandBackSample:
    """One hand-back sample of a cluster file, each field checked by name."""
    if not isinstance(data, Mapping):
        raise CalibrationError(f"{where}: expected an object, got {data!r}")
    return _built(where, lambda: HandBackSample(*(_number(_field(data, key, where), f"{where}.{key}")
                                                  for key in ("leaves", "stage_devices", "seconds"))))


def _link_fit(fits: Sequence[CommFit]) -> CommFit | None:
    """The fit the cluster's link table takes: a collective-permute (every device sends to one
    other, as a point-to-point link is priced) over the largest group; else a transfer."""
    for kind in (Collective.COLLECTIVE_PERMUTE.value, TRANSFER):
        ours = [f for f in fits if f.kind == kind and math.isfinite(f.bandwidth)]
        if ours:
            return max(ours, key=lambda f: f.group)
    return None


def _f32_curve(calibration: ClusterCalibration) -> MatmulCurve:
    curves = {c.dtype: c for c in calibration.matmul_curves}
    if "f32" not in curves:
        raise CalibrationError("a cluster calibration needs f32 matmul samples (the rate of every other type)")
    return curves["f32"]


def _narrow_curves(calibration: ClusterCalibration, device: DeviceSpec) -> dict[str, NarrowCurve]:
    f32 = _f32_curve(calibration)
    side = round((max(f for f, _ in f32.points) / 2.0) ** (1.0 / 3.0))  # the largest square matmul's
    return fit_narrow_curves(calibration.kernels, device, f32.overhead_seconds, side)


def roofline_device(calibration: ClusterCalibration, memory_bandwidth: float) -> DeviceSpec:
    """The device's roofline as `calibrated_cluster` describes it, without its narrow curves."""
    f32 = _f32_curve(calibration)
    efficiency = min(1.0, max(MIN_EFFICIENCY, f32.efficiency(max(f for f, _ in f32.points))))
    peak = {c.dtype: c.rate(max(f for f, _ in c.points)) / efficiency for c in calibration.matmul_curves}
    return DeviceSpec(name=calibration.device_kind or calibration.backend, peak_flops=peak,
                      hbm_bandwidth=memory_bandwidth, memory_bytes=calibration.memory_bytes, efficiency=efficiency)


def calibrated_cluster(calibration: ClusterCalibration, *, name: str | None = None) -> Cluster:
    """The Cluster a calibration describes: `n_devices` identical devices on one node, every pair
    linked at the measured point-to-point latency and bandwidth.

    The device's roofline reproduces the measured matmuls: its efficiency is the f32 curve's at
    the largest f32 matmul measured (the dots that dominate a step are the large ones) and each
    dtype's peak is that matmul's achieved rate over this efficiency, so peak x efficiency is
    what the largest matmul of each dtype achieved. HBM bandwidth is the memory-bound fit's. The
    narrow dots and convolutions measured give its `NarrowCurve`s (`fit_narrow_curves`).
    The collectives, transfer and dispatch as measured go in `Cluster.measured`, which prices
    collectives instead of the links (`hlomap.cost.measured`).
    """
    figures = calibration.figures()
    device = roofline_device(calibration, figures["memory bandwidth B/s"])
    device = replace(device, narrow=_narrow_curves(calibration, device))
    n = calibration.n_devices
    link = _link_fit(calibration.comm_fits)
    if n > 1 and link is None:
        raise CalibrationError(f"{n} devices but no collective-permute or transfer sample to price their links")
    bandwidth = np.full((n, n), link.bandwidth if link else math.inf)
    latency = np.full((n, n), link.latency if link else 0.0)
    label = name or f"calibrated-{calibration.backend}-{n}"
    fits = calibration.comm_fits
    executors = fit_executor_terms(calibration.executors)
    alone_dot, alone_memory = alone_curves(calibration.kernels)
    measured = replace(measured_costs(fits, DISPATCH, TRANSFER, {name: fit.step for name, fit in executors.items()}),
                       solo_speedup=calibration.solo_speedup, n_devices=n,
                       kernel_seconds=_per_count(fits, LAUNCH), combined_operand_seconds=_per_count(fits, COMBINED),
                       combined_operands=_per_count_by_group(fits, COMBINED),
                       executor_buffers=_executor_buffers(executors, fit_hand_back(calibration.hand_backs)),
                       cores=calibration.cores if calibration.backend == "cpu" else 0,
                       alone_dot=alone_dot, alone_memory=alone_memory)
    return Cluster(label, (device,) * n, (0,) * n, bandwidth, latency, measured=measured)


def _executor_buffers(executors: Mapping[str, ExecutorFit], hand_back: float) -> dict[str, float]:
    """Each executor's cost per buffer it hands the host (`MeasuredCosts.executor_buffers`): the
    mpmd executor's fitted from its steps on models of two buffer counts, the spmd executor's
    from its hand-back of the state (`fit_hand_back`); none where not timed."""
    out = {name: fit.per_buffer for name, fit in executors.items() if fit.per_buffer}
    if hand_back:
        out["spmd"] = hand_back
    return out


def _per_count(fits: Sequence[CommFit], kind: str) -> float:
    """Seconds per counted item of a LAUNCH or COMBINED fit (whose "bytes" count kernels or
    buffers), over the largest group measured; 0 when it was not measured."""
    ours = [f for f in fits if f.kind == kind and math.isfinite(f.bandwidth)]
    return 0.0 if not ours else 1.0 / max(ours, key=lambda f: f.group).bandwidth


def _per_count_by_group(fits: Sequence[CommFit], kind: str) -> dict[int, float]:
    """`_per_count` of every group size measured (of two devices or more)."""
    return {f.group: 1.0 / f.bandwidth for f in fits if f.kind == kind and f.group >= 2 and math.isfinite(f.bandwidth)}


def calibrated_cluster_json(calibration: ClusterCalibration, *, name: str | None = None) -> dict[str, Any]:
    """An ordinary cluster file's object plus the calibration (fits and raw samples) under
    CLUSTER_CALIBRATION_KEY."""
    data = calibrated_cluster(calibration, name=name).to_json()
    data[CLUSTER_CALIBRATION_KEY] = calibration.to_json()
    return data
