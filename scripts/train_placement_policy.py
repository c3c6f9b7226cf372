"""Train the PPO device-placement policy (DRL-PP) and write the policy file.

Every episode places a fresh random problem (`hlomap.tasks.placement.generate.random_problem`:
torus, mesh, hierarchical, random-block and random-uniform clusters of 8-64 devices; spmd meshes
and pipelines with random message sizes). Every --validate-every episodes the policy's greedy
rollouts are compared with the greedy construction on --validation held-out problems; the best
network is kept and written to --out.

    python scripts/train_placement_policy.py [--episodes 20000] [--seconds N] [--seed 0] \
        [--out hlomap/tasks/placement/data/placement_policy.npz]

The run is deterministic given the seed and the episode count (up to floating-point reductions on
other hardware); --seconds stops it early at an episode boundary, which depends on the machine.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from rich.console import Console

from hlomap.tasks.placement.ppo import (DEFAULT_POLICY, PlacementTrainingConfig, PlacementValidation,
                                        train_placement_policy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=PlacementTrainingConfig.episodes)
    parser.add_argument("--seconds", type=float, default=None, help="also stop after this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--validation", type=int, default=PlacementTrainingConfig.validation)
    parser.add_argument("--validate-every", type=int, default=PlacementTrainingConfig.validate_every)
    parser.add_argument("--out", type=Path, default=DEFAULT_POLICY)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    console = Console(width=120)
    start = time.perf_counter()

    def report(episode: int, score: PlacementValidation) -> None:
        console.print(f"episode {episode:>7}  {time.perf_counter() - start:7.0f} s  validation: mean gain over the "
                      f"greedy construction {100 * score.mean_gain:+7.3f}%  better on {100 * score.better:5.1f}%  "
                      f"worse on {100 * score.worse:5.1f}%")

    config = PlacementTrainingConfig(episodes=args.episodes, seed=args.seed, validation=args.validation,
                            validate_every=args.validate_every, seconds=args.seconds,
                            progress=not args.no_progress)
    _, best = train_placement_policy(config, out=args.out, report=report)
    console.print(f"kept the network with mean gain {100 * best.mean_gain:+.3f}% over the construction (better on "
                  f"{100 * best.better:.1f}%, worse on {100 * best.worse:.1f}% of {args.validation} problems); wrote "
                  f"{args.out} ({args.out.stat().st_size / 2**20:.2f} MiB) in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
