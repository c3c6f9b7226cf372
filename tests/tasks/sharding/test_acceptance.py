"""Issue #6 acceptance on the tiny zoo models (1-D mesh of 8 unless stated); the full-size runs
are `@slow` here and in scripts/reproduce_automap.py.

- OPP, paper reward: Megatron's partitioning of every attention, MLP and embedding variable,
  layer norms replicated (identical to `megatron_plan` on the same graph), by MILP and by DQN.
- OPP, cost reward: an estimate no worse than Megatron's.
- ADP: exactly the batch dims of all data inputs.
- Every plan found runs with numerics equal to the unsharded step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from hlomap import zoo
from hlomap.api import explore_detailed
from hlomap.tasks.sharding.problem import build_problem, search_sharding
from hlomap.tasks.sharding.compare import compare_with_megatron, is_layer_norm, partitioned_dims, variable_specs
from hlomap.verify.numerics import run_plan
from hlomap.search.tracker import Budget
from hlomap.hlo.capture import Role
from hlomap.propagation.plans import megatron_plan

TRANSFORMERS = ["gpt-tiny", "bert-tiny", "t5-tiny"]
EVALS = Budget(seconds=None, evaluations=200)


def _megatron_check(exploration, *, identical: bool = True) -> None:
    problem = exploration.problem
    mega = megatron_plan(problem.graph, "model", problem.axes)
    cmp = compare_with_megatron(problem.space, exploration.result.choices, mega)
    assert cmp.equivalent, cmp.differences
    if identical:
        assert cmp.identical and cmp.same_variables, cmp.differences
        assert cmp.found_partitioned == cmp.megatron_partitioned > 0
    specs = variable_specs(problem.space, exploration.result.choices)
    for path, (_, spec) in specs.items():
        sharded = any(s is not None for s in spec)
        if is_layer_norm(path):
            assert not sharded, path
        elif any(k in path for k in ("/attn/", "_attn/", "/mlp/")) and path.endswith("kernel"):
            assert sharded, path  # every attention and MLP kernel is split
    assert any(any(s is not None for s in spec) for path, (_, spec) in specs.items() if "embed" in path)


@pytest.mark.parametrize("name", TRANSFORMERS)
@pytest.mark.parametrize("agent", ["exact", pytest.param("dqn", marks=pytest.mark.slow)])
def test_opp_paper_reward_finds_megatron(cap_of, graph_of, name, agent) -> None:
    ex = explore_detailed(cap_of(name), "opp", 8, "A", agent, None, 0, "paper", budget_evaluations=EVALS.evaluations,
                          graph=graph_of(name), with_estimate=False)
    _megatron_check(ex)
    found, total = partitioned_dims(ex.space, ex.result.choices)
    assert 0 < found < total


def test_opp_paper_reward_without_pruning_prefers_the_residual_stream(cap_of, graph_of) -> None:
    """Honest difference: on our factor graph the hidden dim of the residual stream can be split
    (XLA all-reduces the layer norms' partial sums), and it holds more trainable dims than the
    Megatron groups it clashes with, so the unpruned paper optimum splits it instead."""
    ex = explore_detailed(cap_of("gpt-tiny"), "opp", 8, "A", "exact", None, 0, "paper", graph=graph_of("gpt-tiny"),
                          replicate_residual=False, with_estimate=False)
    mega = megatron_plan(ex.problem.graph, "model", ex.problem.axes)
    cmp = compare_with_megatron(ex.space, ex.result.choices, mega)
    assert not cmp.identical and not cmp.layer_norms_replicated
    assert cmp.found_partitioned > cmp.megatron_partitioned


@pytest.mark.parametrize("name", ["gpt-tiny", "bert-tiny", "t5-tiny", "vgg19-tiny"])
def test_adp_partitions_exactly_the_batch_dims(cap_of, graph_of, name) -> None:
    ex = explore_detailed(cap_of(name), "adp", 8, "A", "exact", None, 0, "paper", graph=graph_of(name),
                          with_estimate=False)
    specs = variable_specs(ex.space, ex.result.choices)
    data = [p for p in ex.problem.graph.parameters if p.role is Role.DATA]
    assert {p.path for p in data} == set(specs)
    for p in data:
        spec = specs[p.path][1]
        assert spec[0] == "data" and all(s is None for s in spec[1:]), (p.path, spec)  # ADP's 1-D mesh: data=8


@pytest.mark.parametrize("name", ["bert-tiny"])
def test_opp_paper_reward_dqn_finds_megatron_despite_ties(cap_of, graph_of, name) -> None:
    """BERT's heads and head-dim partitions split the same number of dims (a tie in the paper's
    reward); the DQN must land on Megatron's (heads), the tie-break, like the MILP."""
    ex = explore_detailed(cap_of(name), "opp", 8, "A", "dqn", None, 0, "paper", budget_evaluations=EVALS.evaluations,
                          graph=graph_of(name), with_estimate=False)
    _megatron_check(ex)


def test_adp_dqn_agrees_with_exact(cap_of, graph_of) -> None:
    ex = explore_detailed(cap_of("t5-tiny"), "adp", 8, "A", "dqn", None, 0, "paper", budget_evaluations=60,
                          graph=graph_of("t5-tiny"), with_estimate=False)
    specs = variable_specs(ex.space, ex.result.choices)
    assert all(spec[0] == "data" and spec[1] is None for _, spec in specs.values())


def test_vgg_paper_reward_partitions_the_fully_connected_layers(cap_of, graph_of) -> None:
    ex = explore_detailed(cap_of("vgg19-tiny"), "opp", 8, "A", "exact", None, 0, "paper", graph=graph_of("vgg19-tiny"),
                          with_estimate=False)
    specs = variable_specs(ex.space, ex.result.choices)
    for layer in ("fc1", "fc2", "predictions"):
        assert any(s is not None for s in specs[f"params/{layer}/kernel"][1]), layer
    # Honest difference from the paper's Table 4: the conv output channels are split too (every
    # other conv, like Megatron's column/row alternation), because our graph allows it.
    assert any(any(s is not None for s in spec) for path, (_, spec) in specs.items() if "conv" in path)


@pytest.mark.parametrize("agent", ["greedy", "dqn"])
def test_opp_cost_reward_is_no_worse_than_megatron(cap_of, graph_of, agent) -> None:
    name = "gpt-tiny"
    problem = build_problem(cap_of(name), task="opp", mesh=8, cluster="A", reward="cost", graph=graph_of(name))
    mega = problem.objective.score(problem.space.choices_of(megatron_plan(problem.graph, "model", problem.axes)))
    result = search_sharding(problem, agent, Budget(seconds=None, evaluations=40), 0)
    assert result.score.fits and result.score.step_time <= mega.step_time
    assert result.evaluations <= 40


def test_hybrid_cost_reward_on_a_2x4_mesh(cap_of, graph_of) -> None:
    problem = build_problem(cap_of("gpt-tiny"), task="hybrid", mesh="data=2,model=4", cluster="A", reward="cost",
                            graph=graph_of("gpt-tiny"))
    result = search_sharding(problem, "greedy", Budget(seconds=None, evaluations=60), 0)
    assert result.score.conflict_free and result.score.value >= 1.0  # never worse than replicated


@pytest.mark.parametrize("name,task,mesh,reward,agent", [
    ("gpt-tiny", "opp", 8, "paper", "exact"),
    pytest.param("t5-tiny", "opp", 8, "paper", "exact", marks=pytest.mark.slow),
    pytest.param("bert-tiny", "adp", 8, "paper", "exact", marks=pytest.mark.slow),
    ("gpt-tiny", "hybrid", "data=2,model=4", "paper", "exact"),
])
def test_found_plans_run_with_unsharded_numerics(cap_of, graph_of, name, task, mesh, reward, agent) -> None:
    ex = explore_detailed(cap_of(name), task, mesh, "A", agent, None, 0, reward, graph=graph_of(name),
                          with_estimate=False)
    assert any(any(s is not None for s in p.spec) for p in ex.plan.parameters)
    report = run_plan(ex.plan, zoo.get(name), seed=0)
    assert report.ok, report
    assert report.max_abs_err < 1e-4


def _small_memory_cluster(memory_bytes: int) -> Any:
    """One 8-GPU server of cluster A's V100s with `memory_bytes` of memory each."""
    from hlomap.cost.cluster import hierarchical
    from hlomap.cost.devices import device_preset

    return hierarchical(1, 8, dataclasses.replace(device_preset("V100-16GB"), memory_bytes=memory_bytes))


@pytest.mark.slow
def test_cost_reward_plan_runs_with_unsharded_numerics(cap_of, graph_of) -> None:
    """On cluster A a tiny model's cost optimum is the replicated plan (Megatron's collectives cost
    ~20x its compute), which would run trivially; with 8 MiB devices the replicated t5-tiny step
    (~15 MB) does not fit, so the cost reward has to shard it, and that plan must run. (Greedy
    stops at a plan that does not fit: its first step splits the residual stream, the largest
    memory saving, which clashes with every other split; the DQN gets past it.)"""
    name = "t5-tiny"
    ex = explore_detailed(cap_of(name), "opp", 8, _small_memory_cluster(8 * 2**20), "dqn", None, 0, "cost",
                          budget_evaluations=100, graph=graph_of(name), with_estimate=False)
    assert ex.result.score.fits and ex.result.score.value > 0
    assert any(any(s is not None for s in p.spec) for p in ex.plan.parameters)
    report = run_plan(ex.plan, zoo.get(name), seed=0)
    assert report.ok, report
    assert report.max_abs_err < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert-tiny", "vgg19-tiny"])
def test_found_plans_run_with_unsharded_numerics_more_models(cap_of, graph_of, name) -> None:
    ex = explore_detailed(cap_of(name), "opp", 8, "A", "exact", None, 0, "paper", graph=graph_of(name),
                          with_estimate=False)
    report = run_plan(ex.plan, zoo.get(name), seed=0)
    assert report.ok, report


@pytest.mark.slow
@pytest.mark.parametrize("name", ["haiku-mlp", "resnet50-tiny"])
def test_found_plans_agree_in_float64_where_float32_is_ill_conditioned(cap_of, graph_of, name) -> None:
    """Measured: these steps miss rtol=1e-4 / atol=1e-5 in float32, and so does the *unsharded*
    float32 step against its own float64 run (resnet50-tiny: batch-norm gradients off by up to
    0.5 in float32; haiku-mlp: Adam's first update lr * g / (|g| + eps) at gradients near eps).
    Both compute entirely in float64 when given float64 arguments, and there the sharded step
    must match the unsharded one to the same tolerance: a wrong partitioning would not."""
    ex = explore_detailed(cap_of(name), "opp", 8, "A", "exact", None, 0, "paper", graph=graph_of(name),
                          with_estimate=False)
    report = run_plan(ex.plan, zoo.get(name), seed=0, float64=True)
    assert report.ok or report.float64_ok, report
    assert report.float64_max_abs_err is not None and report.float64_max_abs_err < 1e-9, report


@pytest.mark.slow
def test_found_plan_for_moe_agrees_in_loss_and_gradients(cap_of, graph_of) -> None:
    """Measured: moe-tiny's updated parameters miss the tolerance at a few elements whose gradient
    is ~1e-9, where Adam's first update lr * g / (|g| + eps) (lr 1e-3, eps 1e-8) multiplies the
    gradient's float32 rounding by up to 1e5; its embedding computes in float32 even under x64, so
    a float64 run does not remove that. The loss and the optimizer moments (mu = 0.1 g,
    nu = 0.001 g^2: the gradients) must still agree to rtol=1e-4 / atol=1e-5."""
    ex = explore_detailed(cap_of("moe-tiny"), "opp", 8, "A", "exact", None, 0, "paper", graph=graph_of("moe-tiny"),
                          with_estimate=False)
    report = run_plan(ex.plan, zoo.get("moe-tiny"), seed=0)
    assert all(leaf.startswith("[0]") for leaf in report.failing_leaves), report  # outputs: (params, opt, loss)
    assert report.max_abs_err < 1e-4, report


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt-base", "bert-base", "t5-base"])
def test_opp_paper_reward_finds_megatron_full_size(cap_of, graph_of, name) -> None:
    """t5-base's 12 heads do not divide by 8: Megatron splits the head dim instead, and the paper
    optimum also splits the relative-bias table's buckets, which Megatron leaves alone."""
    ex = explore_detailed(cap_of(name), "opp", 8, "A", "dqn", 120, 0, "paper", graph=graph_of(name),
                          with_estimate=False)
    _megatron_check(ex, identical=name != "t5-base")
    exact = explore_detailed(cap_of(name), "opp", 8, "A", "exact", None, 0, "paper", graph=graph_of(name),
                             with_estimate=False)
    assert ex.result.score.value == pytest.approx(exact.result.score.value)
