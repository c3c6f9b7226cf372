"""Pipeline plans: stages (contiguous layers on a group of devices), microbatches, schedule."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

__all__ = ["DEFAULT_SCHEDULE", "Pass", "PipelinePlan", "Schedule", "Stage", "default_executor", "in_flight", "splits_batch",
           "stage_order"]


class Schedule(enum.Enum):
    """Order in which a stage runs the forward (F) and backward (B) passes of its microbatches.

    GPIPE: all forwards, then all backwards (synchronous flush at the end of the batch).
    ONE_F_ONE_B: PipeDream-Flush / Megatron non-interleaved 1F1B: stage s runs S - s - 1 warm-up
      forwards, then alternates one forward and one backward, then drains the backwards. Same
      bubble as GPipe, but at most min(S - s, M) microbatches are stashed on stage s instead of M.
    """

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"


#: The schedule of a pipeline that names none, for every reader (explorers, cost model, placement,
#: re-planning, runner). 1F1B: the same bubble as GPipe with at most S in-flight microbatches per
#: stage instead of M (Narayanan et al., Megatron-LM SC21, section 2.2.1), so it is what the explorers
#: write and what the cost model prices; the MPMD runner executes it.
DEFAULT_SCHEDULE = Schedule.ONE_F_ONE_B


def default_executor(schedule: Schedule, uniform: bool, repeats: int = 1) -> str:
    """The executor a pipeline runs on when none is asked for (`hlomap.run.Executor` values): a
    circular pipeline (`repeats` > 1) and a GPipe pipeline whose stages are alike run on "spmd";
    1F1B, or stages that differ, on "mpmd"."""
    if repeats > 1:
        return "spmd"
    return "mpmd" if schedule is Schedule.ONE_F_ONE_B or not uniform else "spmd"


class Pass(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"


def in_flight(schedule: Schedule, stage: int, n_stages: int, microbatches: int) -> int:
    """Microbatches whose activations stage `stage` holds at once, at its peak."""
    if schedule is Schedule.GPIPE:
        return microbatches
    return min(n_stages - stage, microbatches)


def splits_batch(batch: int, microbatches: int, replicas: int) -> bool:
    """The batch splits into `microbatches` equal microbatches and each of them evenly over a
    stage's `replicas` data-parallel devices: the one rule under which the runner can split a
    batch, which the explorers therefore offer only stages that satisfy."""
    return batch >= 1 and microbatches >= 1 and replicas >= 1 and batch % (microbatches * replicas) == 0


def stage_order(
    schedule: Schedule, stage: int, n_stages: int, microbatches: int
) -> tuple[tuple[Pass, int], ...]:
    """The sequence of (pass, microbatch) one stage executes."""
    m = microbatches
    if schedule is Schedule.GPIPE:
        return tuple((Pass.FORWARD, i) for i in range(m)) + tuple(
            (Pass.BACKWARD, i) for i in range(m)
        )
    warmup = min(n_stages - stage - 1, m)
    order: list[tuple[Pass, int]] = [(Pass.FORWARD, i) for i in range(warmup)]
    for i in range(m - warmup):
        order.append((Pass.FORWARD, warmup + i))
        order.append((Pass.BACKWARD, i))
    order.extend((Pass.BACKWARD, i) for i in range(m - warmup, m))
    return tuple(order)


@dataclass(frozen=True)
class Stage:
    """Layers [start, stop) on `devices`, a data x model mesh: `model` devices split each
    layer's tensors (tensor parallelism) and the data = len(devices) / model replicas split the
    batch (data parallelism). The pipeline task's stages are replicated (model 1); the joint
    task's carry a mesh and the sharding plan inside it (`tasks.joint.plans.JointStage`)."""

    start: int
    stop: int
    devices: tuple[int, ...]
    model: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise ValueError(f"Stage layers [{self.start}, {self.stop}) are empty or negative")
        if not self.devices or len(set(self.devices)) != len(self.devices):
            raise ValueError(f"Stage [{self.start}, {self.stop}) has devices {self.devices!r}")
        if self.model < 1 or len(self.devices) % self.model:
            raise ValueError(f"Stage [{self.start}, {self.stop}) has {len(self.devices)} devices, which a model axis "
                             f"of {self.model} does not divide")

    @property
    def replication(self) -> int:
        """The data axis: how many replicas of the stage split each microbatch."""
        return len(self.devices) // self.model


@dataclass(frozen=True)
class PipelinePlan:
    """Stages in pipeline order, covering layers [0, n) without gaps, on disjoint devices."""

    stages: tuple[Stage, ...]
    microbatches: int
    schedule: Schedule = DEFAULT_SCHEDULE

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("PipelinePlan needs at least one stage")
        if self.microbatches < 1:
            raise ValueError(f"PipelinePlan.microbatches = {self.microbatches} must be >= 1")
        if self.stages[0].start != 0:
            raise ValueError(f"the first stage starts at layer {self.stages[0].start}, not 0")
        for s, (a, b) in enumerate(zip(self.stages[:-1], self.stages[1:])):
            if a.stop != b.start:
                raise ValueError(
                    f"stage {s} ends at layer {a.stop} but stage {s + 1} starts at {b.start}"
                )
        seen: dict[int, int] = {}
        for s, stage in enumerate(self.stages):
            for d in stage.devices:
                if d in seen:
                    raise ValueError(f"device {d} is in stage {seen[d]} and stage {s}")
                seen[d] = s

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def n_layers(self) -> int:
        return self.stages[-1].stop

    @property
    def cuts(self) -> tuple[int, ...]:
        """Pivots cut: stage s ends after layer cuts[s] (pivot p separates layers p, p + 1)."""
        return tuple(stage.stop - 1 for stage in self.stages[:-1])

    @property
    def replication(self) -> tuple[int, ...]:
        return tuple(stage.replication for stage in self.stages)

    @classmethod
    def linear(
        cls,
        bounds: Sequence[int],
        replication: Sequence[int],
        *,
        microbatches: int,
        schedule: Schedule = DEFAULT_SCHEDULE,
        first_device: int = 0,
    ) -> PipelinePlan:
        """Stages [bounds[s], bounds[s+1]) on consecutive device blocks in linear device order."""
        if len(bounds) != len(replication) + 1:
            raise ValueError(
                f"{len(bounds)} stage bounds {tuple(bounds)} need {len(bounds) - 1} replication "
                f"factors, got {tuple(replication)}"
            )
        stages = []
        device = first_device
        for start, stop, r in zip(bounds[:-1], bounds[1:], replication):
            stages.append(Stage(int(start), int(stop), tuple(range(device, device + int(r)))))
            device += int(r)
        return cls(stages=tuple(stages), microbatches=microbatches, schedule=schedule)

    def describe(self, names: Sequence[str] | None = None) -> str:
        """One line per stage, e.g. `stage 0: layers [0, 5) conv1..relu3 on devices (0, 1)`."""
        lines = []
        for s, stage in enumerate(self.stages):
            label = ""
            if names is not None:
                label = f" {names[stage.start]}..{names[stage.stop - 1]}"
            lines.append(
                f"stage {s}: layers [{stage.start}, {stage.stop}){label} on devices {stage.devices}"
            )
        return "\n".join(lines)
