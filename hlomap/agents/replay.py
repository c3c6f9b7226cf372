"""Prioritized experience replay on a sum tree, and n-step transition accumulation.

Host-side numpy, as in dqn_zoo: the buffer is written once per environment step and read once per
learner update, and keeping it in numpy makes both a few microseconds and its contents trivially
checkpointable. Every per-batch operation (sampling, importance weights, priority updates) is
vectorised over the batch; only the single-item write walks the tree in Python, over its few
levels.

Priorities follow Schaul et al. (2016): an item with priority p is sampled with probability
(p + eps)^alpha / sum_j (p_j + eps)^alpha, new items enter at the largest priority seen so far, and
the learner weights each sample by (N * P(i))^-beta normalised by the batch maximum.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from hlomap.agents.environment import TimeStep


class SumTree:
    """A complete `fanout`-ary tree whose internal nodes hold the sum of their children.

    Level arrays run from the root's children (`levels[0]`, `fanout` values) down to the leaves
    (`levels[-1]`, fanout**depth >= capacity values). A wide, shallow tree suits numpy: sampling a
    batch is `depth` vectorised steps over [batch, fanout] blocks (2 steps up to 4096 items, 4 up
    to 16 million) instead of log2(capacity) steps of tiny binary decisions, each a handful of
    numpy calls. Parents are always recomputed as the sum of their children, never updated by
    deltas, so rounding errors cannot accumulate; float64 keeps totals exact enough for millions
    of items.
    """

    def __init__(self, capacity: int, fanout: int = 64):
        if capacity < 1 or fanout < 2:
            raise ValueError(f"SumTree needs capacity >= 1 and fanout >= 2, got {capacity}, "
                             f"{fanout}")
        self.capacity = capacity
        self.fanout = fanout
        self.depth = max(1, int(np.ceil(np.log(capacity) / np.log(fanout) - 1e-9)))
        self.levels = [np.zeros(fanout ** (d + 1), np.float64) for d in range(self.depth)]

    @property
    def leaves(self) -> np.ndarray:
        return self.levels[-1]

    @property
    def total(self) -> float:
        return float(self.levels[0].sum())

    def get(self, indices: np.ndarray) -> np.ndarray:
        return self.leaves[np.asarray(indices)]

    def set_one(self, index: int, value: float) -> None:
        """Sets one leaf; a scalar Python walk is cheaper than vectorised calls for one item."""
        f = self.fanout
        self.leaves[index] = value
        for d in range(self.depth - 1, 0, -1):
            index //= f
            self.levels[d - 1][index] = self.levels[d][index * f:(index + 1) * f].sum()

    def set(self, indices: np.ndarray, values: np.ndarray) -> None:
        """Sets many leaves at once; for a repeated index the last value wins."""
        f = self.fanout
        idx = np.asarray(indices, np.int64)
        self.leaves[idx] = values
        for d in range(self.depth - 1, 0, -1):
            idx = idx // f
            # Repeated parents are recomputed more than once, to the same value: harmless.
            self.levels[d - 1][idx] = self.levels[d].reshape(-1, f)[idx].sum(axis=1)

    def find(self, targets: np.ndarray) -> np.ndarray:
        """Leaf indices i such that the prefix sum of leaves before i is <= target < that plus
        leaf i, for each target in [0, total). Never returns a zero-priority leaf, even when
        rounding puts a target at or past a subtree's exact total."""
        if self.total <= 0.0:
            raise ValueError("cannot sample from a SumTree whose total priority is 0")
        f = self.fanout
        t = np.asarray(targets, np.float64)
        idx = np.zeros(t.shape, np.int64)
        rows = np.arange(t.size)
        for level in self.levels:
            block = level.reshape(-1, f)[idx]  # [batch, fanout]: the children of each node
            prefix = np.cumsum(block, axis=1)
            # Keep the target strictly inside this node's own total (rounding can put it at or
            # past it); then the first child whose prefix sum exceeds the target has mass > 0.
            t = np.minimum(t, prefix[:, -1] * (1.0 - 2.0**-50))
            child = (prefix <= t[:, None]).sum(axis=1)
            # Among subnormal totals the shrink above can round to nothing, leaving every prefix
            # <= t: fall back to the last child with mass.
            last = f - 1 - np.argmax(block[:, ::-1] > 0, axis=1)
            child = np.minimum(child, last)
            # t >= the exact prefix before the child, so the subtraction stays >= 0.
            t = t - np.where(child > 0, prefix[rows, child - 1], 0.0)
            idx = idx * f + child
        return idx

    def state(self) -> np.ndarray:
        """Every level, root side first, as one array (restoring copies the sums verbatim rather
        than recomputing them, so a restored tree is bit-identical to the saved one)."""
        return np.concatenate(self.levels)

    def load_state(self, state: np.ndarray) -> None:
        sizes = [level.size for level in self.levels]
        if state.shape != (sum(sizes),):
            raise ValueError(f"sum tree state {state.shape} does not match this tree "
                             f"({sum(sizes)} nodes)")
        for level, part in zip(self.levels, np.split(state, np.cumsum(sizes)[:-1])):
            level[...] = part


class Transition(NamedTuple):
    """One (n-step) transition, or a batch of them with a leading batch axis.

    `discount` is the whole bootstrap multiplier: gamma^k times the product of the environment's
    discounts over the k <= n steps folded into `reward`; 0 when the episode terminated.
    """

    observation: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    discount: np.ndarray
    next_observation: np.ndarray
    next_legal: np.ndarray


class Sample(NamedTuple):
    """A sampled batch: where it came from, the transitions, and their importance weights."""

    indices: np.ndarray
    transitions: Transition
    weights: np.ndarray


class PrioritizedReplay:
    """A fixed-capacity FIFO of transitions, sampled in proportion to priority^alpha.

    `priority_exponent=0` gives uniform replay (every leaf is 1) with unit importance weights.
    """

    def __init__(self, capacity: int, observation_size: int, num_actions: int, *,
                 priority_exponent: float, priority_eps: float = 1e-6):
        self.capacity = capacity
        self.priority_exponent = priority_exponent
        self.priority_eps = priority_eps
        self.tree = SumTree(capacity)
        self.observation = np.zeros((capacity, observation_size), np.float32)
        self.action = np.zeros(capacity, np.int32)
        self.reward = np.zeros(capacity, np.float32)
        self.discount = np.zeros(capacity, np.float32)
        self.next_observation = np.zeros((capacity, observation_size), np.float32)
        self.next_legal = np.zeros((capacity, num_actions), bool)
        self.size = 0
        self.next_index = 0
        self.max_priority = 1.0

    def _leaf(self, priority: np.ndarray | float) -> np.ndarray | float:
        return (priority + self.priority_eps) ** self.priority_exponent

    def add(self, transition: Transition) -> int:
        """Stores a transition (overwriting the oldest when full) at the maximum priority."""
        i = self.next_index
        self.observation[i] = transition.observation
        self.action[i] = transition.action
        self.reward[i] = transition.reward
        self.discount[i] = transition.discount
        self.next_observation[i] = transition.next_observation
        self.next_legal[i] = transition.next_legal
        self.tree.set_one(i, float(self._leaf(self.max_priority)))
        self.next_index = (i + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)
        return i

    def sample(self, rng: np.random.Generator, batch_size: int,
               importance_exponent: float) -> Sample:
        """Stratified proportional sampling: one uniform draw in each of `batch_size` equal slices
        of the total priority, which lowers variance against independent draws without changing
        each item's marginal probability."""
        indices, weights = self._draw(rng, 1, batch_size, importance_exponent)
        return Sample(indices[0], self.gather(indices[0]), weights[0])

    def sample_batches(self, rng: np.random.Generator, num_batches: int, batch_size: int,
                       importance_exponent: float) -> Sample:
        """`num_batches` batches in one tree descent, with a leading [num_batches, batch_size]
        shape. The strata are shuffled across batches so that every batch sees the whole range
        of priorities; weights are normalised within each batch, as `sample` does."""
        indices, weights = self._draw(rng, num_batches, batch_size, importance_exponent)
        return Sample(indices, self.gather(indices), weights)

    def _draw(self, rng: np.random.Generator, num_batches: int, batch_size: int,
              importance_exponent: float) -> tuple[np.ndarray, np.ndarray]:
        if self.size == 0:
            raise ValueError("cannot sample from an empty replay")
        n = num_batches * batch_size
        total = self.tree.total
        targets = (np.arange(n) + rng.random(n)) * (total / n)
        if num_batches > 1:
            targets = rng.permutation(targets)
        indices = self.tree.find(np.minimum(targets, np.nextafter(total, 0.0)))
        indices = indices.reshape(num_batches, batch_size)
        probabilities = self.tree.get(indices) / total
        weights = (self.size * probabilities) ** (-importance_exponent)
        weights = (weights / weights.max(axis=1, keepdims=True)).astype(np.float32)
        return indices, weights

    def gather(self, indices: np.ndarray) -> Transition:
        return Transition(self.observation[indices], self.action[indices], self.reward[indices],
                          self.discount[indices], self.next_observation[indices],
                          self.next_legal[indices])

    def update_priorities(self, indices: np.ndarray, priorities: np.ndarray) -> None:
        """Sets the priorities (e.g. |TD error|) of sampled items."""
        priorities = np.asarray(priorities, np.float64)
        if not np.all(np.isfinite(priorities)):
            raise ValueError(f"non-finite priorities: {priorities[~np.isfinite(priorities)]}")
        self.max_priority = max(self.max_priority, float(priorities.max()))
        self.tree.set(indices, self._leaf(priorities))

    def state_dict(self) -> dict[str, np.ndarray]:
        return {
            "observation": self.observation, "action": self.action, "reward": self.reward,
            "discount": self.discount, "next_observation": self.next_observation,
            "next_legal": self.next_legal, "tree": self.tree.state(),
            "counters": np.array([self.size, self.next_index], np.int64),
            "max_priority": np.array(self.max_priority, np.float64),
        }

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        for name in ("observation", "action", "reward", "discount", "next_observation",
                     "next_legal"):
            target = getattr(self, name)
            if state[name].shape != target.shape:
                raise ValueError(f"replay {name}: checkpoint shape {state[name].shape} does not "
                                 f"match this replay's {target.shape}")
            target[...] = state[name]
        self.tree.load_state(state["tree"])
        self.size, self.next_index = (int(x) for x in state["counters"])
        self.max_priority = float(state["max_priority"])


class NStepAccumulator:
    """Turns a stream of time steps into n-step transitions.

    For the transition that starts at step i: reward r_{i+1} + g d_{i+1} r_{i+2} + ... over up to
    n rewards (g the agent's discount, d the environment's), bootstrap multiplier g^n times the
    product of those d, and the observation n steps later. At the end of an episode the pending
    shorter transitions are flushed; a terminal step has d = 0, so they do not bootstrap, while a
    truncated one (d > 0) bootstraps from its observation.
    """

    def __init__(self, n: int, discount: float):
        if n < 1:
            raise ValueError(f"n-step must be >= 1, got {n}")
        self.n = n
        self.gamma = discount
        self._observation: np.ndarray | None = None
        # Pending transitions, oldest first: [observation, action, return, bootstrap multiplier].
        self._pending: list[list[Any]] = []

    def first(self, timestep: TimeStep) -> None:
        self._observation = np.asarray(timestep.observation, np.float32)
        self._pending = []

    def push(self, action: int, timestep: TimeStep) -> list[Transition]:
        """Records `action` taken from the last observation and its outcome `timestep`; returns
        the transitions that became complete."""
        if self._observation is None:
            raise RuntimeError("NStepAccumulator.push before first(); call observe_first")
        self._pending.append([self._observation, int(action), 0.0, 1.0])
        r, d = float(timestep.reward), float(timestep.discount)
        for item in self._pending:
            item[2] += item[3] * r
            item[3] *= self.gamma * d
        next_obs = np.asarray(timestep.observation, np.float32)
        legal = np.asarray(timestep.legal, bool)
        done = len(self._pending) if timestep.last else max(0, len(self._pending) - self.n + 1)
        out = [Transition(o, a, g, disc, next_obs, legal) for o, a, g, disc in self._pending[:done]]
        del self._pending[:done]
        self._observation = None if timestep.last else next_obs
        return out

    def state_dict(self, observation_size: int) -> dict[str, np.ndarray]:
        k = len(self._pending)
        obs = np.zeros((k, observation_size), np.float32)
        for j, item in enumerate(self._pending):
            obs[j] = item[0]
        has_obs = self._observation is not None
        return {
            "pending_observation": obs,
            "pending_action": np.array([p[1] for p in self._pending], np.int64),
            "pending_return_discount": np.array([[p[2], p[3]] for p in self._pending],
                                                np.float64).reshape(k, 2),
            "observation": (self._observation if has_obs
                            else np.zeros((0, observation_size), np.float32)).reshape(-1),
            "has_observation": np.array(has_obs),
        }

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        self._observation = (np.array(state["observation"], np.float32)
                             if bool(state["has_observation"]) else None)
        self._pending = [
            [np.array(o, np.float32), int(a), float(rd[0]), float(rd[1])]
            for o, a, rd in zip(state["pending_observation"], state["pending_action"],
                                state["pending_return_discount"])
        ]
