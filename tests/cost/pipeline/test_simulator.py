import logging
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hlomap.cost.pipeline.costs import CommModel, CostOptions, evaluate_plan
from hlomap.cost.cluster import Cluster
from hlomap.cost.devices import device_preset
from hlomap.cost.pipeline.links import with_device_memory
from hlomap.cost.pipeline.profile import PipelineProfile, uniform_profile
from hlomap.cost.pipeline.simulator import PipelineMemoryError, SpanKind, simulate
from hlomap.cost.pipeline.timeline import COMPUTE
from hlomap.cost.pipeline.stages import PipelinePlan, Schedule, Stage
from hlomap.report.gantt import draw_gantt
from hlomap.cost.pipeline.costs import gpipe_latency, lockstep_latency
from tests.tasks.pipeline.strategies import clusters as random_clusters
from tests.tasks.pipeline.strategies import uniform_cluster
from tests.tasks.pipeline.strategies import profiles

NO_COMM = CostOptions(comm=CommModel.IGNORED)


def _straight(n_stages, microbatches, schedule, layers_per_stage=1):
    bounds = [s * layers_per_stage for s in range(n_stages + 1)]
    return PipelinePlan.linear(
        bounds, [1] * n_stages, microbatches=microbatches, schedule=schedule
    )


@settings(max_examples=60, deadline=None)
@given(
    n_stages=st.integers(1, 6),
    microbatches=st.integers(1, 10),
    t_f=st.floats(0.01, 5.0),
    t_b=st.floats(0.01, 5.0),
    layers_per_stage=st.integers(1, 3),
    # interleaved 1F1B without chunks is 1F1B; ZB-H1 beats the formula (tests/cost/pipeline/test_schedules.py)
    schedule=st.sampled_from([Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED]),
)
def test_uniform_stages_follow_the_gpipe_formula(
    n_stages, microbatches, t_f, t_b, layers_per_stage, schedule
):
    """L = (M + S - 1)(t_f + t_b) for GPipe and for 1F1B (same bubble)."""
    profile = uniform_profile(
        n_stages * layers_per_stage,
        forward_time=t_f / layers_per_stage,
        backward_time=t_b / layers_per_stage,
        activation_bytes=1e9,
    )
    plan = _straight(n_stages, microbatches, schedule, layers_per_stage)
    result = simulate(profile, uniform_cluster(n_stages, bandwidth=1e9), plan, NO_COMM)
    assert result.length == pytest.approx((microbatches + n_stages - 1) * (t_f + t_b), rel=1e-9)
    # The closed-form model the DP minimizes agrees in this setting.
    model = evaluate_plan(profile, uniform_cluster(n_stages, bandwidth=1e9), plan, NO_COMM)
    assert model.latency == pytest.approx(result.length, rel=1e-9)


@pytest.mark.parametrize("n_stages,microbatches", [(4, 8), (4, 2), (5, 5), (1, 3)])
def test_1f1b_stashes_min_of_remaining_stages_and_microbatches(n_stages, microbatches):
    stash = 1e9
    profile = uniform_profile(n_stages, forward_time=1, backward_time=2, stash_bytes=stash)
    cluster = uniform_cluster(n_stages, bandwidth=1e9)
    gpipe = simulate(profile, cluster, _straight(n_stages, microbatches, Schedule.GPIPE), NO_COMM)
    one_f = simulate(
        profile, cluster, _straight(n_stages, microbatches, Schedule.ONE_F_ONE_B), NO_COMM
    )
    assert gpipe.peak_in_flight == (microbatches,) * n_stages
    assert one_f.peak_in_flight == tuple(
        min(n_stages - s, microbatches) for s in range(n_stages)
    )
    assert one_f.stage_memory == tuple(
        min(n_stages - s, microbatches) * stash for s in range(n_stages)
    )
    assert one_f.length == pytest.approx(gpipe.length)
    if microbatches > 1:  # the last stage holds one microbatch instead of M
        assert one_f.stage_memory[-1] < gpipe.stage_memory[-1]


def test_two_stages_one_microbatch_by_hand():
    """f0 -> send -> f1 -> b1 -> send back -> b0 -> all-reduce of stage 0 over two devices."""
    profile = PipelineProfile(
        names=("a", "b"),
        forward_time=[1.0, 2.0],
        backward_time=[3.0, 4.0],
        activation_bytes=[5e8],
        parameter_bytes=[4e8, 0.0],
    )
    cluster = uniform_cluster(3, bandwidth=1e9, latency=0.1)
    plan = PipelinePlan.linear([0, 1, 2], [2, 1], microbatches=1, schedule=Schedule.GPIPE)
    result = simulate(profile, cluster, plan)
    # stage 0 runs on two replicas: f0 = 0.5, b0 = 1.5. The 5e8-byte activation goes as two
    # chunks of 2.5e8 in parallel: 0.1 + 0.25 s. All-reduce of 4e8 bytes over 2 devices:
    # 2 steps of (0.1 + 2e8 / 1e9).
    transfer = 0.1 + 0.25
    expected = 0.5 + transfer + 2.0 + 4.0 + transfer + 1.5 + 2 * (0.1 + 0.2)
    assert result.length == pytest.approx(expected)
    kinds = [span.kind for span in result.spans]
    assert kinds.count(SpanKind.SEND_ACTIVATION) == 1
    assert kinds.count(SpanKind.SEND_GRADIENT) == 1
    assert kinds.count(SpanKind.ALLREDUCE) == 1


def _random_gpipe_plan(profile, cluster, data):
    """A GPipe plan of random cuts over every device of `cluster`, replicas spread at random."""
    n_stages = data.draw(st.integers(1, min(profile.n_layers, cluster.n_devices)))
    cuts = sorted(data.draw(st.sets(st.integers(1, profile.n_layers - 1), min_size=n_stages - 1,
                                    max_size=n_stages - 1)))
    replication = [1] * n_stages
    for _ in range(cluster.n_devices - n_stages):
        replication[data.draw(st.integers(0, n_stages - 1))] += 1
    return PipelinePlan.linear([0, *cuts, profile.n_layers], replication, microbatches=data.draw(st.integers(1, 6)),
                               schedule=Schedule.GPIPE)


@settings(max_examples=60, deadline=None)
@given(profile=profiles(min_layers=2, max_layers=6), cluster=random_clusters(), data=st.data())
def test_gpipe_matches_the_flow_shop_closed_form_with_communication(profile, cluster, data):
    plan = _random_gpipe_plan(profile, cluster, data)
    result = simulate(profile, cluster, plan)
    assert result.length == pytest.approx(gpipe_latency(profile, cluster, plan), rel=1e-9, abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(profile=profiles(min_layers=2, max_layers=6), cluster=random_clusters(), data=st.data())
def test_where_every_microbatch_syncs_the_all_reduce_is_part_of_each_backward(profile, cluster, data):
    """On a measured cluster (`costs.syncs_each_microbatch`) a replicated stage all-reduces its
    gradients in every microbatch's backward: no all-reduce is left for the end, the closed form
    still equals the simulation, and a stage pays M all-reduces, not one."""
    from hlomap.cost.measured import MeasuredCosts
    from hlomap.cost.pipeline.links import allreduce_time

    measured = replace(cluster, measured=MeasuredCosts())
    plan = _random_gpipe_plan(profile, cluster, data)
    m = plan.microbatches
    result = simulate(profile, measured, plan)
    assert not any(span.kind is SpanKind.ALLREDUCE for span in result.spans)
    assert result.length == pytest.approx(gpipe_latency(profile, measured, plan), rel=1e-9, abs=1e-12)
    # a stage's devices run its M all-reduces one after another
    syncs = [allreduce_time(measured, stage.devices,
                            float(profile.parameter_bytes[profile.stage_slice(stage.start, stage.stop)].sum()))
             for stage in plan.stages]
    assert result.length >= m * max(syncs) * (1 - 1e-9)


@settings(max_examples=60, deadline=None)
@given(
    profile=profiles(min_layers=2, max_layers=6),
    cluster=random_clusters(),
    schedule=st.sampled_from(Schedule),
    data=st.data(),
)
def test_timeline_respects_dependencies_and_resources(profile, cluster, schedule, data):
    n_stages = data.draw(st.integers(1, min(profile.n_layers, cluster.n_devices)))
    cuts = sorted(data.draw(st.sets(
        st.integers(1, profile.n_layers - 1), min_size=n_stages - 1, max_size=n_stages - 1
    )))
    m = data.draw(st.integers(1, 5))
    plan = PipelinePlan.linear(
        [0, *cuts, profile.n_layers], [1] * n_stages, microbatches=m, schedule=schedule
    )
    result = simulate(profile, cluster, plan)
    span = {(s.kind, s.stage, s.microbatch): s for s in result.spans}
    eps = 1e-9
    for s in range(n_stages):
        for mb in range(m):
            f, b = span[(SpanKind.FORWARD, s, mb)], span[(SpanKind.BACKWARD, s, mb)]
            assert b.start >= f.end - eps
            if s > 0:
                assert f.start >= span[(SpanKind.FORWARD, s - 1, mb)].end - eps
                send = span.get((SpanKind.SEND_ACTIVATION, s - 1, mb))
                if send is not None:
                    assert f.start >= send.end - eps
            if s < n_stages - 1:
                assert b.start >= span[(SpanKind.BACKWARD, s + 1, mb)].end - eps
    # one pass at a time per stage, one transfer at a time per link direction
    for key in {(sp.kind, sp.stage) for sp in result.spans}:
        compute = {SpanKind.FORWARD, SpanKind.BACKWARD, SpanKind.WEIGHT}
        kinds = compute if key[0] in compute else {key[0]}
        busy = sorted(
            (sp.start, sp.end) for sp in result.spans if sp.stage == key[1] and sp.kind in kinds
        )
        for (_, end), (start, _) in zip(busy, busy[1:]):
            assert start >= end - eps
    assert result.length == pytest.approx(max(sp.end for sp in result.spans))


def test_memory_violations_are_reported_logged_and_raised(caplog):
    profile = uniform_profile(
        4, forward_time=1, backward_time=1, parameter_bytes=1e9, stash_bytes=2e9
    )
    # 1F1B on 2 stages of 2 layers: stage 0 needs 4 * 2e9 params + 2 * 4e9 stash = 16e9.
    memory = (10e9, 40e9)
    v100 = device_preset("V100-16GB")
    cluster = Cluster("two", tuple(replace(v100, memory_bytes=m) for m in memory), (0, 0),
                    np.full((2, 2), 1e9), np.zeros((2, 2)))
    plan = PipelinePlan.linear([0, 2, 4], [1, 1], microbatches=4)
    with caplog.at_level(logging.WARNING, logger="hlomap.cost.pipeline.simulator"):
        result = simulate(profile, cluster, plan)
    assert result.stage_memory == pytest.approx((16e9, 12e9))
    assert not result.feasible
    assert [(v.stage, v.device) for v in result.violations] == [(0, 0)]
    assert "stage 0 needs" in caplog.text and "device 0" in caplog.text
    with pytest.raises(PipelineMemoryError, match=r"stage 0 needs 14.901 GiB on device 0"):
        result.check()
    roomy = with_device_memory(cluster, 20e9)
    assert simulate(profile, roomy, plan).check().feasible


def test_gantt_png_is_drawn(tmp_path):
    profile = uniform_profile(
        4, forward_time=1e-3, backward_time=2e-3, activation_bytes=1e6, parameter_bytes=1e6
    )
    cluster = uniform_cluster(6, bandwidth=1e9, latency=1e-5)
    plan = PipelinePlan.linear([0, 1, 2, 4], [2, 1, 3], microbatches=4)
    result = simulate(profile, cluster, plan)
    path = draw_gantt(result, tmp_path / "timeline.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    image = imread(path)[..., :3]
    forward_blue = np.array([0x4C, 0x72, 0xB0]) / 255
    assert np.isclose(image, forward_blue, atol=0.02).all(axis=-1).sum() > 100


def test_plans_that_do_not_fit_the_profile_or_links_are_rejected():
    profile = uniform_profile(3, forward_time=1, backward_time=1)
    cluster = uniform_cluster(2, bandwidth=1e9)
    with pytest.raises(ValueError, match="plan covers 2 layers but uniform_profile"):
        simulate(profile, cluster, PipelinePlan.linear([0, 1, 2], [1, 1], microbatches=1))
    with pytest.raises(ValueError, match="stage 1 uses device 2; cluster .* has 2 devices"):
        simulate(profile, cluster, PipelinePlan.linear([0, 1, 3], [2, 1], microbatches=1))
    with pytest.raises(ValueError, match="stage 0 ends at layer 1 but stage 1 starts at 2"):
        PipelinePlan(stages=(Stage(0, 1, (0,)), Stage(2, 3, (1,))), microbatches=1)
    with pytest.raises(ValueError, match="device 0 is in stage 0 and stage 1"):
        PipelinePlan(stages=(Stage(0, 1, (0,)), Stage(1, 3, (0,))), microbatches=1)


@settings(max_examples=40, deadline=None)
@given(profile=profiles(min_layers=2, max_layers=6), cluster=random_clusters(), data=st.data())
def test_each_stage_updates_its_parameters_once_after_its_last_pass(profile, cluster, data):
    """With `update_seconds_per_byte`, every device stage ends with one UPDATE span of its
    parameters' bytes times the rate (after its all-reduce), and GPipe's closed form still equals
    the simulation."""
    from hlomap.cost.pipeline.costs import stage_update_seconds

    per_byte = data.draw(st.floats(1e-12, 1e-9))
    profile = replace(profile, update_seconds_per_byte=per_byte)
    n_stages = data.draw(st.integers(1, min(profile.n_layers, cluster.n_devices)))
    cuts = sorted(data.draw(st.sets(st.integers(1, profile.n_layers - 1), min_size=n_stages - 1,
                                    max_size=n_stages - 1)))
    plan = PipelinePlan.linear([0, *cuts, profile.n_layers], [1] * n_stages,
                               microbatches=data.draw(st.integers(1, 6)), schedule=Schedule.GPIPE)
    result = simulate(profile, cluster, plan)
    assert result.length == pytest.approx(gpipe_latency(profile, cluster, plan), rel=1e-9, abs=1e-12)
    updates = [span for span in result.spans if span.kind is SpanKind.UPDATE]
    for s, stage in enumerate(plan.stages):
        params = float(profile.parameter_bytes[stage.start:stage.stop].sum())
        mine = [span for span in updates if span.stage == s]
        assert len(mine) == (1 if params > 0 else 0)
        if mine:
            assert mine[0].end - mine[0].start == pytest.approx(params * per_byte, rel=1e-9)
            assert stage_update_seconds(profile, cluster, plan, s) == pytest.approx(params * per_byte, rel=1e-9)
            last = max(span.end for span in result.spans if span.stage == s and span.kind in COMPUTE)
            assert mine[0].start >= last - 1e-15


@settings(max_examples=60, deadline=None)
@given(profile=profiles(min_layers=2, max_layers=6), cluster=random_clusters(), data=st.data(),
       remat=st.booleans())
def test_lockstep_ticks_are_never_faster_than_the_overlapped_gpipe_schedule(profile, cluster, data, remat):
    """The spmd executor's lockstep (`costs.lockstep_latency`) waits for the slowest stage every
    tick and computes in the fill and drain ticks too; on devices that do not share hardware it
    cannot beat the event simulator's GPipe, whose stages start as soon as their input is there."""
    plan = _random_gpipe_plan(profile, cluster, data)
    lockstep = lockstep_latency(profile, cluster, plan, remat=remat)
    assert lockstep >= gpipe_latency(profile, cluster, plan) * (1 - 1e-9) - 1e-12
    assert lockstep_latency(profile, cluster, plan, remat=True) >= lockstep_latency(
        profile, cluster, plan, remat=False) * (1 - 1e-12)


def test_lockstep_by_hand():
    """Two stages of one device each, M = 3: T = 4 ticks each way. A forward tick is the slower
    stage's forward, a backward tick its backward plus the forward recomputed; links are free
    and nothing is replicated, so no all-reduce; no parameters, no row passes, no update."""
    profile = PipelineProfile(names=("a", "b"), forward_time=np.array([1.0, 3.0]),
                              backward_time=np.array([2.0, 5.0]), activation_bytes=np.array([0.0]),
                              parameter_bytes=np.array([0.0, 0.0]))
    cluster = uniform_cluster(2, latency=0.0, bandwidth=float("inf"))
    plan = PipelinePlan.linear([0, 1, 2], [1, 1], microbatches=3, schedule=Schedule.GPIPE)
    assert lockstep_latency(profile, cluster, plan, remat=False) == pytest.approx(4 * 3.0 + 4 * 5.0)
    assert lockstep_latency(profile, cluster, plan, remat=True) == pytest.approx(4 * 3.0 + 4 * (5.0 + 3.0))


def test_on_devices_sharing_cores_a_tick_takes_the_devices_mean_work():
    """Host CPU devices share the cores (`MeasuredCosts.solo_speedup`): a device that finishes
    its tick early lends its cores to the others, so a tick of unequal stages lasts the mean
    device's work (priced at the all-busy rate), unless the slowest alone at full speed is longer."""
    from hlomap.cost.measured import MeasuredCosts

    profile = PipelineProfile(names=("a", "b"), forward_time=np.array([1.0, 3.0]),
                              backward_time=np.array([2.0, 6.0]), activation_bytes=np.array([0.0]),
                              parameter_bytes=np.array([0.0, 0.0]))
    cluster = uniform_cluster(2, latency=0.0, bandwidth=float("inf"))
    plan = PipelinePlan.linear([0, 1, 2], [1, 1], microbatches=1, schedule=Schedule.GPIPE)
    shared = replace(cluster, measured=MeasuredCosts(solo_speedup=8.0, n_devices=2))  # alone: up to 2x
    assert lockstep_latency(profile, shared, plan, remat=False) == pytest.approx(2 * (2.0 + 4.0))
    slow_alone = replace(cluster, measured=MeasuredCosts(solo_speedup=1.2, n_devices=2))  # alone: 1.2x
    assert lockstep_latency(profile, slow_alone, plan, remat=False) == pytest.approx(2 * (3.0 + 6.0) / 1.2)


def test_each_gradient_array_after_the_first_adds_its_measured_cost_to_every_all_reduce():
    """Two stages on two devices each, one microbatch, free links: the all-reduce of each
    stage's gradient costs only its buffers, (arrays - 1) x the measured cost per buffer, in every
    backward (the mpmd executor's timeline) and in every backward tick of the lockstep (the spmd
    executor's, as long as the costlier stage's); nothing on a datasheet cluster."""
    from hlomap.cost.measured import MeasuredCosts

    counted = PipelineProfile(names=("a", "b"), forward_time=np.array([1.0, 3.0]),
                              backward_time=np.array([2.0, 5.0]), activation_bytes=np.array([0.0]),
                              parameter_bytes=np.array([4.0, 4.0]), gradient_buffers=np.array([5.0, 3.0]))
    uncounted = replace(counted, gradient_buffers=None)
    cluster = uniform_cluster(4, latency=0.0, bandwidth=float("inf"))
    measured = replace(cluster, measured=MeasuredCosts(combined_operand_seconds=1e-3))
    plan = PipelinePlan.linear([0, 1, 2], [2, 2], microbatches=1, schedule=Schedule.GPIPE)
    added = simulate(counted, measured, plan).length - simulate(uncounted, measured, plan).length
    assert added == pytest.approx((5 - 1) * 1e-3 + (3 - 1) * 1e-3)
    ticks = lockstep_latency(counted, measured, plan, remat=False) - lockstep_latency(uncounted, measured, plan,
                                                                                       remat=False)
    assert ticks == pytest.approx(2 * (5 - 1) * 1e-3)  # T = M + S - 1 = 2 backward ticks
    assert simulate(counted, cluster, plan).length == simulate(uncounted, cluster, plan).length
