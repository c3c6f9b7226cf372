"""Issue #7 acceptance: the DQN's pipeline cuts against the DP optimum on zoo steps.

For GPT, BERT and T5 train steps on Auto-MAP's clusters A, B and C (2, 3 and 4 servers of 8
V100s: 2, 3 and 4 stages, each stage one server, data parallel inside it), prints model, config,
stages, DP L, DQN L, gap, search seconds, whether the device cuts are on server boundaries, and
what the inference network alone (no training on the model) lands on. L is the closed form both
the DP and the DQN minimize; "sim L" is the event simulator's L of the DP's and the DQN's plans.
Two baselines on the DQN's own ranked candidates show what the pruning alone gives: "first"
always takes the best-estimated candidate, "random" is random search with the DQN's episode
budget. Timings are wall-clock on this machine; the load average is printed before and after.

    python scripts/reproduce_pipeline.py [--models gpt-small bert-base t5-small] \
        [--configs A B C] [--seeds 0] [--episodes 2000] [--microbatches 8] [--no-infer]

Acceptance: the DQN within 1% of the DP optimum in at least 95% of the cases.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

from rich.console import Console
from rich.table import Table

from pipeline_acceptance import ACCEPTANCE_MODELS, CONFIG_STAGES, model_profile, run_case
from hlomap.search.budget import Budget
from hlomap.cost.pipeline.stages import Schedule


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(ACCEPTANCE_MODELS))
    parser.add_argument("--configs", nargs="+", default=list(CONFIG_STAGES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--episodes", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=None, help="DQN time limit per case")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", choices=[s.value for s in Schedule], default="1f1b")
    parser.add_argument("--policy", default=None, help="inference policy file (default: shipped)")
    parser.add_argument("--no-infer", action="store_true", help="skip the inference network")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    console = Console(width=260)
    table = Table(title=f"Pipeline cuts: DQN vs DP (M = {args.microbatches}, {args.schedule}, "
                        f"{args.episodes} episodes)")
    for column in ("model", "config", "S", "pivots", "seed", "DP L (ms)", "DQN L (ms)", "gap %",
                   "search s", "found at", "on server bounds", "DP s", "sim L DP (ms)", "sim L DQN (ms)",
                   "first gap %", "random gap %", "random s", "infer L (ms)", "infer gap %",
                   "infer s"):
        table.add_column(column, justify="left" if column in ("model", "config") else "right")
    console.print(f"load average before: {_load()}")
    cases = []
    budget = Budget(episodes=args.episodes, seconds=args.seconds)
    for model in args.models:
        start = time.perf_counter()
        hlo = model_profile(model)
        console.print(f"{model}: {hlo.chain.profile.n_layers} forward instructions, "
                      f"{len(hlo.pivots)} pivots ({time.perf_counter() - start:.1f} s)")
        for config in args.configs:
            for seed in args.seeds:
                case = run_case(model, config, hlo=hlo, microbatches=args.microbatches,
                                schedule=Schedule(args.schedule), budget=budget, seed=seed,
                                policy_path=args.policy, infer=not args.no_infer)
                cases.append(case)
                infer = case.infer_value is not None
                table.add_row(
                    model, case.config, str(case.stages), str(case.pivots), str(seed),
                    f"{case.dp_value * 1e3:.5g}", f"{case.dqn_value * 1e3:.5g}",
                    f"{100 * case.gap:.3f}", f"{case.dqn_seconds:.1f}",
                    f"{case.dqn_found_at}/{case.dqn_episodes}",
                    "yes" if case.dqn_on_server_boundaries else "NO", f"{case.dp_seconds:.2f}",
                    f"{case.dp_simulated * 1e3:.4g}", f"{case.dqn_simulated * 1e3:.4g}",
                    f"{100 * case.first_gap:.3f}", f"{100 * case.random_gap:.3f}",
                    f"{case.random_seconds:.1f}",
                    f"{case.infer_value * 1e3:.5g}" if infer else "-",
                    f"{100 * case.infer_gap:.2f}" if infer else "-",
                    f"{case.infer_seconds:.1f}" if infer else "-",
                )
                console.print(f"  {model} {case.config} seed {seed}: gap "
                              f"{100 * case.gap:.3f}% in {case.dqn_seconds:.1f} s")
    console.print(table)
    console.print(f"load average after: {_load()}")
    within = sum(case.gap <= 0.01 for case in cases)
    console.print(f"DQN within 1% of the DP optimum: {within}/{len(cases)} cases "
                  f"({100 * within / len(cases):.0f}%; acceptance needs 95%); all device cuts on "
                  f"server boundaries: {all(c.dqn_on_server_boundaries for c in cases)}")
    seconds = [c.dqn_seconds for c in cases]
    console.print(f"DQN search time per case: mean {sum(seconds) / len(seconds):.1f} s, "
                  f"max {max(seconds):.1f} s")
    for label, key in (("first candidate", "first_gap"), ("random search", "random_gap")):
        close = sum(getattr(c, key) <= 0.01 for c in cases)
        console.print(f"baseline {label}: within 1% in {close}/{len(cases)} cases, worst "
                      f"{100 * max(getattr(c, key) for c in cases):.3f}%")
    if not args.no_infer:
        gaps = [c.infer_gap for c in cases if c.infer_gap is not None]
        close = sum(g <= 0.01 for g in gaps)
        console.print(f"inference alone: within 1% in {close}/{len(gaps)} cases, mean gap "
                      f"{100 * sum(gaps) / len(gaps):.2f}%, worst {100 * max(gaps):.2f}%")


if __name__ == "__main__":
    main()
