"""Placing joint plans (stages each with its own data x model mesh): the layout prices the joint
planner's plans exactly on their own devices, the search state agrees with the direct price
after every move, greedy unscrambles a scrambled torus, and a placed plan runs on its placed
devices with the unsharded step's numerics."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pytest

from hlomap.cost.cluster import hierarchical, load_cluster
from hlomap.cost.collectives import Collective
from hlomap.cost.pipeline.stages import Schedule
from hlomap.plan import Plan
from hlomap.search.tracker import Budget
from hlomap.tasks.joint.costs import StageOption
from hlomap.tasks.joint.explore import JointResult, joint_model, joint_plan, reprice_joint_plan
from hlomap.tasks.joint.layout import joint_layout, priced_on, staged_model
from hlomap.tasks.joint.plans import evaluate
from hlomap.tasks.joint.solve import JointSpace, solve
from hlomap.tasks.placement.construct import walk_starts
from hlomap.tasks.placement.generate import scrambled
from hlomap.tasks.placement.objective import new_state
from hlomap.tasks.placement.place import problem_from_plan, search_placement
from hlomap.tasks.placement.problem import (JointLayout, MeshStage, PlacementError, PlacementProblem, StageTerm,
                                            step_seconds)
from tests.tasks.placement.helpers import placed_joint_plan

CASES = [(StageOption(4, 2, 2), Schedule.GPIPE), (StageOption(4, 2, 2, split_state=True), Schedule.ONE_F_ONE_B),
         (StageOption(4, 4, 1, split_state=True, shard_parameters=True), Schedule.GPIPE),
         (StageOption(2, 1, 2), Schedule.ZERO_BUBBLE), (StageOption(2, 2, 1), Schedule.ONE_F_ONE_B)]


def _solved(cap: Any, cluster: Any, option: StageOption, schedule: Schedule, stages: int = 4) -> tuple[Any, Any]:
    model = joint_model(cap, cluster)
    plan, _ = solve(model, JointSpace((option,), (2, 4), schedule, max_stages=stages))
    return model, plan


def _cluster(name: str) -> Any:
    if name == "local":
        from tests.local_cluster import LOCAL_CLUSTER_FILE

        return load_cluster(str(LOCAL_CLUSTER_FILE))
    return hierarchical(2, 4) if name == "hier" else load_cluster(name)


@pytest.mark.parametrize("where", ["hier", "A", "local"])
def test_the_layout_prices_the_planners_plans_on_their_own_devices(cap_of, where) -> None:  # type: ignore[no-untyped-def]
    """On clusters of equal servers, where the planner's groups (the first devices of each size)
    cost what the stage's own do, the layout's step on the identity order equals the planner's L
    to rounding, for every schedule (the closed form and the event timeline), a split optimizer
    state, split parameters (FSDP) and a measured cluster's per-microbatch sync; and the plan saved and cut again at its
    stage boundaries only prices as in the cluster's own layers."""
    cap = cap_of("gpt-tiny")
    cluster = _cluster(where)
    for option, schedule in CASES:
        model, plan = _solved(cap, cluster, option, schedule)
        layout = joint_layout(model, plan)
        identity = [d for stage in plan.stages for d in stage.devices]
        problem = PlacementProblem(model.cluster, layout, identity=identity)
        expected = evaluate(model, plan).latency
        assert step_seconds(problem, identity) == pytest.approx(expected, rel=1e-12), (option, schedule)
        saved = joint_plan(JointResult(model, plan, evaluate(model, plan), (), 0.0, "exact", 1))
        saved = Plan.from_json(json.loads(json.dumps(saved.to_json())))
        if saved.pipeline is None:  # one stage, one microbatch: written as an SPMD plan
            continue
        # both priced at the pace of the devices the plan keeps busy (faster on `local` when it
        # leaves some idle), the saved plan in the cluster's own layers
        again = reprice_joint_plan(cap, cluster, saved.pipeline)
        assert again.plan.stages[-1].stop == model.n_layers
        staged, restaged = staged_model(cap, cluster, saved.pipeline)
        assert restaged.n_stages == plan.n_stages and all(s.stop - s.start == 1 for s in restaged.stages)
        assert evaluate(staged, restaged).latency == pytest.approx(again.cost.latency, rel=1e-12)
        assert priced_on(staged, restaged, identity).latency == pytest.approx(again.cost.latency, rel=1e-12)


def _synthetic(data: int, model: int, stages: int, microbatches: int = 4) -> JointLayout:
    """Stages of a data x model mesh each: tensor-parallel all-reduces over `model` every
    microbatch, a gradient all-reduce over `data`, 16 MB cuts."""
    terms = (StageTerm(Collective.ALL_REDUCE, ("model",), 4e7, 8, 1.0, 1.0 / microbatches),
             StageTerm(Collective.ALL_GATHER, ("data", "model"), 2e6, 2, 1.0, 1.0 / microbatches),
             StageTerm(Collective.ALL_REDUCE, ("data",), 3e8, 1, 1.0 / microbatches, 1.0 / microbatches))
    return JointLayout(tuple(MeshStage((("data", data), ("model", model)), 0.002 * (1 + s % 2), terms,
                                       1.6e7 if s + 1 < stages else 0.0) for s in range(stages)), microbatches)


@pytest.mark.parametrize("topology, schedule", [("random:16:3", Schedule.ONE_F_ONE_B),
                                                ("torus:4x4", Schedule.ZERO_BUBBLE), ("hier:2x8", Schedule.GPIPE)])
def test_the_search_state_prices_every_move_as_the_cost_model_does(topology, schedule) -> None:
    """Random swaps, some onto unused devices: after each, the incremental state's value equals
    `step_seconds` of its order, and a trial that is not taken changes nothing."""
    layout = dataclasses.replace(_synthetic(2, 2, 3), schedule=schedule)  # 12 positions on 16 devices
    problem = PlacementProblem(load_cluster(topology), layout)
    state = new_state(problem)
    assert state.value == pytest.approx(step_seconds(problem, problem.identity), rel=1e-12)
    rng = np.random.default_rng(0)
    values = set()
    for _ in range(60):
        a, b = (int(x) for x in rng.choice(problem.n_devices, 2, replace=False))
        before = state.value
        state.try_swap(a, b)
        assert state.value == before
        state.swap(a, b)
        values.add(round(state.value, 12))
        assert state.value == pytest.approx(step_seconds(problem, state.order[:problem.n_positions]), rel=1e-12)
    assert len(values) > 5  # the moves do change the step


def test_greedy_unscrambles_a_joint_plan_on_a_scrambled_torus() -> None:
    """Four stages of data=2 x model=8 on torus:8x8 whose ids are a random permutation of its
    nodes: physical row-major puts each model group on a torus row. Greedy (which starts from the
    walks over coordinates) must come within 1% of it while the scrambled identity is far slower;
    the affinity-guided construction and walks alone are not asked to be optimal."""
    physical = load_cluster("torus:8x8")
    cluster = scrambled(physical, seed=3)
    layout = _synthetic(2, 8, 4)
    row_major = step_seconds(PlacementProblem(physical, layout), tuple(range(64)))
    problem = PlacementProblem(cluster, layout)
    result = search_placement(problem, "greedy", Budget(None, 1500))
    assert result.plan.identity_seconds > 1.5 * row_major  # the scramble matters
    assert result.plan.step_seconds <= 1.01 * row_major
    assert step_seconds(problem, result.plan.devices) == pytest.approx(result.plan.step_seconds, rel=1e-12)
    assert set(walk_starts(problem)) >= {"row-major", "snake", "hilbert"}


def test_a_placed_joint_plan_keeps_each_stage_in_a_server(cap_of) -> None:  # type: ignore[no-untyped-def]
    """On ids that alternate between servers, the identity splits both stages over the network;
    the exact placement (every permutation of 8) puts each stage in one server and prices as the
    plan on the physical order."""
    cap = cap_of("gpt-tiny")
    saved, placed, result = placed_joint_plan(cap)
    assert result.optimal
    servers = [{d % 2 for d in stage} for stage in placed.stage_devices()]  # alternating ids: server = id % 2
    assert all(len(s) == 1 for s in servers) and servers[0] != servers[1]
    on_physical = evaluate(*staged_model(cap, hierarchical(2, 4), saved.pipeline)).latency
    assert result.plan.step_seconds == pytest.approx(on_physical, rel=1e-9)
    assert result.plan.identity_seconds > 1.2 * result.plan.step_seconds


def test_joint_plans_without_their_step_cannot_be_placed(cap_of) -> None:  # type: ignore[no-untyped-def]
    cap = cap_of("gpt-tiny")
    saved, _, _ = placed_joint_plan(cap)
    with pytest.raises(PlacementError, match="joint plan is priced from its step's module"):
        problem_from_plan(saved, load_cluster("torus:2x4"))
    broken = dataclasses.replace(saved, pipeline=dataclasses.replace(
        saved.pipeline, cuts=tuple(dataclasses.replace(c, pivot=None) for c in saved.pipeline.cuts)))
    with pytest.raises(PlacementError, match="cuts with chain positions"):
        problem_from_plan(broken, load_cluster("torus:2x4"), cap=cap)


def test_place_and_simulate_a_joint_plan_from_the_command_line(tmp_path, capsys, cap_of) -> None:  # type: ignore[no-untyped-def]
    """`hlomap place` takes a joint plan with its SOURCE, says why without it, and `hlomap
    simulate` prices the placed plan on its placement (the same step `place` reported)."""
    from hlomap.cli import run

    cap = cap_of("gpt-tiny")
    saved, _, _ = placed_joint_plan(cap)
    saved.save(tmp_path / "auto.json")
    assert run(["place", str(tmp_path / "auto.json"), "--cluster", "torus:2x4", "-q"]) == 2
    assert "name its SOURCE (--source)" in capsys.readouterr().err
    assert run(["place", str(tmp_path / "auto.json"), "--cluster", "random:8:2", "--source", "zoo:gpt-tiny",
                "--budget-evaluations", "300", "--json", "-q"]) == 0
    placed = json.loads(capsys.readouterr().out)
    assert sorted(placed["devices"]) == list(range(8))
    assert run(["simulate", "zoo:gpt-tiny", "--plan", str(tmp_path / "auto.placed.json"), "--cluster", "random:8:2",
                "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert simulated["step_seconds"] == pytest.approx(placed["step_seconds"], rel=1e-9)
    assert simulated["identity_order_step_seconds"] == pytest.approx(placed["identity_step_seconds"], rel=1e-9)
    assert [d for stage in simulated["stages"] for d in stage] == placed["devices"]
