"""The one pipeline closed form: L = sum t + 2 sum u + (M - 1) max(t, u), and the pipeline
task's plan cost built on it."""

from __future__ import annotations

import pytest

import hlomap.cost.pipeline.costs as costs
from hlomap.cost.cluster import hierarchical
from hlomap.cost.pipeline.costs import evaluate_plan, pipeline_latency
from hlomap.cost.pipeline.profile import uniform_profile
from hlomap.cost.pipeline.stages import PipelinePlan


def test_pipeline_latency_is_fill_and_drain_plus_m_minus_one_bottlenecks() -> None:
    assert pipeline_latency([1.0, 3.0, 2.0], [0.5, 4.0], 5) == (1 + 3 + 2 + 2 * 4.5 + 4 * 4.0, 4.0)
    assert pipeline_latency([2.0], [], 1) == (2.0, 2.0)


def test_the_pipeline_plan_cost_uses_the_one_formula(monkeypatch) -> None:
    profile = uniform_profile(4, forward_time=1e-3, backward_time=2e-3, activation_bytes=1e6, parameter_bytes=1e7)
    cluster = hierarchical(1, 4)
    plan = PipelinePlan.linear((0, 2, 4), (2, 2), microbatches=3)
    cost = evaluate_plan(profile, cluster, plan)
    stage_times = [c + a / 3 for c, a in zip(cost.stage_compute, cost.stage_allreduce)]
    assert (cost.latency, cost.bottleneck) == pytest.approx(pipeline_latency(stage_times, cost.cut_transfer, 3))
    monkeypatch.setattr(costs, "pipeline_latency", lambda t, u, m: (7.0, 1.0))
    assert evaluate_plan(profile, cluster, plan).latency == 7.0


def test_a_stage_on_replicas_pays_its_weight_gradients_transposes_every_microbatch() -> None:
    """The transposes after a replicated stage's gradient all-reduce (`replica_transposes`) are
    charged to each microbatch's backward on r > 1 replicas and not on one; the closed form, the
    simulator and the DP charge the same."""
    import dataclasses

    import numpy as np

    from hlomap.cost.pipeline.simulator import simulate
    from hlomap.cost.pipeline.stages import Stage
    from hlomap.tasks.pipeline.dp import solve
    from hlomap.tasks.pipeline.space import PipelineSpace

    plain = uniform_profile(4, forward_time=1e-3, backward_time=2e-3, activation_bytes=1e6, parameter_bytes=1e7)
    transposing = dataclasses.replace(plain, replica_transposes=np.array([5e-4, 0.0, 5e-4, 5e-4]))
    cluster = hierarchical(1, 4)
    assert costs.stage_sync_seconds(transposing, cluster, Stage(0, 2, (0, 1))) == (0.0, pytest.approx(5e-4))
    assert costs.stage_sync_seconds(transposing, cluster, Stage(2, 4, (2, 3))) == (0.0, pytest.approx(1e-3))
    assert costs.stage_sync_seconds(transposing, cluster, Stage(0, 2, (0,))) == (0.0, 0.0)
    plan = PipelinePlan.linear((0, 2, 4), (2, 2), microbatches=3)
    before, after = evaluate_plan(plain, cluster, plan), evaluate_plan(transposing, cluster, plan)
    assert sum(after.stage_compute) - sum(before.stage_compute) == pytest.approx(1.5e-3)
    assert simulate(transposing, cluster, plan).length > simulate(plain, cluster, plan).length
    one_replica = PipelinePlan.linear((0, 2, 4), (1, 1), microbatches=3)
    assert evaluate_plan(transposing, cluster, one_replica).latency == evaluate_plan(plain, cluster, one_replica).latency
    best = solve(transposing, cluster, PipelineSpace(microbatches=3))
    assert best.value == pytest.approx(evaluate_plan(transposing, cluster, best.plan).latency)


def test_a_stage_on_replicas_pays_its_passes_all_reduces_every_microbatch() -> None:
    """Batch norm's statistics: a stage on r > 1 replicas all-reduces them in each pass of each
    microbatch (`stage_sync_seconds`: count x one all-reduce of the mean bytes); on one device
    there is nothing to all-reduce. The closed form, the simulator and the DP charge the same."""
    import dataclasses

    import numpy as np

    from hlomap.cost.pipeline.links import allreduce_time
    from hlomap.cost.pipeline.simulator import simulate
    from hlomap.cost.pipeline.stages import Stage
    from hlomap.tasks.pipeline.dp import solve
    from hlomap.tasks.pipeline.space import PipelineSpace

    plain = uniform_profile(4, forward_time=1e-3, backward_time=2e-3, activation_bytes=1e6, parameter_bytes=1e7)
    synced = dataclasses.replace(plain, forward_syncs=np.full(4, 3.0), backward_syncs=np.full(4, 2.0),
                                 forward_sync_bytes=np.full(4, 3e3), backward_sync_bytes=np.full(4, 4e3))
    cluster = hierarchical(1, 4)
    forward, backward = costs.stage_sync_seconds(synced, cluster, Stage(0, 2, (0, 1)))
    assert forward == pytest.approx(6 * allreduce_time(cluster, (0, 1), 1e3))
    assert backward == pytest.approx(4 * allreduce_time(cluster, (0, 1), 2e3))
    assert costs.stage_sync_seconds(synced, cluster, Stage(0, 2, (0,))) == (0.0, 0.0)
    assert costs.stage_sync_seconds(plain, cluster, Stage(0, 2, (0, 1))) == (0.0, 0.0)
    plan = PipelinePlan.linear((0, 2, 4), (2, 2), microbatches=3)
    extra = sum(costs.stage_sync_seconds(synced, cluster, stage)[0] + costs.stage_sync_seconds(synced, cluster, stage)[1]
                for stage in plan.stages)
    assert extra > 0
    before, after = evaluate_plan(plain, cluster, plan), evaluate_plan(synced, cluster, plan)
    assert sum(after.stage_compute) - sum(before.stage_compute) == pytest.approx(extra)
    assert simulate(synced, cluster, plan).length > simulate(plain, cluster, plan).length
    # the DP's optimum is the closed form's price of the plan it returns, syncs included
    space = PipelineSpace(microbatches=3)
    best = solve(synced, cluster, space)
    assert best.value == pytest.approx(evaluate_plan(synced, cluster, best.plan).latency)
