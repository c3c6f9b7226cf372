"""Drivers: the MILP agrees with enumeration; random, greedy and DQN respect their budgets and
report honestly; the DQN reaches the exact optimum and beats random at equal budget; Ctrl-C
keeps the best plan."""

from __future__ import annotations

import numpy as np
import pytest

from hlomap.search.budget import Budget
from hlomap.search.dqn import DqnSearchConfig, dqn_search
from hlomap.search.exact import exact_search
from hlomap.search.greedy import greedy_search
from hlomap.search.random import random_search
from hlomap.search.tracker import Driver
from hlomap.tasks.sharding.exact import ExactTooLarge, count_conflict_free, enumerate_conflict_free, paper_milp
from hlomap.tasks.sharding.objective import CostEval, CostObjective, PaperObjective
from hlomap.tasks.sharding.space import adp_space, hybrid_space, opp_space
from hlomap.tasks.sharding.task import ShardingTask

EVALS = Budget(seconds=None, evaluations=300)


def _brute_force_paper(space) -> float:
    obj = PaperObjective(space)
    rows = np.asarray(list(enumerate_conflict_free(space)))
    value, tiebreak, ok = obj.values(rows)
    assert ok.all()
    return float(value.max())


@pytest.mark.parametrize("name,task,tie", [
    ("gpt-tiny", "opp", False), ("gpt-tiny", "opp", True), ("bert-tiny", "opp", True), ("t5-tiny", "opp", True),
    ("t5-tiny", "adp", True), ("gpt-tiny", "hybrid", True),
])
def test_milp_matches_enumeration(graph_of, axes8, axes2x4, name, task, tie) -> None:
    g = graph_of(name)
    if task == "opp":
        space = opp_space(g, axes8, tie=tie)
    elif task == "adp":
        space = adp_space(g, axes8, tie=tie)
    else:
        space = hybrid_space(g, axes2x4, tie=tie)
    assert count_conflict_free(space, 200_000) <= 200_000
    choices, proven = paper_milp(space)
    assert proven and space.ok(choices[None])[0]
    assert PaperObjective(space).score(choices).value == pytest.approx(_brute_force_paper(space))


def _additive_cost(space, gains: dict[int, float]):
    """Step time falls by `gains[group]` for each sharded group; always fits."""

    def model(plan: np.ndarray) -> CostEval:
        return CostEval(10.0 - sum(v for g, v in gains.items() if plan[g] >= 0), 1.0, 2.0)

    return model


def test_exact_enumeration_finds_the_cost_optimum(graph_of, axes8) -> None:
    space = opp_space(graph_of("gpt-tiny"), axes8)
    rng = np.random.default_rng(0)
    gains = {int(g): float(rng.uniform(-1, 2)) for g in space.groups}
    result = exact_search(ShardingTask(space, CostObjective(space, _additive_cost(space, gains))))
    assert result.optimal and result.driver is Driver.EXACT
    brute = max(CostObjective(space, _additive_cost(space, gains)).score(c).value for c in enumerate_conflict_free(space))
    assert result.score.value == pytest.approx(brute)
    count = count_conflict_free(space, 10_000)
    assert f"enumerated {count} of {count} conflict-free plans" in result.notes
    assert result.evaluations >= count  # the hill climb first, then every plan


def test_exact_cut_short_by_its_budget_still_returns_the_climbs_optimum(graph_of, axes8) -> None:
    # Depth first and replicate-first, the enumeration meets the plans that partition its first
    # positions last: a budget that stops it early returned a near-replicated plan before the
    # climb came first.
    space = opp_space(graph_of("t5-tiny"), axes8)  # 15 positions, 3244 conflict-free plans
    # only partitioning the first position pays: the plans that do are the second half of the order
    gains = {int(g): 1.0 for g, p in space.position_of_group.items() if p == 0}
    greedy = greedy_search(ShardingTask(space, CostObjective(space, _additive_cost(space, gains))),
                           Budget(seconds=None), 0)
    budget = Budget(seconds=None, evaluations=greedy.evaluations + 2)
    cut = exact_search(ShardingTask(space, CostObjective(space, _additive_cost(space, gains))), budget)
    assert not cut.optimal
    assert cut.score.value >= greedy.score.value > 1.0  # a speedup over the all-replicated plan
    # the enumeration alone, given the whole budget, stops far short of that
    alone = [CostObjective(space, _additive_cost(space, gains)).score(c).value
             for c, _ in zip(enumerate_conflict_free(space), range(budget.evaluations))]
    assert max(alone) < greedy.score.value
    assert any(n.startswith("climbed first") for n in cut.notes)
    assert any(n.startswith("enumerated 2 of ") for n in cut.notes)


def test_exact_cut_short_by_its_budget_is_never_behind_megatrons_plan(graph_of, axes8) -> None:
    """The exact search scores the expert plans its space holds before it climbs: a budget that
    stops it at once still returns Megatron's plan where only that plan pays (a climb from the
    replicated plan cannot see it, and the depth-first enumeration reaches it late)."""
    from hlomap.plan import reference_plan
    from hlomap.tasks.sharding.problem import expert_starts

    graph = graph_of("t5-tiny")
    space = opp_space(graph, axes8)
    megatron, plan_axes = reference_plan(graph, "megatron", {"model": 8})
    assert plan_axes == axes8 and space.represents(megatron)
    starts = expert_starts(graph, axes8, space)
    assert len(starts) == 1 and np.array_equal(starts[0], space.choices_of(megatron))

    def only_megatron_pays(plan: np.ndarray) -> CostEval:
        return CostEval(1.0 if np.array_equal(plan, megatron) else 10.0, 1.0, 2.0)

    budget = Budget(seconds=None, evaluations=3)
    seeded = exact_search(ShardingTask(space, CostObjective(space, only_megatron_pays), expert_starts=starts), budget)
    assert not seeded.optimal
    assert np.array_equal(seeded.plan, megatron)
    unseeded = exact_search(ShardingTask(space, CostObjective(space, only_megatron_pays)), budget)
    assert not np.array_equal(unseeded.plan, megatron)


def test_exact_refuses_spaces_too_large_to_enumerate(graph_of, axes8) -> None:
    space = opp_space(graph_of("t5-tiny"), axes8, tie=False)
    obj = CostObjective(space, _additive_cost(space, {}))
    with pytest.raises(ExactTooLarge):
        exact_search(ShardingTask(space, obj, enumeration_limit=100))


@pytest.mark.parametrize("driver", [random_search, greedy_search])
def test_baselines_respect_the_evaluation_budget(graph_of, axes8, driver) -> None:
    space = opp_space(graph_of("t5-tiny"), axes8, tie=False)
    result = driver(ShardingTask(space, PaperObjective(space)), Budget(seconds=None, evaluations=57), 0)
    assert result.evaluations <= 57
    assert len(result.curve) == result.evaluations
    assert space.ok(result.choices[None])[0]
    assert result.score.value == pytest.approx(PaperObjective(space).score(result.choices).value)
    # improvements are strictly increasing and end at the reported best
    values = [i.value for i in result.improvements]
    assert values == sorted(values) and values[-1] == pytest.approx(result.score.value)


def test_greedy_reaches_a_local_optimum_and_says_so(graph_of, axes8) -> None:
    space = opp_space(graph_of("gpt-tiny"), axes8, replicate_residual=False)
    result = greedy_search(ShardingTask(space, PaperObjective(space)), Budget(seconds=30), 0)
    assert any("local optimum" in n for n in result.notes)
    # greedy takes the residual stream first (28 dims at once) and is then stuck: the paper optimum
    exact = exact_search(ShardingTask(space, PaperObjective(space)))
    assert result.score.value == pytest.approx(exact.score.value)


def test_interrupt_keeps_the_best_plan(graph_of, axes8) -> None:
    space = opp_space(graph_of("t5-tiny"), axes8, tie=False)
    calls = []

    def stop(progress) -> None:
        calls.append(progress)
        if len(calls) == 3:
            raise KeyboardInterrupt

    result = random_search(ShardingTask(space, PaperObjective(space)), Budget(seconds=60), 0, batch=16, on_progress=stop)
    assert result.interrupted
    assert result.evaluations == 1 + 3 * 16 and result.score.conflict_free  # the replicated plan, 3 batches
    assert len(calls) == 3  # nothing ran after the interrupt (a structural check, not a wall-time bound)


def test_on_best_sees_every_improvement(graph_of, axes8) -> None:
    space = opp_space(graph_of("t5-tiny"), axes8, tie=False)
    seen = []
    result = random_search(ShardingTask(space, PaperObjective(space)), EVALS, 3, on_best=lambda r: seen.append(r.score.value))
    assert seen == [i.value for i in result.improvements]
    assert seen[-1] == result.score.value


def _first_at(result, value: float) -> int | None:
    return next((i.evaluation for i in result.improvements if i.value >= value - 1e-9), None)


def test_dqn_learns_the_paper_optimum_and_beats_random(graph_of, axes8) -> None:
    """t5-tiny, untied (24 positions), the agent alone (no fine-tuning) against random at the
    same evaluation budget and against the MILP optimum."""
    space = opp_space(graph_of("t5-tiny"), axes8, replicate_residual=True, tie=False)
    optimum = exact_search(ShardingTask(space, PaperObjective(space))).score.value
    budget = Budget(seconds=None, evaluations=400, settle=False)  # the whole learning curve
    dqn = dqn_search(ShardingTask(space, PaperObjective(space)), budget, 0, config=DqnSearchConfig(fine_tune=False))
    rnd = random_search(ShardingTask(space, PaperObjective(space)), budget, 0)
    assert dqn.evaluations <= 400 and rnd.evaluations <= 400
    assert dqn.score.value == pytest.approx(optimum)
    assert rnd.score.value < optimum
    assert dqn.driver is Driver.DQN and "0 fine-tuning" in dqn.notes[0]
    # the curve is per episode; the late episodes are much better than the early random ones
    assert np.mean(dqn.curve[-50:]) > np.mean(dqn.curve[:50]) + 3


@pytest.mark.slow
def test_fine_tuning_reaches_the_optimum_sooner(graph_of, axes8) -> None:
    space = opp_space(graph_of("t5-tiny"), axes8, replicate_residual=True, tie=False)
    optimum = exact_search(ShardingTask(space, PaperObjective(space))).score.value
    budget = Budget(seconds=None, evaluations=250, settle=False)
    tuned = dqn_search(ShardingTask(space, PaperObjective(space)), budget, 0)
    plain = dqn_search(ShardingTask(space, PaperObjective(space)), budget, 0, config=DqnSearchConfig(fine_tune=False))
    assert tuned.score.value == pytest.approx(optimum)
    assert "0 fine-tuning" not in tuned.notes[0]
    at_plain = _first_at(plain, optimum)
    assert _first_at(tuned, optimum) < (at_plain if at_plain is not None else 10**9)


def test_a_search_stops_at_the_proven_optimum(graph_of, axes8) -> None:
    """ADP with the paper reward: the MILP proves the optimum in milliseconds, so a DQN or random
    search with a long budget stops once it has found it instead of spending the budget."""
    space = adp_space(graph_of("gpt-tiny"), axes8)
    optimum = exact_search(ShardingTask(space, PaperObjective(space))).score
    for driver in (dqn_search, random_search):
        result = driver(ShardingTask(space, PaperObjective(space)), Budget(seconds=60, evaluations=5000), 0)
        assert result.optimal and result.score.key == optimum.key, driver
        assert result.evaluations < 5000 and any("proven optimum" in n for n in result.notes)


def test_a_search_stops_after_scoring_every_plan_of_a_small_space(graph_of, axes8) -> None:
    space = adp_space(graph_of("gpt-tiny"), axes8)
    gains = {int(g): 1.0 for g in space.groups}
    task = ShardingTask(space, CostObjective(space, _additive_cost(space, gains)))
    count = count_conflict_free(space, 512)
    result = random_search(task, Budget(seconds=60, evaluations=10_000), 0)
    assert result.optimal and f"every one of the {count}" in result.notes[-1]
    assert result.score.value == pytest.approx(exact_search(task).score.value)


def test_identity_reports_the_trivial_plan_unsearched(graph_of, axes8) -> None:
    from hlomap.search.drivers import run_driver

    space = opp_space(graph_of("gpt-tiny"), axes8)
    task = ShardingTask(space, PaperObjective(space))
    result = run_driver(task, "identity", Budget(seconds=None), 0)
    assert result.driver is Driver.IDENTITY and result.evaluations == 1
    np.testing.assert_array_equal(result.decisions, task.trivial_plan())


def test_the_ppo_driver_needs_a_policy_and_a_task_it_can_polish(graph_of, axes8) -> None:
    from hlomap.agents.ppo import PpoAgent, PpoConfig
    from hlomap.search.drivers import run_driver
    from hlomap.search.ppo import ppo_search

    space = opp_space(graph_of("gpt-tiny"), axes8)
    task = ShardingTask(space, PaperObjective(space))
    with pytest.raises(ValueError, match="needs a trained policy"):
        run_driver(task, "ppo", EVALS, 0)
    with pytest.raises(TypeError, match="local search, which ShardingTask does not offer"):
        ppo_search(task, EVALS, 0, agent=PpoAgent(PpoConfig(), 4, 2))
