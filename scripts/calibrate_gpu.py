"""Fit a device preset's efficiency factors to kernels timed on this machine, and check them.

Times representative kernels with JAX on the default backend (dots of several shapes in bf16 and
f32, elementwise ops, reductions) and the jitted train steps of zoo models, counts each kernel's
FLOPs and bytes with hlomap's own cost functions on its lowered HLO, fits the preset's compute
and HBM-bandwidth efficiencies (`hlomap.cost.calibration.fit_calibration`), writes the profile, then
prints the cost model's predicted step time (one device, data-parallel plan on a mesh of 1)
against the measured one, before and after calibration.

    python scripts/calibrate_gpu.py -o h100.json                  # on one H100 (issue 4, section 6)
    python scripts/calibrate_gpu.py --quick --preset A100-80GB -o /tmp/p.json   # smoke test, any backend
    hlomap simulate zoo:gpt-base --cluster my-h100s.json --profile h100.json

Off a GPU the script still runs (that is how it is tested) but warns, and notes in the profile,
that the fitted factors then describe the host CPU, not the preset's GPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GPU_BACKENDS = frozenset({"gpu", "cuda", "rocm"})
DEFAULT_PRESET = "H100-80GB"
DEFAULT_MODELS = ("gpt-small", "gpt-base")
QUICK_MODELS = ("gpt-tiny",)
#: Timed calls per sample are capped so a kernel that is mostly dispatch overhead on a CPU does
#: not loop for long; on a GPU the sizes below keep every kernel above ~0.1 ms anyway.
MAX_INNER_CALLS = 1000


# ---------------------------------------------------------------------------------------------
# The kernels
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kernel:
    """One single-instruction jitted function to time. `dtype` is the HLO element type whose
    peak the cost model applies (a dot's operand type); `fit` False keeps it out of the fit."""

    name: str
    kind: str
    dtype: str
    fn: Callable[..., Any]
    shapes: tuple[tuple[int, ...], ...]
    fit: bool = True


def _matmul(precision: Any = None) -> Callable[[Any, Any], Any]:
    import jax.numpy as jnp

    return lambda a, b: jnp.matmul(a, b, precision=precision)


def _dot(dtype: str, m: int, k: int, n: int, *, batch: int = 0, precision: Any = None, label: str = "",
         fit: bool = True) -> Kernel:
    lead = (batch,) if batch else ()
    name = f"dot_{label or dtype}_{f'{batch}x' if batch else ''}{m}x{k}x{n}"
    return Kernel(name, "dot", dtype, _matmul(precision), (lead + (m, k), lead + (k, n)), fit)


def kernel_suite(quick: bool) -> tuple[Kernel, ...]:
    """Dots (compute-bound squares and transformer-like shapes, memory-bound batched and
    matrix-vector ones), elementwise ops and reductions. Full sizes move hundreds of MiB, well
    past an H100's 50 MiB L2, so memory-bound kernels see HBM; `quick` shrinks everything for a
    CPU smoke test."""
    import jax
    import jax.numpy as jnp

    highest = jax.lax.Precision.HIGHEST
    # f32 dots run at the CUDA-core FP32 rate (the preset's "f32" peak, which the cost model
    # applies to f32 dots) only at HIGHEST precision; at JAX's default precision GPUs since
    # Ampere use TF32 tensor cores, several times faster. That one is timed as a diagnostic
    # (not fitted): the zoo models' f32 dots run that way.
    full = not quick
    big, mid, small = (8192, 4096, 1024) if full else (256, 128, 64)
    vec = 1 << 26 if full else 1 << 18
    rows = 8192 if full else 512
    kernels = [
        _dot("bf16", mid, mid, mid),
        _dot("bf16", big, big, big) if full else _dot("bf16", small, mid, small),
        _dot("bf16", 4 * mid, small, mid),                 # tokens x d_model -> d_ff
        _dot("bf16", mid, 4 * mid, small),                 # d_ff -> d_model, long contraction
        _dot("bf16", small, mid // 32, small, batch=64 if full else 8),  # attention scores: memory-bound
        # f32 dots big enough to be compute-bound against a GPU's f32 ridge point (~20 FLOP/byte)
        # even at --quick sizes, so that a CPU smoke test exercises both sides of the fit.
        _dot("f32", 4 * mid, 4 * mid, 4 * mid, precision=highest, label="f32highest") if quick
        else _dot("f32", mid, mid, mid, precision=highest, label="f32highest"),
        _dot("f32", 2 * mid, 8 * mid, 2 * mid, precision=highest, label="f32highest") if quick
        else _dot("f32", big, mid // 2, big, precision=highest, label="f32highest"),
        _dot("f32", mid, mid, mid, label="f32default", fit=False),
        Kernel(f"matvec_f32_{2 * big}", "dot", "f32", _matmul(), ((2 * big, 2 * big), (2 * big,))),
        Kernel(f"add_f32_{vec}", "elementwise", "f32", jnp.add, ((vec,), (vec,))),
        Kernel(f"multiply_bf16_{2 * vec}", "elementwise", "bf16", jnp.multiply, ((2 * vec,), (2 * vec,))),
        Kernel(f"negate_f32_{vec}", "elementwise", "f32", jnp.negative, ((vec,),)),
        Kernel(f"sum_rows_f32_{rows}x{rows}", "reduce", "f32", lambda x: jnp.sum(x, axis=1), ((rows, rows),)),
        Kernel(f"sum_cols_f32_{rows}x{rows}", "reduce", "f32", lambda x: jnp.sum(x, axis=0), ((rows, rows),)),
        Kernel(f"max_all_f32_{vec}", "reduce", "f32", jnp.max, ((vec,),)),
    ]
    return tuple(kernels)


def kernel_args(kernel: Kernel, seed: int) -> list[Any]:
    """Random operands, drawn on the host: jax.random would compile a generator per shape,
    which costs more than the kernels themselves at --quick sizes."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    dtype = jnp.bfloat16 if kernel.dtype == "bf16" else jnp.float32
    return [jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype=dtype) for shape in kernel.shapes]


def count_work(jitted: Any, args: Sequence[Any]) -> tuple[float, float]:
    """(FLOPs, bytes) of one call, by hlomap's cost functions on the lowered HLO: the counts the
    cost model itself uses, so the fitted factors relate its roofline to real time."""
    from hlomap.cost.compute import module_cost
    from hlomap.hlo.parser import parse

    cost = module_cost(parse(jitted.lower(*args).as_text(dialect="hlo")))
    return cost.flops, cost.bytes_accessed


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    min_seconds: float  # wall time of one sample (calls are batched until they take this long)
    repeats: int  # samples; their median is reported


def time_call(fn: Callable[..., Any], args: Sequence[Any], timing: Timing) -> float:
    """Median seconds per call. The first call compiles and warms up; each sample then issues
    enough calls back to back (JAX dispatches asynchronously) to take `min_seconds`, and waits
    once at the end, so dispatch latency overlaps device work as it does in a training loop."""
    import jax

    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = max(time.perf_counter() - start, 1e-9)
    inner = max(1, min(MAX_INNER_CALLS, math.ceil(timing.min_seconds / once)))
    samples = []
    for _ in range(timing.repeats):
        start = time.perf_counter()
        out = None
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def measure_kernel(kernel: Kernel, timing: Timing, seed: int = 0) -> Any:
    import jax

    from hlomap.cost.calibration import Measurement

    args = kernel_args(kernel, seed)
    jitted = jax.jit(kernel.fn)
    flops, nbytes = count_work(jitted, args)
    seconds = time_call(jitted, args, timing)
    return Measurement(kernel.name, kernel.kind, kernel.dtype, flops, nbytes, seconds, fit=kernel.fit)


# ---------------------------------------------------------------------------------------------
# Train steps: measured, and predicted by the cost model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepRun:
    """A zoo train step timed on the device, and what is needed to estimate it again."""

    model: str
    seconds: float
    capture: Any
    graph: Any


def measure_step(model_name: str, timing: Timing, seed: int = 0) -> StepRun:
    import jax

    from hlomap import zoo
    from hlomap.propagation.graph import FactorGraph
    from hlomap.api import load_source

    model = zoo.get(model_name)
    args = model.example_args(seed)
    seconds = time_call(jax.jit(model.train_step()), args, timing)
    del args  # free the weights on the device before the next model
    cap = load_source(f"zoo:{model_name}")
    return StepRun(model_name, seconds, cap, FactorGraph.from_capture(cap))


def single_device_cluster(device: Any) -> Any:
    from hlomap.cost.cluster import hierarchical

    return hierarchical(1, 1, device, name=f"1x{device.name}")


def predict_step(run: StepRun, cluster: Any) -> Any:
    """The cost model's estimate of the step on one device: data parallel on a mesh of 1, i.e.
    the unsharded step, which is what was timed."""
    from hlomap.api import estimate

    return estimate(run.capture, "dp", mesh=1, cluster=cluster, graph=run.graph)


def step_measurement(run: StepRun, est: Any) -> Any:
    """The step as a (not fitted) measurement, so the profile records what its report rests on."""
    from hlomap.cost.calibration import Measurement

    nbytes = sum(i.bytes_accessed for i in est.instructions)
    return Measurement(f"step_{run.model}", "step", "f32", est.flops, nbytes, run.seconds, fit=False)


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepRow:
    model: str
    measured: float
    predicted_preset: float
    predicted_calibrated: float
    flops: float

    @property
    def ratio(self) -> float:
        return self.predicted_calibrated / self.measured


@dataclass(frozen=True)
class Calibration:
    """What one run produced: the profile and the rows of its report."""

    profile: Any
    steps: tuple[StepRow, ...]
    warnings: tuple[str, ...] = field(default=())


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:10.3f}"


def format_kernels(profile: Any, device: Any) -> str:
    from hlomap.cost.calibration import classify, ideal_seconds, predicted_seconds

    ce, be = profile.compute_efficiency, profile.bandwidth_efficiency
    lines = [f"{'kernel':34} {'bound':8} {'measured ms':>11} {'model ms':>10} {'TFLOP/s':>9} {'GB/s':>8} "
             f"{'eff':>7}  (model: {device.name}, compute x{ce:.3g}, bandwidth x{be:.3g})"]
    for m in profile.measurements:
        if m.kind == "step":
            continue
        bound = classify(m, device, ce, be)
        compute, memory = ideal_seconds(m, device)
        eff = (compute if bound.value == "compute" else memory) / m.seconds
        # a kernel past the datasheet means the preset's peak is not the rate it ran at (f32 dots
        # on TF32 tensor cores), which no efficiency factor <= 1 can express: flag it
        mark = ("" if m.fit else "  (not fitted)") + ("  faster than the datasheet" if eff > 1 else "")
        lines.append(f"{m.name:34} {bound.value:8} {_ms(m.seconds):>11} {_ms(predicted_seconds(m, device, ce, be))} "
                     f"{m.flops / m.seconds / 1e12:9.3f} {m.bytes_accessed / m.seconds / 1e9:8.1f} {eff:7.3f}{mark}")
    return "\n".join(lines)


def format_steps(rows: Sequence[StepRow], device: Any) -> str:
    lines = [f"{'step (1 device, dp)':22} {'measured ms':>11} {'preset ms':>10} {'calibrated ms':>13} "
             f"{'calibrated/measured':>19} {'measured TFLOP/s':>16}   (preset: {device.name}, "
             f"efficiency {device.efficiency:g})"]
    for r in rows:
        lines.append(f"zoo:{r.model:18} {_ms(r.measured):>11} {_ms(r.predicted_preset)} "
                     f"{_ms(r.predicted_calibrated):>13} {r.ratio:19.3f} {r.flops / r.measured / 1e12:16.3f}")
    return "\n".join(lines)


def report_json(result: Calibration) -> dict[str, Any]:
    return {"profile": result.profile.to_json(), "warnings": list(result.warnings),
            "steps": [{"model": r.model, "measured_seconds": r.measured,
                       "predicted_preset_seconds": r.predicted_preset,
                       "predicted_calibrated_seconds": r.predicted_calibrated,
                       "calibrated_over_measured": r.ratio, "flops": r.flops} for r in result.steps]}


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def resolve_device(text: str) -> Any:
    """A preset name, or a JSON file holding one DeviceSpec object (or a preset name)."""
    from hlomap.cost.devices import DeviceSpec, device_preset

    path = Path(text)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise ValueError(f"--preset {text}: no such device JSON file")
        try:
            return DeviceSpec.from_json(json.loads(path.read_text()), where=str(path))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{err.lineno}:{err.colno}: invalid JSON: {err.msg}") from None
    return device_preset(text)


def backend_warnings(backend: str, device_kind: str, device: Any) -> tuple[str, ...]:
    """Why this run's fit may not describe the preset: measured off a GPU, or on another GPU."""
    from hlomap.cost.devices import DEVICE_PRESETS

    if backend not in GPU_BACKENDS:
        if device.name in DEVICE_PRESETS:  # every preset is a GPU
            return (f"JAX's backend is {backend} ({device_kind}), not a GPU: the fitted factors describe this "
                    f"machine against the {device.name} preset and are not meaningful for the {device.name}",)
        return ()
    family = device.name.split("-")[0].lower()
    if family not in device_kind.lower():
        return (f"measured on {device_kind!r} but fitted to the {device.name} preset: "
                f"the factors describe the device measured",)
    return ()


def calibrate(device: Any, kernels: Sequence[Kernel], models: Sequence[str], timing: Timing, *,
              log: Callable[[str], None] = lambda s: None) -> Calibration:
    """Time everything, fit `device`, and predict every model's step before and after."""
    import jax

    from hlomap.cost.calibration import apply_calibration, fit_calibration

    backend = jax.default_backend()
    device_kind = jax.devices()[0].device_kind
    warnings = backend_warnings(backend, device_kind, device)
    measurements = []
    for kernel in kernels:
        measurements.append(measure_kernel(kernel, timing))
        log(f"  {kernel.name}: {measurements[-1].seconds * 1e3:.3f} ms")
    preset_cluster = single_device_cluster(device)
    runs, preset_estimates = [], []
    for name in models:
        runs.append(measure_step(name, timing))
        preset_estimates.append(predict_step(runs[-1], preset_cluster))
        measurements.append(step_measurement(runs[-1], preset_estimates[-1]))
        log(f"  step zoo:{name}: {runs[-1].seconds * 1e3:.3f} ms")
    profile = fit_calibration(measurements, device, backend=backend, device_kind=device_kind,
                          jax_version=jax.__version__,
                          measured_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    profile = replace(profile, notes=profile.notes + tuple(f"warning: {w}" for w in warnings))
    calibrated_cluster = apply_calibration(preset_cluster, profile)
    rows = tuple(StepRow(run.model, run.seconds, est.step_seconds, predict_step(run, calibrated_cluster).step_seconds,
                         est.flops)
                 for run, est in zip(runs, preset_estimates))
    return Calibration(profile, rows, warnings)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Then: hlomap simulate|explore ... --profile PROFILE.json")
    parser.add_argument("-o", "--output", required=True, metavar="PROFILE.json", help="where the profile is written")
    parser.add_argument("--preset", default=DEFAULT_PRESET, metavar="NAME|DEVICE.json",
                        help=f"device preset to fit, or a DeviceSpec JSON file (default {DEFAULT_PRESET})")
    parser.add_argument("--quick", action="store_true",
                        help="small shapes, short timings and zoo:gpt-tiny only: a smoke test that runs on a CPU")
    parser.add_argument("--models", metavar="LIST",
                        help="comma-separated zoo models whose step is timed and predicted "
                             f"(default {','.join(DEFAULT_MODELS)}; with --quick {','.join(QUICK_MODELS)}; "
                             "'' for none)")
    parser.add_argument("--min-seconds", type=float, metavar="S",
                        help="wall time of one timing sample (default 0.2; 0.005 with --quick)")
    parser.add_argument("--repeats", type=int, metavar="N",
                        help="timing samples per kernel (default 5; 3 with --quick)")
    parser.add_argument("--report", metavar="FILE.json", help="also write the report (profile and step rows) as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    output = Path(args.output)
    if not output.parent.is_dir():
        print(f"calibrate_gpu: error: {output.parent}: directory does not exist", file=sys.stderr)
        return 2
    from hlomap.cost.devices import DeviceSpecError

    try:
        device = resolve_device(args.preset)
    except (ValueError, DeviceSpecError) as err:
        print(f"calibrate_gpu: error: {err}", file=sys.stderr)
        return 2
    models = (QUICK_MODELS if args.quick else DEFAULT_MODELS) if args.models is None else tuple(
        m.strip() for m in args.models.split(",") if m.strip())
    timing = Timing(min_seconds=args.min_seconds if args.min_seconds is not None else (0.005 if args.quick else 0.2),
                    repeats=args.repeats if args.repeats is not None else (3 if args.quick else 5))
    if timing.min_seconds <= 0 or timing.repeats < 1:
        print("calibrate_gpu: error: --min-seconds must be > 0 and --repeats >= 1", file=sys.stderr)
        return 2

    import jax

    print(f"calibrating {device.name} on {jax.default_backend()} ({jax.devices()[0].device_kind}), "
          f"jax {jax.__version__}", file=sys.stderr)
    for w in backend_warnings(jax.default_backend(), jax.devices()[0].device_kind, device):
        print(f"warning: {w}", file=sys.stderr)
    result = calibrate(device, kernel_suite(args.quick), models, timing,
                       log=lambda s: print(s, file=sys.stderr))
    result.profile.save(output)
    print(format_kernels(result.profile, device))
    print()
    if result.steps:
        print(format_steps(result.steps, device))
        print()
    print(f"{device.name}: compute efficiency {result.profile.compute_efficiency:.4g} "
          f"(preset {device.efficiency:g}), bandwidth efficiency {result.profile.bandwidth_efficiency:.4g}")
    for note in result.profile.notes:
        print(f"  - {note}")
    print(f"profile: {output}")
    if args.report:
        Path(args.report).write_text(json.dumps(report_json(result), indent=1) + "\n")
        print(f"report: {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
