"""A joint plan as a placement layout: what `hlomap place` re-prices for every device order.

    model, plan = staged_model(cap, cluster, plan_file.pipeline)   # one layer per stage
    layout = joint_layout(model, plan)                              # a placement `JointLayout`

The joint planner prices a stage's collectives on the cluster's first devices of its size and
its cuts from its first device (`costs.JointModel`): on a cluster of equal servers any aligned
group costs the same. Placement needs them on any devices, so `joint_layout` splits each stage's
time per microbatch (`plans.stage_seconds`) into what no device order changes (compute, the
update, recomputation, the per-buffer cost of a measured cluster) and its collectives as
`StageTerm`s over its mesh axes: each tensor-parallel collective of the stage's layers, the
gradient all-reduce over `data`, and, where the stage splits its optimizer state, the
all-gather of its updated parameters (where it splits its parameters too, the weights'
all-gathers and the gradients' reduce-scatter of every microbatch instead). On the identity order the layout's step equals
`plans.evaluate`'s wherever the two price the same groups (a test holds them equal).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Sequence

import numpy as np

from hlomap.cost.cluster import Cluster, with_busy_devices
from hlomap.cost.collectives import Collective
from hlomap.cost.pipeline.costs import syncs_each_microbatch
from hlomap.hlo.capture import Capture
from hlomap.plan import Pipeline
from hlomap.propagation.graph import FactorGraph
from hlomap.tasks.joint.costs import JointModel, StageArrays
from hlomap.tasks.joint.plans import (JointCost, JointPlan, JointStage, evaluate, forward_share, joint_overhead,
                                      stage_seconds)
from hlomap.tasks.placement.problem import JointLayout, MeshStage, StageTerm

__all__ = ["joint_layout", "priced_on", "staged_model"]


def _unpriced(a: StageArrays) -> StageArrays:
    """`a` without any collective's price: what `stage_seconds` gives then does not depend on
    which devices the stage runs on."""
    zeros = np.zeros_like(a.alpha)
    return a._replace(alpha=zeros, beta=zeros, sync_alpha=0.0, sync_beta=0.0, gather_alpha=0.0, gather_beta=0.0,
                      scatter_alpha=0.0, scatter_beta=0.0)


def _stage_terms(model: JointModel, stage: JointStage, microbatches: int, each: bool) -> tuple[StageTerm, ...]:
    """The collectives of `stage` (module docstring), equal ones merged."""
    option = stage.option
    bounds = model.boundaries
    first, last = int(bounds[stage.start]), int(bounds[stage.stop])
    counts: dict[tuple[Collective, tuple[str, ...], float], float] = defaultdict(float)
    for c in model.work(option.plain).collectives:
        if first <= c.position < last:
            counts[(c.kind, tuple(c.axes), float(c.nbytes))] += c.count
    terms = [StageTerm(kind, axes, nbytes, count, 1.0, 1.0 / microbatches)
             for (kind, axes, nbytes), count in counts.items()]
    a = model.arrays(option)
    if option.data > 1:
        grads = float(a.grads[stage.stop] - a.grads[stage.start])
        params = float(a.params[stage.stop] - a.params[stage.start])
        if option.shard_parameters:  # FSDP: both passes gather the weights, the backward scatters, every microbatch
            if params > 0:
                terms.append(StageTerm(Collective.ALL_GATHER, ("data",), params, 2.0, 1.0, 1.0))
            if grads > 0:
                terms.append(StageTerm(Collective.REDUCE_SCATTER, ("data",), grads, 1.0, 1.0, 1.0))
            return tuple(terms)
        once = 1.0 if each else 1.0 / microbatches
        if option.shard_gradients and grads > 0:  # ZeRO-2: every microbatch's gradients reduce-scattered
            terms.append(StageTerm(Collective.REDUCE_SCATTER, ("data",), grads, 1.0, 1.0, 1.0))
        elif grads > 0:
            terms.append(StageTerm(Collective.ALL_REDUCE, ("data",), grads, 1.0, once, once))
        if option.split_state and params > 0:
            per_step = 1.0 / microbatches
            terms.append(StageTerm(Collective.ALL_GATHER, ("data",), params, 1.0, per_step, per_step))
    return tuple(terms)


def joint_layout(model: JointModel, plan: JointPlan) -> JointLayout:
    """`plan`'s stages as a placement layout on `model`'s cluster (module docstring)."""
    m = plan.microbatches
    each = syncs_each_microbatch(model.cluster)
    stages = []
    for s, stage in enumerate(plan.stages):
        option = stage.option
        a = model.arrays(option)
        fixed = float(stage_seconds(_unpriced(a), stage.start, stage.stop, m, sync_each_microbatch=each))
        send = float(a.crossing[stage.stop - 1]) * option.data / m if s + 1 < plan.n_stages else 0.0
        stages.append(MeshStage((("data", option.data), ("model", option.model)), fixed,
                                _stage_terms(model, stage, m, each), send,
                                forward_share(a, stage.start, stage.stop)))
    return JointLayout(tuple(stages), m, plan.schedule,
                       joint_overhead(model.cluster, plan, model.pass_buffers, model.state_leaves))


def priced_on(model: JointModel, plan: JointPlan, devices: Sequence[int]) -> JointCost:
    """`plans.evaluate(model, plan)` with the plan's positions (stage by stage, each mesh
    row-major) on `devices`: every stage's collectives and cuts priced on the devices it is
    given (the planner's model prices them on the cluster's first devices of each size), and
    each stage's capacity the least memory among them."""
    cost = evaluate(model, plan)
    layout = joint_layout(model, plan)
    times, cuts = layout.times(model.cluster, devices)
    latency, bottleneck = layout.latency_and_bottleneck(times, cuts)
    memory = [d.memory_bytes for d in model.cluster.devices]
    capacity = tuple(float(min(memory[int(devices[p])] for p in positions)) for positions in layout.stage_positions())
    return dataclasses.replace(cost, latency=latency, bottleneck=bottleneck, stage_seconds=tuple(times),
                               transfer_seconds=tuple(cuts), device_memory=capacity)


def staged_model(cap: Capture, cluster: Cluster, section: Pipeline, *,
                 graph: FactorGraph | None = None) -> tuple[JointModel, JointPlan]:
    """A saved joint plan and a joint model of `cap` cut at its stage boundaries only (stage s
    is layer s): the stages cost what they cost in the model the planner cut finer, on any
    cluster, since a stage's price is a sum over its chain positions. Priced at the rate of the
    devices the plan keeps busy, as `explore.reprice_joint_plan` does. Raises ValueError when
    the plan's cuts do not record their chain positions."""
    from hlomap.tasks.joint.explore import saved_joint_plan

    pivots = [cut.pivot for cut in section.cuts]
    if len(pivots) != section.n_stages - 1 or any(p is None for p in pivots):
        raise ValueError(f"the joint plan's pipeline section lists {len(pivots)} cuts with chain positions for "
                         f"{section.n_stages} stages; explore the plan again")
    busy = len({d for stage in section.stages for d in stage.devices})
    model = JointModel.build(cap, with_busy_devices(cluster, busy), [int(p) for p in pivots], graph=graph)  # type: ignore[arg-type]
    if pivots and max(pivots) >= model.attribution.length - 1:  # type: ignore[type-var]
        raise ValueError(f"the joint plan cuts at chain position {max(pivots)}, past this step's chain of "  # type: ignore[type-var]
                         f"{model.attribution.length}: was the plan made for another step?")
    saved = saved_joint_plan(section)
    stages = tuple(dataclasses.replace(stage, start=s, stop=s + 1) for s, stage in enumerate(saved.stages))
    names = section.layer_names
    if names and len(names) >= saved.stages[-1].stop:  # each stage named by its first and last layer
        model = dataclasses.replace(model, layer_names=tuple(
            names[st.start] if st.stop - st.start == 1 else f"{names[st.start]} .. {names[st.stop - 1]}"
            for st in saved.stages))
    return model, dataclasses.replace(saved, stages=stages)
