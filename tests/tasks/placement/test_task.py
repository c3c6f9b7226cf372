"""The placement task under the search drivers, against brute force over the cost model on
small clusters, and their contracts."""

from __future__ import annotations

import itertools

import pytest

from hlomap.search.exact import exact_search as exact_driver
from hlomap.search.greedy import greedy_search as greedy_driver
from hlomap.search.random import random_search as random_driver
from hlomap.search.tracker import Budget, SearchResult
from hlomap.tasks.placement.construct import construct
from hlomap.tasks.placement.place import search_placement
from hlomap.tasks.placement.problem import PlacementError, step_seconds
from hlomap.tasks.placement.task import PlacementTask, PlacementTooLarge

from tests.tasks.placement.helpers import mesh_layout, problem, stage_layout


def exact_search(pb, budget: Budget = Budget(None, None)) -> SearchResult:
    return exact_driver(PlacementTask(pb), budget)


def greedy_search(pb, budget: Budget, seed: int = 0) -> SearchResult:
    return greedy_driver(PlacementTask(pb), budget, seed)


def random_search(pb, budget: Budget, seed: int = 0) -> SearchResult:
    return random_driver(PlacementTask(pb), budget, seed)


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
    assert exact.optimal and exact.plan.step_seconds == pytest.approx(optimum, rel=1e-12)
    assert step_seconds(pb, exact.plan.devices) == pytest.approx(exact.plan.step_seconds, rel=1e-12)
    greedy = greedy_search(pb, Budget(None, 800), seed=0)
    assert greedy.plan.step_seconds == pytest.approx(optimum, rel=1e-9)
    assert greedy.plan.step_seconds <= greedy.plan.identity_seconds


@pytest.mark.slow
@pytest.mark.parametrize("topology, layout", [
    ("uniform:8:5", mesh_layout((2, 4))), ("random:8:2:3", stage_layout((2, 2, 2, 2))),
    ("torus:2x2x2", mesh_layout((2, 4), latency_bound=True)), ("hier:2x4", stage_layout((4, 4)))])
def test_eight_devices_agree_with_brute_force(topology, layout):
    pb = problem(topology, layout)
    optimum = brute_force(pb)
    assert exact_search(pb).plan.step_seconds == pytest.approx(optimum, rel=1e-12)
    assert greedy_search(pb, Budget(None, 20_000)).plan.step_seconds == pytest.approx(optimum, rel=1e-9)


def test_uniform_distances_make_every_placement_equal():
    pb = problem("uniform:6", mesh_layout((2, 3)))
    result = exact_search(pb).plan
    assert result.step_seconds == pytest.approx(result.identity_seconds, rel=1e-12) and result.gain == pytest.approx(0)


def test_placement_beats_identity_on_uneven_links():
    pb = problem("uniform:16:4", mesh_layout((4, 4)))
    result = search_placement(pb, "greedy", Budget(None, 1500))
    assert result.driver.value == "greedy" and result.plan.gain > 0.05
    assert step_seconds(pb, result.plan.devices) == pytest.approx(result.plan.step_seconds, rel=1e-12)
    sampled = random_search(pb, Budget(None, 50), seed=3)
    assert sampled.evaluations >= 50 and sampled.plan.step_seconds >= result.plan.step_seconds


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
    identity = search_placement(pb, "identity")
    assert identity.plan.devices == tuple(range(9)) and identity.evaluations == 1
    stopped = exact_search(problem("uniform:6:1", mesh_layout((2, 3))), Budget(None, 10))
    assert not stopped.optimal and stopped.evaluations <= 11
    with pytest.raises(PlacementError, match="placement driver 'dqn' is not one of greedy, ppo, exact"):
        search_placement(pb, "dqn")



def test_the_greedy_driver_runs_iterated_local_search_on_placement():
    pb = problem("uniform:16:4", mesh_layout((4, 4)))
    result = greedy_search(pb, Budget(None, 3000), seed=1)
    assert any(note.endswith("restarts") for note in result.notes)
    assert result.evaluations <= 3000 + 1 and result.improvements


def test_placement_modules_import_in_one_direction():
    # The learned policy's environment knows nothing of the task or the plan side; the task
    # knows the environment only when asked for it (make_env).
    import ast
    from pathlib import Path

    import hlomap.tasks.placement as package

    def imports(name: str) -> set[str]:
        tree = ast.parse((Path(package.__file__).parent / f"{name}.py").read_text())
        found = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        return {m.rsplit(".", 1)[-1] for m in found if m.startswith("hlomap.tasks.placement.")}

    assert not imports("ppo") & {"task", "place"}
    assert not imports("construct") & {"ppo", "task", "place"}
    assert not (Path(package.__file__).parent / "solvers.py").exists()
