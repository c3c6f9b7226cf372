"""Pipeline plans: stages (contiguous layers on a group of devices), microbatches, schedule.

A plan's stages are its logical stages, in model order. With `repeats` V > 1 (interleaved 1F1B) the
model is cut into S V logical stages (chunks) and logical stage k runs on the devices of stage
k mod S, its device stage (device group): chunk k // S of that group. Every schedule is given as
the sequence of passes each device group runs (`device_order`); the event simulator, the closed
form and the mpmd executor all read it from here.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

__all__ = ["DEFAULT_SCHEDULE", "INPUT_GRADIENT_SHARE", "Pass", "PipelinePlan", "Schedule", "Stage", "Step",
           "default_executor", "device_order", "in_flight", "schedule_problem", "splits_batch", "stage_order"]


class Schedule(enum.Enum):
    """Order in which a device group runs the forward (F), backward (B) and, split from it, weight
    gradient (W) passes of its microbatches.

    GPIPE: all forwards, then all backwards (synchronous flush at the end of the batch).
    ONE_F_ONE_B: PipeDream-Flush / Megatron non-interleaved 1F1B: stage s runs S - s - 1 warm-up
      forwards, then alternates one forward and one backward, then drains the backwards. Same
      bubble as GPipe, but at most min(S - s, M) microbatches are stashed on stage s instead of M.
    INTERLEAVED: Megatron-LM interleaved 1F1B (Narayanan et al., SC'21, section 2.2.2): each device
      group runs V = `repeats` model chunks (logical stages g, g + S, ...); microbatches go through
      in groups of S (M must be a multiple of S), a group's warm-up is 2 (S - g - 1) + (V - 1) S
      chunk-forwards. The bubble shrinks V-fold: (S - 1) / (V M + S - 1) of the step for uniform
      stages, at the price of V times the transfers and more stashed chunk-microbatches.
    ZERO_BUBBLE: ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): the backward is
      split into B (the input gradient, which the previous stage waits for) and W (the weight
      gradient, which nobody waits for). Each stage runs 1F1B's forwards (at most min(S - s, M)
      microbatches between F and B) and keeps 1F1B's peak memory (at most min(S, M) microbatches
      between F and W, what 1F1B's first stage holds), running a W only when no B or F can run: the
      gradient runs back through B passes only, and later stages defer up to s W passes into their
      drain. For S equal stages with B = W = F the paper's bubble is (S - 1) F instead of 1F1B's
      3 (S - 1) F; this greedy order reaches it when M = S (and for S = 2) and stays within another
      (S - 1) F of it otherwise, always below 1F1B's.
    """

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved-1f1b"
    ZERO_BUBBLE = "zb-h1"


#: The schedule of a pipeline that names none, for every reader (explorers, cost model, placement,
#: re-planning, runner). 1F1B: the same bubble as GPipe with at most S in-flight microbatches per
#: stage instead of M (Narayanan et al., Megatron-LM SC21, section 2.2.1), so it is what the explorers
#: write and what the cost model prices; the MPMD runner executes it.
DEFAULT_SCHEDULE = Schedule.ONE_F_ONE_B

#: Share of a stage's backward time that its input-gradient pass B takes under ZB-H1; the weight
#: pass W takes the rest. For a matmul y = x w the backward is two matmuls of the forward's size
#: (dx = dy w^T and dw = x^T dy), so with the usual backward = 2 x forward, B and W are each about
#: one forward; the profile does not measure them apart, so the split is this constant.
INPUT_GRADIENT_SHARE = 0.5


def default_executor(schedule: Schedule, uniform: bool, repeats: int = 1) -> str:
    """The executor a pipeline runs on when none is asked for (`hlomap.run.Executor` values): a
    circular pipeline (GPipe with `repeats` > 1) and a GPipe pipeline whose stages are alike run
    on "spmd"; 1F1B, interleaved 1F1B, ZB-H1, or stages that differ, on "mpmd"."""
    if schedule is Schedule.GPIPE:
        return "spmd" if repeats > 1 or uniform else "mpmd"
    return "mpmd"


class Pass(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"  # the whole backward; under ZB-H1 the input gradient only
    WEIGHT = "W"  # ZB-H1's weight gradient


class Step(NamedTuple):
    """One pass a device group runs: `chunk` c of group g is logical stage c S + g."""

    kind: Pass
    chunk: int
    microbatch: int


def schedule_problem(schedule: Schedule, n_groups: int, microbatches: int, repeats: int = 1) -> str | None:
    """Why `schedule` cannot run S = `n_groups` device groups, M microbatches and V = `repeats`
    chunks per group (a sentence), or None when it can."""
    if n_groups < 1 or microbatches < 1 or repeats < 1:
        return f"{n_groups} stages, {microbatches} microbatches and repeats {repeats} must each be at least 1"
    if repeats > 1 and schedule is Schedule.INTERLEAVED and microbatches % n_groups:
        return (f"interleaved 1F1B sends microbatches through in groups of S = {n_groups} stages; "
                f"{microbatches} microbatches is not a multiple of {n_groups}")
    if repeats > 1 and schedule not in (Schedule.INTERLEAVED, Schedule.GPIPE):
        return f"repeats {repeats} (model chunks per stage) needs the interleaved-1f1b schedule, not {schedule.value}"
    return None


def in_flight(schedule: Schedule, stage: int, n_stages: int, microbatches: int, repeats: int = 1) -> int:
    """Microbatches whose activations logical stage `stage` holds at once, at its peak (a
    microbatch is held from its forward to its backward, under ZB-H1 to its weight pass).
    `n_stages` counts device groups when `repeats` > 1."""
    if schedule is Schedule.GPIPE and repeats == 1:
        return microbatches
    if schedule in (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED) and repeats == 1:
        return min(n_stages - stage, microbatches)
    group, chunk = stage % n_stages, stage // n_stages
    return held_counts(device_order(schedule, group, n_stages, microbatches, repeats), repeats)[chunk]


def held_counts(order: Sequence[Step], chunks: int) -> tuple[int, ...]:
    """Peak microbatches each chunk holds along a device group's `order`, counted in execution
    order (a forward holds from its start; the pass that frees is the W when the order has W
    passes, else the B): the order, not a clock, decides."""
    frees = Pass.WEIGHT if any(step.kind is Pass.WEIGHT for step in order) else Pass.BACKWARD
    held, peak = [0] * chunks, [0] * chunks
    for step in order:
        if step.kind is Pass.FORWARD:
            held[step.chunk] += 1
            peak[step.chunk] = max(peak[step.chunk], held[step.chunk])
        elif step.kind is frees:
            held[step.chunk] -= 1
    return tuple(peak)


def splits_batch(batch: int, microbatches: int, replicas: int) -> bool:
    """The batch splits into `microbatches` equal microbatches and each of them evenly over a
    stage's `replicas` data-parallel devices: the one rule under which the runner can split a
    batch, which the explorers therefore offer only stages that satisfy."""
    return batch >= 1 and microbatches >= 1 and replicas >= 1 and batch % (microbatches * replicas) == 0


def stage_order(
    schedule: Schedule, stage: int, n_stages: int, microbatches: int
) -> tuple[tuple[Pass, int], ...]:
    """The sequence of (pass, microbatch) one stage of a pipeline without chunks executes."""
    return tuple((step.kind, step.microbatch) for step in device_order(schedule, stage, n_stages, microbatches))


@functools.lru_cache(maxsize=256)
def device_order(schedule: Schedule, group: int, n_groups: int, microbatches: int, repeats: int = 1) -> tuple[Step, ...]:
    """The passes device group `group` of S = `n_groups` runs, in order (see `Schedule`). Raises
    ValueError for a combination the schedule does not run (`schedule_problem`)."""
    problem = schedule_problem(schedule, n_groups, microbatches, repeats)
    if problem is not None:
        raise ValueError(problem)
    if not 0 <= group < n_groups:
        raise ValueError(f"device group {group} is not one of the {n_groups} stages")
    m = microbatches
    if schedule is Schedule.GPIPE:
        if repeats > 1:
            raise ValueError("a circular (gpipe, repeats > 1) pipeline has no per-stage order here: the spmd "
                             "executor runs it in lockstep ticks")
        return tuple(Step(Pass.FORWARD, 0, i) for i in range(m)) + tuple(Step(Pass.BACKWARD, 0, i) for i in range(m))
    if schedule is Schedule.ZERO_BUBBLE:
        return _zero_bubble_orders(n_groups, m)[group]
    if schedule is Schedule.INTERLEAVED and repeats > 1:
        return _interleaved_order(group, n_groups, m, repeats)
    warmup = min(n_groups - group - 1, m)
    order = [Step(Pass.FORWARD, 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Step(Pass.FORWARD, 0, warmup + i), Step(Pass.BACKWARD, 0, i)]
    order += [Step(Pass.BACKWARD, 0, i) for i in range(m - warmup, m)]
    return tuple(order)


def _interleaved_order(group: int, n_groups: int, microbatches: int, chunks: int) -> tuple[Step, ...]:
    """Megatron-LM's interleaved 1F1B for one device group: the k-th forward runs chunk
    (k // S) mod V on microbatch (k // (S V)) S + k mod S (S microbatches through one chunk, then
    the same S through the next); backwards walk the chunks in reverse. Warm-up: 2 (S - g - 1)
    for the pipeline's depth both ways, plus (V - 1) S for the first microbatch group to come
    round to the last chunk; then one forward, one backward; then the remaining backwards."""
    s, v = n_groups, chunks
    total = microbatches * v

    def microbatch(k: int) -> int:
        return (k // (s * v)) * s + k % s

    def forward(k: int) -> Step:
        return Step(Pass.FORWARD, (k // s) % v, microbatch(k))

    def backward(k: int) -> Step:
        return Step(Pass.BACKWARD, v - 1 - (k // s) % v, microbatch(k))

    warmup = min(2 * (s - group - 1) + (v - 1) * s, total)
    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(warmup + k), backward(k)]
    order += [backward(k) for k in range(total - warmup, total)]
    return tuple(order)


@functools.lru_cache(maxsize=64)
def _zero_bubble_orders(n_groups: int, microbatches: int) -> tuple[tuple[Step, ...], ...]:
    """ZB-H1's order per stage, from a run of the pipeline with unit-time F, B and W passes and
    free links (B and W each about a forward: `INPUT_GRADIENT_SHARE`): at each tick a free stage
    runs its next B when its gradient has arrived, else its next F when its input has arrived and
    1F1B's limits allow it (`Schedule.ZERO_BUBBLE`), else its oldest pending W.
    The orders come from one execution, so together they are deadlock-free whatever the real
    pass times are."""
    s_count, m = n_groups, microbatches
    forward_done: list[list[int | None]] = [[None] * m for _ in range(s_count)]  # tick at which the pass ended
    backward_done: list[list[int | None]] = [[None] * m for _ in range(s_count)]
    next_forward, next_backward = [0] * s_count, [0] * s_count
    pending_weight: list[list[int]] = [[] for _ in range(s_count)]
    held = [0] * s_count
    orders: list[list[Step]] = [[] for _ in range(s_count)]
    tick, left = 0, 3 * s_count * m
    while left:
        chosen: list[tuple[int, Step]] = []
        for s in range(s_count):
            b, f = next_backward[s], next_forward[s]
            # F runs while 1F1B would (at most S - s microbatches between F and B) and the stage
            # holds fewer than 1F1B's peak, S (microbatches between F and W): a later stage may
            # defer up to s weight passes, which fill its drain
            may_forward = f - b < min(s_count - s, m) and held[s] < min(s_count, m)
            if b < f and _arrived(backward_done[s + 1][b] if s + 1 < s_count else forward_done[s][b], tick):
                chosen.append((s, Step(Pass.BACKWARD, 0, b)))
            elif f < m and may_forward and (s == 0 or _arrived(forward_done[s - 1][f], tick)):
                chosen.append((s, Step(Pass.FORWARD, 0, f)))
            elif pending_weight[s]:
                chosen.append((s, Step(Pass.WEIGHT, 0, pending_weight[s][0])))
        if not chosen:
            raise AssertionError(f"ZB-H1 order generation stalled at tick {tick} ({s_count} stages, {m} microbatches)")
        for s, step in chosen:  # a pass ends at tick + 1, which is when others may use it
            orders[s].append(step)
            left -= 1
            if step.kind is Pass.FORWARD:
                forward_done[s][step.microbatch] = tick + 1
                next_forward[s] += 1
                held[s] += 1
            elif step.kind is Pass.BACKWARD:
                backward_done[s][step.microbatch] = tick + 1
                next_backward[s] += 1
                pending_weight[s].append(step.microbatch)
            else:
                pending_weight[s].pop(0)
                held[s] -= 1
        tick += 1
    return tuple(tuple(order) for order in orders)


def _arrived(done: int | None, tick: int) -> bool:
    return done is not None and done <= tick


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
    """Logical stages in pipeline order, covering layers [0, n) without gaps. Without chunks
    (`repeats` 1) the stages' devices are disjoint; with V = `repeats` > 1 (interleaved 1F1B)
    there are S V stages and stage k runs on the devices of stage k mod S (the first S are
    disjoint)."""

    stages: tuple[Stage, ...]
    microbatches: int
    schedule: Schedule = DEFAULT_SCHEDULE
    repeats: int = 1

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("PipelinePlan needs at least one stage")
        if self.microbatches < 1:
            raise ValueError(f"PipelinePlan.microbatches = {self.microbatches} must be >= 1")
        if self.repeats < 1 or len(self.stages) % self.repeats:
            raise ValueError(f"{len(self.stages)} logical stages do not split into repeats = {self.repeats} chunks "
                             "per device stage")
        problem = schedule_problem(self.schedule, self.device_stages, self.microbatches, self.repeats)
        if problem is not None:
            raise ValueError(problem)
        if self.stages[0].start != 0:
            raise ValueError(f"the first stage starts at layer {self.stages[0].start}, not 0")
        for s, (a, b) in enumerate(zip(self.stages[:-1], self.stages[1:])):
            if a.stop != b.start:
                raise ValueError(
                    f"stage {s} ends at layer {a.stop} but stage {s + 1} starts at {b.start}"
                )
        seen: dict[int, int] = {}
        for s, stage in enumerate(self.stages[:self.device_stages]):
            for d in stage.devices:
                if d in seen:
                    raise ValueError(f"device {d} is in stage {seen[d]} and stage {s}")
                seen[d] = s
        for k, stage in enumerate(self.stages[self.device_stages:], start=self.device_stages):
            group = self.stages[k % self.device_stages]
            if (stage.devices, stage.model) != (group.devices, group.model):
                raise ValueError(f"logical stage {k} runs on devices {stage.devices} (model {stage.model}), not on "
                                 f"those of its device stage {k % self.device_stages}: {group.devices} "
                                 f"(model {group.model})")

    @property
    def device_stages(self) -> int:
        """S: the groups of devices; logical stage k runs on group k mod S."""
        return len(self.stages) // self.repeats

    def device_group(self, stage: int) -> int:
        return stage % self.device_stages

    @property
    def n_stages(self) -> int:
        """Logical stages (S V)."""
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
