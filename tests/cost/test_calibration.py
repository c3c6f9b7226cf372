"""Calibration profiles: the fit, the JSON file, applying a profile, the script and --profile."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from hlomap.cli import run
from hlomap.cost.calibration import (
    MIN_EFFICIENCY,
    Bound,
    CalibrationError,
    Calibration,
    Measurement,
    apply_calibration,
    classify,
    fit_calibration,
    ideal_seconds,
    load_calibration,
)
from hlomap.cost.cluster import Cluster, cluster_preset, hierarchical
from hlomap.cost.devices import DeviceSpec, device_preset

H100 = device_preset("H100-80GB")
V100 = device_preset("V100-16GB")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "calibrate_gpu.py"


def timed(name: str, kind: str, dtype: str, flops: float, nbytes: float, device: DeviceSpec,
          compute_eff: float, bandwidth_eff: float, *, fit: bool = True) -> Measurement:
    """A measurement whose time is exactly the roofline with the given factors."""
    probe = Measurement(name, kind, dtype, flops, nbytes, 1.0, fit)
    compute, memory = ideal_seconds(probe, device)
    return replace(probe, seconds=max(compute / compute_eff, memory / bandwidth_eff))


def suite(device: DeviceSpec, compute_eff: float, bandwidth_eff: float) -> list[Measurement]:
    """Square bf16 and f32 dots (compute-bound), elementwise ops and reductions (memory-bound),
    a matrix-vector dot (memory-bound), and a step that must not enter the fit."""
    def dot(m: int, k: int, n: int, dtype: str) -> Measurement:
        size = 2 if dtype == "bf16" else 4
        return timed(f"dot_{dtype}_{m}x{k}x{n}", "dot", dtype, 2.0 * m * k * n, size * (m * k + k * n + m * n),
                     device, compute_eff, bandwidth_eff)

    n = 1 << 26
    return [
        dot(4096, 4096, 4096, "bf16"), dot(8192, 8192, 8192, "bf16"), dot(16384, 1024, 4096, "bf16"),
        dot(4096, 4096, 4096, "f32"), dot(16384, 16384, 1, "f32"),
        timed("add", "elementwise", "f32", n, 12.0 * n, device, compute_eff, bandwidth_eff),
        timed("negate", "elementwise", "bf16", n, 4.0 * n, device, compute_eff, bandwidth_eff),
        timed("sum_rows", "reduce", "f32", n, 4.0 * n + 4 * 8192, device, compute_eff, bandwidth_eff),
        Measurement("step_gpt", "step", "f32", 1e12, 1e10, 123.0, fit=False),  # absurd: must be ignored
    ]


# ---------------------------------------------------------------------------------------------
# Fitting
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compute_eff, bandwidth_eff", [(0.71, 0.88), (0.35, 0.95), (0.9, 0.4), (1.0, 1.0)])
def test_fit_recovers_known_efficiencies(compute_eff: float, bandwidth_eff: float) -> None:
    ms = suite(H100, compute_eff, bandwidth_eff)
    profile = fit_calibration(ms, H100, backend="gpu", device_kind="NVIDIA H100 80GB HBM3")
    assert profile.compute_efficiency == pytest.approx(compute_eff, rel=1e-12)
    assert profile.bandwidth_efficiency == pytest.approx(bandwidth_eff, rel=1e-12)
    assert profile.device == "H100-80GB" and profile.device_kind == "NVIDIA H100 80GB HBM3"
    assert profile.measurements == tuple(ms)  # the step is kept in the file, just not fitted
    assert any("fit=false" in n for n in profile.notes)


def test_fit_classifies_with_the_fitted_factors_not_the_datasheet() -> None:
    """Dots 2.5x past the datasheet ridge point are memory-bound when HBM reaches only 30%; a
    one-shot classification at the datasheet roofline would fit them as compute-bound and pull
    the compute efficiency down to 0.825."""
    ce, be = 0.9, 0.3
    clear = [timed(f"big{i}", "dot", "bf16", 50.0 * 1e9 * H100.flops_for("bf16") / H100.hbm_bandwidth, 1e9,
                   H100, ce, be) for i in range(3)]
    near = [timed(f"near{i}", "dot", "bf16", 2.5 * 1e9 * H100.flops_for("bf16") / H100.hbm_bandwidth, 1e9,
                  H100, ce, be) for i in range(3)]
    memory = [timed(f"add{i}", "elementwise", "f32", 1e6 * (i + 1), 1e9 * (i + 1), H100, ce, be) for i in range(3)]
    assert all(classify(m, H100, 1.0, 1.0) is Bound.COMPUTE for m in near)  # at the datasheet roofline
    profile = fit_calibration(clear + near + memory, H100)
    assert profile.compute_efficiency == pytest.approx(ce, rel=1e-12)
    assert profile.bandwidth_efficiency == pytest.approx(be, rel=1e-12)
    assert any("near0" in n and "ridge" in n for n in profile.notes)


def test_fit_is_robust_to_noise_and_an_outlier() -> None:
    rng = np.random.default_rng(0)
    ms = [m for m in suite(H100, 0.7, 0.85) if m.fit]
    noisy = [replace(m, seconds=m.seconds * float(rng.uniform(0.97, 1.03))) for m in ms]
    noisy[0] = replace(noisy[0], seconds=noisy[0].seconds * 20)  # a clock dip on one dot
    noisy[5] = replace(noisy[5], seconds=noisy[5].seconds * 20)  # and on one elementwise op
    profile = fit_calibration(noisy, H100)
    assert profile.compute_efficiency == pytest.approx(0.7, rel=0.05)
    assert profile.bandwidth_efficiency == pytest.approx(0.85, rel=0.05)


def test_fit_clamps_faster_than_datasheet_and_says_why() -> None:
    # f32 dots on TF32 tensor cores run several times past the preset's CUDA-core f32 peak
    fast = [timed(f"dot{i}", "dot", "f32", 1e13 * (i + 1), 1e9, H100, 4.0, 0.9) for i in range(3)]
    memory = [timed("add", "elementwise", "f32", 1e6, 1e9, H100, 4.0, 0.9)]
    profile = fit_calibration(fast + memory, H100)
    assert profile.compute_efficiency == 1.0
    assert profile.bandwidth_efficiency == pytest.approx(0.9)
    assert any("clamped to 1" in n and "compute efficiency 4" in n for n in profile.notes)


def test_fit_raises_a_hopeless_factor_to_the_floor() -> None:
    ms = [timed("add", "elementwise", "f32", 1e6, 1e9, H100, 1.0, 1e-9)]
    profile = fit_calibration(ms, H100)
    assert profile.bandwidth_efficiency == MIN_EFFICIENCY
    assert any("raised to" in n for n in profile.notes)


def test_a_side_without_kernels_keeps_the_preset() -> None:
    memory_only = [timed(f"add{i}", "elementwise", "f32", 1e6, 1e9 * (i + 1), V100, 0.5, 0.8) for i in range(3)]
    profile = fit_calibration(memory_only, V100)
    assert profile.compute_efficiency == V100.efficiency
    assert profile.bandwidth_efficiency == pytest.approx(0.8)
    assert any("no compute-bound kernel" in n for n in profile.notes)


def test_fit_needs_measurements_marked_fit() -> None:
    with pytest.raises(CalibrationError, match="no measurements to fit"):
        fit_calibration([Measurement("step", "step", "f32", 1.0, 1.0, 1.0, fit=False)], H100)
    with pytest.raises(CalibrationError, match="no measurements"):
        fit_calibration([], H100)


@pytest.mark.parametrize("kwargs, message", [
    ({"seconds": 0.0}, "seconds = 0.0 must be finite and positive"),
    ({"seconds": float("nan")}, "must be finite and positive"),
    ({"flops": -1.0}, "flops = -1.0"),
    ({"bytes_accessed": float("inf")}, "bytes = inf"),
])
def test_measurements_are_validated(kwargs: dict[str, float], message: str) -> None:
    fields: dict[str, Any] = {"name": "k", "kind": "dot", "dtype": "bf16", "flops": 1.0, "bytes_accessed": 1.0,
                              "seconds": 1.0, **kwargs}
    with pytest.raises(CalibrationError, match=message):
        Measurement(**fields)


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------


def test_json_round_trip(tmp_path: Path) -> None:
    profile = fit_calibration(suite(H100, 0.7, 0.85), H100, backend="gpu", device_kind="NVIDIA H100 80GB HBM3",
                          jax_version="0.4.35", measured_at="2025-01-01T00:00:00+00:00")
    path = tmp_path / "h100.json"
    profile.save(path)
    loaded = load_calibration(path)
    assert loaded == profile
    assert json.loads(path.read_text())["format"] == "hlomap-calibration"


def _valid(tmp_path: Path) -> dict[str, Any]:
    Calibration("H100-80GB", 0.7, 0.9, measurements=suite(H100, 0.7, 0.9)[:2]).save(tmp_path / "ok.json")
    return json.loads((tmp_path / "ok.json").read_text())


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("compute_efficiency"), r"missing field\(s\) \['compute_efficiency'\]"),
    (lambda d: d.update(compute_efficiency=1.5), r"field 'compute_efficiency': expected a number in \(0, 1\]"),
    (lambda d: d.update(bandwidth_efficiency="0.9"), r"field 'bandwidth_efficiency': expected a number"),
    (lambda d: d.update(format="hlomap-cluster"), r"field 'format'.*is this a calibration profile"),
    (lambda d: d.update(version=7), r"field 'version'"),
    (lambda d: d.update(colour="blue"), r"unknown field\(s\) \['colour'\]"),
    (lambda d: d.update(measurements={}), r"field 'measurements': expected a list"),
    (lambda d: d["measurements"][1].update(seconds="fast"), r"field 'measurements'\[1\]\.seconds: expected a number"),
    (lambda d: d["measurements"][0].update(seconds=-1), r"field 'measurements'\[0\]: measurement .* must be finite and positive"),
    (lambda d: d["measurements"][0].pop("bytes"), r"field 'measurements'\[0\]: missing field\(s\) \['bytes'\]"),
    (lambda d: d["measurements"][0].update(fit="yes"), r"field 'measurements'\[0\]\.fit: expected true or false"),
    (lambda d: d.update(notes="none"), r"field 'notes': expected a list of strings"),
])
def test_bad_fields_name_the_file_and_the_field(tmp_path: Path, edit: Any, message: str) -> None:
    data = _valid(tmp_path)
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match=message) as err:
        load_calibration(path)
    assert str(err.value).startswith(str(path))


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(CalibrationError, match="no such profile file"):
        load_calibration(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"device": "H100-80GB",\n "compute_efficiency": }')
    with pytest.raises(CalibrationError, match=rf"{broken}:2:\d+: invalid JSON"):
        load_calibration(broken)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(CalibrationError, match="expected a JSON object, got list"):
        load_calibration(listed)


# ---------------------------------------------------------------------------------------------
# Applying
# ---------------------------------------------------------------------------------------------


def test_apply_profile_changes_only_the_profiled_devices() -> None:
    a = cluster_preset("A")
    mixed = Cluster("mixed", (V100, H100, V100), (0, 0, 1), a.bandwidth[:3, :3], a.latency[:3, :3])
    out = apply_calibration(mixed, Calibration("h100-80gb", 0.5, 0.25))  # names match case-insensitively
    assert out.devices[0] == V100 and out.devices[2] == V100
    assert out.devices[1].efficiency == 0.5
    assert out.devices[1].hbm_bandwidth == pytest.approx(0.25 * H100.hbm_bandwidth)
    assert out.devices[1].name == "H100-80GB" and out.devices[1].peak_flops == H100.peak_flops
    assert np.array_equal(out.bandwidth, mixed.bandwidth) and np.array_equal(out.latency, mixed.latency)
    assert out.name == mixed.name and out.node_of == mixed.node_of
    assert mixed.devices[1] == H100  # the input is untouched


def test_apply_profile_without_a_matching_device_says_which_devices_there_are() -> None:
    message = r"'H100-80GB' matches no device of cluster 'A' \(its devices: V100-16GB\)"
    with pytest.raises(CalibrationError, match=message):
        apply_calibration(cluster_preset("A"), Calibration("H100-80GB", 0.5, 0.5))


@pytest.fixture(scope="module")
def gpt_tiny() -> Any:
    from hlomap.api import load_source

    return load_source("zoo:gpt-tiny")


def test_apply_profile_moves_the_estimate_the_expected_way(gpt_tiny: Any) -> None:
    from hlomap.api import estimate

    cluster = hierarchical(1, 1, "H100-80GB")

    def step(profile: Calibration | None) -> Any:
        clus = cluster if profile is None else apply_calibration(cluster, profile)
        return estimate(gpt_tiny, "dp", mesh=1, cluster=clus)

    base = step(None)
    slower_compute = step(Calibration("H100-80GB", H100.efficiency / 3, 1.0))
    slower_memory = step(Calibration("H100-80GB", H100.efficiency, 0.2))
    faster = step(Calibration("H100-80GB", 1.0, 1.0))
    same = step(Calibration("H100-80GB", H100.efficiency, 1.0))
    assert same.step_seconds == pytest.approx(base.step_seconds, rel=1e-12)
    assert slower_compute.step_seconds > base.step_seconds
    assert slower_memory.step_seconds > base.step_seconds
    assert faster.step_seconds < base.step_seconds
    # compute time of each instruction scales by 3 at most, memory time by 5 at most
    assert slower_compute.step_seconds <= 3 * base.step_seconds * (1 + 1e-12)
    assert slower_memory.step_seconds <= 5 * base.step_seconds * (1 + 1e-12)
    assert faster.flops == base.flops  # the work is the same; only its price moves


# ---------------------------------------------------------------------------------------------
# The script
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("calibrate_gpu", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["calibrate_gpu"] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


def test_script_quick_kernels_on_cpu_write_a_loadable_profile(script: ModuleType, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "profile.json"
    assert script.main(["--quick", "--models", "", "--preset", "A100-80GB", "-o", str(out)]) == 0
    profile = load_calibration(out)
    assert profile.device == "A100-80GB" and profile.backend == "cpu"
    names = {m.name for m in profile.measurements}
    assert len(names) == len(script.kernel_suite(True))
    assert {m.kind for m in profile.measurements} == {"dot", "elementwise", "reduce"}
    assert all(m.seconds > 0 and m.bytes_accessed > 0 for m in profile.measurements)
    # counted by hlomap on the lowered HLO: an f32 add of n elements is n flops over 12n bytes
    add = next(m for m in profile.measurements if m.name.startswith("add_f32_"))
    n = int(add.name.rsplit("_", 1)[1])
    assert (add.flops, add.bytes_accessed) == (n, 12 * n)
    # the quick f32 dots are compute-bound even against a GPU ridge point: both sides are fitted
    assert not any("no compute-bound" in n or "no memory-bound" in n for n in profile.notes)
    assert any("not a GPU" in n for n in profile.notes)
    captured = capsys.readouterr()
    assert "warning: JAX's backend is cpu" in captured.err
    assert "compute efficiency" in captured.out


def test_script_rejects_an_unknown_preset(script: ModuleType, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert script.main(["--quick", "--preset", "TPU-v9", "-o", str(tmp_path / "p.json")]) == 2
    assert "unknown device preset 'TPU-v9'" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_script_takes_a_device_json(script: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "h200.json"
    h200 = replace(H100, name="H200", hbm_bandwidth=4.8e12, memory_bytes=141 * 2**30)
    path.write_text(json.dumps(h200.to_json()))
    assert script.resolve_device(str(path)) == h200
    assert script.resolve_device("a100-80gb") == device_preset("A100-80GB")
    path.write_text("{")
    with pytest.raises(ValueError, match=rf"{path}:1:2: invalid JSON"):
        script.resolve_device(str(path))


def test_script_warns_when_the_fit_does_not_describe_the_preset(script: ModuleType) -> None:
    assert script.backend_warnings("gpu", "NVIDIA H100 80GB HBM3", H100) == ()
    (other,) = script.backend_warnings("gpu", "NVIDIA H200", H100)
    assert "'NVIDIA H200'" in other and "H100-80GB" in other
    (cpu,) = script.backend_warnings("cpu", "cpu", H100)
    assert "not a GPU" in cpu and "not meaningful for the H100-80GB" in cpu


def test_script_step_prediction_uses_the_profile(script: ModuleType, gpt_tiny: Any) -> None:
    """The report's two predictions: the preset's and the calibrated one, on one device."""
    from hlomap.propagation.graph import FactorGraph

    run_ = script.StepRun("gpt-tiny", 1e-3, gpt_tiny, FactorGraph.from_capture(gpt_tiny))
    cluster = script.single_device_cluster(H100)
    preset = script.predict_step(run_, cluster)
    slow = script.predict_step(run_, apply_calibration(cluster, Calibration("H100-80GB", 0.1, 0.1)))
    assert preset.mesh == (("data", 1),) and preset.communication_seconds == 0  # groups of one device
    assert slow.step_seconds > preset.step_seconds
    m = script.step_measurement(run_, preset)
    assert (m.kind, m.fit, m.seconds, m.flops) == ("step", False, 1e-3, preset.flops)


@pytest.mark.slow
def test_script_quick_with_a_train_step(script: ModuleType, tmp_path: Path) -> None:
    out, report = tmp_path / "profile.json", tmp_path / "report.json"
    assert script.main(["--quick", "-o", str(out), "--report", str(report)]) == 0
    profile = load_calibration(out)
    step = next(m for m in profile.measurements if m.kind == "step")
    assert step.name == "step_gpt-tiny" and not step.fit
    rows = json.loads(report.read_text())["steps"]
    assert [r["model"] for r in rows] == ["gpt-tiny"]
    assert rows[0]["measured_seconds"] == step.seconds
    assert rows[0]["predicted_calibrated_seconds"] > 0 and rows[0]["predicted_preset_seconds"] > 0


# ---------------------------------------------------------------------------------------------
# --profile on the command line
# ---------------------------------------------------------------------------------------------

SMALL_HLO = """HloModule small, entry_computation_layout={(f32[8,16]{1,0}, f32[16,4]{1,0})->f32[8,4]{1,0}}

ENTRY main {
  x = f32[8,16]{1,0} parameter(0)
  w = f32[16,4]{1,0} parameter(1)
  ROOT d = f32[8,4]{1,0} dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


@pytest.fixture()
def small(tmp_path: Path) -> Path:
    path = tmp_path / "small.hlo"
    path.write_text(SMALL_HLO)
    return path


def _simulate(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert run(["simulate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_profile(small: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "v100.json"
    Calibration("V100-16GB", V100.efficiency / 2, 0.5, backend="gpu").save(profile)
    argv = [str(small), "--trainable", "1", "--mesh", "1", "--cluster", "A"]
    base = _simulate(argv, capsys)
    calibrated = _simulate([*argv, "--profile", str(profile)], capsys)
    # the dot's compute and its memory traffic both take twice as long
    assert calibrated["step_seconds"] == pytest.approx(2 * base["step_seconds"], rel=1e-9)
    assert calibrated["device"] == "V100-16GB"


def test_simulate_warns_about_a_profile_measured_off_a_gpu(small: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "cpu.json"
    Calibration("V100-16GB", 0.5, 0.5, backend="cpu").save(profile)
    assert run(["simulate", str(small), "--trainable", "1", "--mesh", "1", "--profile", str(profile)]) == 0
    assert "measured on the cpu backend, not a GPU" in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    (None, "--profile: {path}: no such profile file"),
    ("{", "--profile: {path}:1:2: invalid JSON"),
    ('{"device": "V100-16GB", "compute_efficiency": 2, "bandwidth_efficiency": 1, "measurements": []}',
     "--profile: {path}: field 'compute_efficiency': expected a number in (0, 1], got 2.0"),
    ('{"device": "H100-80GB", "compute_efficiency": 1, "bandwidth_efficiency": 1, "measurements": []}',
     "--profile {path}: calibration profile for 'H100-80GB' matches no device of cluster 'A'"),
])
@pytest.mark.parametrize("command", [["simulate"], ["explore", "--agent", "exact", "-q"]])
def test_profile_errors_are_one_line(small: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     content: str | None, message: str, command: list[str]) -> None:
    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content)
    extra = ["-o", str(tmp_path / "plan.json")] if command[0] == "explore" else []
    assert run([*command, str(small), "--trainable", "1", "--profile", str(path), *extra]) == 2
    err = capsys.readouterr().err
    assert message.format(path=path) in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "plan.json").exists()


def test_explore_profile_prices_the_saved_plan(small: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "v100.json"
    Calibration("V100-16GB", V100.efficiency / 2, 0.5, backend="gpu").save(profile)
    plans = []
    for extra in ([], ["--profile", str(profile)]):
        out = tmp_path / f"plan{len(plans)}.json"
        argv = ["explore", str(small), "--trainable", "1", "--agent", "exact", "--mesh", "2", "-q", "-o", str(out)]
        assert run([*argv, *extra]) == 0
        plans.append(json.loads(out.read_text()))
    capsys.readouterr()
    assert plans[1]["estimate"]["step_seconds"] > plans[0]["estimate"]["step_seconds"]
