"""Rainbow DQN: learns small MDPs with known optima; acting, masking and target updates."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from hlomap.agents.dqn import (DqnAgent, DqnConfig, DqnFunctions, TargetUpdate,
                               importance_exponent, make_dqn)
from hlomap.agents.environment import Environment, restart, termination, transition
from hlomap.agents.loop import LoopConfig, run_loop
from tests.agents.toy_envs import ChainMDP, ContextualBandit, MaskedMDP

SMALL = DqnConfig(hidden=(32, 32), learning_rate=1e-3, min_replay_size=64,
                  target_update_period=50)
SLOW_SEEDS = [pytest.param(s, marks=pytest.mark.slow) for s in (1, 2)]


def greedy_return(env: Environment, agent: DqnAgent) -> tuple[float, int]:
    ts = env.reset(0)
    total, steps = 0.0, 0
    while not ts.last:
        ts = env.step(agent.greedy_action(ts.observation, ts.legal))
        total, steps = total + ts.reward, steps + 1
    return total, steps


def train(env: Environment, config: DqnConfig, steps: int, seed: int,
          functions: DqnFunctions | None = None) -> DqnAgent:
    agent = DqnAgent(config, env.observation_size, env.num_actions, seed=seed,
                     functions=functions)
    run_loop(env, agent, LoopConfig(num_steps=steps, seed=seed))
    return agent


@pytest.mark.parametrize("seed", [0, *SLOW_SEEDS])
def test_learns_chain_that_needs_exploration(seed: int) -> None:
    env = ChainMDP(8)
    config = dataclasses.replace(SMALL, n_step=3, discount=0.9, epsilon_decay_steps=1000)
    agent = train(env, config, 2000, seed)
    assert greedy_return(env, agent) == (1.0, 6)  # straight to the far end
    q = agent.q_values(np.eye(8, dtype=np.float32)[1:7])
    assert np.all(q[:, 1] > q[:, 0])  # "right" is preferred in every inner state


@pytest.mark.parametrize("distributional", [False, True])
@pytest.mark.parametrize("seed", [0, *SLOW_SEEDS])
def test_learns_contextual_bandit(seed: int, distributional: bool) -> None:
    env = ContextualBandit(num_contexts=4, num_actions=5, noise=0.1)
    config = dataclasses.replace(SMALL, n_step=1, epsilon_decay_steps=400,
                                 distributional=distributional, num_atoms=21, v_min=-1.0,
                                 v_max=2.0)
    agent = train(env, config, 800, seed)
    contexts = np.eye(4, dtype=np.float32)
    np.testing.assert_array_equal(agent.greedy_batch(contexts, np.ones((4, 5), bool)),
                                  env.best_actions())
    # One-step episodes: Q estimates the expected reward itself.
    np.testing.assert_allclose(agent.q_values(contexts), env.rewards, atol=0.15)


@pytest.mark.parametrize("seed", [0, *SLOW_SEEDS])
def test_learns_masked_mdp_without_touching_illegal_actions(seed: int) -> None:
    env = MaskedMDP(num_states=5, num_actions=4, horizon=4, table_seed=0)
    optimum = env.optimal_return()
    config = dataclasses.replace(SMALL, n_step=2, discount=1.0, epsilon_decay_steps=1000)
    # MaskedMDP raises on an illegal action, so training itself checks masked exploration.
    agent = train(env, config, 2000, seed)
    assert greedy_return(env, agent)[0] == pytest.approx(optimum)
    # Bootstrapping through illegal actions (reward 2 each) would inflate Q far above optimum.
    ts = env.reset(0)
    q0 = agent.q_values(ts.observation[None])[0]
    assert np.max(q0[ts.legal]) == pytest.approx(optimum, abs=0.25)


def test_masked_mdp_is_not_solved_by_the_myopic_policy() -> None:
    """The MDP above is a real test: the one-step greedy policy falls well short."""
    env = MaskedMDP(num_states=5, num_actions=4, horizon=4, table_seed=0)
    ts, total = env.reset(0), 0.0
    while not ts.last:
        s = env._state
        ts = env.step(int(np.argmax(np.where(env.legal[s], env.reward[s], -np.inf))))
        total += ts.reward
    assert total < env.optimal_return() - 0.5


@pytest.fixture(scope="module")
def functions_2x3() -> DqnFunctions:
    return make_dqn(dataclasses.replace(SMALL, hidden=(8,), target_update_period=3), 2, 3)


def _fill(agent: DqnAgent, n: int) -> None:
    rng = np.random.default_rng(0)
    legal = np.ones(agent.num_actions, bool)
    agent.observe_first(restart(rng.normal(size=2).astype(np.float32), legal))
    for i in range(n):
        obs = rng.normal(size=2).astype(np.float32)
        ts = termination(obs, 1.0, legal) if i % 5 == 4 else transition(obs, 0.5, legal)
        agent.observe(int(rng.integers(3)), ts)
        if ts.last:
            agent.observe_first(restart(obs, legal))


def test_act_is_epsilon_greedy_over_legal_actions_only(functions_2x3: DqnFunctions) -> None:
    config = dataclasses.replace(SMALL, hidden=(8,), target_update_period=3,
                                 epsilon_decay_steps=100)
    agent = DqnAgent(config, 2, 3, functions=functions_2x3)
    obs = np.zeros((3000, 2), np.float32)
    legal = np.tile([True, False, True], (3000, 1))
    actions = agent.act_batch(obs, legal)  # epsilon = 1 at step 0: uniform over legal
    assert set(np.unique(actions)) == {0, 2}
    assert abs(np.mean(actions == 0) - 0.5) < 0.05
    agent.num_steps = 10_000  # epsilon = 0.1: greedy 90% (+ a third of the random 10%)
    greedy = agent.greedy_batch(obs[:1], legal[:1])[0]
    frac = np.mean(agent.act_batch(obs, legal) == greedy)
    assert agent.epsilon == pytest.approx(0.1)
    assert 0.9 < frac < 0.99
    # The greedy choice itself ignores illegal actions even when their Q is highest.
    q = agent.q_values(obs[:1])[0]
    mask = np.ones(3, bool)
    mask[np.argmax(q)] = False
    assert agent.greedy_action(obs[0], mask) == np.argmax(np.where(mask, q, -np.inf))


def test_hard_target_update_every_period(functions_2x3: DqnFunctions) -> None:
    config = dataclasses.replace(SMALL, hidden=(8,), target_update_period=3)
    agent = DqnAgent(config, 2, 3, functions=functions_2x3)
    _fill(agent, 40)
    initial = agent.get_params()

    def same(a: object, b: object) -> bool:
        return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    for k in range(1, 7):
        agent.learn()
        target = jax.tree.map(np.asarray, agent.state.target_params)
        if k % 3 == 0:
            assert same(target, agent.get_params()), k
        else:
            assert not same(target, agent.get_params()), k
        if k < 3:
            assert same(target, initial), k


def test_polyak_target_update() -> None:
    config = dataclasses.replace(SMALL, hidden=(8,), target_update=TargetUpdate.POLYAK,
                                 polyak_tau=0.25)
    agent = DqnAgent(config, 2, 3)
    _fill(agent, 40)
    old_target = jax.tree.map(np.array, agent.state.target_params)
    agent.learn()
    expected = jax.tree.map(lambda p, t: 0.25 * p + 0.75 * t, agent.get_params(), old_target)
    for got, want in zip(jax.tree.leaves(agent.state.target_params), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_update_schedule_and_fused_updates() -> None:
    config = dataclasses.replace(SMALL, hidden=(8,), min_replay_size=20, update_period=2,
                                 updates_per_call=3, n_step=1)
    agent = DqnAgent(config, 2, 3)
    _fill(agent, 19)
    assert agent.update() is None  # replay not warm yet
    _fill(agent, 1)
    assert agent.num_steps == 20 and agent.replay.size == 20
    assert agent.update() is None  # 20 is not a multiple of update_period * updates_per_call
    _fill(agent, 4)
    before = agent.replay.tree.get(np.arange(agent.replay.size)).copy()
    stats = agent.update()
    assert stats is not None and stats.num_updates == 3 and np.isfinite(stats.loss)
    assert int(agent.state.num_updates) == 3
    assert agent.update() is None  # at most once per environment step
    assert not np.array_equal(before, agent.replay.tree.get(np.arange(agent.replay.size)))


def test_importance_exponent_anneals_linearly() -> None:
    config = DqnConfig(importance_anneal_updates=100)
    assert importance_exponent(config, 0) == pytest.approx(0.6)
    assert importance_exponent(config, 50) == pytest.approx(0.8)
    assert importance_exponent(config, 1000) == pytest.approx(1.0)


def test_paper_defaults() -> None:
    c = DqnConfig()
    assert (c.priority_exponent, c.importance_exponent_start, c.importance_exponent_end) == (
        0.2, 0.6, 1.0)
    assert (c.replay_capacity, c.target_update_period, c.epsilon_start, c.epsilon_end) == (
        2000, 100, 1.0, 0.1)
    assert c.noisy is False and c.dueling is True


NOISY = dataclasses.replace(SMALL, hidden=(8,), noisy=True, epsilon_start=0.0, epsilon_end=0.0)


def test_noisy_network_explores_through_parameter_noise() -> None:
    agent = DqnAgent(NOISY, 2, 3)
    obs = np.zeros((500, 2), np.float32)
    legal = np.ones((500, 3), bool)
    # One noise sample per acting call, so a call's identical rows agree; calls differ.
    calls = [agent.act_batch(obs, legal) for _ in range(20)]
    assert all(len(set(a.tolist())) == 1 for a in calls)
    assert len({int(a[0]) for a in calls}) > 1 or np.ptp(agent.q_values(obs[:1])) > 1.0
    # The greedy choice uses the noise-free mean network: deterministic.
    assert len({agent.greedy_action(obs[0], legal[0]) for _ in range(5)}) == 1


@pytest.mark.slow
def test_noisy_network_learns() -> None:
    agent = DqnAgent(NOISY, 2, 3)
    _fill(agent, 70)
    before = agent.get_params()
    losses = [agent.learn().loss for _ in range(3)]
    assert all(np.isfinite(losses))
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before),
                                                       jax.tree.leaves(agent.get_params()))]
    assert all(moved)  # the sigma parameters learn too


def test_rank_decay_explores_near_the_top_of_the_ranking_and_only_legally() -> None:
    import numpy as np

    from hlomap.agents.dqn import random_legal_actions

    rng = np.random.default_rng(0)
    legal = np.ones((20_000, 8), dtype=bool)
    legal[:, 1] = False  # an illegal action in the middle of the ranking is never drawn
    drawn = random_legal_actions(rng, legal, rank_decay=0.5)
    counts = np.bincount(drawn, minlength=8) / len(drawn)
    assert counts[1] == 0
    weights = np.where(legal[0], 0.5 ** np.arange(8), 0.0)
    np.testing.assert_allclose(counts, weights / weights.sum(), atol=0.01)
    uniform = np.bincount(random_legal_actions(rng, legal), minlength=8) / len(drawn)
    np.testing.assert_allclose(uniform[legal[0]], 1 / 7, atol=0.01)
