"""The layer DAG of a captured step (`step_dag`): its straight order is the explorer's profile,
the downset DP on it is never worse than cutting the chain's order and strictly better on a
branch the chain runs too early, and the exact agent reports both."""

from __future__ import annotations

import numpy as np
import pytest

from hlomap.cost.cluster import uniform
from hlomap.cost.pipeline.chain import step_chain
from hlomap.cost.pipeline.profile import scale_batch
from hlomap.tasks.pipeline.dp import solve
from hlomap.tasks.pipeline.downsets import DagTensor, LayerDag
from hlomap.tasks.pipeline.explore import explore_pipeline
from hlomap.tasks.pipeline.space import PipelineObjective, PipelineSpace
from hlomap.tasks.pipeline.step_dag import chain_runs, solve_step_downsets, step_dag

BOTTLENECK = PipelineSpace(objective=PipelineObjective.BOTTLENECK, check_memory=False, require_trainable=False)


def _early_branch() -> LayerDag:
    """Layer 0 (a decoder embedding) makes a large tensor read only by the last layer; layers
    1-4 (an encoder) form a chain into it. The chain order runs layer 0 first, so each of its
    cuts ships that tensor; the downset {1, 2} leaves it to the second stage."""
    n = 6
    return LayerDag(
        names=tuple(f"l{i}" for i in range(n)),
        forward_time=np.array([0.0, 1.0, 1.0, 1.0, 1.0, 0.0]),
        backward_time=np.zeros(n),
        parameter_bytes=np.ones(n),
        stash_bytes=np.zeros(n),
        output_bytes=np.array([1e10, 1e3, 2e3, 1e3, 1e3, 0.0]),
        consumers=((5,), (2,), (3,), (4,), (5,), ()),
        source="early-branch",
        tensors=(DagTensor(0, (5,), 1e10), DagTensor(1, (2,), 1e3), DagTensor(2, (3,), 2e3),
                 DagTensor(3, (4,), 1e3), DagTensor(4, (5,), 1e3)),
    )


def test_several_tensors_of_a_layer_cross_only_the_cuts_between_them_and_their_readers() -> None:
    dag = LayerDag(names=("a", "b", "c"), forward_time=np.ones(3), backward_time=np.ones(3),
                   parameter_bytes=np.ones(3), stash_bytes=None, output_bytes=np.array([3.0, 1.0, 0.0]),
                   consumers=((1, 2), (2,), ()), tensors=(DagTensor(0, (1,), 1.0), DagTensor(0, (2,), 2.0),
                                                          DagTensor(1, (2,), 1.0)))
    # After {a}: both of a's tensors; after {a, b}: a's second and b's.
    assert dag.straight.activation_bytes.tolist() == [3.0, 3.0]
    crossing = dag.crossing_bytes(np.array([[True, False, False], [True, True, False]]))
    assert crossing.tolist() == [3.0, 3.0]
    with pytest.raises(ValueError, match="readers among its producer's consumers"):
        LayerDag(names=("a", "b"), forward_time=np.ones(2), backward_time=np.ones(2), parameter_bytes=np.ones(2),
                 stash_bytes=None, output_bytes=np.zeros(2), consumers=((), ()), tensors=(DagTensor(0, (1,), 1.0),))


def test_the_downset_dp_beats_the_chain_order_on_a_branch_run_too_early() -> None:
    dag = _early_branch()
    cluster = uniform(2, "V100-16GB", 1e9, 0.0)
    space = BOTTLENECK
    linear = solve(dag.straight, cluster, space)
    found = solve_step_downsets(dag, cluster, space, max_states=64)
    assert found.value < 0.5 * linear.value  # every chain cut ships the 10 GB tensor; the downset one does not
    assert dag.latest_order() == (1, 2, 3, 4, 0, 5)
    first_stage = set(found.order[:found.found.solution.plan.stages[0].stop])
    assert 0 not in first_stage and first_stage <= {1, 2, 3, 4}


def test_with_a_tiny_state_bound_the_dp_is_still_no_worse_than_the_chain_order() -> None:
    """Over the bound only the prefixes of both orders remain: still never worse."""
    dag = _early_branch()
    cluster = uniform(2, "V100-16GB", 1e9, 0.0)
    linear = solve(dag.straight, cluster, BOTTLENECK)
    assert solve_step_downsets(dag, cluster, BOTTLENECK, max_states=1).value <= linear.value


def test_a_captured_step_s_dag_has_the_profile_s_crossing_bytes_and_branches(zoo_capture) -> None:
    cap = zoo_capture("t5-tiny")
    hlo = step_chain(cap)
    dag = step_dag(hlo, 0.5)
    profile = scale_batch(hlo.profile, 0.5)
    assert not dag.is_chain
    np.testing.assert_allclose(dag.straight.activation_bytes, profile.activation_bytes, rtol=1e-12)
    np.testing.assert_allclose(dag.straight.compute_time, profile.compute_time, rtol=1e-12)
    dag.linearize(dag.latest_order())  # raises unless it is a topological order
    # what the executors' costs grow with is the step's, whatever the order of its layers
    for reordered in (dag.straight, dag.linearize(dag.latest_order()), dag.reordered(dag.latest_order()).straight):
        assert (reordered.pass_buffers, reordered.state_leaves) == (profile.pass_buffers, profile.state_leaves) != (0, 0)
    names = hlo.chain.profile.names
    assert chain_runs(hlo, range(3)) == ((names[0], hlo.pivots[2].instruction),)
    assert chain_runs(hlo, [0, 2]) == ((names[0], hlo.pivots[0].instruction),
                                       (names[hlo.pivots[1].position + 1], hlo.pivots[2].instruction))


def test_the_exact_agent_cuts_gpt_tiny_at_downsets_when_cheaper_and_says_so(zoo_capture) -> None:
    from rich.console import Console

    from hlomap.cost.cluster import hierarchical
    from hlomap.report.pipeline import format_pipeline_result

    cap = zoo_capture("gpt-tiny")
    result = explore_pipeline(cap, stages=2, microbatches=2, agent="dp", cluster=hierarchical(2, 4), downset_states=128)
    assert result.downset_states > 0 and result.straight_value is not None
    assert result.value < result.straight_value * (1 - 1e-6) and result.order is not None
    hlo = step_chain(cap)
    for cut in result.cuts:  # a cut names the chain's pivot it follows and what runs before it
        assert cut.instruction == hlo.pivots[cut.pivot].instruction
    assert any(cut.downset for cut in result.cuts)
    console = Console(record=True, width=200)
    console.print(format_pipeline_result(result))
    assert "cut at downsets of the layer DAG" in console.export_text()
    linear_only = explore_pipeline(cap, stages=2, microbatches=2, agent="dp", cluster=hierarchical(2, 4),
                                   downset_states=0)
    assert linear_only.order is None and linear_only.downset_states == 0
    assert linear_only.value == pytest.approx(result.straight_value)
    with pytest.raises(ValueError, match="downset_states"):
        explore_pipeline(cap, stages=2, agent="dp", downset_states=-1)
