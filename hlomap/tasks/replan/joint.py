"""Re-planning a joint plan (stages with their own data x model meshes) over a resource trace.

    replay = JointReplay.of_plan(cap, plan, trace)       # the joint planner's space on each state
    run_policy(replay, replay.initial, ReplanPolicy.ARBITER)

The policies (`policies`) are the pipeline re-planner's; what changes is the space they choose in:
- the step is cut into the joint planner's layers (`joint.explore.joint_model` on the trace's
  full cluster, plus the saved plan's own cuts), the same layers on every state;
- a plan's step time on a state is the joint planner's price of its stages on the devices they
  run on (`joint.layout`: each stage's compute, its collectives over its own devices' links, its
  cut over the links to the next stage), its compute at its slowest device's pace, and inf when
  a device left or a stage's memory exceeds its devices';
- a re-solve is the joint planner's exact DP on the available devices: stage count, meshes,
  microbatches, recomputation and state splitting all free, devices left idle where that is
  faster. The DP prices a group of devices as the cluster's first group of that size and does
  not price a straggler, so the re-solve also plans on the devices at full speed, and on those of
  the servers that offer the most of them (`device_sets`), and keeps the plan fastest on the state;
- a move shifts the boundary between two neighbouring stages by 1..`MAX_SHIFT` layers;
- a migration moves, to each device of the new plan, the state of each layer it does not hold in
  the same form: the same layer under the same model split at the same model index (and, where
  the optimizer state or the parameters are split over data replicas, the same data index and
  degree). The bytes per device are the stage's parameters on one device under its option times
  `STATE_FACTOR` (weights and Adam's moments; the moments count 1 / data where the stage splits
  its optimizer state, everything 1 / data where it splits its parameters too; a layer held in
  another form moves whole). They come from the fastest available device that holds the layer in
  the same form, else from the fastest that holds it at all, else from the checkpoint; what one
  device sends another is one message, and messages queue per device as for pipeline plans
  (`options.migration`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from hlomap.cost.cluster import Cluster, compute_slowdown
from hlomap.cost.pipeline.stages import DEFAULT_SCHEDULE, Schedule
from hlomap.hlo.capture import Capture, Role
from hlomap.plan import Pipeline, Plan
from hlomap.plan.sections import PipelineKind, Recompute
from hlomap.propagation.graph import FactorGraph
from hlomap.tasks.joint.costs import JointModel, StageOption
from hlomap.tasks.joint.plans import JointPlan, JointStage, evaluate
from hlomap.tasks.pipeline.solution import NoFeasiblePlan
from hlomap.tasks.placement.problem import JointLayout, PlacementError
from hlomap.tasks.replan.options import CHECKPOINT_BANDWIDTH, MAX_SHIFT, STATE_FACTOR, Migration, busiest_queue
from hlomap.tasks.replan.policies import PlanReplay
from hlomap.tasks.replan.trace import ResourceState, Trace, device_sets, sub_cluster

__all__ = ["JointReplay", "PricedStages", "RunningJoint", "joint_migration", "joint_step_seconds",
           "priced_stages", "stages_step_seconds", "state_bytes"]


@dataclass(frozen=True)
class RunningJoint:
    """A joint plan as the re-planner keeps it: `plan`'s stages are layers of the replay's model
    on global device ids, each stage's in its mesh's row-major order (`model` innermost)."""

    plan: JointPlan

    def devices(self) -> tuple[int, ...]:
        return tuple(d for stage in self.plan.stages for d in stage.devices)

    def describe(self) -> str:
        """Each stage as [layers)@devices data x model (and its recomputation and state split),
        then the microbatches: `[0,14)@0-1 1x2 [14,32)@8-11 2x2 zero M=8`."""
        parts = []
        for st in self.plan.stages:
            extras = "".join([f" {st.recompute.value} recompute" if st.recompute is not Recompute.NONE else "",
                              " zero" if st.split_state and not (st.shard_parameters or st.shard_gradients) else "",
                              " zero2" if st.shard_gradients else "",
                              " fsdp" if st.shard_parameters else ""])
            parts.append(f"[{st.start},{st.stop})@{_span(st.devices)} {st.replication}x{st.model}{extras}")
        return " ".join(parts) + f" M={self.plan.microbatches}"


def _span(group: Sequence[int]) -> str:
    """`4-7` for consecutive devices, `4,5,8,9` otherwise."""
    if len(group) > 1 and list(group) == list(range(group[0], group[0] + len(group))):
        return f"{group[0]}-{group[-1]}"
    return ",".join(map(str, group))


def _on_prefix(plan: JointPlan) -> JointPlan:
    """`plan` with its stages on devices 0.. in order (the layout prices them where they run)."""
    stages, first = [], 0
    for st in plan.stages:
        stages.append(JointStage.of(st.start, st.stop, first, st.option))
        first += len(st.devices)
    return dataclasses.replace(plan, stages=tuple(stages))


def _on_devices(plan: JointPlan, devices: Sequence[int]) -> JointPlan:
    """`plan`'s positions (stage by stage, row-major) on `devices`."""
    stages, it = [], iter(devices)
    for st in plan.stages:
        stages.append(dataclasses.replace(st, devices=tuple(int(next(it)) for _ in st.devices)))
    return dataclasses.replace(plan, stages=tuple(stages))


class PricedStages(NamedTuple):
    """A joint plan's stages as placement prices them on any devices (`layout.joint_layout`),
    and each stage's memory per device: neither depends on the links or on which devices run it,
    so one model of the step prices a plan on every state of a trace."""

    layout: JointLayout
    memory: tuple[float, ...]


def priced_stages(model: JointModel, plan: JointPlan) -> PricedStages:
    from hlomap.tasks.joint.layout import joint_layout

    prefix = _on_prefix(plan)
    return PricedStages(joint_layout(model, prefix), evaluate(model, prefix).stage_memory)


def joint_step_seconds(model: JointModel, plan: JointPlan, devices: Sequence[int],
                       cluster: Cluster | None = None) -> float:
    """Step time of `plan` (its stages' positions on `cluster`'s `devices`, stage by stage; by
    default the model's cluster): the joint planner's price on those devices
    (`layout.joint_layout`), each stage's compute at its slowest device's pace (`cluster`'s
    slowdown); inf when a stage needs more memory than its devices have."""
    return stages_step_seconds(priced_stages(model, plan), cluster or model.cluster, devices)


def stages_step_seconds(stages: PricedStages, cluster: Cluster, devices: Sequence[int]) -> float:
    """`joint_step_seconds` from the plan's `priced_stages`."""
    layout, memory = stages
    times, cuts = layout.times(cluster, devices)
    for s, positions in enumerate(layout.stage_positions()):
        group = [int(devices[p]) for p in positions]
        if memory[s] > min(cluster.devices[d].memory_bytes for d in group):
            return math.inf
        times[s] += layout.stages[s].seconds * (compute_slowdown(cluster, group) - 1.0)
    return layout.latency(times, cuts)


def state_bytes(model: JointModel, option: StageOption, layer: int) -> float:
    """Bytes of one layer's training state on one device of a stage with `option` (module
    docstring)."""
    a = model.arrays(option)
    params = float(a.params[layer + 1] - a.params[layer])
    if option.shard_parameters:
        return STATE_FACTOR * params / option.data
    if option.split_state:
        return params * (1.0 + (STATE_FACTOR - 1.0) / option.data)
    return STATE_FACTOR * params


def _holdings(plan: JointPlan) -> dict[int, dict[int, tuple[object, ...]]]:
    """device -> layer -> the form in which it holds the layer's state."""
    out: dict[int, dict[int, tuple[object, ...]]] = {}
    for st in plan.stages:
        option = st.option
        for p, device in enumerate(st.devices):
            data_index, model_index = divmod(p, option.model)
            split = (option.data, data_index) if option.split_state or option.shard_parameters else ()
            form = (option.model, model_index, option.kind, option.split_state, option.shard_parameters,
                    option.shard_gradients, *split)
            out[int(device)] = {layer: form for layer in range(st.start, st.stop)}
    return out


def joint_migration(model: JointModel, old: JointPlan, new: JointPlan, state: ResourceState) -> Migration:
    """Time and bytes to go from `old` to `new` (global device ids) on the state's links (module
    docstring); `model` gives a layer's bytes per device under an option (any model of the step:
    they do not depend on the links)."""
    if old == new:
        return Migration(0.0, 0.0)
    held, wanted = _holdings(old), _holdings(new)
    holders: dict[int, list[int]] = {}
    for device, layers in held.items():
        if state.local(device) is not None:
            for layer in layers:
                holders.setdefault(layer, []).append(device)
    cluster = state.cluster
    pairs: dict[tuple[int | None, int], float] = {}  # (source or None: the checkpoint, destination) -> bytes
    moved = 0.0
    for st in new.stages:
        option = st.option
        for device in st.devices:
            dst = state.local(device)
            if dst is None:
                raise ValueError(f"cannot migrate to a plan on device {device}: it is not available")
            for layer in range(st.start, st.stop):
                form = wanted[device][layer]
                if held.get(device, {}).get(layer) == form:
                    continue
                nbytes = state_bytes(model, option, layer)
                if nbytes <= 0:
                    continue
                moved += nbytes
                others = [h for h in holders.get(layer, ()) if h != device]
                alike = [h for h in others if held[h][layer] == form]  # the same shard, where someone has it
                sources = alike or others
                source = min(sources, key=lambda h: cluster.p2p_time(int(state.local(h)), dst, nbytes),  # type: ignore[arg-type]
                             default=None)
                pairs[(source, device)] = pairs.get((source, device), 0.0) + nbytes
    transfers = [(source, device, nbytes / CHECKPOINT_BANDWIDTH if source is None else  # one message per pair
                  cluster.p2p_time(int(state.local(source)), int(state.local(device)), nbytes))  # type: ignore[arg-type]
                 for (source, device), nbytes in pairs.items()]
    return Migration(busiest_queue(transfers), moved)


class JointReplay(PlanReplay):
    """The joint planner's space over a trace (module docstring). `initial` is the running plan
    the trace starts from."""

    def __init__(self, trace: Trace, cap: Capture, pivots: Sequence[int], initial: RunningJoint | None, *,
                 graph: FactorGraph | None = None,
                 schedule: Schedule = DEFAULT_SCHEDULE):
        """`initial` None: the joint DP's optimum on the trace's first state."""
        self.trace, self.cap = trace, cap
        self.pivots = tuple(int(p) for p in pivots)
        self.schedule = initial.plan.schedule if initial is not None else schedule
        self.graph = graph
        self.states = trace.states()
        # by cluster: the states of a trace repeat (a server back, a link restored), and neither the
        # joint model nor the DP sees a straggler (which clusters do not compare by)
        self._models: dict[Cluster, JointModel] = {}
        self._plans: dict[Cluster, JointPlan | None] = {}
        self._solved: dict[int, tuple[RunningJoint, float] | None] = {}
        self._steps: dict[tuple[int, RunningJoint], float] = {}
        self._priced: dict[JointPlan, PricedStages] = {}  # by the plan on devices 0..: any devices, any links
        self._reference = JointModel.build(cap, trace.cluster, self.pivots, graph=graph)
        if initial is None:
            first = self.solved(0)
            if first is None:
                raise NoFeasiblePlan(f"{cap.source}: no joint plan fits the trace's first resources")
            initial = first[0]
        self.initial = initial

    @classmethod
    def planned(cls, cap: Capture, trace: Trace, *, schedule: Schedule = DEFAULT_SCHEDULE,
                graph: FactorGraph | None = None) -> JointReplay:
        """The replay of `cap` over `trace` from the joint DP's optimum on its first state, in the
        joint planner's layers for the trace's full cluster (what `scripts/bench_replan.py --joint`
        plays)."""
        from hlomap.tasks.joint.explore import joint_model

        base = joint_model(cap, trace.cluster, graph=graph)
        return cls(trace, cap, base.pivots, None, graph=base.graph, schedule=schedule)

    @classmethod
    def of_plan(cls, cap: Capture, plan: Plan, trace: Trace, *, where: str = "plan",
                graph: FactorGraph | None = None) -> JointReplay:
        """The replay of a saved joint plan over `trace`: one with pipeline stages, or the
        one-stage SPMD plan `hlomap explore --task auto` writes (`replay_plan.is_joint`)."""
        from hlomap.tasks.joint.explore import joint_model

        section = plan.pipeline
        cut_pivots = _cut_pivots(section, where) if section is not None else []
        used = max(plan.device_order())
        if used >= trace.cluster.n_devices:
            raise PlacementError(f"{where}: the plan uses device {used} but trace {trace.name!r} has a cluster of "
                                 f"{trace.cluster.n_devices} devices ({trace.cluster.name})")
        try:
            base = joint_model(cap, trace.cluster, graph=graph)
        except ValueError as err:
            raise PlacementError(f"{where}: {err}") from None
        if max(cut_pivots, default=-1) >= base.attribution.length - 1:
            raise PlacementError(f"{where}: the joint plan cuts at chain position {max(cut_pivots)}, past this "
                                 f"step's chain of {base.attribution.length}: was the plan made for another step?")
        pivots = sorted(set(base.pivots) | set(cut_pivots))
        if section is None:
            running = RunningJoint(_one_stage(cap, plan, len(pivots) + 1, where))
        else:
            running = RunningJoint(_saved_stages(section, pivots, plan.stage_devices()))
        return cls(trace, cap, pivots, running, graph=base.graph)

    # -- models ----------------------------------------------------------------------------

    def model(self, i: int, keep: Sequence[int] | None = None) -> JointModel | None:
        """The joint model of state i's devices (of its local devices `keep` only, none of them
        slowed, when given; None when no device is available)."""
        state = self.states[i][1]
        if state.cluster is None:
            return None
        every = keep is None or len(keep) == state.cluster.n_devices
        cluster = state.cluster if every else sub_cluster(state.cluster, keep)  # type: ignore[arg-type]
        if cluster not in self._models:
            self._models[cluster] = JointModel.build(self.cap, cluster, self.pivots, graph=self.graph)
        return self._models[cluster]

    # -- what the policies ask -------------------------------------------------------------

    def step_seconds(self, i: int, plan: RunningJoint) -> float:
        key = (i, plan)
        if key not in self._steps:
            state = self.states[i][1]
            local = [state.local(d) for d in plan.devices()]
            if state.cluster is None or any(x is None for x in local):
                self._steps[key] = math.inf
            else:
                self._steps[key] = stages_step_seconds(self.priced(plan), state.cluster, local)  # type: ignore[arg-type]
        return self._steps[key]

    def priced(self, plan: RunningJoint) -> PricedStages:
        """`plan`'s stages priced once on the trace's full cluster (the same devices at full
        strength: `PricedStages` depend on neither the links nor the devices)."""
        prefix = _on_prefix(plan.plan)
        if prefix not in self._priced:
            self._priced[prefix] = priced_stages(self._reference, prefix)
        return self._priced[prefix]

    def solved(self, i: int) -> tuple[RunningJoint, float] | None:
        """The fastest of the joint DP's plans on each of the state's `device_sets`, priced on the
        state (None when none fits)."""
        if i not in self._solved:
            state = self.states[i][1]
            found = []
            for keep in device_sets(state.cluster) if state.cluster is not None else ():
                plan = self._solve_on(i, keep)
                if plan is not None:
                    found.append((plan, self.step_seconds(i, plan)))
            runnable = [f for f in found if math.isfinite(f[1])]
            self._solved[i] = min(runnable, key=lambda f: f[1]) if runnable else None
        return self._solved[i]

    def _solve_on(self, i: int, keep: Sequence[int]) -> RunningJoint | None:
        from hlomap.tasks.joint.explore import explore_joint

        model = self.model(i, keep)
        if model is None:
            return None
        if model.cluster not in self._plans:
            try:
                found = explore_joint(self.cap, model.cluster, schedule=self.schedule, model=model, graph=self.graph,
                                      with_grid=False)
                self._plans[model.cluster] = found.plan if found.cost.fits else None
            except NoFeasiblePlan:
                self._plans[model.cluster] = None
        plan = self._plans[model.cluster]
        if plan is None:
            return None
        state = self.states[i][1]
        return RunningJoint(_on_devices(plan, [state.devices[keep[d]] for st in plan.stages for d in st.devices]))

    def best_move(self, i: int, plan: RunningJoint) -> tuple[RunningJoint, float] | None:
        """The boundary shift (1..`MAX_SHIFT` layers between two neighbouring stages) with the
        least step time, or None when none runs or none is faster than the plan."""
        current = self.step_seconds(i, plan)
        best: tuple[RunningJoint, float] | None = None
        stages = plan.plan.stages
        for cut in range(len(stages) - 1):
            for shift in [s for k in range(1, MAX_SHIFT + 1) for s in (-k, k)]:
                boundary = stages[cut].stop + shift
                if not stages[cut].start < boundary < stages[cut + 1].stop:
                    continue
                moved = list(stages)
                moved[cut] = dataclasses.replace(stages[cut], stop=boundary)
                moved[cut + 1] = dataclasses.replace(stages[cut + 1], start=boundary)
                candidate = RunningJoint(dataclasses.replace(plan.plan, stages=tuple(moved)))
                t = self.step_seconds(i, candidate)
                if t < current and (best is None or t < best[1]):
                    best = (candidate, t)
        return best

    def migration(self, i: int, old: RunningJoint, new: RunningJoint) -> Migration:
        # a layer's bytes per device depend on the option, not on the links: the reference model's
        return joint_migration(self._reference, old.plan, new.plan, self.states[i][1])


def _cut_pivots(section: Pipeline, where: str) -> list[int]:
    """The chain position after which each cut of a saved joint plan's pipeline section falls;
    PlacementError for what re-planning does not take."""
    if section.kind is not PipelineKind.JOINT:
        raise PlacementError(f"{where}: not a joint plan (hlomap explore --task auto)")
    if section.repeats > 1:
        raise PlacementError(f"{where}: the pipeline runs {section.repeats} model chunks per stage; re-planning "
                             "takes one chunk per stage")
    pivots = [cut.pivot for cut in section.cuts]
    if len(pivots) != section.n_stages - 1 or any(p is None for p in pivots):
        raise PlacementError(f"{where}: the joint plan's cuts do not record their chain positions; explore the plan "
                             "again")
    return [int(p) for p in pivots]  # type: ignore[arg-type]


def _one_stage(cap: Capture, plan: Plan, layers: int, where: str) -> JointPlan:
    """The one-stage SPMD plan `--task auto` writes, as a joint plan of one stage and microbatch
    on the plan's devices: its data x model mesh and its state split (ZeRO-1, or FSDP where the
    parameters are split too)."""
    mesh = dict(plan.mesh_shape)
    if not set(mesh) <= {"data", "model"}:
        raise PlacementError(f"{where}: an SPMD plan of --task auto has a data x model mesh; this one has "
                             f"{mesh}")
    state = plan.state_sharding
    trainable = {p.index for p in cap.parameters if p.role is Role.TRAINABLE}
    stage = JointStage(0, layers, tuple(plan.device_order()), mesh.get("model", 1), split_state=state is not None,
                       shard_parameters=state is not None and state.splits_any(trainable))
    return JointPlan((stage,), 1, DEFAULT_SCHEDULE)


def _saved_stages(section: Pipeline, pivots: Sequence[int], stage_devices: Sequence[Sequence[int]]) -> JointPlan:
    """The saved joint plan on the replay's layers (cut after chain position p: layer boundary
    `pivots.index(p) + 1`) and its stages' physical devices."""
    from hlomap.tasks.joint.explore import saved_joint_plan

    saved = saved_joint_plan(section)
    bounds = [0, *(list(pivots).index(int(cut.pivot)) + 1 for cut in section.cuts), len(pivots) + 1]  # type: ignore[arg-type]
    stages = tuple(dataclasses.replace(st, start=bounds[s], stop=bounds[s + 1], devices=tuple(stage_devices[s]))
                   for s, st in enumerate(saved.stages))
    return dataclasses.replace(saved, stages=stages)
