"""Small placement problems for the tests."""

from __future__ import annotations

import numpy as np

from hlomap.cost.cluster import load_cluster
from hlomap.cost.collectives import Collective
from hlomap.cost.estimate import CommunicationTerm
from hlomap.cost.pipeline.profile import PipelineProfile
from hlomap.tasks.placement.problem import MeshLayout, PlacementProblem, StageLayout


def mesh_layout(shape: tuple[int, int], latency_bound: bool = False) -> MeshLayout:
    """A data x model mesh with tensor-parallel all-reduces, an all-to-all over both axes and a
    gradient all-reduce; small messages make it latency-bound."""
    scale = 1e-3 if latency_bound else 1.0
    terms = (CommunicationTerm(Collective.ALL_REDUCE, ("model",), 3e7 * scale, 24),
             CommunicationTerm(Collective.ALL_TO_ALL, ("data", "model"), 4e6 * scale, 2),
             CommunicationTerm(Collective.ALL_GATHER, ("data",), 1e7 * scale, 3),
             CommunicationTerm(Collective.ALL_REDUCE, ("data",), 2e8 * scale, 1))
    return MeshLayout((("data", shape[0]), ("model", shape[1])), terms, compute_seconds=0.05)


def stage_layout(replication: tuple[int, ...], microbatches: int = 6, seed: int = 0) -> StageLayout:
    rng = np.random.default_rng(seed)
    s = len(replication)
    profile = PipelineProfile(
        names=tuple(f"s{i}" for i in range(s)),
        forward_time=rng.uniform(0.005, 0.02, s), backward_time=rng.uniform(0.01, 0.04, s),
        activation_bytes=rng.uniform(1e6, 4e7, s - 1), parameter_bytes=rng.uniform(1e7, 4e8, s))
    return StageLayout(profile, replication, microbatches)


def problem(topology: str, layout: MeshLayout | StageLayout) -> PlacementProblem:
    return PlacementProblem(load_cluster(topology), layout, name=f"test on {topology}")
