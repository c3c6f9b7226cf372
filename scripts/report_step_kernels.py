"""Where a train step's time goes, kernel by kernel: XLA:CPU's profiler trace against the cost model.

For each zoo model on 8 host CPU devices, the whole step run on one device while the others idle
("alone") and replicated on all eight ("all busy", each device the whole step):

- measured: the step's median wall time without the profiler (both modes timed in interleaved
  rounds, `--rounds` of them, each the median of 3 calls); from JAX's profiler trace
  (`hlomap.verify.trace`) the seconds per device of its matrix kernels (dots, convolutions, the
  fusions handed to a matrix library) and of its other kernels, and how many kernels ran;
- predicted on `--cluster` (default `local`): the cost model's step, split the same way (the
  roofline of its dots and convolutions, of the rest, and the kernel launches it charges);
- the pipeline chain's price of the whole step (what the pipeline task cuts and prices,
  `hlomap.cost.pipeline.chain`) beside the SPMD estimate's roofline, on the all-busy device.

The trace's kernel durations are wall time: all busy, a kernel's thread also waits for one of the
host's cores mid-kernel. The profiler slows the steps too; the medians are timed without it.

    python scripts/report_step_kernels.py                       # the five fidelity models
    python scripts/report_step_kernels.py --models gpt-tiny --steps 10 --cluster local
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, Sequence

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from hlomap import api, zoo  # noqa: E402
from hlomap.cost.pipeline.chain import chain_arrays  # noqa: E402
from hlomap.plan import Plan  # noqa: E402
from hlomap.propagation.conflicts import REPLICATED, MeshAxes  # noqa: E402
from hlomap.propagation.graph import FactorGraph  # noqa: E402
from hlomap.verify.timing import load_average, time_interleaved  # noqa: E402
from hlomap.verify.trace import ProfiledSteps, profile_kernels  # noqa: E402

MODELS = ("gpt-tiny", "haiku-mlp", "bert-tiny", "t5-tiny", "resnet50-tiny")
DEVICES = 8
MATRIX_OPCODES = frozenset({"dot", "convolution"})


@dataclass(frozen=True)
class Priced:
    """The cost model's step split as the trace is: matrix roofline, other roofline, launches."""

    step: float
    matrix: float
    other: float
    launches: float


@dataclass(frozen=True)
class Row:
    model: str
    mode: str
    median: float
    profiled: ProfiledSteps
    priced: Priced


def priced(estimate: Any) -> Priced:
    matrix = other = launches = 0.0
    for row in estimate.instructions:
        work = max(row.compute_seconds, row.memory_seconds)
        if row.opcode in MATRIX_OPCODES:
            matrix += work
        else:
            other += work
        launches += row.seconds - work
    return Priced(float(estimate.step_seconds), matrix, other, launches)


def measure_model(name: str, cluster: Any, steps: int, rounds: int) -> tuple[list[Row], tuple[float, float]]:
    model = zoo.get(name)
    cap = api.load_source(f"zoo:{name}")
    graph = FactorGraph.from_capture(cap)
    step = jax.jit(model.train_step())
    args = tuple(model.example_args(0))
    devices = jax.devices()[:DEVICES]
    everywhere = NamedSharding(Mesh(np.asarray(devices), ("all",)), PartitionSpec())
    replicated = Plan.from_groups(cap, graph, np.full(graph.num_groups, REPLICATED, dtype=np.int8),
                                  MeshAxes.from_mesh({"data": DEVICES}))
    modes = (("alone", jax.device_put(args, devices[0]), 1, api.estimate(cap, "dp", mesh={"data": 1}, cluster=cluster)),
             ("all busy", jax.device_put(args, everywhere), DEVICES, api.estimate(cap, replicated, cluster=cluster)))
    runs = {mode: (lambda placed=placed: jax.block_until_ready(step(*placed))) for mode, placed, _, _ in modes}
    timed = time_interleaved(runs, rounds=rounds, repeats=3)  # the two modes in alternating rounds
    rows = [Row(name, mode, timed[mode].median, profile_kernels(runs[mode], steps=steps, devices=count),
                priced(estimate)) for mode, _, count, estimate in modes]
    # the pipeline chain's price of the whole step against the SPMD estimate's roofline, all busy
    chain = chain_arrays(cap, cluster.devices[0], graph=graph)
    profile = chain.profile
    chain_seconds = float(profile.forward_time.sum() + profile.backward_time.sum()) + chain.update_seconds \
        + chain.unattributed_seconds
    busy = rows[-1].priced
    return rows, (chain_seconds, busy.matrix + busy.other)


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f}"


def print_rows(rows: Sequence[Row], console: Console) -> None:
    table = Table(title="measured (trace) against predicted, per device and step, ms")
    for column in ("model", "mode", "measured step", "matrix kernels", "other kernels", "kernels",
                   "step - kernels", "predicted step", "matrix", "other", "launches", "pred. / meas."):
        table.add_column(column, justify="left" if column in ("model", "mode") else "right")
    for row in rows:
        p = row.profiled
        # the trace's kernel seconds against the median step without the profiler
        table.add_row(row.model, row.mode, ms(row.median), ms(p.matrix_seconds), ms(p.kernel_seconds - p.matrix_seconds),
                      f"{p.kernel_calls:.0f}", ms(row.median - p.kernel_seconds), ms(row.priced.step),
                      ms(row.priced.matrix), ms(row.priced.other), ms(row.priced.launches),
                      f"{row.priced.step / row.median:.2f}")
    console.print(table)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated zoo names")
    parser.add_argument("--cluster", default="local", help="the cluster the cost model prices on (default local)")
    parser.add_argument("--steps", type=int, default=5, help="steps profiled per model and mode (default 5)")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds timed without the profiler (default 20)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=170)  # the table's 12 columns, unfolded in a log too
    if len(jax.devices()) < DEVICES:
        console.print(f"needs {DEVICES} devices, JAX sees {len(jax.devices())}")
        return 2
    cluster = api.load_cluster(args.cluster)  # once: `local` is read from its cache, or measured
    before = load_average()
    rows: list[Row] = []
    chains = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        found, chain = measure_model(name, cluster, args.steps, args.rounds)
        rows.extend(found)
        chains.append((name, *chain))
        console.print(f"{name}: done", style="dim")
    print_rows(rows, console)
    for name, chain_seconds, spmd_seconds in chains:
        console.print(f"{name}: the pipeline chain prices the step at {ms(chain_seconds)} ms all busy, the SPMD "
                      f"estimate's roofline at {ms(spmd_seconds)} ms ({chain_seconds / spmd_seconds:.2f}x)")
    console.print(f"load average (1, 5, 15 min) before {' '.join(f'{x:.2f}' for x in before)}, after "
                  f"{' '.join(f'{x:.2f}' for x in load_average())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
