"""Train the re-planning meta-network (AutoPipe's gain predictor, an LSTM in Flax NNX) and write it.

Training data: generated traces (`hlomap.tasks.replan.trace.generate`: steps, drift, leave, mixed)
on two clusters (4 servers of 4 GPUs, 8 servers of 2) with a GPT-style workload
(`options.transformer_workload`); along the plans the exact switch arbiter runs, every change gives
one sample: the LSTM's view of the last changes, and the gains a move and a re-solve realize on
the trace when held (`meta.hold_gains`). Held-out traces (other seeds) pick the network (early
stopping on their loss).

    python scripts/train_replan_meta.py [--seeds 6] [--steps 3000] \
        [--out hlomap/tasks/replan/data/gain_lstm.npz]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hlomap.tasks.replan.meta import DEFAULT_NETWORK, samples, save_network, train_meta  # noqa: E402
from hlomap.tasks.replan.options import initial_plan, transformer_workload  # noqa: E402
from hlomap.tasks.replan.trace import TraceKind, generate  # noqa: E402

CLUSTERS = ("hier:4x4", "hier:8x2")


def collect(seeds: range) -> list:
    out = []
    for cluster in CLUSTERS:
        for kind in TraceKind:
            for seed in seeds:
                trace = generate(kind, cluster, seed=seed)
                workload = transformer_workload(seed=seed)
                start = time.perf_counter()
                out += samples(trace, workload, initial_plan(workload, trace.states()[0][1]))
                print(f"  {cluster} {trace.name}: {len(out)} samples so far ({time.perf_counter() - start:.0f} s)",
                      flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=6, help="training traces per cluster and kind")
    parser.add_argument("--validation-seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--out", type=Path, default=DEFAULT_NETWORK)
    args = parser.parse_args()
    start = time.perf_counter()
    train = collect(range(args.seeds))
    held = collect(range(1000, 1000 + args.validation_seeds))
    params, held_loss = train_meta(train, validation=held, steps=args.steps)
    mask = np.stack([s.present for s in held])
    truth = np.stack([s.gains for s in held])
    base_loss = float(np.sum((truth * mask) ** 2) / max(mask.sum(), 1))
    print(f"{len(train)} training samples; kept the network with held-out loss {held_loss:.5f} on {len(held)} "
          f"samples (predicting 0: {base_loss:.5f})")
    save_network(args.out, params, extra={"samples": len(train), "held_out_samples": len(held),
                                          "held_out_loss": held_loss, "zero_loss": base_loss,
                                          "seconds": round(time.perf_counter() - start, 1)})
    print(f"wrote {args.out} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
