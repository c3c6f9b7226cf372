"""Train the pipeline-cut inference network (Auto-MAP section 3.5) and write the policy file.

Every episode is a fresh random 128-pivot problem (`hlomap.tasks.pipeline.normalize.random_task`:
uniform / normal / binomial arrays, 2-8 stages, random links, microbatches, schedule, objective
and memory). Every --validate-every episodes the greedy policy is compared with the DP optimum
on --validation held-out random tasks; the best network is kept and written to --out.

    python scripts/train_pipeline_infer.py [--episodes 100000] [--seed 0] \
        [--out hlomap/pipeline/data/cut_policy.npz]

The shipped policy was made with the defaults; the run is deterministic given the seed (up to
floating-point reductions on other hardware).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from rich.console import Console

from hlomap.report.progress import training_bar
from hlomap.tasks.pipeline.infer import DEFAULT_POLICY, TrainingConfig, Validation, train_policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=TrainingConfig.episodes)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--validation", type=int, default=TrainingConfig.validation)
    parser.add_argument("--validate-every", type=int, default=TrainingConfig.validate_every)
    parser.add_argument("--out", type=Path, default=DEFAULT_POLICY)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    console = Console(width=120)
    start = time.perf_counter()

    def report(episode: int, score: Validation) -> None:
        console.print(
            f"episode {episode:>7}  {time.perf_counter() - start:7.0f} s  validation: mean gap "
            f"{100 * score.mean_gap:6.2f}%  within 1% {100 * score.within_1pct:5.1f}%  "
            f"out of memory {score.infeasible}"
        )

    config = TrainingConfig(
        episodes=args.episodes, seed=args.seed, validation=args.validation,
        validate_every=args.validate_every,
    )
    with training_bar(not args.no_progress, console=console) as on_progress:
        _, best = train_policy(config, out=args.out, report=report, on_progress=on_progress)
    console.print(
        f"kept the network with mean gap {100 * best.mean_gap:.2f}%, within 1% on "
        f"{100 * best.within_1pct:.1f}% of {args.validation} validation tasks; wrote {args.out} "
        f"({args.out.stat().st_size / 2**20:.2f} MiB) in {time.perf_counter() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
