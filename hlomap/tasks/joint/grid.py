"""The expert baseline: every Megatron-LM configuration (pp, tp, dp) a user would try by hand.

pp * tp * dp = devices, tensor parallelism inside a server, pp <= the model's repeated blocks;
the blocks (`layers_k` scopes: transformer layers, encoder then decoder for T5) split
uniformly over the stages, the embedding with the first stage and the head with the last;
Megatron's specs on `model` and the batch on `data` inside every stage; the best microbatch
count, each stage keeping its activations or recomputing them (Megatron-LM's full activation
recomputation) as fits and is faster. Each configuration is priced by the same cost model as the joint planner
(`plans.evaluate`), so the comparison is between plans, not between models.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from hlomap.cost.pipeline.stages import DEFAULT_SCHEDULE, Schedule, splits_batch
from hlomap.plan.sections import Recompute
from hlomap.tasks.joint.costs import JointModel, PlanKind, StageOption, block_ends
from hlomap.tasks.joint.plans import JointCost, JointPlan, JointStage, evaluate
from hlomap.tasks.joint.solve import TIE_TOLERANCE, aligned, microbatch_choices

log = logging.getLogger(__name__)

__all__ = ["GridPoint", "expert_grid"]

@dataclass(frozen=True)
class GridPoint:
    pp: int
    tp: int
    dp: int
    plan: JointPlan | None
    cost: JointCost | None  # None when no microbatch count fits in memory
    note: str = ""
    split_state: bool = False  # the stages split their optimizer state over `dp` (ZeRO-1)

    @property
    def label(self) -> str:
        recomputed = self.plan is not None and any(stage.recompute is not Recompute.NONE for stage in self.plan.stages)
        return f"pp={self.pp} tp={self.tp} dp={self.dp}" + (" recompute" if recomputed else "")


def _layer_of(model: JointModel, position: int) -> int:
    """The joint model's layer that ends at chain position `position` (a pivot)."""
    return model.pivots.index(position) + 1


def _split_end(ends: Sequence[int], pp: int, b: int) -> int:
    """The block end after which stage b of a uniform split of the blocks into pp stages starts."""
    return ends[round(b * len(ends) / pp) - 1]


def uniform_split_ends(ends: Sequence[int], devices: int) -> tuple[int, ...]:
    """Every block end a uniform split into pp stages cuts at, for each pp dividing `devices`."""
    return tuple(sorted({_split_end(ends, pp, b) for pp in range(2, min(len(ends), devices) + 1) if devices % pp == 0
                         for b in range(1, pp)}))


def uniform_cuts(model: JointModel, pp: int, ends: Sequence[int] | None = None) -> tuple[int, ...] | None:
    """Layer bounds [0, ..., n_layers] of a uniform split of the blocks over `pp` stages, or None
    when there are fewer blocks than stages or a block end is not a cut point of the model.
    `ends`: the model's `block_ends`, when the caller has them (they take a pass over the step)."""
    ends = block_ends(model) if ends is None else ends
    if pp > len(ends):
        return None
    bounds = [0]
    for b in range(1, pp):
        end = _split_end(ends, pp, b)
        if end not in model.pivots:
            return None
        bounds.append(_layer_of(model, end))
    bounds.append(model.n_layers)
    return tuple(bounds) if all(a < b for a, b in zip(bounds[:-1], bounds[1:])) else None


def expert_grid(model: JointModel, *, schedule: Schedule = DEFAULT_SCHEDULE,
                microbatches: Sequence[int] | None = None,
                recompute: Sequence[Recompute] = (Recompute.NONE, Recompute.FULL),
                split_state: Sequence[bool] = (False,), max_stages: int | None = None) -> list[GridPoint]:
    """Every (pp, tp, dp) configuration priced at its best microbatch count (module docstring);
    with `split_state` (False, True), each configuration with data replicas once more with its
    optimizer state split over them (a point of its own). `max_stages` caps pp as it caps the
    joint search's stages, so the two are compared over the same plans."""
    cluster = model.cluster
    devices = cluster.n_devices
    per_node = cluster.most_per_node
    choices = tuple(microbatches) if microbatches else microbatch_choices(model.batch)
    out = []
    tp_limit = per_node if per_node > 1 else 8  # as `costs.stage_options`: inside a server, or 8 on a torus
    ends = block_ends(model)
    for pp in (p for p in range(1, min(devices, max_stages or devices) + 1) if devices % p == 0):
        group = devices // pp
        for tp in (t for t in range(1, group + 1) if group % t == 0 and t & (t - 1) == 0 and t <= tp_limit):
            dp = group // tp
            bounds = uniform_cuts(model, pp, ends)
            if bounds is None or not all(aligned(per_node, s * group, group) for s in range(pp)):
                out.append(GridPoint(pp, tp, dp, None, None, "no uniform split of the blocks"))
                continue
            for split in (z for z in split_state if not z or dp > 1):
                best: tuple[JointPlan, JointCost] | None = None
                for again in recompute:
                    option = StageOption(group, dp, tp, PlanKind.EXPERT, again, split)
                    for m in sorted(choices):  # near-ties keep the fewest microbatches, as the joint DP does
                        if not splits_batch(model.batch, m, dp):
                            continue
                        plan = JointPlan(tuple(JointStage.of(bounds[s], bounds[s + 1], s * group, option)
                                               for s in range(pp)), m, schedule)
                        cost = evaluate(model, plan)
                        if cost.fits and (best is None or cost.latency < best[1].latency * (1 - TIE_TOLERANCE)):
                            best = (plan, cost)
                out.append(GridPoint(pp, tp, dp, *(best or (None, None)),
                                     "" if best else "out of memory at every microbatch count", split))
    return out
