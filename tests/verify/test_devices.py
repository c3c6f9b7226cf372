"""The microbenchmarks of `hlomap calibrate`: which groups they cover and what each sample records
(sizes tiny: these check the bookkeeping, not the figures)."""

from __future__ import annotations

import pytest

from hlomap.cost.calibration import CalibrationError, alone_curves
from hlomap.verify.devices import (
    ACCELERATOR_PLAN,
    DEFAULT_PLAN,
    QUICK_PLAN,
    BenchPlan,
    BenchProgress,
    collective_group_sizes,
    default_plan,
    measure_devices,
)

TINY = BenchPlan(matmul_sizes=(8, 16), dtypes=("f32",), memory_sizes=(64, 256), message_sizes=(16, 64),
                 repeats=1, dispatch_repeats=2, narrow_dot_widths=(4,), narrow_conv_widths=(1, 2), conv_images=1,
                 conv_side=4, oversized_conv_widths=(3,))


def test_group_sizes_double_up_to_the_device_count() -> None:
    assert collective_group_sizes(1) == ()
    assert collective_group_sizes(2) == (2,)
    assert collective_group_sizes(8) == (2, 4, 8)
    assert collective_group_sizes(6) == (2, 4, 6)


def test_measure_devices_records_every_sample_with_progress() -> None:
    seen: list[BenchProgress] = []
    cal = measure_devices(4, plan=TINY, on_progress=seen.append)
    assert cal.n_devices == 4 and cal.backend == "cpu" and cal.measured_at
    curve = [(k.kind, k.flops) for k in cal.kernels if k.kind == "dot" and k.fit and not k.width]
    assert curve == [("dot", 2.0 * 8**3), ("dot", 2.0 * 16**3)]
    # narrow products, recorded with their narrowest side: a 16 x 16 by 16 x 4 dot, 3x3
    # convolutions of 1 and 2 channels over one 4 x 4 image (SAME: 10 x 10 valid window pairs), and
    # one of 3 channels over one 2 x 2 image, which its window reaches past (4 x 4 valid pairs)
    narrow = [(k.kind, k.width, k.flops) for k in cal.kernels if k.width]
    assert narrow == [("dot", 4, 2.0 * 16 * 16 * 4), ("convolution", 1, 2.0 * 100), ("convolution", 2, 2.0 * 100 * 4),
                      ("oversized-convolution", 3, 2.0 * 16 * 9)]
    # every f32 matmul and memory-bound op again on one device alone, kept out of the fits and
    # paired with its all-busy twin in the alone curves
    assert [k.name for k in cal.kernels if not k.fit] == ["dot_f32_8_alone", "dot_f32_16_alone",
                                                           "elementwise_f32_64_alone", "elementwise_f32_256_alone"]
    assert cal.figures()["solo speedup"] >= 1.0
    dot, memory = alone_curves(cal.kernels)
    assert [flops for flops, _ in dot] == [2.0 * 8**3, 2.0 * 16**3]
    assert [nbytes for nbytes, _ in memory] == [8.0 * 64, 8.0 * 256]
    # train steps of 2, 16 and 64 tiny layers on every device: their "bytes" are hlomap's count of
    # their kernels, the same number for every layer added (forward, backward and update)
    k2, k16, k64 = sorted(s.nbytes for s in cal.comm if s.kind == "launch")
    assert k2 > 0 and (k16 - k2) / 14 == (k64 - k16) / 48 >= 4
    assert {s.group for s in cal.comm if s.kind == "launch"} == {4}
    # one all-reduce of 1, 8 and 32 buffers over 2 and over 4 devices: their "bytes" count buffers
    assert sorted((s.group, s.nbytes) for s in cal.comm if s.kind == "combined-all-reduce") == [
        (g, n) for g in (2, 4) for n in (1.0, 8.0, 32.0)]
    groups = {(s.kind, s.group) for s in cal.comm}
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
        assert {(kind, 2), (kind, 4)} <= groups
    assert ("transfer", 2) in groups and ("dispatch", 1) in groups
    # all-gather is priced by its full (gathered) buffer, the others by each device's buffer
    assert {s.nbytes for s in cal.comm if s.kind == "all-gather" and s.group == 4} == {4 * 16 * 4, 4 * 64 * 4}
    assert {s.nbytes for s in cal.comm if s.kind == "all-reduce" and s.group == 4} == {16 * 4, 64 * 4}
    assert [p.done for p in seen] == list(range(1, len(seen) + 1)) and seen[-1].fraction == 1
    # the compute samples were timed in 3 passes, and each is recorded once
    assert TINY.kernel_passes == 3
    assert [p.label for p in seen].count("matmul f32 16x16 (pass 3 of 3)") == 1
    assert len({k.name for k in cal.kernels}) == len(cal.kernels)


def test_samples_keep_the_median_of_interleaved_passes() -> None:
    """Every probe is prepared once, timed once per pass (passes one after another, the probes in
    order within each), and its sample is the median of its passes: a burst in one pass is
    outvoted. A probe that cannot be prepared is left out."""
    from hlomap.cost.calibration import Measurement
    from hlomap.verify.devices import Probe, interleaved_passes

    runs: list[str] = []
    prepared: list[str] = []
    # per probe, its passes' times: "b" has a burst in its second pass
    times = {"a": iter([1.0, 1.2, 1.1]), "b": iter([2.0, 9.0, 2.2])}

    def probe(name: str) -> Probe[Measurement]:
        prepared.append(name)

        def run() -> float:
            runs.append(name)
            return next(times[name])

        return Probe(run, lambda seconds: Measurement(name, "dot", "f32", 1.0, 1.0, seconds))

    def timer(run, repeats: int) -> float:  # the fake clock: each run says its own time
        assert repeats == 5
        return run()

    tasks = interleaved_passes([("a", lambda: probe("a")), ("b", lambda: probe("b")), ("c", lambda: None)], 3,
                               5, timer)
    assert [label for label, _ in tasks] == [f"{n} (pass {p} of 3)" for p in (1, 2, 3) for n in ("a", "b", "c")]
    results = [task() for _, task in tasks]
    assert runs == ["a", "b"] * 3 and prepared == ["a", "b"]
    assert results[:6] == [None] * 6 and results[8] is None
    assert [(m.name, m.seconds) for m in results[6:8]] == [("a", 1.1), ("b", 2.2)]
    # one pass: the plain labels, one sample each
    times.update(a=iter([3.0]))
    assert [(label, task().seconds) for label, task in interleaved_passes([("a", lambda: probe("a"))], 1, 5, timer)] \
        == [("a", 3.0)]

def test_measure_devices_refuses_more_devices_than_there_are() -> None:
    with pytest.raises(CalibrationError, match="JAX sees 8"):
        measure_devices(9, plan=TINY)


def test_extra_tasks_run_after_the_microbenchmarks_and_none_is_left_out() -> None:
    """The executor samples come in through `extra_tasks` (hlomap.run.calibrate); a task that
    returns None (an executor that refuses a shape) is left out, and progress counts it."""
    from hlomap.cost.calibration import ExecutorSample

    seen: list[BenchProgress] = []

    def extra(devices, quick, timer):
        assert len(devices) == 2 and quick is False
        return [("mpmd executor 2x1", lambda: ExecutorSample("mpmd", 2, 1, timer(lambda: None, 1))),
                ("spmd executor 2x1", lambda: None)]

    cal = measure_devices(2, plan=TINY, on_progress=seen.append, extra_tasks=extra)
    assert [(e.executor, e.stages, e.microbatches) for e in cal.executors] == [("mpmd", 2, 1)]
    assert seen[-1].label == "spmd executor 2x1" and seen[-1].fraction == 1


def test_accelerators_are_timed_on_sizes_that_reach_their_peak() -> None:
    # an accelerator's matmuls saturate only at sides of thousands, its bandwidth beyond its caches
    assert default_plan("cpu") is DEFAULT_PLAN and default_plan("gpu") is ACCELERATOR_PLAN
    assert default_plan("tpu") is ACCELERATOR_PLAN and default_plan("gpu", quick=True) is QUICK_PLAN
    assert max(ACCELERATOR_PLAN.matmul_sizes) >= 8192 > max(DEFAULT_PLAN.matmul_sizes)
    assert max(ACCELERATOR_PLAN.memory_sizes) * 4 >= 2**29  # 512 MiB per device, past any L2


def test_a_calibration_too_large_for_host_memory_is_refused_before_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    from hlomap.verify import devices

    # the largest all-gather dominates: 8 devices each receiving 8 messages of the largest size
    assert devices.host_bytes_needed(DEFAULT_PLAN, 8) == 8 * 8 * max(DEFAULT_PLAN.message_sizes) * 4.0
    monkeypatch.setattr(devices, "_free_host_bytes", lambda: 2.0**20)
    seen: list[BenchProgress] = []
    with pytest.raises(CalibrationError, match=r"calibrating 4 host CPU devices needs about .* GiB are free: "
                                               r"measure fewer devices, or run the quick calibration \(--quick\)$"):
        measure_devices(4, plan=DEFAULT_PLAN, on_progress=seen.append)
    assert not seen  # nothing was measured
    # the quick calibration itself is not told to run the quick calibration
    with pytest.raises(CalibrationError, match=r"GiB are free: measure fewer devices$"):
        measure_devices(4, plan=QUICK_PLAN, on_progress=seen.append)


def test_one_device_times_its_pipeline_executors_on_one_stage() -> None:
    """One device runs joint plans of one stage and several microbatches on the mpmd executor, so
    a calibration of one device times the executors on one stage (it timed nothing: such a plan
    was priced as free of dispatches, and on an H200 one of 256 microbatches ran 600x its price).
    The samples are real runs of the near-empty model; their values are not asserted."""
    import jax

    from hlomap.cost.calibration import HandBackSample, fit_executors
    from hlomap.run.calibrate import executor_tasks

    tasks = executor_tasks(jax.devices()[:1], quick=True, median_seconds=lambda call, repeats: (call(), 1e-3)[1])
    assert [label for label, _ in tasks] == ["spmd executor 1x2", "mpmd executor 1x2", "spmd executor 1x4",
                                             "mpmd executor 1x4",
                                             "mpmd executor 1x2, 16 more parameters per layer",
                                             "spmd executor's hand-back of the state over 1 stage",
                                             "spmd executor's hand-back of the state over 1 stage, 16 more parameters "
                                             "per layer"]
    measured = [sample for _, measure in tasks if (sample := measure()) is not None]
    samples = [s for s in measured if not isinstance(s, HandBackSample)]
    assert {(s.executor, s.stages, s.microbatches) for s in samples} >= {("mpmd", 1, 2), ("mpmd", 1, 4)}
    assert "mpmd" in fit_executors(samples)
    # the many-buffer variant moves more buffers per microbatch, counted as the model counts them
    counts = sorted({s.buffers for s in samples if s.executor == "mpmd"})
    assert len(counts) == 2 and counts[1] > 5 * counts[0]
    assert all(s.stage_devices == 1.0 for s in samples)
    # the hand-back of the state timed on both models: 8 weights, then 8 + 8 x 16 (SGD keeps none)
    hand_backs = [s for s in measured if isinstance(s, HandBackSample)]
    assert sorted(s.leaves for s in hand_backs) == [8.0, 136.0] and {s.stage_devices for s in hand_backs} == {1.0}
