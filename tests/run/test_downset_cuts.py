"""A plan cut at a downset of a branching step's layer DAG that is no prefix of its forward chain
(`PipelineCut.downset`), found by the exact agent or made by hand, runs under `hlomap.parallelize` and
equals the unsharded step."""

from __future__ import annotations

import pytest

import hlomap
from hlomap.cost.cluster import hierarchical
from hlomap.plan import ParameterSpec, Plan, PlanSource
from hlomap.run.compare import check_pipeline
from hlomap.run.errors import RunError
from hlomap.tasks.pipeline.step_dag import chain_runs, step_dag
from tests.run.helpers import FAST_COMPILE


def _downset_plan(case, *, nested: bool = True) -> Plan:
    """Two stages cut in the DAG's latest order at the first point past the middle where the
    layers before the cut are no prefix of the chain (T5's decoder embedding moves after the
    encoder)."""
    chain = case.chain
    latest = step_dag(chain).latest_order()
    n = len(latest)
    k = next(k for k in range(n // 2, n - 1) if set(latest[:k]) != set(range(k)) and latest[k - 1] < n - 1)
    before = latest[:k] if nested else latest[:k - 1]
    last = chain.pivots[latest[k - 1]]
    cut = {"instruction": last.instruction, "layer": last.layer, "scope": last.scope, "source": last.source,
           "downset": [list(run) for run in chain_runs(chain, before)]}
    cap = case.cap
    parameters = tuple(ParameterSpec(p.index, p.path, tuple(p.shape.dims), (None,) * len(p.shape.dims))
                       for p in cap.parameters)
    return Plan(mesh=(), parameters=parameters, source=PlanSource(cap.source, cap.text_sha256),
                pipeline={"stages": [{"devices": [0]}, {"devices": [1]}], "microbatches": 2, "schedule": "1f1b",
                          "cuts": [cut]})


def test_the_exact_agent_s_downset_plan_runs_and_equals_the_unsharded_step(zoo_case) -> None:
    """On gpt-tiny, 2 stages of 4 devices, the downset DP beats cutting the chain's order (the
    plan's cut lists its runs of chain instructions), and the runner runs that plan."""
    case = zoo_case("gpt-tiny")
    plan = hlomap.explore(case.cap, task="pipeline", stages=2, microbatches=2, agent="dp", cluster=hierarchical(2, 4),
                          downset_states=128)
    assert plan.search["straight_optimum"] > plan.estimate["model_step_seconds"]
    assert plan.pipeline.cuts[0].downset  # not a prefix of the chain
    step = hlomap.parallelize(case.model.train_step(), plan, example_args=case.args, compiler_options=FAST_COMPILE)
    check = check_pipeline(step, case.args)
    assert check.ok, "\n".join(c.words() for c in check.comparisons)


@pytest.mark.slow
def test_a_hand_made_downset_cut_of_t5_runs(zoo_case) -> None:
    case = zoo_case("t5-tiny")
    plan = _downset_plan(case)
    assert len(plan.pipeline.cuts[0].downset) > 1  # not a prefix of the chain
    step = hlomap.parallelize(case.model.train_step(), plan, example_args=case.args, compiler_options=FAST_COMPILE)
    check = check_pipeline(step, case.args)
    assert check.ok, "\n".join(c.words() for c in check.comparisons)


def test_a_downset_that_misses_its_own_cut_instruction_is_refused(zoo_case) -> None:
    case = zoo_case("t5-tiny")
    plan = _downset_plan(case, nested=False)
    with pytest.raises(RunError, match="which its downset does not hold"):
        hlomap.parallelize(case.model.train_step(), plan, example_args=case.args, compiler_options=FAST_COMPILE)


def test_instructions_take_the_stage_of_the_first_cut_that_holds_them() -> None:
    from hlomap.plan import PipelineCut
    from hlomap.run.pipeline.cuts import _chain_stages

    position = {name: q for q, name in enumerate("abcdef")}
    first = PipelineCut("b", downset=(("a", "b"), ("e", "e")))
    second = PipelineCut("d", downset=(("a", "e"),))
    assert _chain_stages([first, second], [1, 3], position, "src").tolist() == [0, 0, 1, 1, 0, 2]
    # A prefix cut after a downset cut holds everything up to its instruction.
    assert _chain_stages([first, PipelineCut("e")], [1, 4], position, "src").tolist() == [0, 0, 1, 1, 0, 2]
    with pytest.raises(RunError, match="must nest"):
        _chain_stages([first, PipelineCut("d")], [1, 3], position, "src")
    with pytest.raises(RunError, match="'zz', which is not in the forward pass of src"):
        _chain_stages([PipelineCut("b", downset=(("a", "zz"),))], [1], position, "src")
    with pytest.raises(RunError, match="runs from 'c' back to the earlier 'a'"):
        _chain_stages([PipelineCut("c", downset=(("c", "a"),))], [2], position, "src")
