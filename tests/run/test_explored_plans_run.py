"""Every plan the pipeline and joint explorers return for the zoo's tiny models runs under
`hlomap.parallelize`, and none gives devices to a stage that does nothing: the explorers offer
only stages whose data-parallel devices split a microbatch (`splits_batch`, the rule the runner
checks) and every stage holds some of the model's parameters."""

from __future__ import annotations

from typing import Any

import pytest

import hlomap
from hlomap.cost.cluster import hierarchical
from hlomap.cost.pipeline.stages import splits_batch
from hlomap.run.compare import check_pipeline
from tests.run.helpers import FAST_COMPILE

CLUSTER = hierarchical(2, 4)


def _check_stages(case: Any, plan: Any) -> None:
    """Each stage's data axis splits a microbatch and no device serves two stages."""
    batch, m = case.cap.batch_size, plan.pipeline.microbatches
    used = [d for s in plan.pipeline.stages for d in s.devices]
    assert len(used) == len(set(used))
    for s, stage in enumerate(plan.pipeline.stages):
        assert splits_batch(batch, m, stage.replication), (s, stage.devices, batch, m)


def _runs(case: Any, plan: Any) -> None:
    """One step of the plan equals the unsharded step's (the runner accepted the plan)."""
    step = hlomap.parallelize(case.model.train_step(), plan, example_args=case.args, compiler_options=FAST_COMPILE)
    check = check_pipeline(step, case.args)
    assert check.ok, "\n".join(c.words() for c in check.comparisons)


def test_a_pipeline_too_wide_for_its_microbatch_leaves_devices_idle_and_runs(zoo_case) -> None:
    """Two stages of 4 devices cannot split a microbatch of 8 / 4 = 2 examples: the DP takes
    stages of at most 2 devices, leaving the others idle, instead of a plan the runner refuses."""
    case = zoo_case("gpt-tiny")
    plan = hlomap.explore(case.cap, task="pipeline", stages=2, microbatches=4, agent="dp", cluster=CLUSTER)
    stages = plan.pipeline.stages
    assert all(len(s.devices) <= 2 for s in stages)
    _check_stages(case, plan)
    _runs(case, plan)


def test_the_dqn_cuts_equal_groups_a_microbatch_splits_over(zoo_case) -> None:
    """The DQN cuts center device groups: 2 of 2 devices here, instead of the even 4 + 4."""
    case = zoo_case("gpt-tiny")
    plan = hlomap.explore(case.cap, task="pipeline", stages=2, microbatches=4, agent="dqn", cluster=CLUSTER,
                          episodes=20)
    assert [s.devices for s in plan.pipeline.stages] == [(0, 1), (2, 3)]
    _check_stages(case, plan)


# bert-tiny's plans take minutes to compile on 2 cores: the slow run covers them
@pytest.mark.parametrize("name", ["gpt-tiny", pytest.param("bert-tiny", marks=pytest.mark.slow), "haiku-mlp"])
@pytest.mark.parametrize("microbatches", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2: 14 s more
def test_every_explored_pipeline_plan_runs(zoo_case, name: str, microbatches: int) -> None:
    case = zoo_case(name)
    plan = hlomap.explore(case.cap, task="pipeline", stages=2, microbatches=microbatches, agent="dp",
                          cluster=CLUSTER)
    _check_stages(case, plan)
    _runs(case, plan)


# gpt-tiny's joint plan on this cluster is tests/run/test_joint.py's joint optimum: it runs there,
# with this test's check of its stages (the fast run keeps one of the two 15 s runs)
@pytest.mark.parametrize("name", [pytest.param("gpt-tiny", marks=pytest.mark.slow),
                                  pytest.param("bert-tiny", marks=pytest.mark.slow),
                                  pytest.param("haiku-mlp", marks=pytest.mark.slow)])
def test_the_joint_plan_has_no_idle_stage_and_runs(zoo_case, name: str) -> None:
    """The loss after the last layer holds no parameter: it joins the stage before it instead of
    taking devices of its own."""
    case = zoo_case(name)
    plan = hlomap.explore(case.cap, task="auto", cluster=CLUSTER)
    _check_stages(case, plan)
    slowest = max(s.seconds_per_microbatch for s in plan.pipeline.stages)
    assert all(s.seconds_per_microbatch > 1e-3 * slowest for s in plan.pipeline.stages)
    _runs(case, plan)
