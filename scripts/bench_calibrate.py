"""Wall time and repeatability of `hlomap calibrate`: the default calibration twice in one process.

    python scripts/bench_calibrate.py                 # 8 host CPU devices on a CPU-only machine
    python scripts/bench_calibrate.py --devices 4 --quick
    python scripts/bench_calibrate.py --quick-against-default   # how rough --quick is

Prints the wall time of each run, the load average before and after (other processes share the
CPU, and every figure here is a timing), and per fitted figure the two runs' values and their
relative difference |a - b| / max(|a|, |b|), with the median and largest spread.

--quick-against-default makes one default calibration and then two quick ones, back to back, and
prices the zoo's dp and megatron plans on each: the quick runs' prices over the default run's,
per plan, with their range and median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="devices to measure (default 8)")
    parser.add_argument("--quick", action="store_true", help="the quick calibration instead of the default")
    parser.add_argument("--quick-against-default", action="store_true",
                        help="price the zoo's dp and megatron plans on a default calibration and two quick ones")
    args = parser.parse_args()

    from hlomap import api

    api.ensure_host_devices(args.devices)
    if args.quick_against_default:
        return quick_against_default(args.devices)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    runs = []
    for i in range(2):
        start = time.perf_counter()
        _, calibration = api.calibrate(args.devices, quick=args.quick)
        wall = time.perf_counter() - start
        print(f"run {i + 1}: {wall:.1f} s wall ({calibration.wall_seconds:.1f} s measuring), "
              f"{len(calibration.kernels)} kernel and {len(calibration.comm)} communication samples")
        runs.append(calibration.figures())
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    first, second = runs
    spreads = {}
    print(f"\n{'figure':44} {'run 1':>11} {'run 2':>11} {'spread':>8}")
    for name in first:
        a, b = first[name], second[name]
        spread = abs(a - b) / max(abs(a), abs(b)) if max(abs(a), abs(b)) > 0 else 0.0
        spreads[name] = spread
        print(f"{name:44} {a:11.4g} {b:11.4g} {spread:8.1%}")
    worst = max(spreads, key=spreads.__getitem__)
    print(f"\nspread: median {statistics.median(spreads.values()):.1%}, largest {spreads[worst]:.1%} ({worst})")
    return 0


#: The zoo's models and built-in plans that --quick-against-default prices.
PRICED_MODELS = ("gpt-tiny", "haiku-mlp", "bert-tiny", "t5-tiny", "resnet50-tiny")
PRICED_PLANS = ("dp", "megatron")


def quick_against_default(devices: int) -> int:
    """One default calibration, then two quick ones; each quick run's prices of the zoo's plans
    over the default run's."""
    from hlomap import api
    from hlomap.cost.calibration import calibrated_cluster

    print(f"load average before: {os.getloadavg()[0]:.2f}")
    clusters = {}
    for name, quick in (("default", False), ("quick 1", True), ("quick 2", True)):
        start = time.perf_counter()
        _, calibration = api.calibrate(devices, quick=quick)
        print(f"{name}: {time.perf_counter() - start:.1f} s wall, load average {os.getloadavg()[0]:.2f}")
        clusters[name] = calibrated_cluster(calibration)
    ratios: dict[str, list[float]] = {"quick 1": [], "quick 2": []}
    print(f"\n{'model':14} {'plan':9} " + " ".join(f"{name + ' ms':>11}" for name in clusters))
    for model in PRICED_MODELS:
        cap = api.load_source(f"zoo:{model}")
        for plan in PRICED_PLANS:
            prices = {name: float(api.estimate(cap, plan, cluster=cluster).step_seconds)
                      for name, cluster in clusters.items()}
            for name in ratios:
                ratios[name].append(prices[name] / prices["default"])
            print(f"{model:14} {plan:9} " + " ".join(f"{1e3 * seconds:11.2f}" for seconds in prices.values()))
    for name, values in ratios.items():
        print(f"{name} over default: {min(values):.2f}-{max(values):.2f}x, median {statistics.median(values):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
