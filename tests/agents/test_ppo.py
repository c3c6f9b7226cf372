"""PPO: advantages against hand computation, and solving a small placement MDP."""

from __future__ import annotations

import dataclasses
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from hlomap.agents.environment import restart, transition
from hlomap.agents.loop import LoopConfig, run_loop
from hlomap.agents.ppo import (Advantage, PpoAgent, PpoConfig, Rollout, advantages_and_targets,
                               make_ppo)
from tests.agents.toy_envs import PlacementMDP

# Five steps: mid, terminal, mid, truncated (bootstrap 3.0), mid cut by the rollout's end (4.0).
G, LAM = 0.9, 0.8
R = np.array([1.0, 2.0, 3.0, 4.0, 5.0], np.float32)
V = np.array([0.5, 0.6, 0.7, 0.8, 0.9], np.float32)
ROLLOUT = Rollout(
    observation=np.zeros((5, 1), np.float32), legal=np.ones((5, 2), bool),
    action=np.zeros(5, np.int32), log_prob=np.zeros(5, np.float32), value=V, reward=R,
    discount=np.array([G, 0.0, G, G, G], np.float32),
    last=np.array([False, True, False, True, False]),
    cut=np.array([False, False, False, True, True]),
    bootstrap=np.array([0.0, 0.0, 0.0, 3.0, 4.0], np.float32),
)


def test_gae_equals_hand_computed_values_across_episode_boundaries() -> None:
    config = PpoConfig(advantage=Advantage.GAE, discount=G, gae_lambda=LAM, rollout_length=4,
                       num_minibatches=1)
    adv, targets = advantages_and_targets(config, jax_rollout(), jnp.zeros(()))
    a4 = R[4] + G * 4.0 - V[4]
    a3 = R[3] + G * 3.0 - V[3]
    a2 = R[2] + G * V[3] - V[2] + G * LAM * a3
    a1 = R[1] - V[1]
    a0 = R[0] + G * V[1] - V[0] + G * LAM * a1
    np.testing.assert_allclose(adv, [a0, a1, a2, a3, a4], rtol=1e-5)
    np.testing.assert_allclose(targets, np.array([a0, a1, a2, a3, a4]) + V, rtol=1e-5)


def test_running_mean_returns_bootstrap_from_the_baseline() -> None:
    config = PpoConfig(advantage=Advantage.RUNNING_MEAN, discount=G, rollout_length=4,
                       num_minibatches=1)
    b = 0.25
    adv, returns = advantages_and_targets(config, jax_rollout(), jnp.asarray(b))
    g4 = R[4] + G * b
    g3 = R[3] + G * b
    g2 = R[2] + G * g3
    g1 = R[1]
    g0 = R[0] + G * g1
    np.testing.assert_allclose(returns, [g0, g1, g2, g3, g4], rtol=1e-5)
    np.testing.assert_allclose(adv, np.array([g0, g1, g2, g3, g4]) - b, rtol=1e-5)


def jax_rollout() -> Rollout:
    return Rollout(*(jnp.asarray(x) for x in ROLLOUT))


def test_drl_pp_defaults() -> None:
    c = PpoConfig()
    assert (c.clip_epsilon, c.entropy_coef, c.learning_rate, c.max_grad_norm) == (
        0.2, 0.001, 3e-4, 1.0)
    assert (c.num_epochs, c.num_minibatches) == (3, 4)


def test_placement_mdp_is_not_trivial() -> None:
    """Few feasible placements are optimal, so finding one is learning, not luck."""
    env = PlacementMDP()
    best = env.optimal_return()
    scores = []
    for placement in itertools.product(range(3), repeat=len(env.costs)):
        p = np.asarray(placement)
        if np.all(np.bincount(p, env.memory, 3) <= env.capacity):
            scores.append(env.score(np.bincount(p, env.costs, 3)))
    assert np.mean(np.isclose(scores, best)) < 0.1


SLOW_SEEDS = [pytest.param(s, marks=pytest.mark.slow) for s in (1, 2)]


@pytest.mark.parametrize("advantage", [Advantage.RUNNING_MEAN, Advantage.GAE])
@pytest.mark.parametrize("seed", [0, *SLOW_SEEDS])
def test_ppo_solves_placement(advantage: Advantage, seed: int) -> None:
    env = PlacementMDP()
    config = PpoConfig(hidden=(64, 64), rollout_length=96, advantage=advantage,
                       learning_rate=1e-3)
    agent = PpoAgent(config, env.observation_size, env.num_actions, seed=seed)
    result = run_loop(env, agent, LoopConfig(num_steps=4800, seed=seed))
    ts, total = env.reset(0), 0.0
    while not ts.last:  # PlacementMDP raises on an illegal (full) device
        ts = env.step(agent.greedy_action(ts.observation, ts.legal))
        total += ts.reward
    assert total == pytest.approx(env.optimal_return())
    assert result.mean_return(50) > env.optimal_return() - 0.02
    assert agent.num_updates == 4800 // 96


def test_ppo_is_on_policy_and_samples_legal_actions() -> None:
    config = PpoConfig(hidden=(8,), rollout_length=8, num_minibatches=2)
    agent = PpoAgent(config, 3, 4)
    legal = np.array([False, True, False, True])
    samples = agent.sample_batch(np.zeros((2000, 3), np.float32), np.tile(legal, (2000, 1)))
    assert set(np.unique(samples)) == {1, 3}
    ts = restart(np.zeros(3, np.float32), legal)
    agent.observe_first(ts)
    a = agent.act(ts)
    with pytest.raises(ValueError, match="on-policy"):
        agent.observe(2 if a != 2 else 1, transition(np.zeros(3, np.float32), 0.0, legal))


def test_ppo_update_runs_every_rollout_and_moves_the_policy() -> None:
    config = dataclasses.replace(PpoConfig(hidden=(8,), rollout_length=8, num_minibatches=2),
                                 learning_rate=1e-2)
    agent = PpoAgent(config, 2, 3, functions=make_ppo(config, 2, 3))
    legal = np.ones(3, bool)
    obs = np.array([1.0, -1.0], np.float32)
    ts = restart(obs, legal)
    agent.observe_first(ts)
    before = agent.fns.logits(agent.state.params, obs[None])
    updates = 0
    for _ in range(16):
        a = agent.act(ts)
        ts = transition(obs, 1.0 if a == 2 else 0.0, legal)
        agent.observe(a, ts)
        updates += agent.update() is not None
    assert updates == 2 and agent.num_updates == 2
    after = agent.fns.logits(agent.state.params, obs[None])
    assert not np.allclose(before, after)
