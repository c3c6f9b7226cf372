"""Small environments with known optimal behaviour, for tests and benchmarks.

Each is a few lines of numpy, deterministic given its constructor arguments and `reset(seed)`,
and knows its own optimum (by construction or by exhaustive dynamic programming), so a test can
check that an agent found it rather than that a number came out.
"""

from __future__ import annotations

import itertools

import numpy as np

from hlomap.agents.environment import (TimeStep, restart, termination, transition,
                                       truncation)


def _one_hot(i: int, n: int) -> np.ndarray:
    x = np.zeros(n, np.float32)
    x[i] = 1.0
    return x


class ChainMDP:
    """A corridor of `length` states; start in state 1; action 0 moves left, 1 moves right.

    Reaching state 0 ends the episode with a small reward, reaching the far end with reward 1.
    The small reward is one step away and the large one `length - 2` steps away, so a greedy
    learner settles for the small one unless exploration finds the far end. Optimal: always right,
    return 1 in `length - 2` steps.
    """

    num_actions = 2

    def __init__(self, length: int = 10, small_reward: float = 0.1, max_steps: int | None = None):
        self.length = length
        self.small_reward = small_reward
        self.max_steps = max_steps if max_steps is not None else 3 * length
        self._state = 1
        self._t = 0

    @property
    def observation_size(self) -> int:
        return self.length

    def _legal(self) -> np.ndarray:
        return np.ones(2, bool)

    def reset(self, seed: int) -> TimeStep:
        del seed  # deterministic
        self._state, self._t = 1, 0
        return restart(_one_hot(1, self.length), self._legal())

    def step(self, action: int) -> TimeStep:
        self._state += 1 if action == 1 else -1
        self._t += 1
        obs = _one_hot(self._state, self.length)
        if self._state == 0:
            return termination(obs, self.small_reward, self._legal())
        if self._state == self.length - 1:
            return termination(obs, 1.0, self._legal())
        if self._t >= self.max_steps:
            return truncation(obs, 0.0, self._legal())
        return transition(obs, 0.0, self._legal())

    def optimal_return(self) -> float:
        return 1.0


class ContextualBandit:
    """One-step episodes: observe one of `num_contexts` contexts (one-hot), pick an arm, get
    `rewards[context, arm]` plus Gaussian noise. Each context's arms pay a random permutation of
    evenly spaced values in [0, 1], so the best arm of every context is clear by a known gap.
    The context is drawn from the reset seed. Optimal: the best arm of each context."""

    def __init__(self, num_contexts: int = 4, num_actions: int = 5, noise: float = 0.1,
                 table_seed: int = 0):
        rng = np.random.default_rng(table_seed)
        levels = np.linspace(0.0, 1.0, num_actions)
        self.rewards = np.stack([rng.permutation(levels) for _ in range(num_contexts)])
        self.num_contexts = num_contexts
        self.num_actions = num_actions
        self.noise = noise
        self._context = 0
        self._rng = np.random.default_rng(0)

    @property
    def observation_size(self) -> int:
        return self.num_contexts

    def reset(self, seed: int) -> TimeStep:
        self._rng = np.random.default_rng(seed)
        self._context = int(self._rng.integers(self.num_contexts))
        return restart(_one_hot(self._context, self.num_contexts),
                       np.ones(self.num_actions, bool))

    def step(self, action: int) -> TimeStep:
        reward = self.rewards[self._context, action] + self.noise * self._rng.normal()
        return termination(np.zeros(self.num_contexts, np.float32), float(reward),
                           np.ones(self.num_actions, bool))

    def best_actions(self) -> np.ndarray:
        return np.argmax(self.rewards, axis=1)


class IllegalActionError(ValueError):
    """An agent took an action the environment had marked illegal."""


class MaskedMDP:
    """A finite-horizon MDP with random transitions, rewards and legal-action masks.

    Illegal actions carry the largest rewards, so an agent that ignores the mask when acting or
    when bootstrapping is drawn to them; taking one raises `IllegalActionError`. The observation
    is one-hot(state) + one-hot(time), which makes the problem Markov. `optimal_return` solves it
    exactly by backward induction.
    """

    def __init__(self, num_states: int = 5, num_actions: int = 4, horizon: int = 4,
                 table_seed: int = 0):
        rng = np.random.default_rng(table_seed)
        self.num_states, self.num_actions, self.horizon = num_states, num_actions, horizon
        self.next_state = rng.integers(num_states, size=(num_states, num_actions))
        self.legal = rng.random((num_states, num_actions)) < 0.6
        self.legal[np.arange(num_states), rng.integers(num_actions, size=num_states)] = True
        self.reward = np.where(self.legal, rng.uniform(0.0, 1.0, self.legal.shape), 2.0)
        self._state = 0
        self._t = 0

    @property
    def observation_size(self) -> int:
        return self.num_states + self.horizon + 1

    def _obs(self) -> np.ndarray:
        return np.concatenate([_one_hot(self._state, self.num_states),
                               _one_hot(self._t, self.horizon + 1)])

    def reset(self, seed: int) -> TimeStep:
        del seed  # deterministic; always starts in state 0
        self._state, self._t = 0, 0
        return restart(self._obs(), self.legal[0].copy())

    def step(self, action: int) -> TimeStep:
        if not self.legal[self._state, action]:
            raise IllegalActionError(f"action {action} is illegal in state {self._state}")
        reward = float(self.reward[self._state, action])
        self._state = int(self.next_state[self._state, action])
        self._t += 1
        if self._t == self.horizon:
            return termination(self._obs(), reward, self.legal[self._state].copy())
        return transition(self._obs(), reward, self.legal[self._state].copy())

    def optimal_values(self) -> np.ndarray:
        """V[t, s]: the best undiscounted return from state s with t steps taken."""
        v = np.zeros((self.horizon + 1, self.num_states))
        for t in range(self.horizon - 1, -1, -1):
            q = self.reward + v[t + 1][self.next_state]
            v[t] = np.where(self.legal, q, -np.inf).max(axis=1)
        return v

    def optimal_return(self) -> float:
        return float(self.optimal_values()[0, 0])


class PlacementMDP:
    """Place `len(costs)` operators, one per step, onto `num_devices` devices.

    A toy of DRL-PP's pipeline placement: each device has a memory capacity; a device is legal for
    the current operator only if it still has room. The episode's only reward, at the end, is
    minus the makespan (the largest per-device compute load) relative to the total load; a
    partial placement that leaves no room for the next operator ends the episode with
    `dead_end_reward`. The observation is one-hot(operator index) + per-device load + per-device
    memory used, both normalised. `optimal_return` enumerates every placement. The default is a
    balanced partition: two operators per device, 90 feasible placements, 6 of them optimal
    ({5, 1}, {4, 2}, {3, 3} on the three devices in any order).
    """

    def __init__(self, costs: tuple[float, ...] = (5.0, 4.0, 3.0, 3.0, 2.0, 1.0),
                 memory: tuple[float, ...] = (1.0,) * 6,
                 capacity: tuple[float, ...] = (2.0, 2.0, 2.0), dead_end_reward: float = -2.0):
        self.dead_end_reward = dead_end_reward
        self.costs = np.asarray(costs, np.float64)
        self.memory = np.asarray(memory, np.float64)
        self.capacity = np.asarray(capacity, np.float64)
        self.num_actions = len(capacity)
        self._load = np.zeros(self.num_actions)
        self._used = np.zeros(self.num_actions)
        self._t = 0

    @property
    def observation_size(self) -> int:
        return len(self.costs) + 2 * self.num_actions

    def _legal(self) -> np.ndarray:
        if self._t >= len(self.costs):
            return np.ones(self.num_actions, bool)
        return self._used + self.memory[self._t] <= self.capacity + 1e-9

    def _obs(self) -> np.ndarray:
        onehot = np.zeros(len(self.costs), np.float32)
        if self._t < len(self.costs):
            onehot[self._t] = 1.0
        return np.concatenate([onehot, (self._load / self.costs.sum()).astype(np.float32),
                               (self._used / self.capacity).astype(np.float32)])

    def reset(self, seed: int) -> TimeStep:
        del seed
        self._load[:] = 0.0
        self._used[:] = 0.0
        self._t = 0
        return restart(self._obs(), self._legal())

    def step(self, action: int) -> TimeStep:
        if not self._legal()[action]:
            raise IllegalActionError(f"device {action} is full for operator {self._t}")
        self._load[action] += self.costs[self._t]
        self._used[action] += self.memory[self._t]
        self._t += 1
        if self._t == len(self.costs):
            return termination(self._obs(), self.score(self._load), self._legal())
        legal = self._legal()
        if not legal.any():
            return termination(self._obs(), self.dead_end_reward, np.ones_like(legal))
        return transition(self._obs(), 0.0, legal)

    def score(self, loads: np.ndarray) -> float:
        return float(-loads.max() / self.costs.sum())

    def optimal_return(self) -> float:
        best = -np.inf
        for placement in itertools.product(range(self.num_actions), repeat=len(self.costs)):
            p = np.asarray(placement)
            used = np.bincount(p, self.memory, self.num_actions)
            if np.all(used <= self.capacity + 1e-9):
                best = max(best, self.score(np.bincount(p, self.costs, self.num_actions)))
        return best


class TrivialEnv:
    """Fixed-length episodes of a constant observation and zero reward: measures the loop's own
    overhead. Every fourth action is illegal, to exercise masking."""

    def __init__(self, observation_size: int = 512, num_actions: int = 2,
                 episode_length: int = 100):
        self._observation = np.linspace(-1.0, 1.0, observation_size, dtype=np.float32)
        self._legal = np.ones(num_actions, bool)
        self._legal[3::4] = False
        self.num_actions = num_actions
        self.episode_length = episode_length
        self._t = 0

    @property
    def observation_size(self) -> int:
        return self._observation.shape[0]

    def reset(self, seed: int) -> TimeStep:
        del seed
        self._t = 0
        return restart(self._observation, self._legal)

    def step(self, action: int) -> TimeStep:
        self._t += 1
        if self._t >= self.episode_length:
            return truncation(self._observation, 0.0, self._legal)
        return transition(self._observation, 0.0, self._legal)
