"""`hlomap calibrate --check`: a calibration's compute samples timed again, matched by name and
set against their calibrated times (`hlomap.verify.recheck`)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from hlomap.cost.calibration import DISPATCH, LAUNCH, CalibrationError, ClusterCalibration, CommSample, Measurement
from hlomap.verify.devices import DEFAULT_PLAN, QUICK_PLAN, BenchPlan
from hlomap.verify.recheck import STALE_RATIO, recheck, reference_plan


def _calibration(kernels: tuple[Measurement, ...], comm: tuple[CommSample, ...] = (),
                 backend: str = "cpu") -> ClusterCalibration:
    return ClusterCalibration(backend, "cpu", 4, 2**30, kernels, comm, measured_at="2026-11-29T00:00:00+00:00")


THEN = _calibration(
    (Measurement("dot_f32_512", "dot", "f32", 2.0 * 512**3, 3e6, 0.010),
     Measurement("dot_f32_512_alone", "dot", "f32", 2.0 * 512**3, 3e6, 0.002, fit=False),
     Measurement("dot_f32_512x512x8", "dot", "f32", 2.0 * 512 * 512 * 8, 1e6, 0.001, width=8),
     Measurement("elementwise_f32_4096", "elementwise", "f32", 8192.0, 32768.0, 1e-4),
     Measurement("elementwise_f32_65536", "elementwise", "f32", 131072.0, 524288.0, 4e-4)),
    (CommSample(LAUNCH, 4, 110.0, 1e-3), CommSample(DISPATCH, 1, 0.0, 1e-5),
     CommSample("all-reduce", 4, 1024.0, 1e-4)))


def _now(factors: dict[str, float]):  # type: ignore[no-untyped-def]
    """A `measure` that returns THEN's samples, each `factors[name]` (default 1) times slower,
    with one sample THEN does not hold; it records what it was asked to time."""
    asked: list[tuple[int, BenchPlan]] = []

    def measure(count: int, plan: BenchPlan, on_progress):  # type: ignore[no-untyped-def]
        asked.append((count, plan))
        kernels = tuple(dataclasses.replace(m, seconds=m.seconds * factors.get(m.name, 1.0)) for m in THEN.kernels)
        comm = tuple(dataclasses.replace(s, seconds=s.seconds * factors.get(s.kind, 1.0)) for s in THEN.comm
                     if s.kind in (LAUNCH, DISPATCH))
        extra = Measurement("dot_f32_64", "dot", "f32", 2.0 * 64**3, 5e4, 1.0)
        return dataclasses.replace(THEN, kernels=(*kernels, extra), comm=comm, load_average=(0.5, 0.7))

    return measure, asked


def test_a_check_times_the_compute_samples_again_without_collectives() -> None:
    plan = reference_plan(THEN)
    assert plan.message_sizes == () and plan.combined_buffers == ()
    # otherwise the plan that made the calibration: the same samples in the same passes
    assert plan.matmul_sizes == DEFAULT_PLAN.matmul_sizes and plan.memory_sizes == DEFAULT_PLAN.memory_sizes
    assert plan.kernel_passes == DEFAULT_PLAN.kernel_passes and plan.launch_layers == DEFAULT_PLAN.launch_layers
    side = max(QUICK_PLAN.matmul_sizes)
    quick = _calibration((Measurement(f"dot_f32_{side}", "dot", "f32", 2.0 * side**3, 1e5, 1e-3),))
    assert reference_plan(quick).matmul_sizes == QUICK_PLAN.matmul_sizes


def test_each_sample_held_then_and_now_drifts_by_its_ratio() -> None:
    measure, asked = _now({"dot_f32_512": 1.5, "elementwise_f32_4096": 0.5, LAUNCH: 2.0})
    check = recheck(THEN, measure=measure)
    assert asked[0][0] == 4  # the calibration's device count
    by_label = {d.label: d for d in check.drifts}
    assert "dot_f32_64" not in by_label  # not in the calibration: nothing to compare
    assert by_label["dot_f32_512"].ratio == pytest.approx(1.5)
    assert by_label["launch step of 110 kernels"].ratio == pytest.approx(2.0)
    assert by_label["dispatch"].ratio == pytest.approx(1.0)
    assert len(check.drifts) == 7 and check.load_average == 0.5 and check.measured_at == THEN.measured_at
    assert check.speed_ratio == pytest.approx(math.exp((math.log(1.5) + math.log(0.5) + math.log(2.0)) / 7))
    groups = {g.group: g for g in check.groups()}
    assert [g.group for g in check.groups()] == ["matmul", "matmul alone", "narrow product", "memory-bound op",
                                                 "kernel-launch step", "dispatch"]
    assert groups["memory-bound op"].samples == 2 and groups["memory-bound op"].ratio == pytest.approx(math.sqrt(0.5))
    assert (groups["memory-bound op"].lowest, groups["memory-bound op"].highest) == (pytest.approx(0.5), 1.0)
    assert not check.stale


@pytest.mark.parametrize("factor, stale", [(1.0, False), (STALE_RATIO * 0.99, False), (STALE_RATIO * 1.01, True),
                                           (1 / (STALE_RATIO * 1.01), True)])
def test_a_calibration_is_stale_past_the_ratio_either_way(factor: float, stale: bool) -> None:
    names = [m.name for m in THEN.kernels] + [LAUNCH, DISPATCH]
    measure, _ = _now({name: factor for name in names})
    check = recheck(THEN, measure=measure)
    assert check.speed_ratio == pytest.approx(factor) and check.stale is stale


def test_a_check_refuses_another_backend_and_a_calibration_it_cannot_match() -> None:
    measure, asked = _now({})
    with pytest.raises(CalibrationError, match="measured gpu devices; JAX runs on cpu"):
        recheck(dataclasses.replace(THEN, backend="gpu"), measure=measure)
    assert not asked  # refused before timing anything
    foreign = dataclasses.replace(THEN, kernels=(Measurement("mystery", "dot", "f32", 2.0, 1.0, 1.0),), comm=())
    with pytest.raises(CalibrationError, match="none of the calibration's samples"):
        recheck(foreign, measure=lambda count, plan, on_progress: dataclasses.replace(THEN, comm=()))
    # without matmuls, the launch and dispatch alone would say nothing of what prices a plan's compute
    memory_only = dataclasses.replace(THEN, kernels=tuple(m for m in THEN.kernels if not m.matrix))
    with pytest.raises(CalibrationError, match="holds no matmul samples"):
        recheck(memory_only, measure=measure)
    assert not asked


def test_check_calibration_names_the_file_that_cannot_be_checked(tmp_path: Path) -> None:
    from hlomap import api

    with pytest.raises(api.InputError, match=r"nope\.json: no such file"):
        api.check_calibration(tmp_path / "nope.json")
    hand = tmp_path / "hand.json"
    hand.write_text(json.dumps(api.load_cluster("hier:1x2@V100-16GB").to_json()))
    with pytest.raises(api.InputError, match=r"hand\.json: no 'calibration' object, so nothing measured to time "
                                             r"again: only the cluster files hlomap calibrate writes hold one"):
        api.check_calibration(hand)
    with pytest.raises(api.InputError, match=r": a folder, not a cluster file"):
        api.check_calibration(tmp_path)
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(api.InputError, match=r"broken\.json: cannot read a cluster file"):
        api.check_calibration(broken)
    with pytest.raises(api.InputError, match=r"^A: a datasheet model \(a preset or a topology string\), which holds "
                                             r"no calibration to time again"):
        api.check_calibration("A")
    with pytest.raises(api.InputError, match=r"expected 'local' or the path of a cluster file hlomap calibrate "
                                             r"wrote, not a Cluster"):
        api.check_calibration(api.load_cluster("hier:1x2@V100-16GB"))  # type: ignore[arg-type]


def test_read_calibration_refuses_a_file_edited_out_of_step_with_its_calibration(tmp_path: Path) -> None:
    from hlomap import api
    from hlomap.cost.calibration import calibrated_cluster_json

    kernels = (*THEN.kernels, *(Measurement(f"copy_{n}", "copy", "f32", 0.0, n, 1e-6 + n / 2e10) for n in (1e4, 1e6)))
    calibration = dataclasses.replace(THEN, kernels=kernels, comm=(
        *THEN.comm, CommSample("collective-permute", 4, 1e3, 1e-5), CommSample("collective-permute", 4, 1e6, 1e-3)))
    data = calibrated_cluster_json(calibration)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(data))
    assert api.read_calibration(path)[1].n_devices == 4
    path.write_text(json.dumps({**data, "devices": data["devices"][:2]}))
    with pytest.raises(api.InputError, match=r"cluster\.json: its cluster has 2 devices but its calibration "
                                             r"measured 4: the file was edited"):
        api.read_calibration(path)
    for version, needle in ((99, "99; this hlomap reads calibrations of versions 1 to"), ("x", "'x'")):
        path.write_text(json.dumps({**data, "calibration": {**data["calibration"], "version": version}}))
        with pytest.raises(api.InputError, match=rf"calibration\.version: {needle}"):
            api.read_calibration(path)
    path.write_text(json.dumps({**data, "calibration": {**data["calibration"], "memory_bytes": -1}}))
    with pytest.raises(api.InputError, match=r"calibration: memory_bytes = -1\.0 must be finite and positive"):
        api.read_calibration(path)
