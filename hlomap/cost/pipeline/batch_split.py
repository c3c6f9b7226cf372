"""How much of each instruction's time does not shrink when its batch is split.

A pipeline profile prices every layer at the captured batch and a stage runs a microbatch of it
on r data replicas, so the profile's times are scaled by 1 / (M r). That holds for work that
grows with the batch (the flops, the activations read and written) but not for the rest: a
layer's matmul reads its whole weight matrix however few examples it multiplies, and its weight
gradient writes a whole matrix too. On a small model or a small microbatch that part dominates
(haiku-mlp's first layer at 8 examples per microbatch on 2 replicas: the 1.6 MB weight read is
six times the share of the layer's time the linear scaling left), and the pipelines were priced
several times under what they measured.

The split comes from the data-parallel plan the SPMD estimate already prices: each entry
instruction is costed at the captured batch (t_1) and with the batch split K ways by the
data-parallel plan (`propagation.plans.data_parallel_plan`, the built-in `dp`; t_K: its flops
over its split degree, its operand and result bytes as that plan shards them), and the time is
taken as `fixed + (t_1 - fixed) / k` for a batch split k ways, the line through both points:
fixed = (K t_K - t_1) / (K - 1), clipped to [0, t_1].
A model whose batch cannot be split (no data input, a batch K does not divide) keeps fixed = 0:
the linear scaling of before.

The same split says which values its replicas must all-reduce inside a pass (`Syncs`): a
reduction over the batch whose result the pass goes on to use, batch norm's statistics forward
(mean and mean square) and backward (the sums of the cotangent and of its product with the
normalized input): those whose result reaches another reduction. A stage on r > 1 replicas runs
one all-reduce per microbatch for each, on hlomap's executors and any other; resnet50-tiny's
2-stage pipeline on 4 replicas a stage runs about 100 per step on each device, most of its step
on 8 CPU devices. A parameter's gradient (a batch sum nothing else in the pass reads) is not one
of them: the stage's gradient all-reduce prices it; nor is the loss's mean, which nothing waits
for. Reductions that do not depend on one another are combined into one all-reduce (XLA's
combiner does so), so a block's syncs are counted by dependency level: the number of such
reductions on the longest path to it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hlomap.cost.compute import CostCache, kept_instruction_cost
from hlomap.cost.devices import DeviceSpec
from hlomap.hlo.capture import Capture
from hlomap.hlo.graph import topological_order, users

if TYPE_CHECKING:
    from hlomap.cost.sharding import ShardedGraph
    from hlomap.propagation.graph import FactorGraph

log = logging.getLogger(__name__)

#: The split the line is fitted through: the largest of these that divides the batch.
SPLIT_DEGREES = (8, 4, 2)


def split_degree(batch: int | None) -> int | None:
    """The largest of `SPLIT_DEGREES` dividing `batch` (None when none does or it is unknown)."""
    if not batch:
        return None
    return next((k for k in SPLIT_DEGREES if batch % k == 0), None)


def fixed_fraction(t_1: float, t_k: float, k: int) -> float:
    """The share of `t_1` that stays when the batch is split: the intercept of the line through
    (1, t_1) and (1 / k, t_k) over t_1, clipped to [0, 1]."""
    if t_1 <= 0.0 or k <= 1:
        return 0.0
    fixed = (k * t_k - t_1) / (k - 1)
    return float(min(max(fixed / t_1, 0.0), 1.0))


@dataclass(frozen=True)
class Syncs:
    """The all-reduces a batch split adds inside the passes (module docstring): entry instruction
    name -> its dependency level (reductions of one level are combined into one all-reduce) and
    -> the bytes it all-reduces (its result, which a reduction over the batch makes independent
    of the batch)."""

    level: dict[str, int] = field(default_factory=dict)
    nbytes: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class BatchSplit:
    """What splitting the batch does to each entry instruction: `fixed`, the share of its
    seconds that does not shrink (`fixed_fraction`); `syncs`, the all-reduces it adds inside the
    pass (`Syncs`); `replica_transposes`, the transposes it no longer folds. All empty when the
    batch cannot be split."""

    fixed: dict[str, float] = field(default_factory=dict)
    syncs: Syncs = field(default_factory=Syncs)
    # entry transposes of products the split all-reduces (weight gradients): XLA folds them into
    # the product on one replica, and runs them after the all-reduce on several
    # (`hlomap.cost.compute.transposed_product_cost`)
    replica_transposes: frozenset[str] = frozenset()


def batch_split(cap: Capture, device: DeviceSpec, cache: CostCache | None = None, *,
                graph: FactorGraph | None = None) -> BatchSplit:
    """The fixed shares and in-pass all-reduces of a split batch on `device` (module docstring).
    `graph`: the step's factor graph when the caller has it already (building it is most of this
    function's time)."""
    from hlomap.cost.sharding import ShardedGraph
    from hlomap.propagation.conflicts import MeshAxes
    from hlomap.propagation.graph import FactorGraph
    from hlomap.propagation.plans import data_parallel_plan

    k = split_degree(cap.batch_size)
    if k is None:
        return BatchSplit()
    graph = graph if graph is not None else FactorGraph.from_capture(cap)
    axes = MeshAxes.from_mesh({"data": k})
    try:
        plan = data_parallel_plan(graph, "data", axes)
    except ValueError as err:  # no data input to split
        log.info("%s: no data-parallel split to price a microbatch's fixed work (%s)", cap.source, err)
        return BatchSplit()
    split = ShardedGraph.build(graph, plan, axes)
    whole = ShardedGraph.build(graph, np.full(graph.num_groups, -1, dtype=np.int64), axes)
    moved_split, moved_whole = _moved_bytes(split), _moved_bytes(whole)
    module = cap.module
    entry = module.entry
    cache = {} if cache is None else cache
    out: dict[str, float] = {}
    for n, node in enumerate(graph.nodes):
        if node.computation != entry.name:
            continue
        cost = kept_instruction_cost(node.instruction, entry, module, device, cache)
        if cost.seconds <= 0.0:
            continue
        ratio = float(moved_split[n] / moved_whole[n]) if moved_whole[n] > 0 else 1.0
        degree = max(int(split.node_degree[n]), 1)
        compute = cost.compute_seconds / degree * split.narrow_slowdown(n, device, cache)  # type: ignore[arg-type]
        t_k = max(compute, cost.memory_seconds * ratio)
        out[node.instruction.name] = fixed_fraction(cost.seconds, t_k, k)
    return BatchSplit(out, _in_pass_syncs(split, entry.name), _replica_transposes(split, entry.name))


def _replica_transposes(split: ShardedGraph, entry: str) -> frozenset[str]:
    """The entry transposes of products whose results the split all-reduces
    (`ShardedGraph.transposed_product`): those XLA runs after the all-reduce instead of folding
    them into the product."""
    reduced = {pr.node for pr in split.partials}
    graph = split.graph
    return frozenset(graph.nodes[n].instruction.name for n in range(len(graph.nodes))
                     if graph.nodes[n].computation == entry and split.transposed_product(n) in reduced)


def _in_pass_syncs(split: ShardedGraph, entry: str) -> Syncs:
    """The split's partial results (batch reductions) of the entry computation that the pass
    reads on: those whose result reaches another reduction (a parameter's gradient and the
    loss's mean reach none). Levels: the most such reductions on a path to each."""
    graph = split.graph
    reductions = {graph.nodes[pr.node].instruction.name: pr.node for pr in split.partials
                  if graph.nodes[pr.node].computation == entry and int(split.node_count[pr.node]) > 0}
    if not reductions:
        return Syncs()
    computation = graph.module.computation(entry)
    instructions = topological_order(computation)
    used_by = users(computation)
    # reaches[name]: a reduction lies downstream of it (users come after it in topological order)
    reaches: dict[str, bool] = {}
    for inst in reversed(instructions):
        reaches[inst.name] = any(user in reductions or reaches[user] for user in used_by[inst.name])
    kept = {name for name in reductions if reaches[name]}
    depth: dict[str, int] = {}
    level: dict[str, int] = {}
    for inst in instructions:
        below = max((depth.get(operand, 0) for operand in inst.operands), default=0)
        if inst.name in kept:
            level[inst.name] = below
            depth[inst.name] = below + 1
        else:
            depth[inst.name] = below
    return Syncs(level, {name: split.node_result_bytes(reductions[name]) for name in kept})


def _moved_bytes(sg: ShardedGraph) -> np.ndarray:
    """Per node, the per-device bytes it reads and writes under a sharded graph: its operands'
    and its own results'."""
    source, operand = sg.facts.operand_edges(sg.graph)
    result = sg.node_bytes_all
    return np.bincount(source, weights=result[operand], minlength=len(result)) + result
