"""Whole-cluster calibration (`hlomap calibrate`): the fits recover known figures from synthetic
samples, and the calibrated cluster file loads as an ordinary cluster."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hlomap.cost.calibration import (
    CLUSTER_CALIBRATION_KEY,
    DISPATCH,
    TRANSFER,
    CalibrationError,
    ClusterCalibration,
    CommSample,
    Measurement,
    calibrated_cluster,
    calibrated_cluster_json,
    fit_alpha_beta,
    fit_comm,
    fit_matmul_curves,
    fit_memory_bandwidth,
)
from hlomap.cost.cluster import Cluster, load_cluster

SIZES = [2.0**k for k in range(10, 24, 2)]


def _noisy(values: list[float], seed: int, spread: float = 0.0) -> list[float]:
    rng = np.random.default_rng(seed)
    return [v * (1 + spread * rng.uniform(-1, 1)) for v in values]


def test_alpha_beta_recovers_latency_and_bandwidth_exactly() -> None:
    fit = fit_alpha_beta(SIZES, [20e-6 + n / 5e9 for n in SIZES])
    assert fit.alpha == pytest.approx(20e-6, rel=1e-9)
    assert 1 / fit.beta == pytest.approx(5e9, rel=1e-9)


def test_alpha_beta_recovers_figures_through_noise() -> None:
    fit = fit_alpha_beta(SIZES * 3, _noisy([3e-6 + n / 1e10 for n in SIZES * 3], seed=0, spread=0.02))
    assert fit.alpha == pytest.approx(3e-6, rel=0.1)
    assert 1 / fit.beta == pytest.approx(1e10, rel=0.05)


def test_alpha_beta_keeps_terms_non_negative() -> None:
    """A pure bandwidth curve whose noise would give a negative intercept goes through 0; a flat
    time gets no bandwidth term."""
    through_origin = fit_alpha_beta([1e6, 2e6, 4e6], [0.9e-3, 2.0e-3, 4.0e-3])
    assert through_origin.alpha == 0 and through_origin.beta > 0
    flat = fit_alpha_beta([1e3, 1e6], [5e-6, 5e-6])
    assert flat.beta == 0 and flat.alpha == pytest.approx(5e-6)


def test_alpha_beta_refuses_no_samples() -> None:
    with pytest.raises(CalibrationError, match="non-empty"):
        fit_alpha_beta([], [])


def _matmuls(dtype: str, peak: float, overhead: float) -> list[Measurement]:
    out = []
    for n in (64, 128, 256, 512, 1024):
        flops = 2.0 * n**3
        out.append(Measurement(f"dot_{dtype}_{n}", "dot", dtype, flops, 3 * n * n * 4, overhead + flops / peak))
    return out


def test_matmul_curve_recovers_peak_overhead_and_efficiency() -> None:
    curves = fit_matmul_curves(_matmuls("f32", 1e11, 50e-6) + _matmuls("bf16", 4e11, 80e-6))
    assert [c.dtype for c in curves] == ["bf16", "f32"]
    bf16, f32 = curves
    assert f32.peak_flops == pytest.approx(1e11, rel=1e-6)
    assert f32.overhead_seconds == pytest.approx(50e-6, rel=1e-6)
    assert bf16.peak_flops == pytest.approx(4e11, rel=1e-6)
    flops = 2.0 * 128**3
    assert f32.efficiency(flops) == pytest.approx(flops / (flops + 50e-6 * 1e11))
    rates = [rate for _, rate in f32.points]
    assert rates == sorted(rates) and rates[-1] < 1e11  # a curve rising towards the peak


def test_memory_bandwidth_fit_uses_only_memory_bound_kernels() -> None:
    kernels = _matmuls("f32", 1e11, 1e-5) + [Measurement(f"copy_{n}", "copy", "f32", 0.0, n, 2e-6 + n / 2e10)
                                              for n in SIZES]
    fit = fit_memory_bandwidth(kernels)
    assert 1 / fit.beta == pytest.approx(2e10, rel=1e-6)
    with pytest.raises(CalibrationError, match="memory-bound"):
        fit_memory_bandwidth(_matmuls("f32", 1e11, 1e-5))


def _comm(kind: str, group: int, latency: float, bandwidth: float) -> list[CommSample]:
    return [CommSample(kind, group, n, latency + n / bandwidth) for n in SIZES]


def test_comm_fit_per_kind_and_group_size() -> None:
    samples = (_comm("all-reduce", 2, 10e-6, 4e9) + _comm("all-reduce", 8, 40e-6, 2e9)
               + _comm("collective-permute", 8, 5e-6, 8e9) + [CommSample(DISPATCH, 1, 0, 30e-6)] * 3)
    fits = {(f.kind, f.group): f for f in fit_comm(samples)}
    assert set(fits) == {("all-reduce", 2), ("all-reduce", 8), ("collective-permute", 8), (DISPATCH, 1)}
    assert fits["all-reduce", 2].latency == pytest.approx(10e-6, rel=1e-6)
    assert fits["all-reduce", 8].bandwidth == pytest.approx(2e9, rel=1e-6)
    assert fits["collective-permute", 8].bandwidth == pytest.approx(8e9, rel=1e-6)
    assert fits[DISPATCH, 1].latency == pytest.approx(30e-6) and math.isinf(fits[DISPATCH, 1].bandwidth)


def test_comm_sample_refuses_an_unknown_kind() -> None:
    with pytest.raises(CalibrationError, match="sample kind 'broadcast'"):
        CommSample("broadcast", 2, 1.0, 1.0)


def _calibration(n: int = 4) -> ClusterCalibration:
    kernels = (_matmuls("f32", 1e11, 50e-6) + _matmuls("bf16", 4e11, 50e-6)
               + [Measurement(f"copy_{s}", "copy", "f32", 0.0, s, 1e-6 + s / 2e10) for s in SIZES])
    comm = (_comm("collective-permute", n, 7e-6, 3e9) + _comm(TRANSFER, 2, 20e-6, 1e9)
            + [CommSample(DISPATCH, 1, 0, 25e-6)])
    return ClusterCalibration("cpu", "cpu", n, 2**30, kernels, comm, jax_version="0.0", hlomap_version="0.1.0",
                              measured_at="2026-01-01T00:00:00+00:00", wall_seconds=1.0)


def test_calibrated_cluster_maps_the_fits_onto_the_cluster() -> None:
    cal = _calibration()
    cluster = calibrated_cluster(cal)
    device = cluster.devices[0]
    assert cluster.n_devices == 4 and cluster.n_nodes == 1
    assert cluster.latency[0, 1] == pytest.approx(7e-6, rel=1e-6)
    assert cluster.bandwidth[2, 3] == pytest.approx(3e9, rel=1e-6)
    assert device.hbm_bandwidth == pytest.approx(2e10, rel=1e-6)
    largest = 2.0 * 1024**3
    # peak x efficiency is what the largest matmul of each dtype achieved
    assert device.peak_flops["f32"] * device.efficiency == pytest.approx(largest / (50e-6 + largest / 1e11))
    assert device.peak_flops["bf16"] * device.efficiency == pytest.approx(largest / (50e-6 + largest / 4e11))
    assert cal.figures()["dispatch s"] == pytest.approx(25e-6)


def test_calibrated_cluster_of_host_devices_records_the_cores_they_share() -> None:
    import dataclasses

    cal = dataclasses.replace(_calibration(), cores=2)
    assert calibrated_cluster(cal).measured.cores == 2
    assert calibrated_cluster(dataclasses.replace(cal, backend="gpu")).measured.cores == 0  # no cores shared


def test_calibrated_cluster_needs_f32_matmuls_and_links() -> None:
    cal = _calibration()
    with pytest.raises(CalibrationError, match="f32"):
        calibrated_cluster(ClusterCalibration("cpu", "cpu", 4, 1.0, [k for k in cal.kernels if k.dtype != "f32"
                                                                     or not k.matrix], cal.comm))
    with pytest.raises(CalibrationError, match="no collective-permute or transfer"):
        calibrated_cluster(ClusterCalibration("cpu", "cpu", 4, 1.0, cal.kernels, []))


def test_calibration_json_round_trips_through_load_cluster(tmp_path: Path) -> None:
    cal = _calibration()
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(calibrated_cluster_json(cal)))
    loaded = load_cluster(path)
    assert isinstance(loaded, Cluster)
    assert loaded == calibrated_cluster(cal)
    kept = json.loads(path.read_text())[CLUSTER_CALIBRATION_KEY]
    assert kept["format"] == "hlomap-cluster-calibration" and kept["n_devices"] == 4
    assert kept["device_kind"] == "cpu" and kept["jax_version"] == "0.0" and kept["hlomap_version"] == "0.1.0"
    assert len(kept["samples"]["kernels"]) == len(cal.kernels) and len(kept["samples"]["comm"]) == len(cal.comm)
    assert kept["figures"] == pytest.approx(cal.figures())


def test_the_spmd_hand_back_is_fitted_into_the_cluster_and_kept_through_json() -> None:
    """The spmd executor's hand-back samples give its cost per buffer (the slope over the
    buffers, `fit_hand_back`), beside the mpmd executor's from its steps; a calibration file of
    version 9 has none and prices no such cost."""
    import dataclasses

    from hlomap.cost.calibration import HandBackSample

    hand_backs = (HandBackSample(8.0, 4.0, 1e-3 + 8 * 4 * 16e-6), HandBackSample(136.0, 4.0, 1e-3 + 136 * 4 * 16e-6))
    cal = dataclasses.replace(_calibration(), hand_backs=hand_backs)
    assert calibrated_cluster(cal).measured.executor_buffers == {"spmd": pytest.approx(16e-6)}
    assert cal.figures()["spmd executor hand-back per buffer s"] == pytest.approx(16e-6)
    kept = calibrated_cluster_json(cal)[CLUSTER_CALIBRATION_KEY]
    again = ClusterCalibration.from_json(kept)
    assert again.hand_backs == hand_backs and calibrated_cluster(again) == calibrated_cluster(cal)
    del kept["samples"]["hand_backs"]
    assert calibrated_cluster(ClusterCalibration.from_json(kept)).measured.executor_buffers == {}


@pytest.mark.parametrize("path, value, message", [
    (("samples", "hand_backs", 0, "leaves"), "x", r"calibration\.samples\.hand_backs\[0\]\.leaves: expected a number"),
    (("samples", "comm", 0, "bytes"), "x", r"calibration\.samples\.comm\[0\]\.bytes: expected a number, got 'x'"),
    (("samples", "comm", 1, "kind"), "psum", r"calibration\.samples\.comm\[1\]: sample kind 'psum'"),
    (("samples", "comm", 1, "group"), 0, r"calibration\.samples\.comm\[1\]: .*group = 0 must be >= 1"),
    (("samples", "kernels", 2, "seconds"), None, r"calibration\.samples\.kernels\[2\]\.seconds: expected a number"),
    (("n_devices",), "4", r"calibration\.n_devices: expected a number, got '4'"),
    (("cores",), 1.5, r"calibration\.cores: expected a whole number, got 1\.5"),
    (("load_average",), 3, r"calibration\.load_average: expected a list of numbers"),
    (("samples", "comm"), {}, r"calibration\.samples\.comm: expected a list of samples, got dict"),
])
def test_a_broken_field_of_a_saved_calibration_is_named(path: tuple[Any, ...], value: Any, message: str) -> None:
    import dataclasses

    from hlomap.cost.calibration import HandBackSample

    calibration = dataclasses.replace(_calibration(), hand_backs=(HandBackSample(8.0, 4.0, 1e-3),))
    kept = calibrated_cluster_json(calibration)[CLUSTER_CALIBRATION_KEY]
    target = kept
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(CalibrationError, match=rf"^cluster\.json: {message}"):
        ClusterCalibration.from_json(kept, source="cluster.json")


def test_a_missing_field_of_a_saved_calibration_is_named() -> None:
    kept = calibrated_cluster_json(_calibration())[CLUSTER_CALIBRATION_KEY]
    del kept["samples"]["comm"][0]["group"]
    with pytest.raises(CalibrationError, match=r"calibration\.samples\.comm\[0\]: missing field 'group'"):
        ClusterCalibration.from_json(kept, source="cluster.json")
    kept = calibrated_cluster_json(_calibration())[CLUSTER_CALIBRATION_KEY]
    del kept["backend"]
    with pytest.raises(CalibrationError, match=r"calibration: missing field 'backend'"):
        ClusterCalibration.from_json(kept, source="cluster.json")


def test_the_measured_h200_is_a_device_preset_of_its_shipped_calibration() -> None:
    from hlomap.cost.calibration import ClusterCalibration
    from hlomap.cost.devices import device_preset, measured_device_path

    data = json.loads(measured_device_path("H200-measured").read_text())
    shipped = load_cluster(Cluster.from_json(data))
    preset = device_preset("h200-measured")
    assert preset.name == "H200-measured"
    assert dict(preset.peak_flops) == dict(shipped.devices[0].peak_flops)
    assert preset.hbm_bandwidth == shipped.devices[0].hbm_bandwidth
    # the file's figures are its samples' fits, not numbers typed in: refitting them agrees
    calibration = ClusterCalibration.from_json(data["calibration"])
    assert dict(calibrated_cluster(calibration).devices[0].peak_flops) == pytest.approx(dict(preset.peak_flops))
    assert calibration.backend == "gpu" and calibration.device_kind == "NVIDIA H200"
    # usable in a topology string, and such a cluster round-trips through its JSON
    cluster = load_cluster("hier:1x8@H200-measured")
    assert cluster.devices[0] == preset
    assert Cluster.from_json(json.loads(json.dumps(cluster.to_json()))).devices == cluster.devices


# -- narrow matrix products ---------------------------------------------------------------------


def _narrow(kind: str, width: int, share: float, rate: float, overhead: float, flops: float = 1e8,
            nbytes: float = 1e3) -> Measurement:
    """A narrow sample that ran at `share` of `rate` after `overhead`."""
    return Measurement(f"{kind}_{width}", kind, "f32", flops, nbytes, overhead + flops / (rate * share), width=width)


def test_narrow_curves_recover_the_measured_shares_of_the_matrix_rate() -> None:
    """Synthetic narrow samples on the `_calibration` device: each width's share of the largest
    matmul's rate comes back (the program overhead, the matmul curve's intercept, taken off),
    a dot curve ends at the reference matmul (share 1), and the cluster's device carries them."""
    cal = _calibration()
    rate = 2.0 * 1024**3 / (50e-6 + 2.0 * 1024**3 / 1e11)  # what the largest f32 matmul achieved
    conv = {1: 0.004, 4: 0.03, 8: 0.1, 16: 0.3, 32: 0.95}
    dots = {8: 0.3, 32: 0.6, 128: 0.9}
    kernels = cal.kernels + tuple(_narrow("convolution", w, e, rate, 50e-6) for w, e in conv.items()) \
        + tuple(_narrow("dot", w, e, rate, 50e-6) for w, e in dots.items())
    device = calibrated_cluster(ClusterCalibration(**{**cal.__dict__, "kernels": kernels})).devices[0]
    convolution, dot = device.narrow["convolution"], device.narrow["dot"]
    assert [w for w, _ in convolution.points] == list(conv)
    assert [e for _, e in convolution.points] == pytest.approx(list(conv.values()), rel=1e-6)
    assert dot.points[-1] == (1024.0, 1.0)
    assert [e for _, e in dot.points[:-1]] == pytest.approx(list(dots.values()), rel=1e-6)
    # between the points: log-log interpolation; below the narrowest: the first segment's slope
    assert convolution.factor(2) == pytest.approx(0.004 * (0.03 / 0.004) ** 0.5)  # halfway from 1 to 4 in logs
    assert dot.factor(4) == pytest.approx(0.3 * (4 / 8) ** (math.log(0.6 / 0.3) / math.log(4)))
    assert convolution.factor(1000) == pytest.approx(0.95) and dot.factor(4096) == 1.0
    # the figures name each point, and the cluster file keeps the curves
    figures = ClusterCalibration(**{**cal.__dict__, "kernels": kernels}).figures()
    assert figures["convolution of width 8 share of rate"] == pytest.approx(0.1, rel=1e-6)


def test_oversized_convolution_samples_give_a_curve_of_their_own() -> None:
    """Convolutions whose window reaches past their images ran at 2% of the matrix rate whatever
    their channels: the device gets a flat curve of that kind beside the convolution curve, and a
    cluster file round-trips it."""
    from hlomap.cost.cluster import Cluster
    from hlomap.cost.devices import OVERSIZED_CONVOLUTION

    cal = _calibration()
    rate = 2.0 * 1024**3 / (50e-6 + 2.0 * 1024**3 / 1e11)
    kernels = cal.kernels + tuple(_narrow("convolution", w, e, rate, 50e-6) for w, e in {4: 0.03, 32: 0.95}.items()) \
        + tuple(_narrow(OVERSIZED_CONVOLUTION, w, 0.02, rate, 50e-6) for w in (32, 64))
    calibration = ClusterCalibration(**{**cal.__dict__, "kernels": kernels})
    cluster = calibrated_cluster(calibration)
    oversized = cluster.devices[0].narrow[OVERSIZED_CONVOLUTION]
    assert [w for w, _ in oversized.points] == [32, 64]
    assert oversized.factor(8) == pytest.approx(0.02) and oversized.factor(512) == pytest.approx(0.02)
    assert cluster.devices[0].narrow["convolution"].factor(32) == pytest.approx(0.95)
    assert calibration.figures()["oversized-convolution of width 64 share of rate"] == pytest.approx(0.02, rel=1e-6)
    again = Cluster.from_json(cluster.to_json())
    assert again.devices[0].narrow == cluster.devices[0].narrow


def test_narrow_samples_the_memory_side_explains_or_that_dip_are_not_read_as_slow() -> None:
    """A sample whose time the roofline's memory side explains says nothing about the matrix
    rate; a wider product measured slower than a narrower one is noise (the curve never falls);
    samples at full rate everywhere give no curve."""
    from hlomap.cost.calibration import fit_narrow_curve, narrow_shares
    from hlomap.cost.devices import DeviceSpec

    device = DeviceSpec("d", {"f32": 1e11}, 1e9, 2**30, efficiency=1.0)
    memory_bound = Measurement("dot_8", "dot", "f32", 1e6, 1e6, 1.2e-3, width=8)  # 1.2 ms, 1 ms of memory
    slow = _narrow("dot", 16, 0.2, 1e11, 0.0)
    assert narrow_shares([memory_bound, slow], device, 0.0, "dot") == [(16, pytest.approx(0.2))]
    curve = fit_narrow_curve([(8, 0.2), (16, 0.1), (32, 0.5)])
    assert curve is not None and [e for _, e in curve.points] == [0.2, 0.2, 0.5]
    assert fit_narrow_curve([(8, 1.0), (32, 1.0)]) is None and fit_narrow_curve([]) is None
