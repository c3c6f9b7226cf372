"""What a re-planner can do when resources change, and what each choice costs (AutoPipe).

Options at a change:
- keep: the running plan, at its step time on the new resources (none if a device left);
- move: the best "two-worker move": shift the boundary between two neighbouring stages by a few
  blocks, moving those layers (their parameters and optimizer state) from one stage to the other;
- re-solve: the pipeline DP's optimal plan on the available devices (some may stay idle).

Each is priced by its step time (the pipeline cost model's closed-form latency on the state's
cluster, `PipelineModel.plan_cost`) and by its migration: every device of the new plan must hold
the parameters and optimizer state of its stage's blocks (`STATE_FACTOR` x parameter bytes: the
weights and Adam's two moments); what it lacks it receives from the device holding that block
with the fastest link to it, or, when every holder has left, from the last checkpoint in shared
storage at `CHECKPOINT_BANDWIDTH`. Transfers run at once; a device receives, and sends, one
transfer after another, so the migration takes as long as the busiest device's queue.

Every call to the pipeline cost model and DP goes through `tasks.placement.pipeline_costs`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Protocol

import numpy as np

from hlomap.cost.pipeline.profile import PipelineProfile
from hlomap.cost.pipeline.stages import PipelinePlan, Schedule, Stage
from hlomap.tasks.pipeline.solution import NoFeasiblePlan
from hlomap.tasks.pipeline.space import PipelineObjective, PipelineSpace
from hlomap.tasks.placement.pipeline_costs import PipelineModel
from hlomap.tasks.replan.trace import ResourceState, device_sets, sub_cluster

__all__ = ["CHECKPOINT_BANDWIDTH", "STATE_FACTOR", "Candidate", "Migration", "Option", "RunningPlan", "Workload",
           "ReplannedPlan", "best_move", "busiest_queue", "initial_plan", "migration", "plan_step_seconds", "resolve",
           "transformer_workload"]

#: Bytes of state per parameter byte that move with a layer: the weights and Adam's two moments.
STATE_FACTOR = 3.0
#: Bytes/s from shared checkpoint storage to a device (10 Gbit/s), for blocks whose every holder left.
CHECKPOINT_BANDWIDTH = 1.25e9
#: Most blocks a two-worker move shifts a boundary by.
MAX_SHIFT = 4


class Option(str, enum.Enum):
    KEEP = "keep"
    MOVE = "move"
    RESOLVE = "re-solve"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Workload:
    """The model being trained: its profile in blocks (per microbatch), microbatches, schedule,
    and the plans a re-solve may return (stage replication factors, most stages)."""

    profile: PipelineProfile
    microbatches: int
    schedule: Schedule = Schedule.ONE_F_ONE_B
    replication: tuple[int, ...] = (1, 2, 4, 8)
    max_stages: int = 4

    def space(self) -> PipelineSpace:
        """The plans a re-solve chooses from. Devices may stay idle: 14 GPUs cannot be cut into 2
        stages of 1, 2, 4 or 8 replicas, and a re-solve that had to use them all answered "cannot
        run" while 12 of them could train; leaving a device idle is also sometimes faster."""
        return PipelineSpace(microbatches=self.microbatches, schedule=self.schedule,
                             objective=PipelineObjective.LATENCY, replication=self.replication, use_all_devices=False,
                             max_stages=self.max_stages, max_thresholds=200)


def transformer_workload(layers: int = 24, hidden: int = 2048, seq: int = 2048, microbatch: int = 2,
                         microbatches: int = 16, flops: float = 125e12 * 0.6, seed: int = 0) -> Workload:
    """A GPT-style model as blocks: an embedding, `layers` transformer layers (+-10% compute
    noise, seeded) and an output head; bf16 activations, fp32 parameters; per microbatch on a
    device of `flops` FLOP/s. What the generated re-planning experiments train."""
    rng = np.random.default_rng(seed)
    tokens = microbatch * seq
    layer_params = 12.0 * hidden**2
    vocab_params = 50_000.0 * hidden
    params = np.array([vocab_params, *([layer_params] * layers), vocab_params])
    forward = 2 * params * tokens / flops * np.concatenate([[0.1], rng.uniform(0.9, 1.1, layers), [1.0]])
    profile = PipelineProfile(
        names=("embed", *(f"layer{i}" for i in range(layers)), "head"),
        forward_time=forward, backward_time=2 * forward,
        activation_bytes=np.full(layers + 1, tokens * hidden * 2.0), parameter_bytes=4.0 * params,
        stash_bytes=np.full(layers + 2, 6.0 * tokens * hidden * 2.0),
        source=f"gpt {layers}x{hidden}")
    return Workload(profile, microbatches)


@dataclass(frozen=True)
class RunningPlan:
    """A pipeline plan as the re-planner keeps it: stage s is blocks [bounds[s], bounds[s+1]) on
    the global devices `devices[s]`."""

    bounds: tuple[int, ...]
    devices: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if len(self.bounds) != len(self.devices) + 1 or any(a >= b for a, b in zip(self.bounds[:-1], self.bounds[1:])):
            raise ValueError(f"stage bounds {self.bounds} do not fit {len(self.devices)} stages")

    @property
    def n_stages(self) -> int:
        return len(self.devices)

    def holders(self, block: int) -> tuple[int, ...]:
        """Devices that hold a block's parameters and optimizer state."""
        s = int(np.searchsorted(self.bounds, block, side="right")) - 1
        return self.devices[s]

    def on(self, state: ResourceState) -> PipelinePlan | None:
        """The plan on the state's local device ids (None when one of its devices is not there)."""
        stages = []
        for (a, b), group in zip(zip(self.bounds[:-1], self.bounds[1:]), self.devices):
            local = [state.local(d) for d in group]
            if any(x is None for x in local):
                return None
            stages.append(Stage(a, b, tuple(int(x) for x in local if x is not None)))
        return PipelinePlan(tuple(stages), 1)

    def describe(self) -> str:
        parts = []
        for (a, b), group in zip(zip(self.bounds[:-1], self.bounds[1:]), self.devices):
            span = f"{group[0]}-{group[-1]}" if len(group) > 1 else str(group[0])
            parts.append(f"[{a},{b})@{span}")
        return " ".join(parts)


def plan_step_seconds(workload: Workload, plan: RunningPlan, state: ResourceState,
                      model: PipelineModel | None) -> float:
    """Closed-form step time of `plan` on the state (inf when it cannot run: a device left, or a
    stage does not fit its devices' memory)."""
    local = plan.on(state)
    if local is None or model is None:
        return math.inf
    local = PipelinePlan(local.stages, workload.microbatches, workload.schedule)
    cost = model.plan_cost(workload.profile, local)
    return cost.latency if cost.feasible else math.inf


def _shifted(plan: RunningPlan, cut: int, shift: int) -> RunningPlan | None:
    bounds = list(plan.bounds)
    bounds[cut + 1] += shift
    if bounds[cut + 1] <= bounds[cut] or bounds[cut + 1] >= bounds[cut + 2]:
        return None
    return RunningPlan(tuple(bounds), plan.devices)


def best_move(workload: Workload, plan: RunningPlan, state: ResourceState,
              model: PipelineModel | None) -> tuple[RunningPlan, float] | None:
    """The two-worker move (a boundary shifted by 1..`MAX_SHIFT` blocks) with the least step time,
    or None when none runs or none is faster than the plan."""
    best: tuple[RunningPlan, float] | None = None
    current = plan_step_seconds(workload, plan, state, model)
    for cut in range(plan.n_stages - 1):
        for shift in [s for k in range(1, MAX_SHIFT + 1) for s in (-k, k)]:
            moved = _shifted(plan, cut, shift)
            if moved is None:
                continue
            t = plan_step_seconds(workload, moved, state, model)
            if t < current and (best is None or t < best[1]):
                best = (moved, t)
    return best


def resolve(workload: Workload, state: ResourceState, model: PipelineModel | None) -> tuple[RunningPlan, float] | None:
    """The fastest of the DP's optimal plans on each of the state's `device_sets` (every available
    device, `model`'s; those at full speed; the full servers'), leaving some idle where that is
    faster or the only way (None when nothing fits). On every device alone the DP fills them in
    order: a straggler on device 0, or a server left with fewer GPUs, would be in every plan."""
    if model is None or state.cluster is None:
        return None
    best: tuple[RunningPlan, float] | None = None
    for keep in device_sets(state.cluster):
        on = model if len(keep) == state.cluster.n_devices else PipelineModel(sub_cluster(state.cluster, keep))
        try:
            solution = on.solve(workload.profile, workload.space())
        except NoFeasiblePlan:
            continue
        devices = tuple(tuple(state.devices[keep[d]] for d in stage.devices) for stage in solution.plan.stages)
        bounds = (0, *(stage.stop for stage in solution.plan.stages))
        if best is None or solution.cost.latency < best[1]:
            best = RunningPlan(bounds, devices), solution.cost.latency
    return best


class Migration(NamedTuple):
    seconds: float
    nbytes: float


def migration(workload: Workload, old: RunningPlan, new: RunningPlan, state: ResourceState) -> Migration:
    """Time and bytes to move from `old` to `new` on the state's links (module docstring); `new`
    must run on the state's devices."""
    if old == new:
        return Migration(0.0, 0.0)
    if new.on(state) is None:
        raise ValueError(f"cannot migrate to {new.describe()}: some of its devices are not available")
    state_bytes = STATE_FACTOR * workload.profile.parameter_bytes
    transfers: list[tuple[int | None, int, float]] = []
    moved = 0.0
    cluster = state.cluster
    for (a, b), group in zip(zip(new.bounds[:-1], new.bounds[1:]), new.devices):
        for block in range(a, b):
            nbytes = float(state_bytes[block])
            if nbytes <= 0:
                continue
            holders = [h for h in old.holders(block) if state.local(h) is not None]
            for device in group:
                if device in holders:
                    continue
                moved += nbytes
                if not holders:
                    transfers.append((None, device, nbytes / CHECKPOINT_BANDWIDTH))
                    continue
                dst = state.local(device)
                assert dst is not None
                times = [cluster.p2p_time(int(state.local(h)), dst, nbytes) for h in holders]  # type: ignore[arg-type]
                k = int(np.argmin(times))
                transfers.append((holders[k], device, times[k]))
    return Migration(busiest_queue(transfers), moved)


def busiest_queue(transfers: Iterable[tuple[int | None, int, float]]) -> float:
    """Seconds until the last of `transfers` (source, or None for the checkpoint; destination;
    seconds) is done when they all start at once and each device receives, and sends, one after
    another: the busiest device's queue."""
    receive: dict[int, float] = {}
    send: dict[int, float] = {}
    for source, device, seconds in transfers:
        receive[device] = receive.get(device, 0.0) + seconds
        if source is not None:
            send[source] = send.get(source, 0.0) + seconds
    return max([*receive.values(), *send.values()], default=0.0)


class ReplannedPlan(Protocol):
    """What the policies need of a plan: equality (a re-solve to the running plan is keeping it),
    a hash (the oracle's pool) and a one-line description. `RunningPlan` for the pipeline planner,
    `joint.RunningJoint` for the joint planner."""

    def describe(self) -> str: ...

    def __hash__(self) -> int: ...


class Candidate(NamedTuple):
    option: Option
    plan: ReplannedPlan
    step_seconds: float
    migration_seconds: float
    moved_bytes: float


def initial_plan(workload: Workload, state: ResourceState) -> RunningPlan:
    """The plan a job starts with: the DP's optimum on the initial resources."""
    solved = resolve(workload, state, PipelineModel(state.cluster))
    if solved is None:
        raise NoFeasiblePlan(f"{workload.profile.source}: no pipeline plan fits the initial resources")
    return solved[0]
