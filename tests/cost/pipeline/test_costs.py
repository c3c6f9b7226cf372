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
