"""Solvers against brute force over the cost model on small clusters, and their contracts."""

from __future__ import annotations

import itertools

import pytest

from hlomap.search.tracker import Budget
from hlomap.tasks.placement.problem import step_seconds
from hlomap.tasks.placement.solvers import (PlacementTooLarge, Solver, construct, exact_search, greedy_search,
                                            identity, random_search, solve)

from tests.tasks.placement.helpers import mesh_layout, problem, stage_layout


def brute_force(pb) -> float:
    """The least step time over every assignment of logical positions to devices."""
    return min(step_seconds(pb, devices) for devices in itertools.permutations(range(pb.n_devices), pb.n_positions))


SMALL = [
    ("uniform:6:1", mesh_layout((2, 3))),
    ("random:6:4:3", mesh_layout((3, 2))),
    ("torus:2x3", mesh_layout((2, 3), latency_bound=True)),
    ("hier:3x2", mesh_layout((3, 2))),
    ("uniform:6:2", stage_layout((2, 1, 3))),
    ("random:6:7:3", stage_layout((1, 2, 1, 2), seed=1)),
    ("mesh:2x3", stage_layout((3, 3), seed=2)),
    ("uniform:6:3", mesh_layout((1, 4))),  # 4 positions on 6 devices: which devices, too
]


@pytest.mark.parametrize("topology, layout", SMALL)
def test_exact_and_greedy_find_the_brute_force_optimum(topology, layout):
    pb = problem(topology, layout)
    optimum = brute_force(pb)
    exact = exact_search(pb)
    assert exact.optimal and exact.step_seconds == pytest.approx(optimum, rel=1e-12)
    assert step_seconds(pb, exact.devices) == pytest.approx(exact.step_seconds, rel=1e-12)
    greedy = greedy_search(pb, Budget(None, 800), seed=0)
    assert greedy.step_seconds == pytest.approx(optimum, rel=1e-9)
    assert greedy.step_seconds <= greedy.identity_seconds


@pytest.mark.slow
@pytest.mark.parametrize("topology, layout", [
    ("uniform:8:5", mesh_layout((2, 4))), ("random:8:2:3", stage_layout((2, 2, 2, 2))),
    ("torus:2x2x2", mesh_layout((2, 4), latency_bound=True)), ("hier:2x4", stage_layout((4, 4)))])
def test_eight_devices_agree_with_brute_force(topology, layout):
    pb = problem(topology, layout)
    optimum = brute_force(pb)
    assert exact_search(pb).step_seconds == pytest.approx(optimum, rel=1e-12)
    assert greedy_search(pb, Budget(None, 20_000)).step_seconds == pytest.approx(optimum, rel=1e-9)


def test_uniform_distances_make_every_placement_equal():
    pb = problem("uniform:6", mesh_layout((2, 3)))
    result = exact_search(pb)
    assert result.step_seconds == pytest.approx(result.identity_seconds, rel=1e-12) and result.gain == pytest.approx(0)


def test_placement_beats_identity_on_uneven_links():
    pb = problem("uniform:16:4", mesh_layout((4, 4)))
    result = solve(pb, Solver.GREEDY, Budget(None, 1500))
    assert result.gain > 0.05
    assert step_seconds(pb, result.devices) == pytest.approx(result.step_seconds, rel=1e-12)
    sampled = random_search(pb, Budget(None, 50), seed=3)
    assert sampled.evaluations >= 50 and sampled.step_seconds >= result.step_seconds


def test_construction_places_every_position_once():
    pb = problem("random:12:1", stage_layout((2, 4, 3)))
    order = construct(pb)
    assert sorted(order.tolist()) == list(range(12))


def test_contracts():
    pb = problem("uniform:9:1", mesh_layout((3, 3)))
    with pytest.raises(PlacementTooLarge, match="9! = 362880"):
        exact_search(pb)
    with pytest.raises(ValueError, match="needs a budget"):
        random_search(pb, Budget(None, None))
    assert identity(pb).devices == tuple(range(9))
    stopped = exact_search(problem("uniform:6:1", mesh_layout((2, 3))), Budget(None, 10))
    assert not stopped.optimal and stopped.evaluations <= 11
