"""Throughput of hlomap.agents: learner updates per second and environment steps per second.

    python scripts/bench_agents.py            # every configuration below (a few minutes)
    python scripts/bench_agents.py --quick    # shorter timing windows
    python scripts/bench_agents.py --json out.json

Learner: batch 32, a 2x256 MLP (dueling head), 512-dim observations, 2 and 128 actions, replay of
2000 transitions. "step" is the jitted update alone on a fixed batch; "update" is what the agent
does per learner call: prioritized sample, jitted update(s), priority write-back. With K > 1
updates are fused into one call (lax.scan).
Loop: the whole `run_loop` over a trivial environment (constant observation, every 4th action
illegal, 100-step episodes), so the figures are the agents' own per-step overhead.

Each figure is the median of `--repeats` timing windows after a warm-up (compilation); the
machine's load average is printed alongside because other processes share the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

# The checkout's root: hlomap when not installed, and the tests' toy environments.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hlomap.agents import DqnAgent, DqnConfig, LoopConfig, PpoAgent, PpoConfig, run_loop
from hlomap.agents.replay import Transition
from tests.agents.toy_envs import TrivialEnv

OBS = 512
HIDDEN = (256, 256)


class Rate(NamedTuple):
    """Units per second of wall time and per second of this process's CPU time (all threads).

    On a shared machine the wall-clock rate measures the share of the CPU this process got;
    the CPU-time rate is closer to what an idle machine gives (exact for single-threaded work,
    and an underestimate where XLA runs a computation on both cores at once)."""

    wall: float
    cpu: float


def rate(fn: Callable[[], int], seconds: float, repeats: int) -> Rate:
    """Medians over `repeats` timing windows; `fn` returns how many units it did."""
    fn()  # warm-up: compile
    walls, cpus = [], []
    for _ in range(repeats):
        done, start, cpu0 = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - start < seconds:
            done += fn()
        walls.append(done / (time.perf_counter() - start))
        cpus.append(done / max(time.process_time() - cpu0, 1e-9))
    return Rate(statistics.median(walls), statistics.median(cpus))


def filled_agent(num_actions: int, updates_per_call: int) -> DqnAgent:
    config = DqnConfig(hidden=HIDDEN, batch_size=32, replay_capacity=2000,
                       updates_per_call=updates_per_call)
    agent = DqnAgent(config, OBS, num_actions, seed=0)
    rng = np.random.default_rng(0)
    legal = np.ones(num_actions, bool)
    legal[3::4] = False
    for _ in range(config.replay_capacity):
        agent.replay.add(Transition(rng.normal(size=OBS).astype(np.float32),
                                    int(rng.integers(num_actions)), float(rng.normal()), 0.99,
                                    rng.normal(size=OBS).astype(np.float32), legal))
    return agent


def bench_learner(num_actions: int, seconds: float, repeats: int) -> dict[str, Rate]:
    out: dict[str, Rate] = {}
    agent = filled_agent(num_actions, 1)
    sample = agent.replay.sample(agent.rng, 32, 0.6)
    batch = jax.device_put(sample.transitions)
    weights = jax.device_put(sample.weights)

    def step() -> int:
        agent.state, result = agent.fns.update(agent.state, batch, weights)
        result.priorities.block_until_ready()
        return 1

    out["step"] = rate(step, seconds, repeats)
    for k in (1, 4, 8):
        agent_k = agent if k == 1 else filled_agent(num_actions, k)
        out[f"update K={k}"] = rate(lambda a=agent_k, k=k: (a.learn(), k)[1], seconds, repeats)
    return out


def bench_loop(seconds: float, repeats: int) -> dict[str, Rate]:
    out: dict[str, Rate] = {}
    cases: dict[str, tuple[int, int, Callable[[int], object]]] = {}
    greedy = DqnConfig(hidden=HIDDEN, epsilon_start=0.0, epsilon_end=0.0,
                       min_replay_size=10**9)
    cases["dqn act only, greedy (A=2)"] = (2, OBS, lambda a: DqnAgent(greedy, OBS, a))
    cases["dqn act only, greedy (A=128)"] = (128, OBS, lambda a: DqnAgent(greedy, OBS, a))
    learn = DqnConfig(hidden=HIDDEN, epsilon_decay_steps=1000, min_replay_size=256)
    cases["dqn learn every step (A=2)"] = (2, OBS, lambda a: DqnAgent(learn, OBS, a))
    every4 = dataclasses.replace(learn, update_period=4)
    cases["dqn learn every 4 steps (A=2)"] = (2, OBS, lambda a: DqnAgent(every4, OBS, a))
    fused = dataclasses.replace(learn, update_period=1, updates_per_call=4)
    cases["dqn learn every step, K=4 (A=2)"] = (2, OBS, lambda a: DqnAgent(fused, OBS, a))
    small = DqnConfig(hidden=(64,), epsilon_start=0.0, epsilon_end=0.0, min_replay_size=10**9)
    cases["dqn act only, greedy, 64-dim obs, 1x64 MLP"] = (
        8, 64, lambda a: DqnAgent(small, 64, a))
    ppo = PpoConfig(hidden=HIDDEN, rollout_length=128)
    cases["ppo (A=2), update every 128 steps"] = (2, OBS, lambda a: PpoAgent(ppo, OBS, a))
    for name, (actions, obs, build) in cases.items():
        env = TrivialEnv(obs, actions, episode_length=100)
        agent = build(actions)
        chunk = 512

        # A fresh loop per chunk of steps: it restarts the episode while the agent carries on
        # learning; 512 steps are long enough that the restart costs nothing measurable.
        def run(agent: object = agent, env: TrivialEnv = env) -> int:
            run_loop(env, agent, LoopConfig(num_steps=chunk))  # type: ignore
            return chunk

        out[name] = rate(run, seconds, repeats)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1-second timing windows")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    seconds = 1.0 if args.quick else 3.0
    load = os.getloadavg()
    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, load average {load[0]:.1f} "
          f"{load[1]:.1f} {load[2]:.1f} (other processes share the CPU)")
    results: dict[str, dict[str, Rate]] = {}
    for actions in (2, 128):
        results[f"learner updates/s, A={actions}"] = bench_learner(actions, seconds,
                                                                   args.repeats)
    results["loop env steps/s"] = bench_loop(seconds, args.repeats)
    for section, figures in results.items():
        print(f"\n{section:<48} {'per wall-s':>11} {'per CPU-s':>11}")
        for name, value in figures.items():
            print(f"  {name:<46} {value.wall:11,.0f} {value.cpu:11,.0f}")
    load = os.getloadavg()
    print(f"\nload average at the end {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_average": load,
                       **{k: {n: r._asdict() for n, r in v.items()} for k, v in results.items()}},
                      f, indent=2)


if __name__ == "__main__":
    main()
