"""The environment and the two objectives: the paper's rewards step by step, episode returns
equal plan scores, masks, observations, and the cost objective's ordering."""

from __future__ import annotations

import numpy as np
import pytest

from hlomap.agents.environment import Environment
from hlomap.tasks.sharding.task import random_choices
from hlomap.tasks.sharding.env import Encoding, EnvConfig, MaskPolicy, PlanEnv, observation_size
from hlomap.tasks.sharding.objective import CONFLICT_REWARD, CostEval, CostObjective, PaperObjective
from hlomap.tasks.sharding.space import hybrid_space, opp_space


def _play(env: PlanEnv, actions) -> list:
    ts = env.reset(0)
    steps = [ts]
    for a in actions:
        if ts.last:
            break
        ts = env.step(int(a))
        steps.append(ts)
    return steps


def test_env_speaks_the_agents_protocol(graph_of, axes8) -> None:
    space = opp_space(graph_of("gpt-tiny"), axes8)
    env = PlanEnv(space, PaperObjective(space))
    assert isinstance(env, Environment)
    assert env.num_actions == 2
    ts = env.reset(0)
    assert ts.first and ts.observation.shape == (env.observation_size,)


def test_paper_rewards_step_by_step(graph_of, axes8) -> None:
    space = opp_space(graph_of("gpt-tiny"), axes8, replicate_residual=True)
    obj = PaperObjective(space)
    env = PlanEnv(space, obj, EnvConfig(tiebreak_bonus=False))
    # replicate everything: 0.1 per candidate dim, no conflict
    steps = _play(env, [0] * space.num_positions)
    rewards = [s.reward for s in steps[1:]]
    np.testing.assert_allclose(rewards, 0.1 * space.weights)
    assert steps[-1].last and steps[-1].discount == 0.0
    assert env.last_outcome.conflict_free
    assert env.last_outcome.episode_return == pytest.approx(0.1 * space.total_weight)
    # partition the first position that can be: 0.4 per dim it decides
    p = int(np.flatnonzero(space.legal[:, 1])[0])
    assert p == 1  # position 0 is the residual stream, kept replicated
    steps = _play(env, [0] * p + [1] + [0] * space.num_positions)
    assert steps[p + 1].reward == pytest.approx(0.4 * space.weights[p])
    assert env.last_outcome.episode_return == pytest.approx(0.1 * space.total_weight + 0.3 * space.weights[p])


def test_a_conflict_earns_minus_one_and_ends_the_episode(graph_of, axes8) -> None:
    space = opp_space(graph_of("gpt-tiny"), axes8, tie=False)
    a, b = (int(x) for x in space.position_pairs[0])
    env = PlanEnv(space, PaperObjective(space), EnvConfig(mask=MaskPolicy.STATIC))
    actions = [0] * space.num_positions
    actions[a] = actions[b] = 1
    steps = _play(env, actions)
    assert steps[-1].last and steps[-1].reward == CONFLICT_REWARD
    assert len(steps) == b + 2  # reset + positions 0..b
    outcome = env.last_outcome
    assert outcome.stopped_at == b and not outcome.conflict_free
    expected = sum(0.4 * space.weights[p] if actions[p] else 0.1 * space.weights[p] for p in range(b)) - 1
    assert outcome.episode_return == pytest.approx(expected)
    with pytest.raises(RuntimeError):
        env.step(0)
    # FULL masking never offers the clashing action
    full = PlanEnv(space, PaperObjective(space), EnvConfig(mask=MaskPolicy.FULL))
    ts = full.reset(0)
    for p in range(b + 1):
        if p == b:
            assert not ts.legal[1]
            break
        ts = full.step(actions[p])


@pytest.mark.parametrize("tie", [False, True])
def test_episode_return_equals_the_plan_score(graph_of, axes8, tie) -> None:
    space = opp_space(graph_of("t5-tiny"), axes8, tie=tie)
    obj = PaperObjective(space)
    env = PlanEnv(space, obj, EnvConfig(mask=MaskPolicy.NONE))
    rng = np.random.default_rng(0)
    conflicts = 0
    for row in random_choices(space, 40, rng, MaskPolicy.STATIC):
        _play(env, row + 1)
        out = env.last_outcome
        ref = PaperObjective(space).score(row)
        assert out.episode_return == pytest.approx(ref.value)
        assert out.conflict_free == ref.conflict_free
        conflicts += not ref.conflict_free
    assert 0 < conflicts < 40


def test_reward_scale_scales_what_the_agent_sees_only(graph_of, axes8) -> None:
    space = opp_space(graph_of("gpt-tiny"), axes8)
    env = PlanEnv(space, PaperObjective(space), EnvConfig(reward_scale=0.5))
    steps = _play(env, [0] * space.num_positions)
    assert steps[1].reward == pytest.approx(0.05 * space.weights[0])
    assert env.last_outcome.episode_return == pytest.approx(0.1 * space.total_weight)


def test_tiebreak_bonus_prefers_larger_groups_but_never_outweighs_a_dim(graph_of, axes8) -> None:
    space = opp_space(graph_of("gpt-tiny"), axes8, replicate_residual=True)
    plain = PlanEnv(space, PaperObjective(space), EnvConfig(tiebreak_bonus=False))
    bonus = PlanEnv(space, PaperObjective(space))
    extra = []
    for p in range(space.num_positions):
        actions = [0] * p + [1] + [0] * space.num_positions
        r_plain = _play(plain, actions)[p + 1].reward
        r_bonus = _play(bonus, actions)[p + 1].reward
        if space.legal[p, 1]:
            extra.append((space.group_sizes[p], r_bonus - r_plain))
            assert bonus.last_outcome.episode_return == pytest.approx(plain.last_outcome.episode_return)
    assert all(e > 0 for _, e in extra) and sum(e for _, e in extra) < 0.3
    extra.sort()
    assert [e for _, e in extra] == sorted(e for _, e in extra)


@pytest.mark.parametrize("encoding", list(Encoding))
def test_observations_follow_the_paper_on_a_1d_mesh(graph_of, axes8, encoding) -> None:
    space = opp_space(graph_of("gpt-tiny"), axes8)
    env = PlanEnv(space, PaperObjective(space), EnvConfig(encoding=encoding))
    n = space.num_positions if encoding is Encoding.GROUPS else len(space.candidates)
    assert env.observation_size == n + space.num_positions == observation_size(space, encoding)
    ts = env.reset(0)
    assert (ts.observation[:n] == -1).all() and ts.observation[n] == 1
    ts = env.step(1)
    ts = env.step(0)
    state = ts.observation[:n]
    where = (np.arange(space.num_positions) if encoding is Encoding.GROUPS
             else np.asarray([c.position for c in space.candidates]))
    np.testing.assert_array_equal(state[where == 0], 1.0)
    np.testing.assert_array_equal(state[where == 1], 0.0)
    np.testing.assert_array_equal(state[where >= 2], -1.0)
    assert ts.observation[n + 2] == 1 and ts.observation[n:].sum() == 1


def test_observations_on_a_2d_mesh_are_one_hot(graph_of, axes2x4) -> None:
    space = hybrid_space(graph_of("gpt-tiny"), axes2x4)
    env = PlanEnv(space, PaperObjective(space))
    assert env.num_actions == 3
    assert env.observation_size == 3 * space.num_positions + space.num_positions
    ts = env.reset(0)
    legal = np.flatnonzero(ts.legal)
    ts = env.step(int(legal[-1]))
    first = ts.observation[:3]
    assert first[0] == 1 and first[1:].sum() == (1 if legal[-1] > 0 else 0)


def _fake_model(space, fast_groups: set[int], capacity: float = 10.0):
    """Speed grows with each 'fast' group sharded; memory shrinks with every sharded group."""
    calls = []

    def model(plan: np.ndarray) -> CostEval:
        calls.append(1)
        sharded = plan >= 0
        t = 1.0 / (1 + sum(1 for g in fast_groups if sharded[g]))
        mem = 12.0 - int(sharded[space.groups].sum())
        return CostEval(t, mem, capacity)

    return model, calls


def test_cost_objective_orders_fitting_over_overflowing_over_conflicts(graph_of, axes8) -> None:
    space = opp_space(graph_of("gpt-tiny"), axes8, tie=False)
    model, calls = _fake_model(space, {int(space.groups[1])})
    obj = CostObjective(space, model)
    replicated = obj.score(space.empty_choices())
    assert not replicated.fits and -1 < replicated.value < 0  # memory 12 > capacity 10
    a, b = (int(x) for x in space.position_pairs[0])
    clash = space.empty_choices()
    clash[[a, b]] = 0
    assert obj.score(clash).value == CONFLICT_REWARD
    rng = np.random.default_rng(0)
    scores = obj.score_many(random_choices(space, 30, rng, MaskPolicy.FULL))
    fitting = [s for s in scores if s.fits]
    overflowing = [s for s in scores if not s.fits]
    assert fitting and min(s.value for s in fitting) > max((s.value for s in overflowing), default=-1)
    assert all(s.value > CONFLICT_REWARD for s in scores)
    before = len(calls)
    obj.score(space.empty_choices())
    assert len(calls) == before  # cached
    assert obj.evaluations == 33


def test_cost_env_rewards_the_plan_value_at_the_end(graph_of, axes8) -> None:
    space = opp_space(graph_of("gpt-tiny"), axes8, tie=False)
    model, _ = _fake_model(space, {int(space.groups[1])}, capacity=100.0)
    obj = CostObjective(space, model)
    env = PlanEnv(space, obj)
    steps = _play(env, [0, 1] + [0] * space.num_positions)
    assert all(s.reward == 0 for s in steps[1:-1])
    assert steps[-1].reward == pytest.approx(2.0)  # twice as fast as replicated
    assert env.last_outcome.score.value == pytest.approx(2.0)
