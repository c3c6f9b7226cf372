"""Speed of the factor graph: build time, and plans checked per second with specs derived.

    python scripts/bench_propagation.py                       # gpt-base and t5-11b
    python scripts/bench_propagation.py --models gpt-tiny --plans 20000 --batch 5000

Goals (issue #3): build < 3 s for zoo:gpt-base; >= 10,000 plans/s checked with specs derived.
Capture (jax lowering + parsing) is timed separately: it is not part of the factor graph.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gpt-base", "t5-11b"])
    parser.add_argument("--mesh", default="data=2,model=4", help="axis=size,... (default data=2,model=4)")
    parser.add_argument("--plans", type=int, default=50_000, help="random plans to check per model")
    parser.add_argument("--batch", type=int, default=10_000, help="plans per vectorized call")
    parser.add_argument("--repeats", type=int, default=3, help="graph builds to time (median reported)")
    args = parser.parse_args()

    import numpy as np

    import hlomap
    from hlomap import zoo
    from hlomap.propagation import ConflictChecker, FactorGraph, MeshAxes, parameter_options, random_plans

    mesh = {k: int(v) for k, v in (item.split("=") for item in args.mesh.split(","))}
    axes = MeshAxes.from_mesh(mesh)
    print(f"mesh {mesh}; {args.plans} random plans per model in batches of {args.batch}")
    for name in args.models:
        entry = zoo.get(name)
        t0 = time.perf_counter()
        cap = hlomap.capture(entry.train_step(), *entry.abstract_args())
        capture_s = time.perf_counter() - t0
        builds = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            graph = FactorGraph.from_capture(cap)
            builds.append(time.perf_counter() - t0)
        checker = ConflictChecker(graph, axes)
        rng = np.random.default_rng(0)
        # Half conflict-free plans (the explorers' kind), half unconstrained random assignments
        # over the parameter groups (mostly conflicting), so both outcomes are exercised.
        groups = np.asarray(graph.parameter_groups_all())
        pool_free = random_plans(graph, axes, args.batch // 2, rng)
        pool_any = np.full((args.batch - args.batch // 2, graph.num_groups), -1, dtype=np.int8)
        pool_any[:, groups] = rng.integers(-1, len(axes.options), size=(len(pool_any), len(groups)))
        pool = np.concatenate([pool_free, pool_any])
        checked = 0
        ok = 0
        t0 = time.perf_counter()
        while checked < args.plans:
            good = checker.ok(pool)
            specs = parameter_options(graph, pool)
            ok += int(good.sum())
            checked += len(pool)
            assert specs.shape[0] == len(pool)
        check_s = time.perf_counter() - t0
        print(f"{name}: {cap.module.instruction_count} instructions, {graph.num_dims} dims, "
              f"{graph.num_groups} groups, {len(checker.pairs)} exclusive pairs")
        print(f"  capture {capture_s:.2f} s; factor graph build {statistics.median(builds):.2f} s "
              f"(median of {args.repeats}: {', '.join(f'{b:.2f}' for b in builds)})")
        print(f"  {checked / check_s:,.0f} plans/s checked with specs derived "
              f"({ok / checked:.0%} conflict-free)")


if __name__ == "__main__":
    main()
