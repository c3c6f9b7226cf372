"""Search spaces: positions, static legality, incremental and vectorized conflict checks agree
with the propagation's ConflictChecker."""

from __future__ import annotations

import numpy as np
import pytest

from hlomap.tasks.sharding.task import random_choices
from hlomap.tasks.sharding.env import MaskPolicy
from hlomap.tasks import Task
from hlomap.tasks.sharding.space import adp_space, hybrid_space, opp_space
from hlomap.hlo.capture import Role, from_module
from hlomap.propagation.conflicts import ConflictChecker
from hlomap.propagation.graph import FactorGraph
from hlomap.propagation.plans import backbone_group


def _sequential_first_conflict(space, choices: np.ndarray) -> int:
    """Reference: decide positions one by one with `conflicts()`."""
    plan = space.plan_of(space.empty_choices())
    for p, c in enumerate(choices):
        if space.conflicts(plan, p, int(c)):
            return p
        space.set_choice(plan, p, int(c))
    return len(choices)


def test_opp_positions_are_the_trainable_groups_in_decision_order(graph_of, axes8) -> None:
    g = graph_of("gpt-tiny")
    space = opp_space(g, axes8, tie=False)
    assert space.task is Task.OPP
    assert tuple(int(x) for x in space.groups) == g.decision_order()
    # every trainable dim of size > 1 is a candidate, at the position of its group
    trainable = [t for t in g.trainable_dims if t.size > 1]
    assert len(space.candidates) == len(trainable)
    for c in space.candidates:
        assert int(g.parameter_groups(c.parameter)[c.dim]) in space.members[c.position]
    assert space.weights.sum() == len(trainable)


def test_tied_positions_cover_the_same_groups_and_never_clash(graph_of, axes8) -> None:
    g = graph_of("gpt-tiny")
    tied = opp_space(g, axes8, tie=True)
    untied = opp_space(g, axes8, tie=False)
    assert sorted(tied.member_groups.tolist()) == sorted(untied.member_groups.tolist())
    assert tied.num_positions < untied.num_positions  # the two layers' heads / MLP groups tie
    assert tied.total_weight == untied.total_weight
    clash = {(int(a), int(b)) for a, b in ConflictChecker(g, axes8).pairs}
    for members in tied.members:
        assert not any((int(a), int(b)) in clash for a in members for b in members)
    # a tied position holds the same variable of different layers
    multi = [m for m in tied.members if len(m) > 1]
    assert multi
    for p, members in enumerate(tied.members):
        if len(members) > 1:
            paths = {c.path.replace("layers_0", "L").replace("layers_1", "L") for c in tied.candidates if c.position == p}
            per_layer = [c for c in tied.candidates if c.position == p and "layers_0" in c.path]
            assert len(paths) == len(per_layer)


@pytest.mark.parametrize("name,mesh", [("gpt-tiny", "axes8"), ("t5-tiny", "axes8"), ("gpt-tiny", "axes2x4"),
                                       ("vgg19-tiny", "axes8")])
@pytest.mark.parametrize("tie", [False, True])
def test_first_conflict_agrees_with_checker_and_sequential(graph_of, request, name, mesh, tie) -> None:
    g = graph_of(name)
    axes = request.getfixturevalue(mesh)
    space = hybrid_space(g, axes, tie=tie) if len(axes.names) > 1 else opp_space(g, axes, tie=tie)
    checker = ConflictChecker(g, axes)
    rng = np.random.default_rng(0)
    seen = []
    for mask in (MaskPolicy.NONE, MaskPolicy.STATIC, MaskPolicy.FULL):
        choices = random_choices(space, 60, rng, mask)
        first = space.first_conflict(choices)
        ok = checker.ok(space.plan_of(choices))
        seen.extend(ok.tolist())
        np.testing.assert_array_equal(first == space.num_positions, ok)
        for row, f in zip(choices[:20], first[:20]):
            assert _sequential_first_conflict(space, row) == f
        if mask is MaskPolicy.FULL:
            assert ok.all()
    # both outcomes occur, or the test proves nothing
    assert any(seen) and not all(seen)


def test_legal_now_masks_exactly_the_clashing_choices(graph_of, axes2x4) -> None:
    space = hybrid_space(graph_of("gpt-tiny"), axes2x4, tie=False)
    rng = np.random.default_rng(1)
    for row in random_choices(space, 10, rng, MaskPolicy.FULL):
        plan = space.plan_of(space.empty_choices())
        for p, c in enumerate(row):
            mask = space.legal_now(plan, p)
            for a in range(space.num_actions):
                assert mask[a] == (not space.conflicts(plan, p, a - 1))
            space.set_choice(plan, p, int(c))


def test_replicate_residual_prunes_the_backbone_only(graph_of, axes8) -> None:
    g = graph_of("gpt-tiny")
    space = opp_space(g, axes8, replicate_residual=True)
    bb = backbone_group(g)
    assert space.pruned == (bb,)
    p = space.position_of_group[bb]
    assert space.legal[p].tolist() == [True, False]
    free = opp_space(g, axes8, replicate_residual=False)
    assert free.legal[free.position_of_group[bb], 1]


def test_adp_candidates_are_the_data_inputs(graph_of, axes8) -> None:
    g = graph_of("gpt-tiny")
    space = adp_space(g, axes8)
    assert {c.path for c in space.candidates} == {p.path for p in g.parameters if p.role is Role.DATA}
    assert all(c.path.startswith("batch/") for c in space.candidates)


def test_adp_on_a_bare_dump_uses_non_trainable_non_scalar_parameters(cap_of, axes8) -> None:
    cap = cap_of("gpt-tiny")
    trainable = [p.index for p in cap.parameters if p.role is Role.TRAINABLE]
    bare = from_module(cap.module, trainable=trainable)
    g = FactorGraph.build(bare.module, bare.parameters)
    space = adp_space(g, axes8)
    names = {c.parameter for c in space.candidates}
    assert names and not names & set(trainable)
    assert all(cap.parameters[i].shape.rank > 0 for i in names)


def test_hybrid_space_decides_data_and_trainable_groups_on_every_axis(graph_of, axes2x4) -> None:
    g = graph_of("gpt-tiny")
    space = hybrid_space(g, axes2x4)
    paths = {c.path for c in space.candidates}
    assert any(p.startswith("batch/") for p in paths) and any(p.startswith("params/") for p in paths)
    assert space.num_actions == 3
    batch = space.position_of_group[int(g.parameter_groups(next(p.index for p in g.parameters if p.path == "batch/tokens"))[0])]
    assert space.legal[batch].all()


def test_plan_of_and_choices_of_round_trip(graph_of, axes8) -> None:
    space = opp_space(graph_of("t5-tiny"), axes8)
    rng = np.random.default_rng(2)
    choices = random_choices(space, 5, rng, MaskPolicy.FULL)
    plans = space.plan_of(choices)
    np.testing.assert_array_equal(space.choices_of(plans), choices)
    assert all(space.represents(p) for p in plans)
