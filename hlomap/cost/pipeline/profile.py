"""The per-layer arrays a pipeline search works on: `PipelineProfile`.

A profile is a straight chain of n layers (forward instructions in topological order, or the
nodes of a profiled layer graph) with n - 1 pivots between them: pivot p is the cut between layer
p and layer p + 1. A pipeline stage is a contiguous run of layers [start, stop).

Everything here is per *microbatch*: a pipeline runs M microbatches of the same size through the
stages, so the simulator and the DP multiply by M where they need a global batch. Use
`scale_batch` to convert a profile measured at another batch size.

Arrays are read-only numpy vectors so that a profile can be shared between a simulator, a DP and
a reinforcement-learning environment without defensive copies; `prefix()` gives the cumulative
sums those need to price any stage [i, j) in O(1).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "PipelineProfile",
    "Prefix",
    "merge_layers",
    "replicated_seconds",
    "scale_batch",
    "uniform_profile",
]


def _frozen_vector(values: object, *, name: str, length: int, source: str) -> np.ndarray:
    """A read-only float64 copy of `values`, checked for length, finiteness and sign."""
    array = np.array(values, dtype=np.float64, copy=True).reshape(-1)
    if array.shape != (length,):
        raise ValueError(
            f"{source}: PipelineProfile.{name} has {array.shape[0]} entries, expected {length}"
        )
    bad = np.flatnonzero(~np.isfinite(array) | (array < 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{source}: PipelineProfile.{name}[{i}] = {float(array[i])!r} is not a finite "
            "value >= 0"
        )
    array.setflags(write=False)
    return array


def replicated_seconds(total: Any, fixed: Any, replicas: Any) -> Any:
    """Seconds on each of `replicas` data replicas of work that takes `total` on one, of which
    `fixed` does not shrink with a split batch (`PipelineProfile.forward_fixed`); arrays too."""
    return fixed + (total - fixed) / replicas


class Prefix(NamedTuple):
    """Cumulative sums with a leading 0, length n + 1: a stage [i, j) costs `x[j] - x[i]`.

    `trainable` counts layers with parameters, for the at-least-one-trainable-layer constraint;
    `fixed` is the part of `compute` a batch split does not shrink (`replicated_seconds`);
    `forward_syncs` ... `backward_sync_bytes` the all-reduces a batch split adds inside the
    passes (`PipelineProfile.forward_syncs`); `gradient_buffers` the arrays of a stage's gradient
    all-reduce; `replica_transposes` the transposes that run after it (`PipelineProfile`).
    """

    forward: np.ndarray
    backward: np.ndarray
    compute: np.ndarray
    parameter: np.ndarray
    stash: np.ndarray
    trainable: np.ndarray
    fixed: np.ndarray
    forward_syncs: np.ndarray
    backward_syncs: np.ndarray
    forward_sync_bytes: np.ndarray
    backward_sync_bytes: np.ndarray
    gradient_buffers: np.ndarray
    replica_transposes: np.ndarray


@dataclass(frozen=True, eq=False)
class PipelineProfile:
    """Per-layer costs of one microbatch through a chain of layers.

    Attributes:
      names: one label per layer (instruction or node name), for plans and error messages.
      forward_time: [n] seconds of forward compute per layer.
      backward_time: [n] seconds of backward compute per layer.
      activation_bytes: [n - 1] bytes of forward activations that cross pivot p (the cut between
        layer p and p + 1). The gradient of the same tensors crosses back in the backward pass,
        with the same size, so a cut moves 2 * activation_bytes[p] per microbatch in total, one
        half each way.
      parameter_bytes: [n] bytes of trainable parameters owned by each layer; a replicated stage
        all-reduces the gradients of these, and every replica stores them.
      stash_bytes: [n] bytes each layer keeps alive per in-flight microbatch (activations saved
        for the backward pass), or None when unknown; None prices activation memory at zero.
      source: where the numbers came from (a file name, a module name), used in messages.
      update_seconds_per_byte: the optimizer update's seconds per step per parameter byte on one
        device (0 when unknown). The update is elementwise over the parameters (Adam), so a stage
        pays this times its parameter bytes once per step, on every replica (`update_time`).
      forward_fixed, backward_fixed: [n] the part of forward_time and backward_time that does not
        shrink when the batch is split (reading a weight matrix, writing its gradient:
        `hlomap.cost.pipeline.batch_split`); None for none. A microbatch 1 / M of the batch on r
        data replicas takes fixed + (time - fixed) / (M r) on each (`scale_batch`, `on_replicas`).
      forward_syncs, backward_syncs: [n] all-reduces per microbatch a layer's pass adds on r > 1
        data replicas (batch norm's statistics: `hlomap.cost.pipeline.batch_split.Syncs`), and
        forward_sync_bytes, backward_sync_bytes: [n] their bytes; None for none. Neither grows
        with the batch; priced on the stage's devices (`costs.stage_sync_seconds`).
      gradient_buffers: [n] trainable parameter arrays each layer owns (None: none known): a
        replicated stage's gradient all-reduce combines one buffer per array, and on a measured
        cluster each buffer after the first costs what the calibration timed
        (`hlomap.cost.pipeline.links.gradient_buffer_seconds`). Sums over merged layers and does
        not scale with the batch, like the syncs.
      replica_transposes: [n] seconds per microbatch, on one device, of the transposes each
        layer's backward runs only on more than one replica (None: none): a weight gradient is a
        product XLA computes transposed on one replica, but all-reduces untransposed over several
        and transposes after (`hlomap.cost.compute.transposed_product_cost`). Weight-shaped, so
        it does not scale with the batch; priced with the passes' all-reduces
        (`costs.stage_sync_seconds`), and scaled with the compute speed (`faster_profile`).
      pass_buffers: buffers the mpmd executor's passes move per microbatch, all stages together
        (`hlomap.cost.estimate.pass_buffers`; 0 when unknown): the step's, whatever the cuts,
        which the executor's cost on a measured cluster grows with (`costs.executor_overhead`).
      state_leaves: arrays of the step's state the spmd executor hands back after every step
        (`hlomap.cost.estimate.state_leaves`; 0 when unknown), which its cost on a measured
        cluster grows with, like the mpmd executor's with `pass_buffers`.
    """

    names: tuple[str, ...]
    forward_time: np.ndarray
    backward_time: np.ndarray
    activation_bytes: np.ndarray
    parameter_bytes: np.ndarray
    stash_bytes: np.ndarray | None = None
    source: str = "<profile>"
    update_seconds_per_byte: float = 0.0
    forward_fixed: np.ndarray | None = None
    backward_fixed: np.ndarray | None = None
    forward_syncs: np.ndarray | None = None
    backward_syncs: np.ndarray | None = None
    forward_sync_bytes: np.ndarray | None = None
    backward_sync_bytes: np.ndarray | None = None
    gradient_buffers: np.ndarray | None = None
    replica_transposes: np.ndarray | None = None
    pass_buffers: float = 0.0
    state_leaves: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.names)
        for name in ("pass_buffers", "state_leaves"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{self.source}: PipelineProfile.{name} = {value!r} is not a finite value >= 0")
        if not (math.isfinite(self.update_seconds_per_byte) and self.update_seconds_per_byte >= 0):
            raise ValueError(f"{self.source}: PipelineProfile.update_seconds_per_byte = "
                             f"{self.update_seconds_per_byte!r} is not a finite value >= 0")
        if n == 0:
            raise ValueError(f"{self.source}: a PipelineProfile needs at least one layer")
        object.__setattr__(self, "names", tuple(str(name) for name in self.names))
        for field_name, length in (
            ("forward_time", n),
            ("backward_time", n),
            ("activation_bytes", n - 1),
            ("parameter_bytes", n),
        ):
            vector = _frozen_vector(
                getattr(self, field_name), name=field_name, length=length, source=self.source
            )
            object.__setattr__(self, field_name, vector)
        if self.stash_bytes is not None:
            vector = _frozen_vector(
                self.stash_bytes, name="stash_bytes", length=n, source=self.source
            )
            object.__setattr__(self, "stash_bytes", vector)
        for field_name, total in (("forward_fixed", self.forward_time), ("backward_fixed", self.backward_time)):
            given = getattr(self, field_name)
            if given is None:
                vector = np.zeros(n)
                vector.setflags(write=False)
            else:  # never more than the whole time (a rounding above it would make the split part negative)
                checked = _frozen_vector(given, name=field_name, length=n, source=self.source)
                vector = np.minimum(checked, total)
                vector.setflags(write=False)
            object.__setattr__(self, field_name, vector)
        for field_name in SYNC_FIELDS:
            given = getattr(self, field_name)
            if given is None:
                vector = np.zeros(n)
                vector.setflags(write=False)
            else:
                vector = _frozen_vector(given, name=field_name, length=n, source=self.source)
            object.__setattr__(self, field_name, vector)

    @property
    def n_layers(self) -> int:
        return len(self.names)

    @property
    def n_pivots(self) -> int:
        """Number of places a cut can go (between consecutive layers)."""
        return len(self.names) - 1

    @property
    def compute_time(self) -> np.ndarray:
        """[n] forward + backward seconds per layer (PipeDream's per-layer compute)."""
        return self.forward_time + self.backward_time

    @property
    def compute_fixed(self) -> np.ndarray:
        """[n] the part of `compute_time` that a batch split does not shrink."""
        return self.forward_fixed + self.backward_fixed  # type: ignore[operator]

    def on_replicas(self, layers: slice, replicas: int) -> tuple[float, float]:
        """(forward, backward) seconds of one microbatch through `layers` on each of `replicas`
        data replicas: the part that grows with the batch is split over them, the fixed part
        (`forward_fixed`) is paid by each."""
        return (replicated_seconds(float(self.forward_time[layers].sum()), float(self.forward_fixed[layers].sum()),
                                   replicas),
                replicated_seconds(float(self.backward_time[layers].sum()),
                                   float(self.backward_fixed[layers].sum()), replicas))

    def syncs_on(self, layers: slice) -> tuple[tuple[float, float], tuple[float, float]]:
        """((count, bytes) forward, (count, bytes) backward) of the all-reduces one microbatch
        through `layers` adds on more than one data replica (`forward_syncs`)."""
        return ((float(self.forward_syncs[layers].sum()), float(self.forward_sync_bytes[layers].sum())),  # type: ignore[index]
                (float(self.backward_syncs[layers].sum()), float(self.backward_sync_bytes[layers].sum())))  # type: ignore[index]

    def replica_transposes_of(self, layers: slice) -> float:
        """Seconds per microbatch, on one device, of the transposes `layers`' backward runs on
        more than one replica (`replica_transposes`)."""
        return float(self.replica_transposes[layers].sum())  # type: ignore[index]

    def gradient_buffers_of(self, layers: slice) -> float:
        """Arrays the gradient all-reduce of `layers` combines (`gradient_buffers`)."""
        return float(self.gradient_buffers[layers].sum())  # type: ignore[index]

    @property
    def update_time(self) -> np.ndarray:
        """[n] seconds per step the optimizer update of each layer's parameters takes on one device."""
        return self.parameter_bytes * self.update_seconds_per_byte

    @property
    def trainable(self) -> np.ndarray:
        """[n] bool: layers that own trainable parameters."""
        return self.parameter_bytes > 0

    def prefix(self) -> Prefix:
        """Cumulative sums (length n + 1, leading zero) for O(1) stage costs."""

        def cumulative(values: np.ndarray) -> np.ndarray:
            out = np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])
            out.setflags(write=False)
            return out

        stash = self.stash_bytes if self.stash_bytes is not None else np.zeros(self.n_layers)
        return Prefix(
            forward=cumulative(self.forward_time),
            backward=cumulative(self.backward_time),
            compute=cumulative(self.compute_time),
            parameter=cumulative(self.parameter_bytes),
            stash=cumulative(stash),
            trainable=cumulative(self.trainable.astype(np.float64)),
            fixed=cumulative(self.compute_fixed),
            **{name: cumulative(values) for name, values in sync_fields(self).items()},
        )

    def stage_slice(self, start: int, stop: int) -> slice:
        """The layers of stage [start, stop), checked."""
        if not 0 <= start < stop <= self.n_layers:
            raise ValueError(
                f"{self.source}: stage [{start}, {stop}) is not a non-empty range of the "
                f"{self.n_layers} layers"
            )
        return slice(start, stop)


#: The fields of what a stage pays only on more than one replica: the in-pass all-reduces
#: (`PipelineProfile.forward_syncs`), the gradient all-reduce's arrays (`gradient_buffers`) and the
#: transposes after it (`replica_transposes`). They do not scale with the batch (nor, but for the
#: transposes' seconds, with the compute speed), and sum over merged layers.
SYNC_FIELDS = ("forward_syncs", "backward_syncs", "forward_sync_bytes", "backward_sync_bytes", "gradient_buffers",
               "replica_transposes")


def sync_fields(profile: PipelineProfile) -> dict[str, np.ndarray]:
    """`profile`'s `SYNC_FIELDS` by name."""
    return {name: getattr(profile, name) for name in SYNC_FIELDS}


def uniform_profile(
    n_layers: int,
    *,
    forward_time: float,
    backward_time: float,
    activation_bytes: float = 0.0,
    parameter_bytes: float = 0.0,
    stash_bytes: float | None = None,
) -> PipelineProfile:
    """n identical layers: the setting of the closed-form GPipe / 1F1B formulas."""
    return PipelineProfile(
        names=tuple(f"layer{i}" for i in range(n_layers)),
        forward_time=np.full(n_layers, forward_time),
        backward_time=np.full(n_layers, backward_time),
        activation_bytes=np.full(n_layers - 1, activation_bytes),
        parameter_bytes=np.full(n_layers, parameter_bytes),
        stash_bytes=None if stash_bytes is None else np.full(n_layers, stash_bytes),
        source=f"uniform_profile({n_layers})",
    )


def scale_batch(profile: PipelineProfile, factor: float) -> PipelineProfile:
    """The profile at `factor` times the batch size it was measured at.

    Compute beyond its fixed part (`PipelineProfile.forward_fixed`), activations and stash scale
    linearly with the batch; parameters and the fixed compute do not scale.
    """
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"{profile.source}: batch scale factor {factor!r} must be > 0")
    return PipelineProfile(
        names=profile.names,
        forward_time=profile.forward_fixed + (profile.forward_time - profile.forward_fixed) * factor,
        backward_time=profile.backward_fixed + (profile.backward_time - profile.backward_fixed) * factor,
        forward_fixed=profile.forward_fixed,
        backward_fixed=profile.backward_fixed,
        **sync_fields(profile),  # a reduction over the batch all-reduces its result whatever the batch
        activation_bytes=profile.activation_bytes * factor,
        parameter_bytes=profile.parameter_bytes,
        stash_bytes=None if profile.stash_bytes is None else profile.stash_bytes * factor,
        source=profile.source,  # the step it was measured on, which errors name
        update_seconds_per_byte=profile.update_seconds_per_byte,  # once per step, whatever the batch
        pass_buffers=profile.pass_buffers,  # the same leaves whatever the batch
        state_leaves=profile.state_leaves,
    )


def merge_layers(profile: PipelineProfile, pivots: tuple[int, ...] | list[int]) -> PipelineProfile:
    """Keep only the given pivots as possible cuts, merging the layers between them.

    Searches on large graphs (thousands of nodes) get cheaper, and any plan on the merged profile
    is a plan on the original one with the same costs, because every per-layer quantity is summed
    and the kept pivots keep their crossing bytes.
    """
    kept = sorted(set(int(p) for p in pivots))
    for p in kept:
        if not 0 <= p < profile.n_pivots:
            raise ValueError(
                f"{profile.source}: pivot {p} is out of range [0, {profile.n_pivots})"
            )
    bounds = [0] + [p + 1 for p in kept] + [profile.n_layers]
    groups = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]

    def summed(values: np.ndarray) -> np.ndarray:
        return np.array([values[g].sum() for g in groups])

    def label(g: slice) -> str:
        first, last = profile.names[g.start], profile.names[g.stop - 1]
        return first if g.stop - g.start == 1 else f"{first}..{last}"

    return PipelineProfile(
        names=tuple(label(g) for g in groups),
        forward_time=summed(profile.forward_time),
        backward_time=summed(profile.backward_time),
        activation_bytes=profile.activation_bytes[kept] if kept else np.zeros(0),
        parameter_bytes=summed(profile.parameter_bytes),
        stash_bytes=None if profile.stash_bytes is None else summed(profile.stash_bytes),
        source=profile.source,
        update_seconds_per_byte=profile.update_seconds_per_byte,
        forward_fixed=summed(profile.forward_fixed),
        backward_fixed=summed(profile.backward_fixed),
        **{name: summed(values) for name, values in sync_fields(profile).items()},
        pass_buffers=profile.pass_buffers,
        state_leaves=profile.state_leaves,
    )


def faster_profile(profile: PipelineProfile, factor: float) -> PipelineProfile:
    """`profile` with its compute `factor` times faster (`hlomap.cost.cluster.busy_speedup`)."""
    if factor == 1.0:
        return profile
    return dataclasses.replace(profile, forward_time=profile.forward_time / factor,
                               backward_time=profile.backward_time / factor,
                               forward_fixed=profile.forward_fixed / factor,
                               backward_fixed=profile.backward_fixed / factor,
                               replica_transposes=profile.replica_transposes / factor,  # type: ignore[operator]
                               update_seconds_per_byte=profile.update_seconds_per_byte / factor)
