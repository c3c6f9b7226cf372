"""Accelerator specifications: peak FLOP/s per element type, HBM bandwidth and memory.

A `DeviceSpec` is what the roofline in `hlomap.cost.compute` needs from one device. The presets
are vendor datasheet figures (dense, no structured sparsity); sources are given per preset below.
Memory sizes are the marketed "GB" figures taken as GiB, which is how the boards are built
(a "16 GB" V100 has 16 GiB of HBM2, slightly less of it usable).

Peak FLOP/s are keyed by HLO element-type name ("f32", "bf16", "f16", "f64", "s8", ...). For a
16-bit type the figure is the tensor-core rate, because the ops that dominate FLOPs (dot,
convolution) run on tensor cores; `hlomap.cost.compute` uses the "f32" rate for everything else.
"f32" is the CUDA-core FP32 rate: XLA may use TF32 tensor cores for f32 dots on Ampere and later
(JAX's default matmul precision), which the separate "tf32" key records for callers who want it.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import numpy as np


TERA = 1e12
GIGA = 1e9
GIB = 2**30

#: Fraction of peak FLOP/s that the roofline assumes is achieved. Large GEMMs reach 70-90% of
#: tensor-core peak while whole training steps typically reach 40-60% model FLOP utilization;
#: 0.6 sits between the two. Override per device (JSON field "efficiency") when calibrated.
DEFAULT_EFFICIENCY = 0.6

#: A convolution whose window reaches past its input in some spatial dimension, such as a 3x3
#: window over the 2x2 images of a small ResNet's last blocks (`hlomap.cost.compute.matrix_kind`).
#: Timed on 8 host CPU devices of 2 cores, XLA ran those at 0.2-0.3 GFLOP/s per device whatever
#: their channels, against up to 20 GFLOP/s for the same convolution over 16x16 images (in
#: resnet50-tiny's step on one device, 1-2 GFLOP/s where the convolution curve priced them at 66):
#: a rate of their own, which a calibration measures as a curve of its own.
OVERSIZED_CONVOLUTION = "oversized-convolution"

#: The kernels that run on matrix units (tensor cores) at their dtype's own peak
#: (`hlomap.cost.compute.flop_rate`), and which a `NarrowCurve` may slow down: the kinds a
#: device's curves are keyed by.
MATRIX_KINDS = ("convolution", "dot", OVERSIZED_CONVOLUTION)

#: Element type whose rate is used when a dtype has no entry of its own (integers, pred, ...).
FALLBACK_DTYPE = "f32"


class DeviceSpecError(ValueError):
    """A device specification (preset name or JSON object) is malformed."""


@dataclass(frozen=True)
class NarrowCurve:
    """How much slower a matrix kernel runs when its matrix product is narrow: a dot or
    convolution as the product of an m x k and a k x n matrix (`hlomap.cost.compute.MatrixSides`)
    whose narrowest side is w = min(m, k, n) runs at `factor(w)` of the device's matrix rate.
    Vector units fill only part of their lanes and tiles on a narrow side: measured on 8 host CPU
    devices, a 3x3 convolution of 8 channels ran at a tenth of the rate of a large matmul, one of
    1 output channel at 0.3%, one of 32 channels at nearly full rate.

    `points` are measured (width, share of the matrix rate) pairs, widths increasing; between
    them the share is interpolated in log-log, below the narrowest it falls on along the first
    segment's slope, beyond the widest it stays. Shares never fall with width (a measured dip is
    noise) and never exceed 1. A measured device has one curve per matrix kind (`MATRIX_KINDS`;
    `hlomap calibrate` fits them); a datasheet device none (every width at full rate)."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        points = tuple((float(w), float(e)) for w, e in self.points)
        if not points:
            raise DeviceSpecError("narrow curve: needs at least one (width, share) point")
        for w, e in points:
            if not (math.isfinite(w) and w >= 1 and math.isfinite(e) and 0 < e <= 1):
                raise DeviceSpecError(f"narrow curve: point ({w!r}, {e!r}) needs width >= 1 and share in (0, 1]")
        if any(b[0] <= a[0] for a, b in zip(points, points[1:])):
            raise DeviceSpecError(f"narrow curve: widths {[w for w, _ in points]} must increase")
        if any(b[1] < a[1] for a, b in zip(points, points[1:])):
            raise DeviceSpecError(f"narrow curve: shares {[e for _, e in points]} must not fall with width")
        object.__setattr__(self, "points", points)

    def factor(self, width: float) -> float:
        """The share of the full matrix rate a kernel of narrowest side `width` achieves."""
        widths = np.log([w for w, _ in self.points])
        shares = np.log([e for _, e in self.points])
        x = math.log(max(width, 1.0))
        if x >= widths[-1]:
            return float(math.exp(shares[-1]))
        if x <= widths[0]:
            slope = (shares[1] - shares[0]) / (widths[1] - widths[0]) if len(widths) > 1 else 0.0
            return float(math.exp(shares[0] - slope * (widths[0] - x)))
        return float(math.exp(np.interp(x, widths, shares)))

    def to_json(self) -> dict[str, Any]:
        return {"points": [list(p) for p in self.points]}

    @classmethod
    def from_json(cls, data: Any, *, where: str) -> NarrowCurve:
        if not isinstance(data, Mapping) or set(data) != {"points"} or not isinstance(data["points"], list):
            raise DeviceSpecError(f"{where}: expected an object with a list of [width, share] points, got {data!r}")
        points = []
        for i, point in enumerate(data["points"]):
            if not isinstance(point, list) or len(point) != 2:
                raise DeviceSpecError(f"{where}.points[{i}]: expected [width, share], got {point!r}")
            points.append((_number(point[0], f"{where}.points[{i}]"), _number(point[1], f"{where}.points[{i}]")))
        try:
            return cls(tuple(points))
        except DeviceSpecError as err:
            raise DeviceSpecError(f"{where}: {err}") from None


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator as the cost model sees it.

    `peak_flops` maps an HLO element type to FLOP/s; `hbm_bandwidth` is bytes/s;
    `memory_bytes` the device memory, `math.inf` for memory that never binds (PipeDream's
    optimizer assumes so; JSON writes it as null, having no infinity); `efficiency` the
    achieved/peak factor the roofline applies to compute (memory traffic is assumed to reach the
    full HBM bandwidth, which copies and elementwise kernels come close to); `narrow` the
    measured `NarrowCurve` per matrix kind (`MATRIX_KINDS`; JSON field "narrow", optional):
    a kind without one runs at full rate whatever its shape.
    """

    name: str
    peak_flops: Mapping[str, float]
    hbm_bandwidth: float
    memory_bytes: float
    efficiency: float = DEFAULT_EFFICIENCY
    narrow: Mapping[str, NarrowCurve] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Freeze the mappings too: a frozen dataclass holding a mutable dict is not frozen.
        object.__setattr__(self, "peak_flops", types.MappingProxyType(dict(self.peak_flops)))
        object.__setattr__(self, "narrow", types.MappingProxyType(dict(sorted(self.narrow.items()))))
        _validate(self)

    def __hash__(self) -> int:
        found = self.__dict__.get("_hash")
        if found is None:  # kept: cost caches key every instruction's price by its device
            found = hash((self.name, tuple(sorted(self.peak_flops.items())), self.hbm_bandwidth,
                          self.memory_bytes, self.efficiency, tuple(self.narrow.items())))
            object.__setattr__(self, "_hash", found)
        return found

    def narrow_factor(self, kind: str, width: float) -> float:
        """The share of the matrix rate a `kind` kernel (`MATRIX_KINDS`) of narrowest side
        `width` achieves (`NarrowCurve`); 1 for a kind without a curve."""
        curve = self.narrow.get(kind)
        return 1.0 if curve is None else curve.factor(width)

    def flops_for(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype`, falling back to the f32 rate for types with no entry."""
        rate = self.peak_flops.get(dtype)
        if rate is None:
            rate = self.peak_flops[FALLBACK_DTYPE]
        return rate

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "peak_flops": dict(self.peak_flops),
            "hbm_bandwidth": self.hbm_bandwidth,
            "memory_bytes": None if math.isinf(self.memory_bytes) else self.memory_bytes,
            "efficiency": self.efficiency,
            **({"narrow": {kind: curve.to_json() for kind, curve in self.narrow.items()}} if self.narrow else {}),
        }

    @classmethod
    def from_json(cls, data: Any, *, where: str = "device") -> DeviceSpec:
        """A preset name (`"A100-80GB"`) or a full object with every field of `to_json`."""
        if isinstance(data, str):
            try:
                return device_preset(data)
            except DeviceSpecError as err:
                raise DeviceSpecError(f"{where}: {err}") from None
        if not isinstance(data, Mapping):
            raise DeviceSpecError(f"{where}: expected a preset name or an object, got {data!r}")
        missing = [k for k in ("name", "peak_flops", "hbm_bandwidth", "memory_bytes") if k not in data]
        if missing:
            raise DeviceSpecError(f"{where}: missing field(s) {missing}")
        unknown = sorted(set(data) - {"name", "peak_flops", "hbm_bandwidth", "memory_bytes", "efficiency", "narrow"})
        if unknown:
            raise DeviceSpecError(f"{where}: unknown field(s) {unknown}")
        peak = data["peak_flops"]
        if not isinstance(peak, Mapping):
            raise DeviceSpecError(f"{where}.peak_flops: expected an object dtype -> FLOP/s, got {peak!r}")
        try:
            return cls(
                name=str(data["name"]),
                peak_flops={str(k): _number(v, f"{where}.peak_flops.{k}") for k, v in peak.items()},
                hbm_bandwidth=_number(data["hbm_bandwidth"], f"{where}.hbm_bandwidth"),
                memory_bytes=_memory(data["memory_bytes"], f"{where}.memory_bytes"),
                efficiency=_number(data.get("efficiency", DEFAULT_EFFICIENCY), f"{where}.efficiency"),
                narrow=_narrow(data.get("narrow", {}), f"{where}.narrow"),
            )
        except DeviceSpecError as err:
            msg = str(err)
            raise DeviceSpecError(msg if msg.startswith(where) else f"{where}: {msg}") from None


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DeviceSpecError(f"{where}: expected a number, got {value!r}")
    return float(value)


def _narrow(data: Any, where: str) -> dict[str, NarrowCurve]:
    if not isinstance(data, Mapping):
        raise DeviceSpecError(f"{where}: expected an object with keys among {sorted(MATRIX_KINDS)}, got {data!r}")
    unknown = sorted(str(kind) for kind in set(data) - set(MATRIX_KINDS))
    if unknown:
        raise DeviceSpecError(f"{where}: unknown matrix kind(s) {unknown}; expected keys among {sorted(MATRIX_KINDS)}")
    return {str(kind): NarrowCurve.from_json(curve, where=f"{where}.{kind}") for kind, curve in data.items()}


def _memory(value: Any, where: str) -> float:
    """Bytes as an integer count, or null for unlimited memory (`math.inf`)."""
    return math.inf if value is None else int(_number(value, where))


def _validate(spec: DeviceSpec) -> None:
    if FALLBACK_DTYPE not in spec.peak_flops:
        raise DeviceSpecError(f"device {spec.name!r}: peak_flops needs an {FALLBACK_DTYPE!r} entry "
                              f"(the rate used for element types without their own)")
    for dtype, rate in spec.peak_flops.items():
        if not (math.isfinite(rate) and rate > 0):
            raise DeviceSpecError(f"device {spec.name!r}: peak_flops[{dtype!r}] = {rate!r} must be positive")
    if not (math.isfinite(spec.hbm_bandwidth) and spec.hbm_bandwidth > 0):
        raise DeviceSpecError(f"device {spec.name!r}: hbm_bandwidth = {spec.hbm_bandwidth!r} must be positive")
    if not spec.memory_bytes > 0:  # inf (unlimited) passes, NaN does not
        raise DeviceSpecError(f"device {spec.name!r}: memory_bytes = {spec.memory_bytes!r} must be positive")
    if not 0 < spec.efficiency <= 1:
        raise DeviceSpecError(f"device {spec.name!r}: efficiency = {spec.efficiency!r} must be in (0, 1]")


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------

# NVIDIA Tesla V100 SXM2 datasheet (2018): FP64 7.8, FP32 15.7, tensor (FP16 in, FP32 acc) 125
# TFLOP/s; HBM2 900 GB/s; 16 or 32 GB. V100 has no bf16 hardware: XLA computes bf16 in f32, so
# bf16 gets the f32 rate.
_V100_FLOPS = {"f64": 7.8 * TERA, "f32": 15.7 * TERA, "f16": 125 * TERA, "bf16": 15.7 * TERA}

# NVIDIA A100 Tensor Core GPU datasheet (SXM4): FP64 9.7 (tensor 19.5), FP32 19.5, TF32 156,
# BF16/FP16 312, INT8 624 TOPS (dense). HBM2 1,555 GB/s (40GB); HBM2e 2,039 GB/s (80GB).
_A100_FLOPS = {"f64": 19.5 * TERA, "f32": 19.5 * TERA, "tf32": 156 * TERA,
               "bf16": 312 * TERA, "f16": 312 * TERA, "s8": 624 * TERA}

# NVIDIA H100 Tensor Core GPU datasheet (SXM5): FP64 34 (tensor 67), FP32 67, TF32 494.5,
# BF16/FP16 989.5, FP8 1,979, INT8 1,979 TOPS (dense, i.e. half the sparse figures); HBM3
# 3.35 TB/s; 80 GB.
_H100_FLOPS = {"f64": 67 * TERA, "f32": 67 * TERA, "tf32": 494.5 * TERA,
               "bf16": 989.5 * TERA, "f16": 989.5 * TERA,
               "f8e4m3fn": 1979 * TERA, "f8e5m2": 1979 * TERA, "s8": 1979 * TERA}

#: Devices measured by `hlomap calibrate` on the real hardware, shipped as the calibrated cluster
#: file it wrote (figures, fits and raw samples, under hlomap/cost/data/): name -> file.
#: H200-measured: one NVIDIA H200 (SXM, 141 GB) measured with JAX 0.11.2 on 2026-11-26 by
#: `python scripts/bench_gpu.py --calibrations 1` (warmed up; kernel launches timed on a train
#: step of tiny layers; docs/benchmarks.md has the run).
MEASURED_DEVICE_FILES: Mapping[str, str] = types.MappingProxyType({"H200-measured": "H200-measured.cluster.json"})


def measured_device(name: str) -> DeviceSpec:
    """The measured device `name` (MEASURED_DEVICE_FILES): the calibrated roofline (per-dtype
    rates, HBM bandwidth, efficiency, memory JAX could use) of the shipped cluster file, renamed.
    Its measured launch and dispatch costs stay in that file (`--cluster FILE` uses them)."""
    import json

    device = json.loads(measured_device_path(name).read_text())["devices"][0]
    return replace(DeviceSpec.from_json(device, where=f"{measured_device_path(name).name}: devices[0]"), name=name)


def measured_device_path(name: str) -> Any:
    """The shipped cluster file of the measured device `name` (a Traversable path)."""
    from importlib import resources

    return resources.files("hlomap.cost").joinpath("data", MEASURED_DEVICE_FILES[name])


DEVICE_PRESETS: Mapping[str, DeviceSpec] = types.MappingProxyType({
    spec.name: spec
    for spec in (
        DeviceSpec("V100-16GB", _V100_FLOPS, 900 * GIGA, 16 * GIB),
        DeviceSpec("V100-32GB", _V100_FLOPS, 900 * GIGA, 32 * GIB),
        DeviceSpec("A100-40GB", _A100_FLOPS, 1555 * GIGA, 40 * GIB),
        DeviceSpec("A100-80GB", _A100_FLOPS, 2039 * GIGA, 80 * GIB),
        DeviceSpec("H100-80GB", _H100_FLOPS, 3350 * GIGA, 80 * GIB),
        # NVIDIA H200 datasheet (SXM): the H100's compute rates; HBM3e 4.8 TB/s, 141 GB.
        DeviceSpec("H200-141GB", _H100_FLOPS, 4800 * GIGA, 141 * GIGA),
        *(measured_device(name) for name in MEASURED_DEVICE_FILES),
    )
})


def device_preset(name: str) -> DeviceSpec:
    """The preset called `name` (case-insensitive): the datasheet V100-16GB, V100-32GB, A100-40GB,
    A100-80GB, H100-80GB, H200-141GB, and the measured H200-measured."""
    for key, spec in DEVICE_PRESETS.items():
        if key.lower() == name.lower():
            return spec
    raise DeviceSpecError(f"unknown device preset {name!r}; known: {', '.join(DEVICE_PRESETS)}")
