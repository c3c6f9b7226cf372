"""A calibrated cluster's measured costs: the table and its JSON, and the cost model's use of it
(collectives by their own fits, dispatch, kernel launches, executors, shared-hardware speedup)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from hlomap.cost.calibration import (
    CalibrationError,
    ExecutorSample,
    Measurement,
    calibrated_cluster,
    fit_executors,
    solo_speedup,
)
from hlomap.cost.cluster import Cluster, ClusterSpecError, busy_speedup, with_busy_devices
from hlomap.cost.collectives import Collective, all_reduce_time, collective_permute_time, collective_time
from hlomap.cost.measured import Fit, MeasuredCosts, MeasuredCostsError, executor_units, measured_costs
from hlomap.cost.pipeline.costs import executor_overhead
from tests.cost.test_calibration_cluster import _calibration

TABLE = MeasuredCosts(
    dispatch_seconds=20e-6, transfer=Fit(100e-6, 5e9),
    collectives={("all-reduce", 2): Fit(100e-6, 2e9), ("all-reduce", 8): Fit(400e-6, 1e9),
                 ("collective-permute", 4): Fit(50e-6, 3e9)},
    executors={"mpmd": Fit(2e-3, 1 / 1.5e-3), "spmd": Fit(5e-3, 1 / 0.5e-3)},
    solo_speedup=6.0, n_devices=8, kernel_seconds=10e-6)


def _cluster(measured: MeasuredCosts | None = TABLE) -> Cluster:
    base = calibrated_cluster(_calibration(8))
    return dataclasses.replace(base, measured=measured)


def test_collective_lookup_rounds_up_to_a_measured_group_and_clamps_beyond() -> None:
    assert TABLE.collective("all-reduce", 2) == Fit(100e-6, 2e9)
    assert TABLE.collective("all-reduce", 3) == Fit(400e-6, 1e9)  # 3 -> the 8-device fit
    assert TABLE.collective("all-reduce", 16) == Fit(400e-6, 1e9)  # beyond: the largest
    assert TABLE.collective("all-reduce", 1) == Fit(0.0, math.inf)  # one device: free
    assert TABLE.collective("all-to-all", 4) is None  # not measured: the links price it


def test_json_round_trip_and_named_errors() -> None:
    assert MeasuredCosts.from_json(TABLE.to_json()) == TABLE
    bad = TABLE.to_json() | {"solo_speedup": 0.5}
    with pytest.raises(MeasuredCostsError, match="solo_speedup"):
        MeasuredCosts.from_json(bad)
    with pytest.raises(MeasuredCostsError, match=r"measured.collectives\[0\]"):
        MeasuredCosts.from_json(TABLE.to_json() | {"collectives": [{"kind": "all-reduce"}]})
    cluster_json = _cluster().to_json()
    assert Cluster.from_json(cluster_json) == _cluster()
    cluster_json["measured"]["executors"] = {"gpu-magic": {"latency": 0, "bandwidth": 1}}
    with pytest.raises(ClusterSpecError, match="gpu-magic"):
        Cluster.from_json(cluster_json, source="c.json")


def test_measured_costs_take_the_dispatch_off_each_collective() -> None:
    from hlomap.cost.calibration import CommFit

    fits = [CommFit("dispatch", 1, 30e-6, math.inf, 1), CommFit("all-reduce", 4, 230e-6, 1e9, 9),
            CommFit("all-gather", 4, 10e-6, 1e9, 9), CommFit("transfer", 2, 50e-6, 4e9, 9)]
    table = measured_costs(fits, "dispatch", "transfer")
    assert table.dispatch_seconds == 30e-6
    assert table.collective("all-reduce", 4).latency == pytest.approx(200e-6)
    assert table.collective("all-gather", 4).latency == 0.0  # never below 0
    assert table.transfer == Fit(50e-6, 4e9)


def test_collectives_on_a_measured_cluster_are_their_fits() -> None:
    cluster = _cluster()
    nbytes = 1e6
    assert all_reduce_time(cluster, range(8), nbytes) == pytest.approx(400e-6 + nbytes / 1e9)
    assert collective_time(Collective.ALL_REDUCE, cluster, [[0, 1], [2, 3]], nbytes) == pytest.approx(
        100e-6 + nbytes / 2e9)
    assert collective_permute_time(cluster, [(0, 1), (2, 3)], nbytes) == pytest.approx(50e-6 + nbytes / 3e9)
    # without the table the ring over the links prices it: a different figure
    assert all_reduce_time(_cluster(None), range(8), nbytes) != pytest.approx(all_reduce_time(cluster, range(8), nbytes))


def test_executor_overhead_grows_with_its_units() -> None:
    assert executor_units("mpmd", 4, 8) == 32 and executor_units("spmd", 4, 8) == 11
    cluster = _cluster()
    assert executor_overhead(cluster, "mpmd", 2, 4) == pytest.approx(2e-3 + 8 * 1.5e-3)
    assert executor_overhead(cluster, "spmd", 2, 4) == pytest.approx(5e-3 + 5 * 0.5e-3)
    assert executor_overhead(_cluster(None), "mpmd", 2, 4) == 0.0


def test_an_executor_not_timed_costs_a_dispatch_per_program() -> None:
    """A calibration that timed no executor (one device, before one stage was timed there) still
    charges the programs a pipeline launches: without it a one-stage plan of two microbatches
    priced one dispatch below the same step as one SPMD program, and the planner chose it on an
    H200 (8.5 ms measured against 5.6)."""
    untimed = dataclasses.replace(TABLE, executors={})
    assert untimed.executor_seconds("mpmd", 1, 2) == pytest.approx(5 * 20e-6)  # F and B per microbatch, one update
    assert untimed.executor_seconds("spmd", 4, 8) == pytest.approx(20e-6)  # one program
    assert untimed.executor_seconds("mpmd", 1, 2) > TABLE.dispatch_seconds  # above one SPMD dispatch


def test_fit_executors_recovers_fixed_and_per_unit_cost() -> None:
    samples = [ExecutorSample("mpmd", s, m, 2e-3 + 1.5e-3 * s * m) for s, m in ((2, 1), (2, 4), (4, 4))]
    samples += [ExecutorSample("spmd", s, m, 5e-3 + 0.5e-3 * (m + s - 1)) for s, m in ((2, 1), (2, 4), (4, 4))]
    fits = fit_executors(samples)
    assert fits["mpmd"].latency == pytest.approx(2e-3) and fits["mpmd"].seconds_per_byte == pytest.approx(1.5e-3)
    assert fits["spmd"].latency == pytest.approx(5e-3) and fits["spmd"].seconds_per_byte == pytest.approx(0.5e-3)


def test_the_mpmd_executor_pays_for_each_buffer_its_passes_move() -> None:
    moving = dataclasses.replace(TABLE, executor_buffers={"mpmd": 2e-6})
    cluster = _cluster(moving)
    # M x buffers x cost per buffer on top of the fit; the spmd executor's program moves none here
    assert executor_overhead(cluster, "mpmd", 2, 4, buffers=1000.0) == pytest.approx(2e-3 + 8 * 1.5e-3 + 4 * 1000 * 2e-6)
    assert executor_overhead(cluster, "spmd", 2, 4, buffers=1000.0) == pytest.approx(5e-3 + 5 * 0.5e-3)
    assert executor_overhead(cluster, "mpmd", 2, 4) == pytest.approx(2e-3 + 8 * 1.5e-3)
    assert MeasuredCosts.from_json(moving.to_json()) == moving
    with pytest.raises(MeasuredCostsError, match="executor_buffers"):
        MeasuredCosts.from_json(moving.to_json() | {"executor_buffers": {"gpu-magic": 1e-6}})


def test_fit_executor_terms_separates_the_cost_per_buffer_from_the_cost_per_pass() -> None:
    from hlomap.cost.calibration import fit_executor_terms

    def seconds(s: int, m: int, buffers: float) -> float:
        return 1e-3 + 0.8e-3 * s * m + 2.5e-6 * m * buffers

    samples = [ExecutorSample("mpmd", s, m, seconds(s, m, 90.0), 90.0) for s, m in ((2, 1), (2, 4), (4, 4))]
    samples += [ExecutorSample("mpmd", s, m, seconds(s, m, 1240.0), 1240.0) for s, m in ((2, 1), (2, 4))]
    samples += [ExecutorSample("spmd", s, m, 5e-3 + 0.5e-3 * (m + s - 1), 90.0) for s, m in ((2, 1), (2, 4))]
    fits = fit_executor_terms(samples)
    assert fits["mpmd"].step.latency == pytest.approx(1e-3)
    assert fits["mpmd"].step.seconds_per_byte == pytest.approx(0.8e-3)
    assert fits["mpmd"].per_buffer == pytest.approx(2.5e-6)
    assert fits["spmd"].per_buffer == 0.0  # one buffer count: no term to fit
    assert fits["spmd"].step.latency == pytest.approx(5e-3)
    # a term the samples make negative is dropped and the rest refitted (never below zero)
    flat = [ExecutorSample("mpmd", 2, m, 1e-3 + 1e-3 * m, b) for m, b in ((1, 10.0), (4, 1000.0), (2, 500.0))]
    assert fit_executor_terms(flat)["mpmd"].per_buffer >= 0.0


def test_the_spmd_executor_pays_for_each_state_leaf_it_hands_back() -> None:
    """The spmd executor slices every leaf of the state out of its rows after each step, one
    buffer per device of the leaf's stage, whatever the microbatches: its cost per buffer is the
    slope of the hand-back timed on models of two state sizes."""
    from hlomap.cost.calibration import HandBackSample, fit_hand_back
    from hlomap.cost.measured import executor_moved

    samples = [HandBackSample(leaves, 4.0, 0.5e-3 + 15e-6 * leaves * 4) for leaves in (8.0, 136.0)]
    assert fit_hand_back(samples) == pytest.approx(15e-6)
    assert fit_hand_back(samples[:1]) == 0.0  # one size: no slope to fit
    assert fit_hand_back([HandBackSample(8.0, 4.0, 2e-3), HandBackSample(136.0, 4.0, 1e-3)]) == 0.0  # never negative
    with pytest.raises(CalibrationError, match="leaves"):
        HandBackSample(0.0, 4.0, 1e-3)
    # the pass buffers are the mpmd executor's size, the state leaves the spmd one's
    assert executor_moved("spmd", 4, 900.0, 136.0) == 136.0
    assert executor_moved("mpmd", 4, 900.0, 136.0) == 3600.0

    cluster = _cluster(dataclasses.replace(TABLE, executor_buffers={"spmd": 15e-6}))
    priced = executor_overhead(cluster, "spmd", 2, 4, buffers=900.0, stage_devices=4.0, state_leaves=109.0)
    assert priced == pytest.approx(5e-3 + 5 * 0.5e-3 + 109 * 4 * 15e-6)
    # four stages of two devices: half the buffers (gpt-tiny's 109 leaves took 7.6 ms and 3.9 ms)
    assert executor_overhead(cluster, "spmd", 4, 4, stage_devices=2.0, state_leaves=109.0) == pytest.approx(
        5e-3 + 7 * 0.5e-3 + 109 * 2 * 15e-6)


def test_state_leaves_count_the_parameters_and_optimizer_state(cap_of) -> None:
    """The oracle: the leaves of the zoo steps' own parameter and optimizer-state pytrees."""
    import jax

    from hlomap import zoo
    from hlomap.cost.estimate import state_leaves

    for name in ("gpt-tiny", "haiku-mlp"):
        params, opt_state, _ = zoo.get(name).example_args(0)
        assert state_leaves(cap_of(name)) == len(jax.tree.leaves(params)) + len(jax.tree.leaves(opt_state)), name


def test_pass_buffers_follow_jaxs_residuals(cap_of) -> None:
    """The residual count read off the HLO against the residuals `jax.vjp` keeps (the oracle)."""
    import jax

    from hlomap import zoo
    from hlomap.cost.estimate import pass_buffers, residual_buffers
    from hlomap.zoo.model import split_other

    for name in ("gpt-tiny", "haiku-mlp"):
        model = zoo.get(name)
        params, _, batch = model.example_args(0)
        trainable, other = split_other(params)
        _, vjp, _ = jax.vjp(lambda p: model.config.make_loss()(p, other, batch), trainable, has_aux=True)
        kept = len(jax.tree.leaves(vjp))
        cap = cap_of(name)
        assert 0.8 * kept <= residual_buffers(cap.module) <= 1.1 * kept, name
        assert pass_buffers(cap) == 5 * len(jax.tree.leaves(trainable)) + 2 * residual_buffers(cap.module)


def test_solo_speedup_and_busy_devices() -> None:
    pair = [Measurement("dot_f32_512", "dot", "f32", 1e9, 1e6, 0.08),
            Measurement("dot_f32_512_alone", "dot", "f32", 1e9, 1e6, 0.01, fit=False)]
    assert solo_speedup(pair) == pytest.approx(8.0)
    assert solo_speedup(pair[:1]) == 1.0
    cluster = _cluster()
    assert busy_speedup(cluster, 8) == 1.0
    assert busy_speedup(cluster, 2) == pytest.approx(4.0)  # n / busy
    assert busy_speedup(cluster, 1) == pytest.approx(6.0)  # capped by the measured solo speedup
    faster = with_busy_devices(cluster, 2)
    assert faster.devices[0].flops_for("f32") == pytest.approx(4 * cluster.devices[0].flops_for("f32"))
    assert with_busy_devices(cluster, 8) is cluster


def test_host_devices_solo_speedup_is_at_most_devices_per_core() -> None:
    """A host device runs a step on about one thread: 8 devices on 2 cores are priced at most 4x
    faster alone, whatever the largest matmul (which spreads over every core) measured; an
    accelerator keeps its measured figure."""
    cal = _calibration(8)
    largest = max((k for k in cal.kernels if k.kind == "dot" and k.dtype == "f32"), key=lambda k: k.flops)
    alone = Measurement(f"{largest.name}_alone", "dot", "f32", largest.flops, largest.bytes_accessed,
                        largest.seconds / 10, fit=False)
    timed = dataclasses.replace(cal, kernels=tuple(cal.kernels) + (alone,), cores=2)
    assert solo_speedup(timed.kernels) == pytest.approx(10.0)
    assert timed.solo_speedup == pytest.approx(4.0)
    assert calibrated_cluster(timed).measured.solo_speedup == pytest.approx(4.0)
    assert timed.figures()["solo speedup of the largest matmul"] == pytest.approx(10.0)
    assert dataclasses.replace(timed, backend="gpu").solo_speedup == pytest.approx(10.0)
    assert dataclasses.replace(timed, cores=0).solo_speedup == pytest.approx(10.0)  # cores unknown
    assert dataclasses.replace(timed, cores=16).solo_speedup == 1.0  # a core or more per device


def test_the_estimate_adds_dispatch_and_kernel_launches(cap_of) -> None:
    import hlomap
    from hlomap.cost.estimate import kernel_count, launched_kernels
    from hlomap.cost.sharding import ShardedGraph
    from hlomap.plan import reference_plan
    from hlomap.propagation.graph import FactorGraph

    cap = cap_of("gpt-tiny")
    table = dataclasses.replace(TABLE, solo_speedup=1.0)
    plain_table = dataclasses.replace(table, dispatch_seconds=0.0, kernel_seconds=0.0)
    for mesh in ({"data": 1}, {"data": 8}):
        with_costs = hlomap.estimate(cap, "dp", mesh=mesh, cluster=_cluster(table))
        plain = hlomap.estimate(cap, "dp", mesh=mesh, cluster=_cluster(plain_table))
        assert with_costs.dispatch_seconds == pytest.approx(20e-6)
        kernels = (with_costs.compute_seconds - plain.compute_seconds) / 10e-6
        assert kernels > 10 and abs(kernels - round(kernels)) < 1e-6  # a whole number of launched kernels
        assert with_costs.step_seconds == pytest.approx(plain.step_seconds + 20e-6 + kernels * 10e-6)
        graph = FactorGraph.from_capture(cap)
        assert round(kernels) == kernel_count(ShardedGraph.build(graph, *reference_plan(graph, "dp", mesh)))
        if mesh["data"] == 1:
            # the count a calibration divides its launch samples by is the count the estimate charges
            assert round(kernels) == launched_kernels(cap)
        else:  # the weight gradients' transposes run after their all-reduce, each a kernel of its own
            assert round(kernels) > launched_kernels(cap)


def test_an_executor_for_an_spmd_plan_is_refused(cap_of) -> None:
    import hlomap
    from hlomap.api import InputError

    with pytest.raises(InputError, match="executors run pipelines"):
        hlomap.estimate(cap_of("gpt-tiny"), "dp", mesh=8, cluster=_cluster(), executor="mpmd")


def test_pipeline_simulation_adds_its_executor(cap_of) -> None:
    import hlomap
    from hlomap.api import InputError, simulate_plan

    cap = cap_of("haiku-mlp")
    cluster = _cluster()
    plan = hlomap.explore(cap, task="pipeline", cluster=cluster, agent="dp", stages=2, microbatches=2,
                          schedule="gpipe")
    spmd = simulate_plan(cap, plan, cluster=cluster, executor="spmd")
    mpmd = simulate_plan(cap, plan, cluster=cluster, executor="mpmd")
    assert spmd.executor == "spmd" and spmd.executor_seconds == pytest.approx(5e-3 + 3 * 0.5e-3)
    assert mpmd.executor_seconds == pytest.approx(2e-3 + 4 * 1.5e-3)
    # the mpmd executor runs the event simulator's schedule, the spmd one its lockstep ticks
    # (`costs.lockstep_latency`), which never overlap the stages more than the schedule does
    assert mpmd.step_seconds == pytest.approx(mpmd.estimate.placed.length + mpmd.executor_seconds)
    assert spmd.step_seconds == pytest.approx(spmd.lockstep_seconds + spmd.executor_seconds)
    assert spmd.lockstep_seconds >= spmd.estimate.placed.length
    assert simulate_plan(cap, plan, cluster=cluster).executor == "spmd"  # GPipe, stages alike: the runner's choice
    one_f_one_b = hlomap.explore(cap, task="pipeline", cluster=cluster, agent="dp", stages=2, microbatches=2,
                                 schedule="1f1b")
    with pytest.raises(InputError, match="schedule 1f1b needs the mpmd executor"):
        simulate_plan(cap, one_f_one_b, cluster=cluster, executor="spmd")


def test_the_pipeline_explorer_prices_a_plan_on_some_devices_as_simulate_does(cap_of) -> None:
    """A pipeline plan that leaves devices idle computes faster on devices that share hardware;
    `simulate` priced it so and the explorer at the all-busy rate (gpt-tiny on two stages of two
    of 8 CPU devices: 37.7 ms in the plan file, 27.7 ms by `simulate`, 29.2 ms measured)."""
    import hlomap
    from hlomap.api import simulate_plan
    from hlomap.cost.cluster import busy_speedup

    cap, cluster = cap_of("gpt-tiny"), _cluster()
    for schedule, executor in (("1f1b", "mpmd"), ("gpipe", "spmd")):
        result = hlomap.api.explore_pipeline_detailed(cap, cluster=cluster, agent="dp", stages=2, microbatches=4,
                                                      schedule=schedule).result
        used = {d for stage in result.plan.stages for d in stage.devices}
        assert len(used) < cluster.n_devices and busy_speedup(cluster, len(used)) > 1  # the case at hand
        plan = hlomap.explore(cap, task="pipeline", cluster=cluster, agent="dp", stages=2, microbatches=4,
                              schedule=schedule)
        simulated = simulate_plan(cap, plan, cluster=cluster)
        assert result.executor == simulated.executor == executor
        assert result.step_seconds == pytest.approx(simulated.step_seconds, rel=1e-9)
        assert plan.estimate["step_seconds"] == pytest.approx(simulated.step_seconds, rel=1e-9)


def test_a_pipeline_and_a_joint_plan_on_the_spmd_executor_pay_for_its_hand_back(cap_of) -> None:
    """Where the calibration timed the spmd executor's hand-back, simulate, the pipeline
    explorer and the joint model each add the step's state leaves x devices per stage x its cost
    per buffer, the same figure; the mpmd executor's price does not change."""
    import hlomap
    from hlomap.api import simulate_plan
    from hlomap.cost.estimate import state_leaves
    from hlomap.cost.pipeline.stages import Schedule
    from hlomap.tasks.joint.costs import StageOption
    from hlomap.tasks.joint.plans import JointPlan, JointStage, evaluate

    cap = cap_of("gpt-tiny")
    plain, handing = _cluster(), _cluster(dataclasses.replace(TABLE, executor_buffers={"spmd": 10e-6}))
    plan = hlomap.explore(cap, task="pipeline", cluster=plain, agent="dp", stages=2, microbatches=2, schedule="gpipe")
    hand_back = state_leaves(cap) * 4 * 10e-6  # two stages of four devices
    assert state_leaves(cap) == 109
    for executor, extra in (("spmd", hand_back), ("mpmd", 0.0)):
        before = simulate_plan(cap, plan, cluster=plain, executor=executor).executor_seconds
        after = simulate_plan(cap, plan, cluster=handing, executor=executor).executor_seconds
        assert after - before == pytest.approx(extra), executor
    explored = [hlomap.api.explore_pipeline_detailed(cap, cluster=c, agent="dp", stages=2, microbatches=2,
                                                     schedule="gpipe").result for c in (plain, handing)]
    assert explored[0].plan == explored[1].plan and explored[1].executor == "spmd"
    assert explored[1].step_seconds - explored[0].step_seconds == pytest.approx(hand_back)
    model = hlomap.api.explore_auto_detailed(cap, cluster=handing).result.model
    half = model.n_layers // 2
    alike = JointPlan((JointStage.of(0, half, 0, StageOption(4, 4, 1)),
                       JointStage.of(half, model.n_layers, 4, StageOption(4, 4, 1))), 2, Schedule.GPIPE)
    assert evaluate(model, alike).executor_seconds == pytest.approx(5e-3 + 3 * 0.5e-3 + hand_back)


def test_the_joint_cost_includes_its_executor_and_one_stage_runs_as_spmd(cap_of) -> None:
    import hlomap
    from hlomap.cost.pipeline.stages import Schedule
    from hlomap.tasks.joint.costs import StageOption
    from hlomap.tasks.joint.plans import JointPlan, JointStage, evaluate, joint_executor

    cap = cap_of("haiku-mlp")
    cluster = _cluster()
    found = hlomap.api.explore_auto_detailed(cap, cluster=cluster)
    model = found.result.model
    half = model.n_layers // 2
    option = StageOption(4, 4, 1)
    two = JointPlan((JointStage.of(0, half, 0, option), JointStage.of(half, model.n_layers, 4, option)), 2,
                    Schedule.ONE_F_ONE_B)
    cost = evaluate(model, two)
    assert joint_executor(two) == "mpmd"
    assert cost.executor_seconds == pytest.approx(executor_overhead(cluster, "mpmd", 2, 2))
    one = JointPlan((JointStage.of(0, model.n_layers, 0, StageOption(8, 8, 1)),), 1, Schedule.ONE_F_ONE_B)
    assert evaluate(model, one).executor_seconds == pytest.approx(TABLE.dispatch_seconds)  # one program
    # the pick of one stage and one microbatch is written as an ordinary SPMD plan on its mesh
    # (the joint planner's own plan: auto may refine it, here into the step on one device)
    written = found.joint if found.joint is not None else found.plan
    if found.result.plan.n_stages == 1 and found.result.plan.microbatches == 1:
        assert written.pipeline is None and written.mesh_shape
        assert hlomap.estimate(cap, written, cluster=cluster).step_seconds > 0
    else:
        assert written.pipeline is not None


def test_the_joint_report_s_l_line_separates_the_executor_s_own_cost(cap_of) -> None:
    """`L` is the schedule's, then the executor's own cost and their sum: the line agrees with
    the executor line `simulate` prints under it (it printed the sum as the event timeline's)."""
    import hlomap
    from rich.console import Console

    from hlomap.cost.pipeline.stages import Schedule
    from hlomap.report.joint import format_joint_result
    from hlomap.report.units import human_seconds
    from hlomap.tasks.joint.costs import StageOption
    from hlomap.tasks.joint.plans import JointPlan, JointStage, evaluate

    found = hlomap.api.explore_auto_detailed(cap_of("haiku-mlp"), cluster=_cluster()).result
    model = found.model
    half = model.n_layers // 2
    two = JointPlan((JointStage.of(0, half, 0, StageOption(4, 4, 1)),
                     JointStage.of(half, model.n_layers, 4, StageOption(4, 4, 1))), 2, Schedule.ONE_F_ONE_B)
    cost = evaluate(model, two)
    console = Console(record=True, width=300)
    console.print(format_joint_result(dataclasses.replace(found, plan=two, cost=cost)))
    line = next(line for line in console.export_text().splitlines() if line.startswith("L = "))
    assert cost.executor_seconds > 0
    assert line.startswith(f"L = {human_seconds(cost.latency - cost.executor_seconds)} per step (closed form) + "
                           f"{human_seconds(cost.executor_seconds)} of the executor's own = "
                           f"{human_seconds(cost.latency)}; bottleneck")


def test_each_buffer_of_the_combined_gradient_all_reduce_adds_its_measured_cost(cap_of) -> None:
    import hlomap

    cap = cap_of("gpt-tiny")
    base = dataclasses.replace(TABLE, solo_speedup=1.0)
    one = hlomap.estimate(cap, "dp", mesh={"data": 8}, cluster=_cluster(base))
    per_buffer = hlomap.estimate(cap, "dp", mesh={"data": 8},
                                 cluster=_cluster(dataclasses.replace(base, combined_operand_seconds=1e-3)))
    buffers = sum(1 for c in one.collectives if c.reason.value == "gradient sync")
    assert buffers > 10
    assert per_buffer.communication_seconds - one.communication_seconds == pytest.approx((buffers - 1) * 1e-3)


def test_the_per_buffer_cost_scales_with_the_groups_all_reduce_latency() -> None:
    from hlomap.cost.estimate import per_buffer_seconds

    cluster = _cluster(dataclasses.replace(TABLE, combined_operand_seconds=300e-6))
    assert per_buffer_seconds(cluster, 8) == pytest.approx(300e-6)
    assert per_buffer_seconds(cluster, 2) == pytest.approx(300e-6 * 100e-6 / 400e-6)  # the 2-device latency
    assert per_buffer_seconds(cluster, 1) == 0.0
    assert per_buffer_seconds(_cluster(None), 8) == 0.0


def test_the_per_buffer_cost_timed_per_group_size_is_read_and_interpolated_in_group_minus_one() -> None:
    from hlomap.cost.estimate import per_buffer_seconds

    timed = dataclasses.replace(TABLE, combined_operand_seconds=140e-6,
                                combined_operands={2: 20e-6, 4: 60e-6, 8: 140e-6})
    cluster = _cluster(timed)
    assert per_buffer_seconds(cluster, 2) == pytest.approx(20e-6)  # as timed, not the latency ratio
    assert per_buffer_seconds(cluster, 4) == pytest.approx(60e-6)
    assert per_buffer_seconds(cluster, 6) == pytest.approx(100e-6)  # between 4 and 8
    assert per_buffer_seconds(cluster, 16) == pytest.approx(140e-6 * 15 / 7)  # beyond: (g - 1) from 8
    assert dataclasses.replace(timed, combined_operands={8: 140e-6}).per_buffer(2) == pytest.approx(20e-6)
    assert per_buffer_seconds(cluster, 1) == 0.0
    assert MeasuredCosts.from_json(timed.to_json()) == timed
    with pytest.raises(MeasuredCostsError, match=r"combined_operands\[0\]"):
        MeasuredCosts.from_json(timed.to_json() | {"combined_operands": [{"group": 2}]})
    with pytest.raises(MeasuredCostsError, match="group must be >= 2"):
        MeasuredCosts.from_json(timed.to_json() | {"combined_operands": [{"group": 1, "seconds": 1e-6}]})


def test_the_calibration_fits_the_combined_all_reduce_per_group_size() -> None:
    from hlomap.cost.calibration import COMBINED, CommSample

    cal = _calibration(8)
    per_buffer = {2: 20e-6, 4: 60e-6, 8: 140e-6}
    samples = [CommSample(COMBINED, g, float(n), 100e-6 + n * t) for g, t in per_buffer.items() for n in (1, 8, 32)]
    cluster = calibrated_cluster(dataclasses.replace(cal, comm=tuple(cal.comm) + tuple(samples)))
    assert cluster.measured is not None
    assert cluster.measured.combined_operands == pytest.approx(per_buffer)
    assert cluster.measured.combined_operand_seconds == pytest.approx(140e-6)  # over all the devices


def test_alone_curves_pair_each_kernel_alone_with_its_twin_and_never_fall() -> None:
    """Kernels timed alone are paired by name with their all-busy twins; a curve's point above a
    larger size's speedup takes that one (the smallest samples time the programs' start); the
    solo speedup is the largest matmul's, not the largest ratio."""
    from hlomap.cost.calibration import alone_curves

    def pair(name: str, kind: str, size: float, busy: float, alone: float) -> list[Measurement]:
        flops, nbytes = (size, 1e3) if kind == "dot" else (1e3, size)
        return [Measurement(name, kind, "f32", flops, nbytes, busy),
                Measurement(f"{name}_alone", kind, "f32", flops, nbytes, alone, fit=False)]

    kernels = (pair("dot_f32_64", "dot", 5e5, 0.25e-3, 0.05e-3)  # 5x: above the larger ones
               + pair("dot_f32_128", "dot", 4e6, 0.4e-3, 0.1e-3) + pair("dot_f32_512", "dot", 2.7e8, 12e-3, 1.5e-3)
               + pair("elementwise_f32_4096", "elementwise", 3.2e4, 225e-6, 9e-6)
               + pair("elementwise_f32_16384", "elementwise", 1.3e5, 165e-6, 35e-6)
               + pair("elementwise_f32_1048576", "elementwise", 8.4e6, 3.4e-3, 0.19e-3)
               + [Measurement("elementwise_f32_99", "elementwise", "f32", 1e3, 1e3, 1e-6)])  # no twin
    dot, memory = alone_curves(kernels)
    assert [n for n, _ in dot] == [5e5, 4e6, 2.7e8]
    assert [x for _, x in dot] == pytest.approx([4.0, 4.0, 8.0])
    assert [n for n, _ in memory] == [3.2e4, 1.3e5, 8.4e6]
    assert memory[0][1] == pytest.approx(165 / 35) and memory[1][1] == pytest.approx(165 / 35)
    assert memory[2][1] == pytest.approx(3.4 / 0.19)
    assert solo_speedup(kernels) == pytest.approx(8.0)
    # a calibration carries them to its cluster
    cal = dataclasses.replace(_calibration(8), kernels=tuple(_calibration(8).kernels) + tuple(kernels[-7:-1]), cores=2)
    measured = calibrated_cluster(cal).measured
    assert measured.alone_memory == memory and measured.prices_alone == bool(measured.alone_dot)
