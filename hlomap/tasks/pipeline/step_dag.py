"""The layer DAG of a captured train step, for the downset DP (`downsets.solve_downsets`).

The pipeline explorer's forward chain (`chain.step_chain`) is one topological order of the HLO,
and its candidate pivots are chosen where few bytes cross in that order. On a branching step
that order is one of many: XLA may put T5's decoder embedding and first self-attention before
the encoder, or a ResNet block's shortcut projection before its main branch, and every cut of
the encoder then ships the decoder's tensors too; worse, the chain's segments can hold pieces of
two branches, so no reordering of them separates the branches.

So the DAG is built from the chain's instructions (`instruction_dag`): one layer per chain
instruction, and a `DagTensor` per chain value read at later positions (by a chain op, or by a
side op anchored there, `chain.attribute`), so that its straight order's crossing bytes are the
chain profile's. `latest_segments` orders the instructions as late as their readers allow
(`LayerDag.latest_order`: the decoder's first layer moves after the encoder), picks pivots in
that order as `chain.select_pivots` does in the chain's (few bytes crossing, thinned to
`PivotOptions.max_pivots` by compute), and merges the instructions between them into segments:
the layers of the DAG the downset DP cuts, around that order (`solve_step_downsets`). A plan's
stage is then a set of chain instructions; `chain_runs` writes it as the runs of the chain
positions the runner reads (`plan.PipelineCut.downset`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from hlomap.cost.cluster import Cluster
from hlomap.cost.pipeline.chain import ChainArrays, PivotOptions, thin_pivots
from hlomap.tasks.pipeline.downsets import DagTensor, DownsetSolution, LayerDag, solve_downsets
from hlomap.tasks.pipeline.space import PipelineSpace

__all__ = ["EXPLORER_MAX_STATES", "StepDownsets", "StepSegments", "chain_runs", "instruction_dag", "latest_segments",
           "solve_step_downsets"]

#: The explorer's bound on the downsets the DP searches (`downsets.DEFAULT_MAX_STATES` is the
#: PipeDream script's). The latency DP runs one O(K^2) pass per candidate bottleneck it tries, so
#: at K = 256 the exact agent takes seconds where the linear DP takes a fraction of one; above
#: the bound the DP keeps the downsets within the largest lookahead of the latest order that
#: fits (logged), and `explore_pipeline(downset_states=0)` (`--downset-states 0`) turns it off.
EXPLORER_MAX_STATES = 256


def _merged_tensors(producer: np.ndarray, readers: Sequence[np.ndarray], nbytes: Iterable[float]
                    ) -> dict[tuple[int, tuple[int, ...]], float]:
    """Tensors by (producer layer, reader layers), bytes summed; readers in the producer dropped."""
    merged: dict[tuple[int, tuple[int, ...]], float] = {}
    for p, rs, b in zip(producer, readers, nbytes):
        outside = tuple(sorted({int(r) for r in rs} - {int(p)}))
        if outside:
            merged[(int(p), outside)] = merged.get((int(p), outside), 0.0) + float(b)
    return merged


def _dag(names: tuple[str, ...], forward: np.ndarray, backward: np.ndarray, parameter: np.ndarray,
         stash: np.ndarray | None, merged: dict[tuple[int, tuple[int, ...]], float], source: str) -> LayerDag:
    consumers: list[set[int]] = [set() for _ in names]
    output = np.zeros(len(names))
    for (producer, readers), nbytes in merged.items():
        consumers[producer].update(readers)
        output[producer] += nbytes
    return LayerDag(names=names, forward_time=forward, backward_time=backward, parameter_bytes=parameter,
                    stash_bytes=stash, output_bytes=output, consumers=tuple(tuple(sorted(c)) for c in consumers),
                    source=source, tensors=tuple(DagTensor(p, r, b) for (p, r), b in merged.items()))


def instruction_dag(chain: ChainArrays, scale: float = 1.0) -> LayerDag:
    """One layer per forward-chain instruction, in the chain's order (module docstring); `scale`
    multiplies what grows with the batch (compute, stash, tensor bytes) as `profile.scale_batch`
    does, to price a microbatch."""
    profile = chain.profile
    values = chain.values
    merged = _merged_tensors(np.array([v.position for v in values], dtype=np.int64),
                             [np.asarray(v.readers, dtype=np.int64) for v in values],
                             (v.nbytes * scale for v in values))
    stash = profile.stash_bytes
    return _dag(profile.names, profile.forward_time * scale, profile.backward_time * scale, profile.parameter_bytes,
                None if stash is None else stash * scale, merged, profile.source)


@dataclass(frozen=True, eq=False)
class StepSegments:
    """Segments of a step's forward chain, contiguous in its latest order: `dag` is their DAG
    (its straight order is that order) and `positions[s]` the chain positions of segment s's
    instructions, in that order."""

    dag: LayerDag
    positions: tuple[tuple[int, ...], ...]


def latest_segments(chain: ChainArrays, scale: float = 1.0, options: PivotOptions = PivotOptions()) -> StepSegments:
    """The chain's instructions in their latest order, merged into segments between pivots of
    that order (module docstring)."""
    fine = instruction_dag(chain, scale)
    order = np.asarray(fine.latest_order(), dtype=np.int64)
    line = fine.linearize(order)
    crossing = line.activation_bytes
    n = fine.n_layers
    if n > 1:
        limit = float(np.quantile(crossing, options.bytes_quantile))
        pivots = thin_pivots(line, np.flatnonzero(crossing <= limit).tolist(), options.max_pivots)
    else:
        pivots = []
    bounds = [0, *(p + 1 for p in pivots), n]
    segment = np.empty(n, dtype=np.int64)
    for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        segment[order[a:b]] = s
    count = len(bounds) - 1

    def summed(values: np.ndarray) -> np.ndarray:
        return np.bincount(segment, weights=values, minlength=count)

    names = tuple(line.names[a] if b - a == 1 else f"{line.names[a]}..{line.names[b - 1]}"
                  for a, b in zip(bounds[:-1], bounds[1:]))
    merged = _merged_tensors(segment[[t.producer for t in fine.tensors or ()]],
                             [segment[list(t.readers)] for t in fine.tensors or ()],
                             (t.nbytes for t in fine.tensors or ()))
    dag = _dag(names, summed(fine.forward_time), summed(fine.backward_time), summed(fine.parameter_bytes),
               None if fine.stash_bytes is None else summed(fine.stash_bytes), merged, fine.source)
    positions = tuple(tuple(int(q) for q in order[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))
    return StepSegments(dag, positions)


@dataclass(frozen=True)
class StepDownsets:
    """The downset DP's plan for a captured step: `found` cuts the DAG of `segments` (its
    `profile` lists them in the plan's order, `order`)."""

    found: DownsetSolution
    segments: StepSegments

    @property
    def value(self) -> float:
        return self.found.value

    @property
    def order(self) -> tuple[int, ...]:
        return self.found.order

    def before_cut(self, pivot: int) -> tuple[int, ...]:
        """The chain positions of every instruction before the cut after plan layer `pivot`."""
        return tuple(sorted(q for s in self.order[:pivot + 1] for q in self.segments.positions[s]))

    def last_instruction(self, pivot: int) -> int:
        """The chain position that ends plan layer `pivot` in the latest order: the instruction
        a cut after it follows."""
        return self.segments.positions[self.order[pivot]][-1]


def solve_step_downsets(chain: ChainArrays, cluster: Cluster, space: PipelineSpace, *, scale: float = 1.0,
                        options: PivotOptions = PivotOptions(),
                        max_states: int = EXPLORER_MAX_STATES) -> StepDownsets:
    """The downset DP on the step's segments in their latest order (`latest_segments`), over at
    most `max_states` downsets (else those within a lookahead of that order); raises
    `NoFeasiblePlan`."""
    segments = latest_segments(chain, scale, options)
    return StepDownsets(solve_downsets(segments.dag, cluster, space, max_states=max_states), segments)


def chain_runs(names: Sequence[str], positions: Iterable[int]) -> tuple[tuple[str, str], ...]:
    """Chain positions as runs [first, last] of consecutive positions, by instruction name
    (`plan.PipelineCut.downset`)."""
    runs: list[list[int]] = []
    for q in sorted(set(int(q) for q in positions)):
        if runs and runs[-1][1] + 1 == q:
            runs[-1][1] = q
        else:
            runs.append([q, q])
    return tuple((names[a], names[b]) for a, b in runs)
