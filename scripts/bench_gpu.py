"""What one accelerator can check: `hlomap calibrate` on it, and the cost model's step time
against the measured step, per zoo model, on the calibrated device and on its datasheet preset.

On one device every plan is the unsharded step, so this is the compute side of issue #22's
fidelity check (part 6 on a one-GPU machine): the collectives, transfers and pipeline terms need
several devices and are not exercised. What it does, in order:

1. `hlomap.calibrate()` on the present devices, `--calibrations` times (the spread of the fitted
   figures between runs is printed); the first run's cluster JSON is written to DIR/NAME.json
   (the file `--cluster FILE` and `hlomap.cost.devices` read).
2. For each zoo model of `--models` (a model that does not fit or fails to compile
   is reported as skipped): the jitted train step timed in `--rounds` rounds of `--repeats` calls
   (median of round medians, IQR), predicted by `hlomap.estimate(..., "dp", mesh=1)` on the
   calibrated cluster and on the datasheet preset `--preset`.
3. Prints the table, the Spearman rank correlation of predicted against measured over the models
   for each cluster, and the median and worst ratio predicted / measured; writes DIR/bench_gpu.json
   after every model (a run cut short keeps what it measured) and a log-log scatter DIR/bench_gpu.png.

    python scripts/bench_gpu.py [--out DIR] [--models LIST] [--preset H200-141GB]
        [--rounds 10] [--repeats 5] [--calibrations 2] [--budget-seconds 420] [--name NAME]

Nothing is asserted: this is a benchmark. Off an accelerator it still runs (on one host CPU
device), which is how it is checked here; its figures then describe the CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: A spread of sizes first (a run cut short by its budget still spans them), the rest after.
DEFAULT_MODELS = ("gpt-tiny", "gpt-small", "gpt-base:bfloat16", "bert-base", "resnet50", "gpt-1.3b", "t5-small",
                  "haiku-mlp", "bert-tiny", "gpt-small:bfloat16", "gpt-base", "t5-base", "vgg19", "bert-large",
                  "t5-tiny", "resnet50-tiny")
DEFAULT_PRESET = "H200-141GB"


@dataclass(frozen=True)
class ModelRow:
    model: str
    flops: float
    measured_seconds: float
    iqr_seconds: float
    calibrated_seconds: float
    datasheet_seconds: float
    compile_seconds: float

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def calibrate_once(quick: bool) -> tuple[Any, Any, float]:
    from hlomap import api

    start = time.perf_counter()
    cluster, measured = api.calibrate(quick=quick)
    return cluster, measured, time.perf_counter() - start


def calibration_figures(cluster: Any) -> dict[str, float]:
    """The fitted figures two calibrations are compared on."""
    device = cluster.devices[0]
    figures = {f"peak {dtype}": rate for dtype, rate in device.peak_flops.items()}
    figures["memory bandwidth"] = device.hbm_bandwidth
    figures["efficiency"] = device.efficiency
    if cluster.measured is not None:
        figures["dispatch"] = cluster.measured.dispatch_seconds
        figures["kernel"] = cluster.measured.kernel_seconds
    return figures


def measure_model(name: str, rounds: int, repeats: int) -> tuple[float, float, float]:
    """(median seconds, IQR, compile seconds) of the model's jitted train step on device 0."""
    import jax

    from hlomap import zoo
    from hlomap.verify.timing import time_interleaved

    model = zoo.get(name)
    # made by a jitted initialiser on the default device; the models are the caller's choice, so
    # no size limit (gpt-1.3b's state is 14.7 GiB)
    args = jax.device_put(model.example_args(0, max_bytes=None), jax.devices()[0])
    step = jax.jit(model.train_step())
    start = time.perf_counter()
    jax.block_until_ready(step(*args))
    compile_seconds = time.perf_counter() - start
    timed = time_interleaved({name: lambda: step(*args)}, rounds=rounds, repeats=repeats)[name]
    return timed.median, timed.iqr, compile_seconds


def predict(name: str, clusters: Sequence[Any]) -> tuple[float, list[float]]:
    """(FLOPs, step seconds on each cluster) of the model's unsharded step."""
    from hlomap import api
    from hlomap.propagation.graph import FactorGraph

    cap = api.load_source(f"zoo:{name}")
    graph = FactorGraph.from_capture(cap)
    estimates = [api.estimate(cap, "dp", mesh=1, cluster=c, graph=graph) for c in clusters]
    return float(estimates[0].flops), [float(e.step_seconds) for e in estimates]


def ratio_summary(rows: Sequence[ModelRow], attribute: str) -> dict[str, float]:
    from hlomap.verify.fidelity import spearman

    predicted = [getattr(r, attribute) for r in rows]
    measured = [r.measured_seconds for r in rows]
    ratios = [p / m for p, m in zip(predicted, measured)]
    if not rows:
        return {}
    return {"spearman": spearman(predicted, measured), "median_ratio": statistics.median(ratios),
            "worst_ratio": max(ratios, key=lambda x: abs(math.log(x)))}


def format_table(rows: Sequence[ModelRow], preset: str) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="one device: predicted against measured step time")
    for column in ("model", "GFLOP", "measured ms (IQR)", "calibrated ms", "ratio", f"{preset} ms", "ratio",
                   "compile s"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for r in rows:
        table.add_row(r.model, f"{r.flops / 1e9:.2f}", f"{r.measured_seconds * 1e3:.3f} ({r.iqr_seconds * 1e3:.3f})",
                      f"{r.calibrated_seconds * 1e3:.3f}", f"{r.calibrated_seconds / r.measured_seconds:.2f}",
                      f"{r.datasheet_seconds * 1e3:.3f}", f"{r.datasheet_seconds / r.measured_seconds:.2f}",
                      f"{r.compile_seconds:.1f}")
    console = Console(width=140, record=True)
    with console.capture() as captured:
        console.print(table)
    return captured.get()


def plot(rows: Sequence[ModelRow], preset: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    measured = [r.measured_seconds * 1e3 for r in rows]
    ax.scatter(measured, [r.calibrated_seconds * 1e3 for r in rows], label="calibrated", marker="o")
    ax.scatter(measured, [r.datasheet_seconds * 1e3 for r in rows], label=preset, marker="x")
    for r in rows:
        ax.annotate(r.model, (r.measured_seconds * 1e3, r.calibrated_seconds * 1e3), fontsize=6)
    low, high = min(measured) / 3, max(measured) * 3
    ax.plot([low, high], [low, high], color="grey", linewidth=0.5)
    ax.set(xscale="log", yscale="log", xlabel="measured step (ms)", ylabel="predicted step (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_gpu", metavar="DIR")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), metavar="LIST")
    parser.add_argument("--preset", default=DEFAULT_PRESET, metavar="DEVICE",
                        help=f"datasheet device preset to compare with (default {DEFAULT_PRESET})")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calibrations", type=int, default=2, help="calibrations run (their spread is printed)")
    parser.add_argument("--quick-calibration", action="store_true", help="hlomap calibrate --quick")
    parser.add_argument("--budget-seconds", type=float, default=420.0,
                        help="stop starting new models after this many seconds")
    parser.add_argument("--name", default=None, help="the calibrated cluster's name (default calibrated-BACKEND-N)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import jax

    from hlomap import api
    from hlomap.cost.cluster import hierarchical

    device = jax.devices()[0]
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} device(s): "
          f"{device.device_kind}", flush=True)
    calibrations = []
    for run in range(max(1, args.calibrations)):
        try:
            cluster, measured, seconds = calibrate_once(args.quick_calibration)
        except Exception:  # the step times below are still worth taking against the datasheet
            traceback.print_exc()
            break
        calibrations.append((cluster, measured, seconds))
        print(f"calibration {run + 1}: {seconds:.1f} s", flush=True)
    datasheet = hierarchical(1, 1, args.preset, name=f"1x{args.preset}")
    figures = [calibration_figures(c) for c, _, _ in calibrations]
    if calibrations:
        cluster_path = api.save_calibration(calibrations[0][1], out / f"{args.name or 'calibrated'}.json",
                                            name=args.name)
        print(f"wrote {cluster_path}")
        for key in figures[0]:
            values = [f[key] for f in figures if key in f]
            spread = (max(values) - min(values)) / statistics.median(values) if statistics.median(values) else 0.0
            print(f"  {key:>18}: " + ", ".join(f"{v:.4g}" for v in values) + f"  (spread {spread:.1%})")
        calibrated = api.load_cluster(str(cluster_path))
    else:
        print(f"calibration failed: the 'calibrated' column below is {args.preset}'s", flush=True)
        calibrated = datasheet

    rows: list[ModelRow] = []
    skipped: dict[str, str] = {}

    def save() -> None:
        summary = {"calibrated": ratio_summary(rows, "calibrated_seconds"),
                   "datasheet": ratio_summary(rows, "datasheet_seconds")}
        (out / "bench_gpu.json").write_text(json.dumps({
            "jax": jax.__version__, "backend": jax.default_backend(), "device_kind": device.device_kind,
            "calibrated": bool(calibrations), "calibration_seconds": [s for _, _, s in calibrations],
            "calibration_figures": figures,
            "preset": args.preset, "rows": [r.to_json() for r in rows], "skipped": skipped,
            "summary": summary}, indent=1, default=float) + "\n")

    for name in (m.strip() for m in args.models.split(",") if m.strip()):
        if time.perf_counter() - started > args.budget_seconds:
            skipped[name] = "time budget spent"
            continue
        try:
            flops, (on_calibrated, on_datasheet) = predict(name, (calibrated, datasheet))
            seconds, iqr, compile_seconds = measure_model(name, args.rounds, args.repeats)
        except Exception as err:  # a model that does not fit or compile is a row of the report
            traceback.print_exc()
            skipped[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
            print(f"{name}: skipped ({skipped[name]})", flush=True)
            continue
        rows.append(ModelRow(name, flops, seconds, iqr, on_calibrated, on_datasheet, compile_seconds))
        print(f"{name}: measured {seconds * 1e3:.3f} ms, calibrated {on_calibrated * 1e3:.3f} ms, "
              f"{args.preset} {on_datasheet * 1e3:.3f} ms ({time.perf_counter() - started:.0f} s)", flush=True)
        save()
    save()
    print(format_table(rows, args.preset))
    for label, attribute in (("calibrated", "calibrated_seconds"), (args.preset, "datasheet_seconds")):
        s = ratio_summary(rows, attribute)
        if s:
            print(f"{label}: Spearman {s['spearman']:.3f}, predicted/measured median {s['median_ratio']:.2f}, "
                  f"worst {s['worst_ratio']:.2f}")
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    if rows:
        plot(rows, args.preset, out / "bench_gpu.png")
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
