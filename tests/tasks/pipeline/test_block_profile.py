"""A plan's profile in blocks keeps the plan's costs and round-trips through JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hlomap.cost.pipeline.costs import evaluate_plan
from hlomap.cost.pipeline.profile import SYNC_FIELDS, PipelineProfile
from hlomap.cost.pipeline.stages import PipelinePlan, Stage
from hlomap.tasks.pipeline.block_profile import PlanProfile, ProfileError, plan_profile
from tests.tasks.pipeline.strategies import uniform_cluster


def _profile(n: int, seed: int = 0) -> PipelineProfile:
    """Random layers, each with a random part of its time that a split batch does not shrink and
    a few all-reduces inside its passes on replicas."""
    rng = np.random.default_rng(seed)
    forward, backward = rng.uniform(1e-4, 1e-3, n), rng.uniform(2e-4, 2e-3, n)
    return PipelineProfile(names=tuple(f"l{i}" for i in range(n)), forward_time=forward, backward_time=backward,
                           activation_bytes=rng.uniform(1e5, 1e7, n - 1), parameter_bytes=rng.uniform(0, 1e7, n),
                           stash_bytes=rng.uniform(0, 1e6, n), forward_fixed=forward * rng.uniform(0, 1, n),
                           backward_fixed=backward * rng.uniform(0, 1, n),
                           forward_syncs=rng.integers(0, 3, n).astype(float), backward_syncs=rng.integers(0, 3, n).astype(float),
                           forward_sync_bytes=rng.uniform(0, 1e4, n), backward_sync_bytes=rng.uniform(0, 1e4, n))


@pytest.mark.parametrize("n, max_blocks", [(40, 64), (300, 64), (300, 8)])
def test_blocks_keep_the_plans_cost(n, max_blocks):
    profile = _profile(n)
    plan = PipelinePlan.linear((0, n // 5, n // 2, n - 7, n), (2, 1, 3, 2), microbatches=6)
    blocks = plan_profile(profile, plan, max_blocks=max_blocks)
    assert blocks.blocks.n_layers <= max(max_blocks, plan.n_stages)
    assert blocks.blocks.n_layers == (n if n <= max_blocks else blocks.blocks.n_layers)
    cluster = uniform_cluster(8, bandwidth=1e10, latency=1e-5)
    on_blocks = PipelinePlan(tuple(Stage(a, b, s.devices) for (a, b), s in
                                   zip(zip(blocks.stage_bounds[:-1], blocks.stage_bounds[1:]), plan.stages)), 6)
    assert evaluate_plan(blocks.blocks, cluster, on_blocks).latency == pytest.approx(
        evaluate_plan(profile, cluster, plan).latency, rel=1e-12)
    stage = blocks.stage_profile()
    assert stage.n_layers == 4 and stage.compute_time.sum() == pytest.approx(profile.compute_time.sum())
    again = PlanProfile.from_json(json.loads(json.dumps(blocks.to_json())))
    assert again.stage_bounds == blocks.stage_bounds
    np.testing.assert_allclose(again.blocks.activation_bytes, blocks.blocks.activation_bytes)
    np.testing.assert_allclose(again.blocks.forward_fixed, blocks.blocks.forward_fixed)
    np.testing.assert_allclose(again.blocks.backward_fixed, blocks.blocks.backward_fixed)
    assert again.blocks.forward_fixed.sum() == pytest.approx(profile.forward_fixed.sum())
    # a plan written before the fixed part existed reads as none: every second split over replicas
    older = {k: v for k, v in blocks.to_json().items() if not k.endswith("_fixed_seconds")}
    assert not PlanProfile.from_json(older).blocks.compute_fixed.any()
    for name in SYNC_FIELDS:  # the passes' all-reduces too; none in plans written before them
        np.testing.assert_allclose(getattr(again.blocks, name), getattr(blocks.blocks, name))
        assert getattr(again.blocks, name).sum() == pytest.approx(getattr(profile, name).sum())
        assert not getattr(PlanProfile.from_json({k: v for k, v in older.items() if k != name}).blocks, name).any()


def test_bad_block_profiles_name_the_field():
    good = plan_profile(_profile(10), PipelinePlan.linear((0, 4, 10), (1, 1), microbatches=2)).to_json()
    with pytest.raises(ProfileError, match="missing field"):
        PlanProfile.from_json({k: v for k, v in good.items() if k != "names"}, where="p")
    with pytest.raises(ProfileError, match="stage_bounds"):
        PlanProfile.from_json(good | {"stage_bounds": [0, 4, 4, 10]})
    with pytest.raises(ProfileError, match="'forward_seconds'"):
        PlanProfile.from_json(good | {"forward_seconds": ["x"]})
