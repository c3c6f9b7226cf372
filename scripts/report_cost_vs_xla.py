"""Check hlomap's cost model against XLA on 8 host CPU devices and print the error table.

For each zoo model and plan (data parallel, Megatron, 2x4 data x Megatron, random plans), the
estimate's collective bytes per kind, FLOPs and peak memory per device are compared with what
XLA compiles (`compiled.as_text()`, `cost_analysis()`, `memory_analysis()`).

    python scripts/report_cost_vs_xla.py                       # the *-tiny models
    python scripts/report_cost_vs_xla.py --models gpt-small,t5-small --random 2
    python scripts/report_cost_vs_xla.py --json errors.json

Goals (issue #4): collective bytes within 10% per kind, FLOPs within 5%, memory within 25%.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import numpy as np  # noqa: E402

TINY = ("gpt-tiny", "bert-tiny", "t5-tiny", "vgg19-tiny", "moe-tiny")
GOALS = {"bytes": 0.10, "flops": 0.05, "memory": 0.25}
HYBRID_MESH = {"data": 2, "model": 4}


def _goal(quantity: str) -> float:
    return GOALS["bytes"] if quantity.endswith("bytes") else GOALS[quantity]


def _fmt_error(err: float | None) -> str:
    if err is None:
        return "-"
    if not np.isfinite(err):
        return "only ours"
    return f"{100 * err:+.1f}%"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(TINY), help="comma-separated zoo names")
    parser.add_argument("--random", type=int, default=3, metavar="N", help="random plans per model (mesh 2x4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="also write every row as JSON")
    args = parser.parse_args(argv)

    from hlomap.verify.xla import check_plan_against_xla
    from hlomap.propagation.graph import FactorGraph
    from hlomap.propagation.plans import random_plans
    from hlomap.propagation.conflicts import MeshAxes
    from hlomap.api import load_source

    records = []
    print(f"{'model':12s} {'plan':12s} {'quantity':26s} {'ours':>14s} {'xla':>14s} {'error':>9s}  ok")
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        cap = load_source(f"zoo:{model}")
        graph = FactorGraph.from_capture(cap)
        plans: list[tuple[str, object, object]] = [("dp", "dp", 8), ("megatron", "megatron", 8),
                                                  ("dp+megatron", "dp+megatron", HYBRID_MESH)]
        axes = MeshAxes.from_mesh(HYBRID_MESH)
        rng = np.random.default_rng(args.seed)
        for k, row in enumerate(random_plans(graph, axes, args.random, rng)):
            plans.append((f"random{k}", row, axes))
        for label, plan, mesh in plans:
            start = time.perf_counter()
            check = check_plan_against_xla(cap, graph, plan, mesh, model=model, name=label)
            elapsed = time.perf_counter() - start
            for r in check.rows:
                ok = r.error is not None and np.isfinite(r.error) and abs(r.error) <= _goal(r.quantity)
                if r.error is None:
                    ok = True
                print(f"{model:12s} {label:12s} {r.quantity:26s} {r.predicted:14.0f} {r.measured:14.0f} "
                      f"{_fmt_error(r.error):>9s}  {'yes' if ok else 'NO'}")
                records.append({"model": model, "plan": label, "quantity": r.quantity, "ours": r.predicted,
                                "xla": r.measured, "error": r.error, "ok": ok, "seconds": elapsed})
            sys.stdout.flush()

    print("\nsummary (max |error| per quantity; rows within goal / rows):")
    by_quantity: dict[str, list[dict]] = {}
    for rec in records:
        key = "collective bytes" if rec["quantity"].endswith("bytes") else rec["quantity"]
        by_quantity.setdefault(key, []).append(rec)
    for key, recs in by_quantity.items():
        finite = [abs(r["error"]) for r in recs if r["error"] is not None and np.isfinite(r["error"])]
        worst = max(finite, default=0.0)
        print(f"  {key:18s} max {100 * worst:6.1f}%   {sum(r['ok'] for r in recs)}/{len(recs)} within goal "
              f"({100 * GOALS['bytes' if key == 'collective bytes' else key]:.0f}%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1, default=lambda x: None if x is None or not np.isfinite(x) else x)
    return 0


if __name__ == "__main__":
    sys.exit(main())
