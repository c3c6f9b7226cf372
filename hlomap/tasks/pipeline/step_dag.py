"""The layer DAG of a captured train step, for the downset DP (`downsets.solve_downsets`).

The pipeline explorer's layers are the segments of the step's forward chain between candidate
pivots (`chain.step_chain`), numbered in the chain's order: one topological order of the HLO. On
a branching step that order is one of many: XLA may put T5's decoder embedding and first
self-attention before the encoder, or a ResNet block's shortcut projection before its main
branch, and a cut between positions of that order then ships tensors a cut elsewhere would not.
The DAG keeps what constrains the order, the data edges: segment a feeds segment b when a chain
value defined in a is read in b (by a chain op, or by a side op anchored there, `chain.attribute`).
Each such value is a `DagTensor` of its bytes read by those segments, so the straight order's
crossing bytes are exactly the profile's (`tests/tasks/pipeline/test_step_dag.py`).

`solve_step_downsets` searches the downsets within a lookahead of the DAG's latest order (every
segment as late as its readers allow, `LayerDag.latest_order`) plus every prefix of the chain's
order, so its optimum is never worse than the linear DP's; `chain_runs` writes a downset as the
runs of chain instructions the runner reads (`plan.PipelineCut.downset`). The segments are cut
where few bytes cross in the chain's order, so a segment may hold pieces of two branches (XLA
runs T5's decoder embedding in the segment that starts the encoder) and then no downset of
segments separates them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from hlomap.cost.cluster import Cluster
from hlomap.cost.pipeline.chain import StepChain
from hlomap.cost.pipeline.profile import scale_batch, sync_fields
from hlomap.tasks.pipeline.downsets import DagTensor, DownsetSolution, LayerDag, solve_downsets
from hlomap.tasks.pipeline.space import PipelineSpace

__all__ = ["EXPLORER_MAX_STATES", "StepDownsets", "chain_runs", "segment_of_positions", "solve_step_downsets",
           "step_dag"]

#: The explorer's bound on the downsets the DP searches around the latest order
#: (`downsets.DEFAULT_MAX_STATES` is the PipeDream script's); the chain's n + 1 prefixes come on
#: top. The latency DP runs one O(K^2) pass per candidate bottleneck it tries, so with K about
#: 500 on a 250-layer step the exact agent takes seconds, not the fraction of a second of the
#: linear DP; above the bound the DP keeps the downsets within the largest lookahead that fits
#: (logged), and `explore_pipeline(downset_states=0)` (`--downset-states 0`) turns it off.
EXPLORER_MAX_STATES = 256


def segment_of_positions(pivot_positions: tuple[int, ...] | list[int], positions: np.ndarray) -> np.ndarray:
    """The segment (profile layer) of each chain position: segment k holds the positions after
    pivot k - 1 up to pivot k included."""
    return np.searchsorted(np.asarray(pivot_positions, dtype=np.int64), positions, side="left")


def step_dag(hlo: StepChain, scale: float = 1.0) -> LayerDag:
    """The DAG of `hlo`'s profile layers (module docstring); `scale` multiplies what grows with
    the batch (compute beyond its fixed part and stash through `profile.scale_batch`, and the
    tensor bytes), to price a microbatch."""
    profile = hlo.profile
    n = profile.n_layers
    pivots = [p.position for p in hlo.pivots]
    merged: dict[tuple[int, tuple[int, ...]], float] = {}
    for value in hlo.chain.values:
        producer = int(segment_of_positions(pivots, np.array([value.position]))[0])
        readers = {int(s) for s in segment_of_positions(pivots, np.asarray(value.readers, dtype=np.int64))} - {producer}
        if readers:
            key = (producer, tuple(sorted(readers)))
            merged[key] = merged.get(key, 0.0) + value.nbytes * scale
    consumers: list[set[int]] = [set() for _ in range(n)]
    output = np.zeros(n)
    for (producer, readers), nbytes in merged.items():
        consumers[producer].update(readers)
        output[producer] += nbytes
    scaled = scale_batch(profile, scale)
    return LayerDag(
        names=profile.names,
        forward_time=scaled.forward_time,
        backward_time=scaled.backward_time,
        forward_fixed=scaled.forward_fixed,
        backward_fixed=scaled.backward_fixed,
        **sync_fields(scaled),
        parameter_bytes=profile.parameter_bytes,
        stash_bytes=scaled.stash_bytes,
        output_bytes=output,
        consumers=tuple(tuple(sorted(c)) for c in consumers),
        source=profile.source,
        tensors=tuple(DagTensor(p, r, b) for (p, r), b in merged.items()),
        update_seconds_per_byte=profile.update_seconds_per_byte,
        pass_buffers=profile.pass_buffers,
        state_leaves=profile.state_leaves,
    )


@dataclass(frozen=True)
class StepDownsets:
    """The downset DP's plan for a captured step: `found` solves the DAG renumbered in its
    latest order, and `order` lists the step's profile layers (chain segments) in the plan's
    order, the order `found.profile` and `found.solution.plan` index."""

    found: DownsetSolution
    order: tuple[int, ...]

    @property
    def value(self) -> float:
        return self.found.value


def solve_step_downsets(dag: LayerDag, cluster: Cluster, space: PipelineSpace, *,
                        max_states: int = EXPLORER_MAX_STATES) -> StepDownsets:
    """The downset DP on a step's layer DAG (`step_dag`) around its latest order
    (`LayerDag.latest_order`: the cuts that keep a branch out of the stages before its readers
    lie within a small lookahead of it), with the prefixes of the chain's own order added so
    that it is never worse than cutting that order; raises `NoFeasiblePlan`."""
    latest = dag.latest_order()
    n = dag.n_layers
    position = np.empty(n, dtype=np.int64)
    position[list(latest)] = np.arange(n)
    chain_prefixes = np.zeros((n + 1, n), dtype=bool)  # prefix p of the chain, in the latest numbering
    for p in range(1, n + 1):
        chain_prefixes[p, position[:p]] = True
    found = solve_downsets(dag.reordered(latest), cluster, space, max_states=max_states, extra=chain_prefixes)
    return StepDownsets(found, tuple(latest[i] for i in found.order))


def chain_runs(hlo: StepChain, segments: Iterable[int]) -> tuple[tuple[str, str], ...]:
    """The chain instructions of the given profile layers (segments) as runs [first, last] of
    consecutive chain positions, by instruction name (`plan.PipelineCut.downset`)."""
    names = hlo.chain.profile.names
    pivots = [p.position for p in hlo.pivots]
    starts = [0, *(p + 1 for p in pivots)]
    ends = [*pivots, len(names) - 1]
    runs: list[list[int]] = []
    for k in sorted(set(segments)):
        if runs and runs[-1][1] + 1 == starts[k]:
            runs[-1][1] = ends[k]
        else:
            runs.append([starts[k], ends[k]])
    return tuple((names[a], names[b]) for a, b in runs)
