import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hlomap.cost.pipeline.costs import CommModel, CostOptions, evaluate_plan
from hlomap.cost.pipeline.profile import PipelineProfile, merge_layers, scale_batch, uniform_profile
from hlomap.cost.pipeline.stages import PipelinePlan
from tests.tasks.pipeline.strategies import profiles, uniform_cluster


def test_rejects_wrong_lengths_and_negative_values_naming_the_field():
    good = dict(
        names=("a", "b", "c"),
        forward_time=[1.0, 2.0, 3.0],
        backward_time=[1.0, 2.0, 3.0],
        activation_bytes=[10.0, 20.0],
        parameter_bytes=[0.0, 5.0, 0.0],
        source="model.txt",
    )
    PipelineProfile(**good)
    with pytest.raises(ValueError, match=r"model.txt: PipelineProfile.activation_bytes has 3"):
        PipelineProfile(**{**good, "activation_bytes": [1.0, 2.0, 3.0]})
    with pytest.raises(ValueError, match=r"backward_time\[1\] = -2.0"):
        PipelineProfile(**{**good, "backward_time": [1.0, -2.0, 3.0]})
    with pytest.raises(ValueError, match=r"forward_time\[2\] = nan"):
        PipelineProfile(**{**good, "forward_time": [1.0, 2.0, float("nan")]})


def test_arrays_are_read_only_copies():
    source = np.array([1.0, 2.0])
    profile = PipelineProfile(("a", "b"), source, source, [3.0], [0.0, 0.0])
    source[0] = 99.0
    assert profile.forward_time[0] == 1.0
    with pytest.raises(ValueError):
        profile.forward_time[0] = 5.0


@settings(max_examples=50, deadline=None)
@given(profile=profiles(), data=st.data())
def test_prefix_sums_price_any_stage_like_a_direct_sum(profile, data):
    n = profile.n_layers
    i = data.draw(st.integers(0, n - 1))
    j = data.draw(st.integers(i + 1, n))
    prefix = profile.prefix()
    assert prefix.compute[j] - prefix.compute[i] == pytest.approx(
        sum(profile.forward_time[i:j]) + sum(profile.backward_time[i:j]), rel=1e-12, abs=1e-12
    )
    assert prefix.parameter[j] - prefix.parameter[i] == pytest.approx(
        sum(profile.parameter_bytes[i:j]), rel=1e-12
    )
    assert prefix.trainable[j] - prefix.trainable[i] == sum(
        1 for b in profile.parameter_bytes[i:j] if b > 0
    )


@settings(max_examples=40, deadline=None)
@given(profile=profiles(min_layers=3, max_layers=7), data=st.data())
def test_merged_profile_prices_plans_like_the_original(profile, data):
    """A plan cutting only at kept pivots costs the same on the merged and original profile."""
    kept = sorted(data.draw(st.sets(st.integers(0, profile.n_pivots - 1), min_size=1)))
    merged = merge_layers(profile, kept)
    assert merged.n_layers == len(kept) + 1
    cut_positions = sorted(data.draw(st.sets(st.integers(0, len(kept) - 1), max_size=3)))
    cluster = uniform_cluster(len(cut_positions) + 1, bandwidth=1e9, latency=1e-4)
    merged_bounds = [0] + [c + 1 for c in cut_positions] + [merged.n_layers]
    original_bounds = [0] + [kept[c] + 1 for c in cut_positions] + [profile.n_layers]
    reps = [1] * (len(cut_positions) + 1)
    a = evaluate_plan(merged, cluster, PipelinePlan.linear(merged_bounds, reps, microbatches=3))
    b = evaluate_plan(profile, cluster, PipelinePlan.linear(original_bounds, reps, microbatches=3))
    assert a.latency == pytest.approx(b.latency, rel=1e-12, abs=1e-15)
    assert a.stage_memory == pytest.approx(b.stage_memory, rel=1e-12)


def test_merge_rejects_out_of_range_pivot():
    with pytest.raises(ValueError, match="pivot 4 is out of range"):
        merge_layers(uniform_profile(4, forward_time=1, backward_time=1), [4])


def test_scale_batch_scales_time_and_activations_not_parameters():
    profile = uniform_profile(
        3, forward_time=1.0, backward_time=2.0, activation_bytes=8.0, parameter_bytes=5.0,
        stash_bytes=4.0,
    )
    half = scale_batch(profile, 0.5)
    assert list(half.compute_time) == [1.5, 1.5, 1.5]
    assert list(half.activation_bytes) == [4.0, 4.0]
    assert list(half.stash_bytes) == [2.0, 2.0, 2.0]
    assert list(half.parameter_bytes) == [5.0, 5.0, 5.0]
    with pytest.raises(ValueError, match="factor 0"):
        scale_batch(profile, 0)


def test_comm_model_ignored_zeroes_transfers():
    profile = uniform_profile(2, forward_time=1, backward_time=1, activation_bytes=1e9)
    cluster = uniform_cluster(2, bandwidth=1e9)
    plan = PipelinePlan.linear([0, 1, 2], [1, 1], microbatches=1)
    assert evaluate_plan(profile, cluster, plan).cut_transfer == (1.0,)
    ignored = evaluate_plan(profile, cluster, plan, CostOptions(comm=CommModel.IGNORED))
    assert ignored.cut_transfer == (0.0,)
