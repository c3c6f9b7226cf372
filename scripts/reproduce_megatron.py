"""The joint planner against Megatron-LM's weak-scaling table (Narayanan et al., SC'21, Table 1).

GPT models of 1.7B to 1T parameters (sequence 2048, vocabulary 51,200, the zoo's GPT layout in
bfloat16 with float32 parameters and Adam state), each on the number of DGX A100 80 GB servers
Megatron-LM trained it on (8 GPUs per server on NVLink, 8 x 200 Gb/s InfiniBand per server), with
Megatron's global batch. Per row: the joint plan (`explore_joint`, exact, 1F1B, the default
microbatch range and recomputation choices), its predicted step time, TFLOP/s per GPU by 6N
tokens and by Megatron's formula (96 B s l h^2 (1 + s / 6h + V / 16lh)), memory per device,
Megatron's own configuration (pp, tp, dp) priced by the same model (the expert grid's point, its
best microbatch count, with or without full recomputation), the time Megatron measured (its
formula's FLOPs at its reported TFLOP/s per GPU), and the planning time (capture excluded) and
peak memory of the process.

    python scripts/reproduce_megatron.py [--rows 1.7B 3.6B ...] [--csv out.csv]

Planning runs on one core; capturing the larger models takes a minute or more each (lowering the
Python-unrolled layers), which the planning time does not include.
"""

from __future__ import annotations

import argparse
import csv
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from hlomap.cost.cluster import Cluster, hierarchical  # noqa: E402
from hlomap.hlo.capture import Capture, capture  # noqa: E402
from hlomap.plan import Recompute  # noqa: E402
from hlomap.tasks.joint.explore import JointResult, explore_joint, joint_model  # noqa: E402
from hlomap.tasks.pipeline.solution import NoFeasiblePlan  # noqa: E402
from hlomap.zoo.gpt import GptConfig  # noqa: E402
from hlomap.zoo.model import ZooModel  # noqa: E402

SEQUENCE = 2048
VOCABULARY = 51_200
#: DGX A100: NVLink 3 through NVSwitch (300 GB/s each way per GPU), 8 HDR InfiniBand NICs of 25 GB/s.
NVLINK_A100 = (300e9, 3e-6)
INFINIBAND_HDR = (25e9, 5e-6)
NICS_PER_SERVER = 8


@dataclass(frozen=True)
class Row:
    """One row of Megatron-LM's Table 1: the model, its GPUs and batch, Megatron's (tp, pp) and
    the TFLOP/s per GPU it achieved."""

    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def parameters(self) -> float:
        """Megatron's count: 12 l h^2 (1 + 13 / 12h + (V + s) / 12lh)."""
        h, lay = self.hidden, self.layers
        return 12 * lay * h * h * (1 + 13 / (12 * h) + (VOCABULARY + SEQUENCE) / (12 * lay * h))

    @property
    def flops_per_step(self) -> float:
        """Megatron's formula (with recomputation): 96 B s l h^2 (1 + s / 6h + V / 16lh)."""
        h, lay = self.hidden, self.layers
        return 96 * self.batch * SEQUENCE * lay * h * h * (1 + SEQUENCE / (6 * h) + VOCABULARY / (16 * lay * h))

    @property
    def measured_seconds(self) -> float:
        return self.flops_per_step / (self.tflops * 1e12 * self.gpus)


ROWS = (
    Row("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    Row("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    Row("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    Row("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    Row("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    Row("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    Row("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    Row("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    Row("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    Row("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def dgx_a100_cluster(gpus: int) -> Cluster:
    return hierarchical(gpus // 8, 8, "A100-80GB", intra_bw=NVLINK_A100[0], inter_bw=INFINIBAND_HDR[0],
                        intra_lat=NVLINK_A100[1], inter_lat=INFINIBAND_HDR[1], nics_per_node=NICS_PER_SERVER,
                        name=f"dgx-a100-{gpus // 8}x8")


def capture_row(row: Row) -> Capture:
    config = GptConfig(num_layers=row.layers, d_model=row.hidden, num_heads=row.heads, d_ff=4 * row.hidden,
                       vocab_size=VOCABULARY, max_positions=SEQUENCE, batch_size=row.batch, seq_len=SEQUENCE,
                       compute_dtype="bfloat16")
    model = ZooModel(name=f"gpt-{row.name}", family=config.family, description=f"Megatron-LM Table 1, {row.name}",
                     config=config, parameters=0)
    return capture(model.train_step(), *model.abstract_args())


def megatron_point(result: JointResult, row: Row):  # type: ignore[no-untyped-def]
    return next((g for g in result.grid if (g.pp, g.tp, g.dp) == (row.pp, row.tp, row.dp)), None)


#: How `describe` marks a stage's recomputation: r in full, s selectively (all but the matmuls).
_RECOMPUTE_MARK = {Recompute.NONE: "", Recompute.SELECTIVE: "s", Recompute.FULL: "r"}


def describe(result: JointResult) -> str:
    parts = []
    for stage in result.plan.stages:
        option = stage.option
        # FSDP, ZeRO-2, ZeRO-1
        state = "f" if option.shard_parameters else "g" if option.shard_gradients else "z" if option.split_state else ""
        parts.append(f"{option.devices}:d{option.data}xt{option.model}{_RECOMPUTE_MARK[option.recompute]}{state}")
    return f"{len(parts)} stages " + " ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="*", default=[r.name for r in ROWS[:7]],
                        help=f"rows of Table 1 (default the first seven; all: {' '.join(r.name for r in ROWS)})")
    parser.add_argument("--csv", help="also write the table here")
    parser.add_argument("--shard-parameters", choices=("auto", "on", "off"), default="auto",
                        help="stages whose gradients (ZeRO-2) or parameters (FSDP) are split: searched only when "
                             "nothing fits without (auto, the planner's default), always (on) or never (off)")
    args = parser.parse_args()
    console = Console(width=220)
    by_name = {r.name: r for r in ROWS}
    unknown = [n for n in args.rows if n not in by_name]
    if unknown:
        parser.error(f"unknown rows {unknown}; rows are {' '.join(by_name)}")
    table = Table(title="The joint planner against Megatron-LM (SC'21 Table 1), priced on DGX A100 80 GB servers")
    columns = ("model", "GPUs", "plan", "M", "predicted s", "TFLOP/s/GPU 6N", "TFLOP/s/GPU Megatron", "GiB/device",
               "Megatron config", "its predicted s", "Megatron measured s", "planning s", "peak RSS GiB")
    for column in columns:
        table.add_column(column, justify="left" if column in ("model", "plan", "Megatron config") else "right")
    records = []
    for name in args.rows:
        row = by_name[name]
        start = time.perf_counter()
        cap = capture_row(row)
        captured = time.perf_counter() - start
        cluster = dgx_a100_cluster(row.gpus)
        start = time.perf_counter()
        try:
            shard = {"auto": None, "on": True, "off": False}[args.shard_parameters]
            result = explore_joint(cap, cluster, model=joint_model(cap, cluster), shard_parameters=shard)
        except NoFeasiblePlan as err:
            planning = time.perf_counter() - start
            table.add_row(row.name, str(row.gpus), f"NoFeasiblePlan: {err}", *[""] * 8, f"{planning:.0f}", "")
            continue
        planning = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        seconds = result.cost.latency
        tokens = row.batch * SEQUENCE
        six_n = 6 * row.parameters * tokens / (seconds * row.gpus) / 1e12
        formula = row.flops_per_step / (seconds * row.gpus) / 1e12
        point = megatron_point(result, row)
        theirs = (f"{point.cost.latency:.2f}" if point is not None and point.cost is not None
                  else ("does not fit" if point is not None else "not in the grid"))
        label = f"pp={row.pp} tp={row.tp} dp={row.dp}"
        if point is not None and point.plan is not None:
            recomputed = any(s.recompute is not Recompute.NONE for s in point.plan.stages)
            label += f" M={point.plan.microbatches}" + (" recompute" if recomputed else "")
        memory = max(result.cost.stage_memory) / 2**30
        cells = (row.name, str(row.gpus), describe(result), str(result.plan.microbatches), f"{seconds:.2f}",
                 f"{six_n:.0f}", f"{formula:.0f}", f"{memory:.1f}", label, theirs, f"{row.measured_seconds:.2f}",
                 f"{planning:.0f}", f"{peak:.2f}")
        table.add_row(*cells)
        records.append(dict(zip(columns, cells)) | {"capture s": f"{captured:.0f}"})
        # each row as it is done: the largest take many minutes
        console.print(f"{row.name}: captured in {captured:.0f} s, planned in {planning:.0f} s: "
                      + " | ".join(f"{k} {v}" for k, v in zip(columns[2:], cells[2:])), highlight=False)
        if args.csv:
            with open(args.csv, "w", newline="") as out:
                writer = csv.DictWriter(out, fieldnames=list(records[0]))
                writer.writeheader()
                writer.writerows(records)
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
