"""A plan cut at a downset of a branching step's layer DAG that is no prefix of its forward chain
(`PipelineCut.downset`) runs under `hlomap.parallelize` and equals the unsharded step."""

from __future__ import annotations

import pytest

import hlomap
from hlomap.plan import ParameterSpec, Plan, PlanSource
from hlomap.run.compare import check_pipeline
from hlomap.run.errors import RunError
from hlomap.tasks.pipeline.step_dag import chain_runs, latest_segments
from tests.run.helpers import FAST_COMPILE


def _downset_plan(case, *, nested: bool = True) -> Plan:
    """Two stages cut in the chain's latest order (`latest_segments`) at the first segment past
    the middle where the instructions before the cut are no prefix of the chain (T5's decoder
    embedding runs after the encoder there)."""
    chain = case.chain.chain
    segments = latest_segments(chain).positions
    k = next(k for k in range(len(segments) // 2, len(segments))
             if sorted(q for s in segments[:k] for q in s) != list(range(sum(len(s) for s in segments[:k]))))
    before = [q for s in segments[:k] for q in s]
    last = segments[k - 1][-1]
    names = chain.profile.names
    cut = {"instruction": names[last], "layer": chain.layers[last],
           "downset": [list(run) for run in chain_runs(names, before if nested else set(before) - {last})]}
    cap = case.cap
    parameters = tuple(ParameterSpec(p.index, p.path, tuple(p.shape.dims), (None,) * len(p.shape.dims))
                       for p in cap.parameters)
    return Plan(mesh=(), parameters=parameters, source=PlanSource(cap.source, cap.text_sha256),
                pipeline={"stages": [{"devices": [0]}, {"devices": [1]}], "microbatches": 2, "schedule": "1f1b",
                          "cuts": [cut]})


def test_a_downset_cut_runs_and_equals_the_unsharded_step(zoo_case) -> None:
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
