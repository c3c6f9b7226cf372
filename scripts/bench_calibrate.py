"""Wall time and repeatability of `hlomap calibrate`: the default calibration twice in one process.

    python scripts/bench_calibrate.py                 # 8 host CPU devices on a CPU-only machine
    python scripts/bench_calibrate.py --devices 4 --quick

Prints the wall time of each run, the load average before and after (other processes share the
CPU, and every figure here is a timing), and per fitted figure the two runs' values and their
relative difference |a - b| / max(|a|, |b|), with the median and largest spread.
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
    args = parser.parse_args()

    from hlomap import api

    api.ensure_host_devices(args.devices)
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


if __name__ == "__main__":
    sys.exit(main())
