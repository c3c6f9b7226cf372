"""Conflict checks: each kind on a small module, messages that locate the problem, and the
vectorized check against a per-tensor brute-force check on many plans."""

from __future__ import annotations

import numpy as np
import pytest

from hlomap.propagation import ConflictChecker, ConflictKind, FactorGraph, MeshAxes, random_plans

from .helpers import module


def _plan(graph: FactorGraph, assignments: dict[tuple[str, int], int]) -> np.ndarray:
    plan = np.full(graph.num_groups, -1, dtype=np.int8)
    for (name, dim), option in assignments.items():
        node = graph.node_of(graph.module.entry_name, name)
        plan[graph.group_of_dim[graph.tensor_dims(graph.result_tensors(node)[0])[dim]]] = option
    return plan


DOT = ("x = f32[8,16] parameter(0)\nw = f32[16,32] parameter(1)\n"
       "ROOT d = f32[8,32] dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}")


def test_conflict_free_plans_pass():
    g = FactorGraph.build(module(DOT))
    checker = ConflictChecker(g, MeshAxes.from_mesh({"data": 2, "model": 4}))
    # data-parallel rows, column-parallel weight, and both on different axes
    plans = np.stack([_plan(g, {("x", 0): 0}), _plan(g, {("w", 1): 1}), _plan(g, {("x", 0): 0, ("w", 1): 1}),
                      _plan(g, {("x", 1): 1})])  # contracting dim sharded: partial result, allowed
    assert checker.ok(plans).tolist() == [True, True, True, True]
    assert all(checker.explain(p) == [] for p in plans)


def test_same_axis_on_two_dims_of_a_result_names_the_tensor_and_instruction():
    g = FactorGraph.build(module(DOT))
    checker = ConflictChecker(g, MeshAxes.from_mesh({"model": 8}))
    plan = _plan(g, {("x", 0): 0, ("w", 1): 0})
    assert checker.ok(plan).tolist() == [False]
    [conflict] = checker.explain(plan)
    assert conflict.kind is ConflictKind.SAME_AXIS
    assert (conflict.tensor, conflict.dims, conflict.instruction) == ("d", (0, 1), "d")
    assert "'model'" in str(conflict)


def test_both_dims_of_a_weight_on_one_axis_names_the_weight():
    g = FactorGraph.build(module(DOT))
    checker = ConflictChecker(g, MeshAxes.from_mesh({"model": 8}))
    [conflict] = checker.explain(_plan(g, {("w", 0): 0, ("w", 1): 0}))
    assert conflict.kind is ConflictKind.SAME_AXIS and conflict.tensor == "w" and conflict.dims == (0, 1)


def test_need_replication():
    g = FactorGraph.build(module("a = f32[8,16] parameter(0)\n"
                                 "ROOT s = f32[8,16] sort(a), dimensions={1}, to_apply=add_f32"))
    checker = ConflictChecker(g, MeshAxes.from_mesh({"model": 8}))
    assert checker.ok(_plan(g, {("a", 0): 0})).tolist() == [True]
    [conflict] = checker.explain(_plan(g, {("a", 1): 0}))
    assert conflict.kind is ConflictKind.NEED_REPLICATION and conflict.instruction == "s"
    assert conflict.dims == (1,)


def test_indivisible_size():
    g = FactorGraph.build(module("a = f32[6,8] parameter(0)\nROOT n = f32[6,8] negate(a)"))
    checker = ConflictChecker(g, MeshAxes.from_mesh({"data": 2, "model": 4}))
    assert checker.ok(_plan(g, {("a", 0): 0})).tolist() == [True]  # 6 on 2
    [conflict] = checker.explain(_plan(g, {("a", 0): 1}))  # 6 on 4
    assert conflict.kind is ConflictKind.INDIVISIBLE and conflict.tensor == "a" and conflict.dims == (0,)
    assert "6" in conflict.detail and "4" in conflict.detail


def test_compound_minor_factor_and_major_factor_divisibility():
    g = FactorGraph.build(module("p = f32[16,3] parameter(0)\nROOT r = f32[2,8,3] reshape(p)"))
    checker = ConflictChecker(g, MeshAxes.from_mesh({"model": 4}))
    # the minor factor (r dim 1) cannot be carried by the merged dim of p
    [minor] = checker.explain(_plan(g, {("r", 1): 0}))
    assert minor.kind is ConflictKind.COMPOUND and minor.instruction == "r"
    # p's dim (16) divides by 4 but its major factor (2) does not: a sub-axis split of r
    [major] = checker.explain(_plan(g, {("p", 0): 0}))
    assert major.kind is ConflictKind.COMPOUND and major.tensor == "p" and major.dims == (0,)
    assert "16" in major.detail and "2" in major.detail
    # the last dim passes through
    assert checker.ok(_plan(g, {("p", 1): 0})).tolist() == [False]  # 3 is not a multiple of 4
    assert ConflictChecker(g, MeshAxes.from_mesh({"model": 2})).ok(_plan(g, {("p", 0): 0})).tolist() == [True]


def test_combined_axes_overlap_with_their_parts():
    g = FactorGraph.build(module(DOT))
    axes = MeshAxes.from_mesh({"data": 2, "model": 4}, with_combinations=True)
    checker = ConflictChecker(g, axes)
    both = axes.index(("data", "model"))
    assert checker.ok(_plan(g, {("x", 0): both})).tolist() == [True]
    assert checker.ok(_plan(g, {("x", 0): both, ("w", 1): axes.index("model")})).tolist() == [False]
    assert checker.ok(_plan(g, {("x", 0): axes.index("data"), ("w", 1): axes.index("model")})).tolist() == [True]


def _brute_force_ok(graph: FactorGraph, axes: MeshAxes, plan: np.ndarray) -> bool:
    """Per tensor: no two dims on overlapping axes and every dim divisible by its axis size."""
    options = np.asarray(plan).astype(np.int64)[graph.group_of_dim]
    split = options >= 0
    if (graph.dim_effective_size[split] % axes.option_sizes[options[split]]).any():
        return False
    for t in np.flatnonzero(graph.tensor_rank >= 2):
        opts = [int(o) for o in options[graph.tensor_dims(t)] if o >= 0]
        for k, o in enumerate(opts):
            if any(axes.overlap[o + 1, o2 + 1] for o2 in opts[k + 1:]):
                return False
    return True


@pytest.mark.parametrize("mesh", [{"model": 8}, {"data": 2, "model": 4}])
def test_vectorized_check_agrees_with_explain_and_implies_brute_force(zoo_graph, mesh):
    g = zoo_graph("gpt-tiny")
    axes = MeshAxes.from_mesh(mesh, with_combinations=len(mesh) > 1)
    checker = ConflictChecker(g, axes)
    rng = np.random.default_rng(0)
    groups = np.asarray(g.parameter_groups_all())
    plans = np.full((60, g.num_groups), -1, dtype=np.int8)
    chosen = rng.integers(-1, len(axes.options), size=(60, len(groups)))
    chosen[rng.random(chosen.shape) < 0.7] = -1  # sparse plans, so that some are conflict-free
    plans[:, groups] = chosen
    plans = np.concatenate([plans, random_plans(g, axes, 40, rng)])
    ok = checker.ok(plans)
    assert 0 < ok.sum() < len(plans), "need both outcomes for the test to mean anything"
    for plan, good in zip(plans, ok):
        assert good == (checker.explain(plan, limit=1) == [])
        if good:
            assert _brute_force_ok(g, axes, plan)
    assert ok[60:].all(), "random_plans must return conflict-free plans"
    # the full explanation of a conflicting plan lists as many conflicts as the count finds
    # at least (count merges the three group-level reasons of one group into one)
    bad = plans[np.flatnonzero(~ok)[0]]
    assert len(checker.explain(bad)) >= checker.count(bad)[0] > 0


def test_conflicts_carry_source_lines(zoo_graph):
    g = zoo_graph("gpt-tiny")
    checker = ConflictChecker(g, MeshAxes.from_mesh({"model": 8}))
    # shard the sequence group: attention's scores have two dims (queries and keys) in it
    seq = next(int(x) for x in np.flatnonzero(g.constraints.self_conflict_node >= 0))
    plan = np.full(g.num_groups, -1, dtype=np.int8)
    plan[seq] = 0
    same = [c for c in checker.explain(plan) if c.kind is ConflictKind.SAME_AXIS]
    assert same
    assert same[0].source is not None and "hlomap/zoo/" in same[0].source and ".py:" in same[0].source


def test_derived_shardings_and_partial_results():
    from hlomap.propagation import instruction_shardings, partial_reductions

    g = FactorGraph.build(module(DOT))
    axes = MeshAxes.from_mesh({"data": 2, "model": 4})
    # rows of x on "data", the contracting dim on "model": d is split on rows, partial over model
    plan = _plan(g, {("x", 0): 0, ("x", 1): 1})
    specs = instruction_shardings(g, plan, axes)
    assert specs[(0, "main", "x")] == ((("data",), ("model",)),)
    assert specs[(0, "main", "w")] == ((("model",), None),)
    assert specs[(0, "main", "d")] == ((("data",), None),)
    [(node, option, size)] = partial_reductions(g, plan)
    assert g.nodes[node].instruction.name == "d" and axes.options[option] == ("model",) and size == 16
    assert partial_reductions(g, _plan(g, {("x", 0): 0})) == []
