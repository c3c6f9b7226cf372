"""Compare hlomap's propagated shardings with XLA's (shardy) for reference and random plans of zoo
models, and run each plan against the unsharded step: the acceptance table of the factor graph.

    python scripts/reproduce_propagation.py                        # gpt-tiny
    python scripts/reproduce_propagation.py gpt-tiny bert-tiny t5-tiny vgg19-tiny moe-tiny
    python scripts/reproduce_propagation.py gpt-tiny --random-per-mesh 1

Per model and mesh (1x8, 2x4): data parallel, Megatron, their combination on 2x4 and
--random-per-mesh random conflict-free plans. Each plan is compiled once on 8 host CPU devices
(`hlomap.verify.shardings.check_plan_shardings`); the columns are the fractions of parameters, outputs,
outputs derived on the captured module, and intermediates whose sharding equals XLA's, and
whether the sharded step's outputs equal the unsharded step's (float64; "isolated": only single
elements of Adam's first update differ, see `OutputComparison.isolated_only`).
tests/verify/test_shardings.py asserts on the same rows.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hlomap.plan import Plan  # noqa: E402
from hlomap.propagation.conflicts import MeshAxes  # noqa: E402
from hlomap.propagation.graph import FactorGraph  # noqa: E402
from hlomap.propagation.plans import combine, data_parallel_plan, megatron_plan, random_plans  # noqa: E402
from hlomap.verify.mesh import mesh_of  # noqa: E402
from hlomap.verify.numerics import OutputComparison, reference_outputs  # noqa: E402
from hlomap.verify.shardings import ShardingCategory, check_plan_shardings  # noqa: E402

DEVICES_FLAG = "--xla_force_host_platform_device_count"
MESHES: dict[str, dict[str, int]] = {"1x8": {"model": 8}, "2x4": {"data": 2, "model": 4}}


@dataclass(frozen=True)
class AcceptanceRow:
    model: str
    mesh: str
    plan: str
    groups_sharded: int
    parameters: float
    outputs: float
    captured_outputs: float
    call_outputs: float  # the captured module's call results that are not built from constants alone
    call_outputs_count: int
    intermediates: float
    intermediates_count: int
    numerics: OutputComparison | None
    disagreements: tuple[tuple[tuple[str, str, str], int], ...]  # ((category, verdict, opcode), n)
    notes: tuple[str, ...]


def acceptance_rows(model: str, workdir: str, *, random_per_mesh: int = 10, seed: int = 0,
                    run_numerics: bool = True, float64: bool = True,
                    meshes: Sequence[str] = ("1x8", "2x4")) -> list[AcceptanceRow]:
    """Every plan of the acceptance matrix for one zoo model: data-parallel and Megatron on each
    mesh, their combination on 2x4, and `random_per_mesh` random conflict-free plans per mesh.
    Numerics run in float64 by default (see `hlomap.verify.shardings.check_plan_shardings`)."""
    import jax

    from hlomap import zoo
    from hlomap.hlo.capture import capture

    entry = zoo.get(model)
    step = entry.train_step()
    cap = capture(step, *entry.abstract_args())
    graph = FactorGraph.from_capture(cap)
    example, reference = (reference_outputs(step, entry.example_args(seed=seed), float64=float64)
                          if run_numerics else (None, None))
    rng = np.random.default_rng(seed)
    rows = []
    for mesh_name in meshes:
        shape = MESHES[mesh_name]
        axes = MeshAxes.from_mesh(shape)
        names = list(shape)
        mesh = mesh_of(jax.devices()[:math.prod(shape.values())], shape)
        dp = data_parallel_plan(graph, names[0], axes)
        mg = megatron_plan(graph, names[-1], axes)
        plans = [("data-parallel", dp), ("megatron", mg)]
        if len(names) > 1:
            plans.append(("data-parallel x megatron", combine(dp, mg)))
        plans += [(f"random {i}", p) for i, p in enumerate(random_plans(graph, axes, random_per_mesh, rng))]
        for label, array in plans:
            plan = Plan.from_groups(cap, graph, array, axes)
            where = os.path.join(workdir, f"{model}_{mesh_name}_{label.replace(' ', '_')}")
            report, numerics = check_plan_shardings(cap, plan, mesh, where, example_args=example, reference=reference,
                                                    float64=float64, graph=graph)
            rows.append(AcceptanceRow(
                model, mesh_name, label, int((array >= 0).sum()),
                report.agreement(ShardingCategory.PARAMETER), report.agreement(ShardingCategory.OUTPUT),
                report.agreement(ShardingCategory.CAPTURED_OUTPUT),
                report.agreement(ShardingCategory.CALL_OUTPUT, include_free=False),
                len(report.of(ShardingCategory.CALL_OUTPUT, include_free=False)),
                report.agreement(ShardingCategory.INTERMEDIATE),
                len(report.of(ShardingCategory.INTERMEDIATE)),
                numerics, tuple(report.kinds().most_common()), tuple(report.notes)))
    return rows


def format_rows(rows: Sequence[AcceptanceRow]) -> str:
    lines = [f"{'model':12} {'mesh':4} {'plan':26} {'groups':>6} {'params':>7} {'outputs':>7} {'out/cap':>7} "
             f"{'calls':>7} {'of':>4} {'interm.':>7} {'of':>5} numerics"]
    for r in rows:
        num = "-" if r.numerics is None else ("ok" if r.numerics.ok else
                                              ("isolated" if r.numerics.isolated_only else "FAIL")
                                              + f" {tuple(str(m) for m in r.numerics.failing[:2])}")
        if r.numerics is not None:
            num += f" (max err {r.numerics.max_abs_error:.1e})"
        lines.append(f"{r.model:12} {r.mesh:4} {r.plan:26} {r.groups_sharded:6d} {r.parameters:7.1%} "
                     f"{r.outputs:7.1%} {r.captured_outputs:7.1%} {r.call_outputs:7.1%} {r.call_outputs_count:4d} "
                     f"{r.intermediates:7.1%} {r.intermediates_count:5d} {num}")
        for (cat, verdict, opcode), n in r.disagreements:
            lines.append(f"{'':14}{n} x {cat} {opcode}: {verdict}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/reproduce_propagation.py",
        description="Compare hlomap's propagated shardings with XLA's (shardy) for reference and random "
                    "plans of zoo models, and run each plan against the unsharded step.")
    parser.add_argument("models", nargs="*", default=["gpt-tiny"], metavar="MODEL",
                        help="zoo model names (default gpt-tiny); `hlomap zoo list` shows them")
    parser.add_argument("--random-per-mesh", type=int, default=10, metavar="N",
                        help="random conflict-free plans per mesh (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random plans and example arguments")
    args = parser.parse_args(argv)
    if args.random_per_mesh < 0:
        parser.error(f"--random-per-mesh {args.random_per_mesh}: must be >= 0")
    # XLA:CPU with 8 devices is the oracle; both are read when JAX starts its backends.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {DEVICES_FLAG}=8".strip()
    from hlomap import zoo

    known = set(zoo.names())
    unknown = [m for m in args.models if m not in known]
    if unknown:
        parser.error(f"unknown zoo model(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            rows = acceptance_rows(name, tmp, random_per_mesh=args.random_per_mesh, seed=args.seed)
            print(format_rows(rows), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
