"""What a calibrated cluster measured beyond its roofline and link tables: the collectives as they
ran, and the fixed cost of dispatching a program.

A datasheet cluster prices a collective from its point-to-point links with a ring algorithm
(`hlomap.cost.collectives`): 2(p-1) latencies for an all-reduce. On devices whose collectives are
not rings over independent links (host CPU devices exchange buffers in shared memory; NCCL picks
its own algorithms) that is far off: an 8-way all-reduce measured 0.5 ms on 8 CPU devices, where
the ring over the measured link latency says 8 ms. A `MeasuredCosts` keeps, per collective kind
and group size, the alpha-beta fit of the collective itself (`hlomap calibrate`), and the cost
model uses it instead of the links wherever a cluster carries one:

- a collective over g devices takes the fit of the smallest measured group >= g (the largest
  measured group beyond it): rounding up errs towards the costlier, larger group;
- each sample timed one dispatched program, so the dispatch is taken off its latency (inside a
  step the collective is one instruction of a program already running);
- `dispatch_seconds` is what launching one program costs the host: once per step for an SPMD
  plan, once per stage program and microbatch on the mpmd pipeline executor;
- `transfer` is a `jax.device_put` of a buffer to another device: the stage-to-stage send of the
  mpmd executor;
- `executors` are the pipeline executors' own costs (`hlomap.run.calibrate`), `fixed +
  per_unit x units` seconds per step, where units are what each executor does per microbatch
  (`executor_units`): the mpmd executor dispatches programs per stage and microbatch (S x M), the
  spmd executor runs one loop tick per microbatch and stage of fill (M + S - 1). A `Fit` holds
  them as latency = fixed and bandwidth = 1 / per_unit; an executor not timed costs a dispatch
  per program it launches (`dispatch_programs`), plus `executor_buffers`, what each buffer
  its programs take or return costs the host (seconds per buffer and device of its stage, an
  array holding one buffer per device; `executor_moved`): the mpmd executor hands
  every stage program its parameters and residuals, M x `hlomap.cost.estimate.pass_buffers` of
  them per step, each costing the host time on every call (on 8 CPU devices a step of
  resnet50-tiny's three one-device stages spent about 30 ms of its 55 ms there); the spmd
  executor slices every leaf of the state out of its rows after each step
  (`hlomap.cost.estimate.state_leaves`: gpt-tiny's 109 took 7.6 ms on two stages of four CPU
  devices);
- `solo_speedup` is how much faster one device computes alone than while all of the cluster's
  devices compute (host CPU devices share the cores: 8 of them on 2 cores run about 4x slower
  each than one alone; GPUs: 1). The devices' roofline is the all-busy rate; a plan keeping only
  k of n devices busy computes `busy_speedup(k)` = min(solo_speedup, n / k) times faster;
- `alone_dot` and `alone_memory` say, per size, how much faster one device ran a matmul (by its
  flops) or a memory-bound op (by its bytes) alone than while every device ran one: points
  (size, speedup) sorted by size. A host device alone has the caches and the spare cores to
  itself, so the gain grows with the kernel: on 8 CPU devices of 2 cores matmuls of 0.5-34
  MFLOP ran 3.3-5.4x faster alone and one of 268 MFLOP 7.7x, elementwise ops moving up to 512 KiB
  3.6-4.6x and 8 MiB 18-22x (two calibrations), where `solo_speedup` allows 4x for all. A plan
  keeping one device busy is priced per kernel on these curves (`alone_speedups`), threads
  included; others on `busy_speedup`. Empty where the calibration timed no such pairs (before
  this version; one device; not host devices);
- `cores` is the host's CPU cores when its devices share them (0 otherwise): with k < cores
  devices computing, each has cores / k of them to itself (`spare_threads`), and the kernels
  XLA:CPU splits over threads run faster still (`hlomap.cost.threads`);
- `kernel_seconds` is what each kernel a program launches costs beyond its roofline (measured on
  a train step of tiny layers, per kernel as `hlomap.cost.estimate.kernel_count` counts them): the
  small-kernel cost that dominates small models on a host and on a GPU;
- `combined_operand_seconds` is what each buffer adds to one all-reduce of many (XLA combines the
  gradients' all-reduces into one): on host CPU devices the buffers are reduced one after
  another, so 38 gradients cost 38 latencies, not one. It is the figure over all the cluster's
  devices; `combined_operands` holds it per group size where the calibration timed several
  (`per_buffer`): on 8 CPU devices of 2 cores a buffer cost 19-28 / 61-66 / 133-182 us over
  2 / 4 / 8 devices in three runs, far from the all-reduce latency's ratios (0.4 / 0.8 / 1).

JSON (a cluster file's optional "measured" object; units: seconds, bytes/s):
    {"dispatch_seconds": 2.6e-05, "transfer": {"latency": 2e-04, "bandwidth": 1.1e10},
     "collectives": [{"kind": "all-reduce", "group": 8, "latency": 4.9e-04, "bandwidth": 1.2e9}, ...],
     "executors": {"mpmd": {"latency": 1e-3, "bandwidth": 700.0}, "spmd": {...}},
     "solo_speedup": 7.9, "n_devices": 8, "kernel_seconds": 9e-06, "combined_operand_seconds": 3e-04,
     "combined_operands": [{"group": 2, "seconds": 2e-05}, {"group": 8, "seconds": 3e-04}],
     "executor_buffers": {"mpmd": 2e-06}, "cores": 2,
     "alone_dot": [[524288.0, 3.3], [268435456.0, 7.7]], "alone_memory": [[32768.0, 3.6], [8388608.0, 18.0]]}
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from hlomap.cost.threads import spare_threads

#: The collective kinds a table may hold (`hlomap.cost.collectives.Collective` values).
COLLECTIVE_KINDS = frozenset({"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"})
#: The pipeline executors (`hlomap.run.Executor` values).
EXECUTORS = frozenset({"spmd", "mpmd"})


def executor_units(executor: str, stages: int, microbatches: int) -> int:
    """What an executor's cost grows with (module docstring): S x M programs per stage and
    microbatch for mpmd, M + S - 1 loop ticks for spmd."""
    if executor == "mpmd":
        return stages * microbatches
    if executor == "spmd":
        return microbatches + stages - 1
    raise MeasuredCostsError(f"executor {executor!r}: expected one of {sorted(EXECUTORS)}")


def executor_moved(executor: str, microbatches: int, pass_buffers: float, state_leaves: float) -> float:
    """Buffers an executor's step hands the host, per device of a stage: the mpmd executor M x
    its passes' buffers (each stage program takes its parameters and residuals and returns their
    gradients, `hlomap.cost.estimate.pass_buffers`), the spmd executor the state's leaves, which
    it slices out of its rows after every step (`hlomap.cost.estimate.state_leaves`)."""
    if executor == "mpmd":
        return microbatches * pass_buffers
    if executor == "spmd":
        return state_leaves
    raise MeasuredCostsError(f"executor {executor!r}: expected one of {sorted(EXECUTORS)}")


def dispatch_programs(executor: str, stages: int, microbatches: int) -> int:
    """Programs an executor launches per step: mpmd a forward and a backward per stage and
    microbatch and an update per stage, spmd one."""
    if executor == "mpmd":
        return 2 * stages * microbatches + stages
    if executor == "spmd":
        return 1
    raise MeasuredCostsError(f"executor {executor!r}: expected one of {sorted(EXECUTORS)}")


class MeasuredCostsError(ValueError):
    """A "measured" object of a cluster file that cannot be used; names the field."""


@dataclass(frozen=True)
class Fit:
    """`latency + nbytes / bandwidth` seconds (bandwidth inf: a fixed cost)."""

    latency: float
    bandwidth: float

    def seconds(self, nbytes: float) -> float:
        return self.latency + (0.0 if math.isinf(self.bandwidth) else nbytes / self.bandwidth)

    @property
    def seconds_per_byte(self) -> float:
        return 0.0 if math.isinf(self.bandwidth) else 1.0 / self.bandwidth

    def to_json(self) -> dict[str, Any]:
        return {"latency": self.latency, "bandwidth": None if math.isinf(self.bandwidth) else self.bandwidth}


@dataclass(frozen=True)
class MeasuredCosts:
    """Measured collectives by (kind, group size), dispatch and transfer (module docstring)."""

    dispatch_seconds: float = 0.0
    transfer: Fit | None = None
    collectives: Mapping[tuple[str, int], Fit] = field(default_factory=dict)
    executors: Mapping[str, Fit] = field(default_factory=dict)
    solo_speedup: float = 1.0
    n_devices: int = 1  # how many devices were busy when the roofline was measured
    kernel_seconds: float = 0.0  # launching one kernel inside a running program (all devices busy)
    combined_operand_seconds: float = 0.0  # each buffer of a combined all-reduce adds this
    combined_operands: Mapping[int, float] = field(default_factory=dict)  # the same per group size
    executor_buffers: Mapping[str, float] = field(default_factory=dict)  # per executor: s per buffer and device
    cores: int = 0  # the host's CPU cores when the devices share them (host CPU devices); 0: not shared
    alone_dot: tuple[tuple[float, float], ...] = ()  # (flops, speedup alone) by matmul size
    alone_memory: tuple[tuple[float, float], ...] = ()  # (bytes, speedup alone) by memory-bound op size

    def __post_init__(self) -> None:
        object.__setattr__(self, "collectives", dict(sorted(self.collectives.items())))
        object.__setattr__(self, "executors", dict(sorted(self.executors.items())))
        object.__setattr__(self, "combined_operands", dict(sorted(self.combined_operands.items())))
        object.__setattr__(self, "executor_buffers", dict(sorted(self.executor_buffers.items())))
        object.__setattr__(self, "alone_dot", _points(self.alone_dot, "alone_dot"))
        object.__setattr__(self, "alone_memory", _points(self.alone_memory, "alone_memory"))
        _check(self)

    def __hash__(self) -> int:
        return hash((self.dispatch_seconds, self.transfer, tuple(self.collectives.items()),
                     tuple(self.executors.items()), self.solo_speedup, self.n_devices, self.kernel_seconds,
                     self.combined_operand_seconds, tuple(self.combined_operands.items()),
                     tuple(self.executor_buffers.items()), self.cores, self.alone_dot, self.alone_memory))

    def per_buffer(self, group: int) -> float | None:
        """What each buffer adds to a combined all-reduce over `group` devices, from
        `combined_operands`: the figure of that group size, else interpolated linearly in g - 1
        between the two measured sizes around it (beyond the largest, scaled by g - 1 from it:
        a buffer is reduced with each other device in turn); None when none was measured."""
        table = self.combined_operands
        if not table:
            return None
        if group in table:
            return table[group]
        below = [g for g in table if g < group]
        above = [g for g in table if g > group]
        if below and above:
            lo, hi = max(below), min(above)
            share = (group - lo) / (hi - lo)
            return table[lo] + share * (table[hi] - table[lo])
        nearest = max(below) if below else min(above)
        return table[nearest] * (group - 1) / max(1, nearest - 1)

    def busy_speedup(self, busy: int) -> float:
        """How much faster each device computes when only `busy` devices work (module docstring)."""
        return max(1.0, min(self.solo_speedup, self.n_devices / max(1, busy)))

    @property
    def prices_alone(self) -> bool:
        """Whether a plan keeping one device busy is priced per kernel on the alone curves (both
        measured, on devices that share a host's cores)."""
        return self.cores > 0 and bool(self.alone_dot) and bool(self.alone_memory)

    def alone_speedups(self, matrix: bool, sizes: np.ndarray) -> np.ndarray:
        """How much faster each kernel of `sizes` (flops of a matmul when `matrix`, else bytes
        moved) runs on one device alone than with every device busy: the curve's speedup
        interpolated linearly in log size between its points, its end points' beyond them."""
        points = self.alone_dot if matrix else self.alone_memory
        at = np.log(np.maximum(np.asarray(sizes, dtype=np.float64), 1.0))
        return np.interp(at, [math.log(size) for size, _ in points], [speedup for _, speedup in points])

    def spare_threads(self, busy: int) -> float:
        """The host cores each of `busy` computing devices has to itself (module docstring; 1
        unless fewer devices than `cores` compute)."""
        return spare_threads(self.cores, busy)

    def executor_seconds(self, executor: str, stages: int, microbatches: int, buffers: float = 0.0,
                         stage_devices: float = 1.0, state_leaves: float = 0.0) -> float:
        """The executor's own seconds per step for S stages and M microbatches of a model whose
        passes move `buffers` per microbatch (`hlomap.cost.estimate.pass_buffers`) and whose
        state has `state_leaves` arrays (`hlomap.cost.estimate.state_leaves`), on stages of
        `stage_devices` devices on average: its fit plus the buffers its step hands the host
        (`executor_moved`) x stage devices x its cost per buffer and device (an array spans one
        buffer per device of its stage), or where it was not timed (a calibration of one device
        before this version timed none) one dispatch per program it launches, so that a
        pipeline never looks cheaper to launch than the one program of an SPMD step
        (`dispatch_programs`)."""
        fit = self.executors.get(executor)
        moved = (executor_moved(executor, microbatches, buffers, state_leaves) * stage_devices
                 * self.executor_buffers.get(executor, 0.0))
        if fit is not None:
            return fit.seconds(executor_units(executor, stages, microbatches)) + moved
        return self.dispatch_seconds * dispatch_programs(executor, stages, microbatches) + moved

    def groups(self, kind: str) -> tuple[int, ...]:
        return tuple(sorted(g for k, g in self.collectives if k == kind))

    def collective(self, kind: str, group: int) -> Fit | None:
        """The fit pricing `kind` over `group` devices (module docstring); None when the kind was
        not measured, and a free fit for one device."""
        if group <= 1:
            return Fit(0.0, math.inf)
        measured = self.groups(kind)
        if not measured:
            return None
        chosen = next((g for g in measured if g >= group), measured[-1])
        return self.collectives[kind, chosen]

    def to_json(self) -> dict[str, Any]:
        return {"dispatch_seconds": self.dispatch_seconds,
                "transfer": None if self.transfer is None else self.transfer.to_json(),
                "collectives": [{"kind": k, "group": g, **fit.to_json()} for (k, g), fit in self.collectives.items()],
                "executors": {name: fit.to_json() for name, fit in self.executors.items()},
                "solo_speedup": self.solo_speedup, "n_devices": self.n_devices,
                "kernel_seconds": self.kernel_seconds, "combined_operand_seconds": self.combined_operand_seconds,
                "combined_operands": [{"group": g, "seconds": t} for g, t in self.combined_operands.items()],
                "executor_buffers": dict(self.executor_buffers), "cores": self.cores,
                "alone_dot": [list(p) for p in self.alone_dot], "alone_memory": [list(p) for p in self.alone_memory]}

    @classmethod
    def from_json(cls, data: Any, *, where: str = "measured") -> MeasuredCosts:
        if not isinstance(data, Mapping):
            raise MeasuredCostsError(f"{where}: expected an object, got {data!r}")
        unknown = sorted(set(data) - {"dispatch_seconds", "transfer", "collectives", "executors", "solo_speedup",
                                      "n_devices", "kernel_seconds", "combined_operand_seconds", "combined_operands",
                                      "executor_buffers", "cores", "alone_dot", "alone_memory"})
        if unknown:
            raise MeasuredCostsError(f"{where}: unknown field(s) {unknown}")
        transfer = data.get("transfer")
        rows = data.get("collectives", [])
        if not isinstance(rows, list):
            raise MeasuredCostsError(f"{where}.collectives: expected a list, got {rows!r}")
        table: dict[tuple[str, int], Fit] = {}
        for i, row in enumerate(rows):
            here = f"{where}.collectives[{i}]"
            if not isinstance(row, Mapping) or set(row) != {"kind", "group", "latency", "bandwidth"}:
                raise MeasuredCostsError(f"{here}: expected an object with kind, group, latency, bandwidth; got {row!r}")
            table[str(row["kind"]), _int(row["group"], f"{here}.group")] = _fit(row, here)
        executors = data.get("executors", {})
        if not isinstance(executors, Mapping):
            raise MeasuredCostsError(f"{where}.executors: expected an object, got {executors!r}")
        operands = data.get("combined_operands", [])
        if not isinstance(operands, list):
            raise MeasuredCostsError(f"{where}.combined_operands: expected a list, got {operands!r}")
        buffers = data.get("executor_buffers", {})
        if not isinstance(buffers, Mapping):
            raise MeasuredCostsError(f"{where}.executor_buffers: expected an object, got {buffers!r}")
        per_group: dict[int, float] = {}
        for i, row in enumerate(operands):
            here = f"{where}.combined_operands[{i}]"
            if not isinstance(row, Mapping) or set(row) != {"group", "seconds"}:
                raise MeasuredCostsError(f"{here}: expected an object with group and seconds; got {row!r}")
            per_group[_int(row["group"], f"{here}.group")] = _number(row["seconds"], f"{here}.seconds")
        try:
            return cls(_number(data.get("dispatch_seconds", 0.0), f"{where}.dispatch_seconds"),
                       None if transfer is None else _fit(transfer, f"{where}.transfer"), table,
                       {str(k): _fit(v, f"{where}.executors.{k}") for k, v in executors.items()},
                       _number(data.get("solo_speedup", 1.0), f"{where}.solo_speedup"),
                       _int(data.get("n_devices", 1), f"{where}.n_devices"),
                       _number(data.get("kernel_seconds", 0.0), f"{where}.kernel_seconds"),
                       _number(data.get("combined_operand_seconds", 0.0), f"{where}.combined_operand_seconds"),
                       per_group, {str(k): _number(v, f"{where}.executor_buffers.{k}") for k, v in buffers.items()},
                       _int(data.get("cores", 0), f"{where}.cores"),
                       _point_list(data.get("alone_dot", []), f"{where}.alone_dot"),
                       _point_list(data.get("alone_memory", []), f"{where}.alone_memory"))
        except MeasuredCostsError as err:  # named once: a field's own check already starts with `where`
            raise MeasuredCostsError(str(err) if str(err).startswith(where) else f"{where}: {err}") from None


def measured_costs(fits: Iterable[Any], dispatch_kind: str, transfer_kind: str,
                   executors: Mapping[str, Fit] | None = None) -> MeasuredCosts:
    """The table of `hlomap.cost.calibration.CommFit`s: collectives with the dispatch taken off
    their latency (never below 0), the dispatch, the transfer of the largest group measured; and
    the executors' fits."""
    fits = list(fits)
    dispatch = next((f.latency for f in fits if f.kind == dispatch_kind), 0.0)
    transfers = [f for f in fits if f.kind == transfer_kind]
    transfer = max(transfers, key=lambda f: f.group) if transfers else None
    table = {(f.kind, f.group): Fit(max(0.0, f.latency - dispatch), f.bandwidth)
             for f in fits if f.kind in COLLECTIVE_KINDS}
    return MeasuredCosts(dispatch, None if transfer is None else Fit(transfer.latency, transfer.bandwidth), table,
                         dict(executors or {}))


def _point_list(value: Any, where: str) -> tuple[tuple[float, float], ...]:
    """A list of [size, speedup] pairs from JSON."""
    if not isinstance(value, list):
        raise MeasuredCostsError(f"{where}: expected a list of [size, speedup] pairs, got {value!r}")
    out = []
    for i, row in enumerate(value):
        if not isinstance(row, list) or len(row) != 2:
            raise MeasuredCostsError(f"{where}[{i}]: expected [size, speedup], got {row!r}")
        out.append((_number(row[0], f"{where}[{i}][0]"), _number(row[1], f"{where}[{i}][1]")))
    return tuple(out)


def _points(points: Iterable[tuple[float, float]], label: str) -> tuple[tuple[float, float], ...]:
    """`points` sorted by size, checked: sizes positive and distinct, speedups finite and >= 1."""
    out = tuple(sorted((float(size), float(speedup)) for size, speedup in points))
    for size, speedup in out:
        if not (math.isfinite(size) and size > 0 and math.isfinite(speedup) and speedup >= 1.0):
            raise MeasuredCostsError(f"{label}: point ({size!r}, {speedup!r}) needs a finite size > 0 and a finite "
                                     "speedup >= 1")
    if len({size for size, _ in out}) != len(out):
        raise MeasuredCostsError(f"{label}: two points of one size in {list(out)}")
    return out


def _check(costs: MeasuredCosts) -> None:
    if not (math.isfinite(costs.solo_speedup) and costs.solo_speedup >= 1.0):
        raise MeasuredCostsError(f"solo_speedup = {costs.solo_speedup!r} must be finite and >= 1")
    for label in ("kernel_seconds", "combined_operand_seconds"):
        value = getattr(costs, label)
        if not (math.isfinite(value) and value >= 0):
            raise MeasuredCostsError(f"{label} = {value!r} must be finite and >= 0")
    for name, seconds in costs.executor_buffers.items():
        if name not in EXECUTORS or not (math.isfinite(seconds) and seconds >= 0):
            raise MeasuredCostsError(f"executor_buffers: {name!r} at {seconds!r} s per buffer: expected an executor of "
                                     f"{sorted(EXECUTORS)} and seconds finite and >= 0")
    for group, seconds in costs.combined_operands.items():
        if group < 2 or not (math.isfinite(seconds) and seconds >= 0):
            raise MeasuredCostsError(f"combined_operands: group {group!r} at {seconds!r} s: the group must be >= 2 "
                                     "and the seconds finite and >= 0")
    if costs.n_devices < 1:
        raise MeasuredCostsError(f"n_devices = {costs.n_devices!r} must be >= 1")
    if costs.cores < 0:
        raise MeasuredCostsError(f"cores = {costs.cores!r} must be >= 0 (0: the devices share no cores)")
    if not (math.isfinite(costs.dispatch_seconds) and costs.dispatch_seconds >= 0):
        raise MeasuredCostsError(f"dispatch_seconds = {costs.dispatch_seconds!r} must be finite and >= 0")
    for (kind, group), fit in costs.collectives.items():
        if kind not in COLLECTIVE_KINDS:
            raise MeasuredCostsError(f"collective kind {kind!r}: expected one of {sorted(COLLECTIVE_KINDS)}")
        if group < 2:
            raise MeasuredCostsError(f"{kind} group {group!r} must be >= 2")
        _check_fit(fit, f"{kind} x{group}")
    if costs.transfer is not None:
        _check_fit(costs.transfer, "transfer")
    for name, fit in costs.executors.items():
        if name not in EXECUTORS:
            raise MeasuredCostsError(f"executor {name!r}: expected one of {sorted(EXECUTORS)}")
        _check_fit(fit, f"{name} executor")


def _check_fit(fit: Fit, what: str) -> None:
    if not (math.isfinite(fit.latency) and fit.latency >= 0):
        raise MeasuredCostsError(f"{what}: latency = {fit.latency!r} must be finite and >= 0")
    if not fit.bandwidth > 0:
        raise MeasuredCostsError(f"{what}: bandwidth = {fit.bandwidth!r} must be > 0")


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MeasuredCostsError(f"{where}: expected a number, got {value!r}")
    return float(value)


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MeasuredCostsError(f"{where}: expected an integer, got {value!r}")
    return value


def _fit(data: Any, where: str) -> Fit:
    if not isinstance(data, Mapping) or not {"latency", "bandwidth"} <= set(data):
        raise MeasuredCostsError(f"{where}: expected an object with latency and bandwidth, got {data!r}")
    bandwidth = data["bandwidth"]
    return Fit(_number(data["latency"], f"{where}.latency"),
               math.inf if bandwidth is None else _number(bandwidth, f"{where}.bandwidth"))
