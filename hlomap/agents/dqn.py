"""Rainbow-style DQN as Auto-MAP used it: double Q, dueling, n-step, prioritized replay, optional
C51 and noisy layers, and illegal actions masked out of every argmax.

Two layers, as in optax/rlax and dqn_zoo:
- `make_dqn` builds pure, jitted functions closed over the static config and network graph:
  `init(key) -> DqnState`, `greedy(params, obs, legal, noise_key) -> actions`,
  `update(state, transitions, weights) -> (state, LearnerOutput)`. The learner state is a
  NamedTuple that `update` consumes (its buffers are donated, so an update reuses them in place).
- `DqnAgent` is the imperative shell: replay, n-step accumulation, schedules, checkpoints.

Epsilon-greedy draws its coin and its random legal action on the host (numpy), so an exploring
step makes no device call at all and a greedy one is a single small jitted call: per step, XLA
random-number kernels cost more than the Q-network of a small MLP.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hlomap.agents import checkpoint
from hlomap.agents.base import UpdateStats
from hlomap.agents.environment import TimeStep
from hlomap.agents.losses import categorical_double_q_loss, double_q_loss, mask_illegal
from hlomap.agents.networks import (RUN_ONCE_COMPILER_OPTIONS, Params, PureModel, QNetwork,
                                    QOutput, abstract_model, purify)
from hlomap.agents.replay import NStepAccumulator, PrioritizedReplay, Transition

log = logging.getLogger(__name__)


class TargetUpdate(enum.Enum):
    """How the target network follows the online one."""

    HARD = "hard"  # copy every `target_update_period` learner updates
    POLYAK = "polyak"  # target <- tau * online + (1 - tau) * target after every update


@dataclasses.dataclass(frozen=True)
class DqnConfig:
    """Rainbow DQN hyper-parameters; defaults are Auto-MAP's where the paper fixes them
    (alpha 0.2, beta 0.6 annealed to 1, buffer 2000, target update every 100 steps, epsilon
    1.0 -> 0.1, no noisy layers)."""

    # network
    hidden: tuple[int, ...] = (256, 256)
    dueling: bool = True
    distributional: bool = False
    num_atoms: int = 51
    v_min: float = -10.0
    v_max: float = 10.0
    noisy: bool = False  # with noisy layers, Rainbow sets epsilon to 0: noise explores
    noisy_sigma0: float = 0.5
    # targets and loss
    discount: float = 0.99
    n_step: int = 3
    huber_delta: float | None = 1.0  # None: 0.5 * td^2; C51 uses cross-entropy instead
    target_update: TargetUpdate = TargetUpdate.HARD
    target_update_period: int = 100  # learner updates
    polyak_tau: float = 0.005
    # optimiser
    learning_rate: float = 1e-4
    adam_eps: float = 1.5e-4
    max_grad_norm: float = 10.0
    # replay
    replay_capacity: int = 2000
    batch_size: int = 32
    min_replay_size: int = 100
    priority_exponent: float = 0.2  # alpha
    importance_exponent_start: float = 0.6  # beta, annealed linearly ...
    importance_exponent_end: float = 1.0
    importance_anneal_updates: int = 10_000  # ... over this many learner updates
    priority_eps: float = 1e-6
    # acting and update cadence
    epsilon_start: float = 1.0
    epsilon_end: float = 0.1
    epsilon_decay_steps: int = 10_000  # environment steps
    # An exploring step draws legal action a with weight `rank_decay` ** a instead of uniformly:
    # for environments whose actions are candidates ranked best-looking first, exploration
    # then stays near the top of the ranking (None: uniform).
    rank_decay: float | None = None
    update_period: int = 1  # environment steps per learner update
    # Learner updates fused into one jitted call (lax.scan). >1 amortises dispatch and host work,
    # at the price of sampling the later batches of a call before the earlier ones' priorities
    # are written back.
    updates_per_call: int = 1

    def __post_init__(self) -> None:
        if self.n_step < 1 or self.batch_size < 1 or self.updates_per_call < 1:
            raise ValueError(f"n_step, batch_size, updates_per_call must be >= 1: {self}")
        if self.distributional and (self.num_atoms < 2 or self.v_max <= self.v_min):
            raise ValueError(f"C51 needs num_atoms >= 2 and v_max > v_min: {self}")
        if not 0 <= self.epsilon_end <= 1 or not 0 <= self.epsilon_start <= 1:
            raise ValueError(f"epsilon must lie in [0, 1]: {self}")
        if self.rank_decay is not None and not 0 < self.rank_decay <= 1:
            raise ValueError(f"rank_decay must lie in (0, 1]: {self}")


class DqnState(NamedTuple):
    """The learner's state: everything `update` reads and writes."""

    params: Params
    target_params: Params
    opt_state: optax.OptState
    key: jax.Array  # noise for noisy layers
    num_updates: jax.Array  # int32 scalar


class LearnerOutput(NamedTuple):
    """Per-call learner output: mean loss and the new priority of every sampled item."""

    loss: jax.Array
    priorities: jax.Array  # [B] (or [K, B] for K fused updates)


@dataclasses.dataclass(frozen=True)
class DqnFunctions:
    """Pure jitted functions for one (config, observation size, action count)."""

    model: PureModel
    init: Callable[[jax.Array], DqnState]
    greedy: Callable[..., jax.Array]  # (params, obs[B,D], legal[B,A], noise_key|None) -> [B]
    q_values: Callable[[Params, jax.Array], jax.Array]  # (params, obs[B,D]) -> [B,A]
    update: Callable[..., tuple[DqnState, LearnerOutput]]  # (state, transitions, weights)
    update_many: Callable[..., tuple[DqnState, LearnerOutput]]  # leading axis K on both


def epsilon_at(config: DqnConfig, step: int) -> float:
    """Epsilon decayed linearly from start to end over `epsilon_decay_steps` environment steps."""
    frac = min(1.0, step / max(1, config.epsilon_decay_steps))
    return config.epsilon_start + frac * (config.epsilon_end - config.epsilon_start)


def importance_exponent(config: DqnConfig, num_updates: int) -> float:
    """Beta annealed linearly from start to end over `importance_anneal_updates` updates."""
    frac = min(1.0, num_updates / max(1, config.importance_anneal_updates))
    return config.importance_exponent_start + frac * (
        config.importance_exponent_end - config.importance_exponent_start)


def make_optimizer(config: DqnConfig) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm),
                       optax.adam(config.learning_rate, eps=config.adam_eps))


def greedy_actions(model: PureModel, params: Params, observations: jax.Array, legal: jax.Array,
                   noise_key: jax.Array | None = None) -> jax.Array:
    """The best legal action of each row: argmax of Q with illegal actions masked out."""
    q = model.apply(params, observations, noise_key).q_values
    return jnp.argmax(mask_illegal(q, legal), axis=-1).astype(jnp.int32)


def random_legal_actions(rng: np.random.Generator, legal: np.ndarray, rank_decay: float | None = None) -> np.ndarray:
    """A random legal action per row of `legal` [B, A]: uniform, or with weight
    `rank_decay` ** a (`DqnConfig.rank_decay`)."""
    if rank_decay is None or rank_decay == 1:
        return np.argmax(np.where(legal, rng.random(legal.shape), -1.0), axis=-1)  # argmax of uniform noise
    weights = np.where(legal, rank_decay ** np.arange(legal.shape[-1], dtype=np.float64), 0.0)
    cumulative = np.cumsum(weights, axis=-1)
    draws = rng.random(legal.shape[0]) * cumulative[:, -1]
    chosen = np.sum(cumulative <= draws[:, None], axis=-1)  # the first action whose cumulative weight exceeds the draw
    return np.minimum(chosen, legal.shape[-1] - 1)


def dqn_loss(config: DqnConfig, model: PureModel, atoms: np.ndarray | None, params: Params,
             target_params: Params, batch: Transition, weights: jax.Array,
             key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(loss, priorities) for one batch: online net on both ends, target net on the next one."""
    keys: list[jax.Array | None] = list(jax.random.split(key, 3)) if config.noisy else [None] * 3
    out_tm1: QOutput = model.apply(params, batch.observation, keys[0])
    out_sel: QOutput = model.apply(params, batch.next_observation, keys[1])
    out_tgt: QOutput = model.apply(target_params, batch.next_observation, keys[2])
    selector = jax.lax.stop_gradient(out_sel.q_values)
    if atoms is not None:
        assert out_tm1.logits is not None and out_tgt.logits is not None
        result = categorical_double_q_loss(atoms, out_tm1.logits, batch.action, batch.reward,
                                           batch.discount, out_tgt.logits, selector,
                                           batch.next_legal, weights)
    else:
        result = double_q_loss(out_tm1.q_values, batch.action, batch.reward, batch.discount,
                               out_tgt.q_values, selector, batch.next_legal, weights,
                               huber_delta=config.huber_delta)
    return result.loss, result.priorities


def make_dqn(config: DqnConfig, observation_size: int, num_actions: int) -> DqnFunctions:
    """Builds the network and the pure jitted DQN functions for these sizes."""
    atoms = (np.linspace(config.v_min, config.v_max, config.num_atoms, dtype=np.float32)
             if config.distributional else None)
    optimizer = make_optimizer(config)

    def build(rngs: nnx.Rngs) -> QNetwork:
        return QNetwork(observation_size, num_actions, hidden=config.hidden,
                        dueling=config.dueling, atoms=atoms, noisy=config.noisy,
                        sigma0=config.noisy_sigma0, rngs=rngs)

    model = abstract_model(build)  # the graph only; parameters come from init(key)

    def init(key: jax.Array) -> DqnState:
        k_params, k_state = jax.random.split(key)
        _, params = purify(build(nnx.Rngs(params=k_params)))
        return DqnState(params=params, target_params=jax.tree.map(jnp.copy, params),
                        opt_state=optimizer.init(params), key=k_state,
                        num_updates=jnp.zeros((), jnp.int32))

    def greedy(params: Params, observations: jax.Array, legal: jax.Array,
               noise_key: jax.Array | None = None) -> jax.Array:
        return greedy_actions(model, params, observations, legal, noise_key)

    def q_values(params: Params, observations: jax.Array) -> jax.Array:
        return model.apply(params, observations).q_values

    def update(state: DqnState, batch: Transition, weights: jax.Array
               ) -> tuple[DqnState, LearnerOutput]:
        key, loss_key = jax.random.split(state.key) if config.noisy else (state.key, state.key)
        (loss, priorities), grads = jax.value_and_grad(
            lambda p: dqn_loss(config, model, atoms, p, state.target_params, batch, weights,
                               loss_key), has_aux=True)(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        num_updates = state.num_updates + 1
        if config.target_update is TargetUpdate.HARD:
            target = jax.lax.cond(num_updates % config.target_update_period == 0,
                                  lambda: params, lambda: state.target_params)
        else:
            target = optax.incremental_update(params, state.target_params, config.polyak_tau)
        new_state = DqnState(params, target, opt_state, key, num_updates)
        return new_state, LearnerOutput(loss, priorities)

    def update_many(state: DqnState, batches: Transition, weights: jax.Array
                    ) -> tuple[DqnState, LearnerOutput]:
        state, out = jax.lax.scan(lambda s, bw: update(s, *bw), state, (batches, weights))
        return state, LearnerOutput(jnp.mean(out.loss), out.priorities)

    return DqnFunctions(
        model=model,
        init=jax.jit(init, compiler_options=RUN_ONCE_COMPILER_OPTIONS),
        greedy=jax.jit(greedy),
        q_values=jax.jit(q_values),
        update=jax.jit(update, donate_argnums=0),
        update_many=jax.jit(update_many, donate_argnums=0),
    )


class DqnAgent:
    """The imperative shell around the pure DQN functions.

    Acting is at most one jitted call per step (`act`) or per batch of environments
    (`act_batch`); `observe` does n-step bookkeeping and a replay write in numpy; `update`
    samples, runs the jitted learner (donating its state) and writes the new priorities back.

    Because updates donate the learner state, do not hold on to `self.state`'s arrays across an
    update; take host copies with `get_params()` instead.
    """

    kind = "dqn"

    def __init__(self, config: DqnConfig, observation_size: int, num_actions: int, *,
                 seed: int = 0, functions: DqnFunctions | None = None):
        """`functions`: the result of `make_dqn` for the same config and sizes, to share one set
        of compiled functions between agents (several seeds, a restored copy...)."""
        self.config = config
        self.observation_size = observation_size
        self.num_actions = num_actions
        self.seed = seed
        self.fns = functions if functions is not None else make_dqn(config, observation_size,
                                                                    num_actions)
        init_key, noise_key = jax.random.split(jax.random.key(seed))
        self.state: DqnState = self.fns.init(init_key)
        # Acting noise of noisy layers: noise_key folded with the count of noisy acting calls.
        self.noise_key = noise_key
        self.num_noisy_calls = 0
        # Host-side streams, independent of each other and of the JAX keys: replay sampling and
        # epsilon-greedy exploration.
        self.rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5EED]))
        self.actor_rng = np.random.default_rng(np.random.SeedSequence([seed, 0xAC7]))
        self.replay = PrioritizedReplay(config.replay_capacity, observation_size, num_actions,
                                        priority_exponent=config.priority_exponent,
                                        priority_eps=config.priority_eps)
        self.accumulator = NStepAccumulator(config.n_step, config.discount)
        self.num_steps = 0
        self.num_updates = 0  # host mirror of state.num_updates (avoids a device sync)
        self._last_update_step = -1

    # ---- acting ---------------------------------------------------------------------------
    def observe_first(self, timestep: TimeStep) -> None:
        self.accumulator.first(timestep)

    def act(self, timestep: TimeStep) -> int:
        """Epsilon-greedy over legal actions; exploring steps make no device call."""
        legal = np.asarray(timestep.legal, bool)
        if self.actor_rng.random() < self.epsilon:
            if self.config.rank_decay is not None:
                return int(random_legal_actions(self.actor_rng, legal[None], self.config.rank_decay)[0])
            choices = np.flatnonzero(legal)
            return int(choices[self.actor_rng.integers(len(choices))])
        obs = np.asarray(timestep.observation, np.float32)[None]
        return int(np.asarray(self.fns.greedy(self.state.params, obs, legal[None],
                                              self._acting_noise()))[0])

    def act_batch(self, observations: np.ndarray, legal: np.ndarray) -> np.ndarray:
        """Epsilon-greedy actions for a batch of environments (at most one jitted call)."""
        legal = np.asarray(legal, bool)
        explore = self.actor_rng.random(legal.shape[0]) < self.epsilon
        actions = random_legal_actions(self.actor_rng, legal, self.config.rank_decay)
        if not explore.all():
            greedy = np.asarray(self.fns.greedy(self.state.params,
                                                np.asarray(observations, np.float32), legal,
                                                self._acting_noise()))
            actions = np.where(explore, actions, greedy)
        return actions

    def _acting_noise(self) -> jax.Array | None:
        if not self.config.noisy:
            return None
        self.num_noisy_calls += 1
        return jax.random.fold_in(self.noise_key, self.num_noisy_calls)

    def greedy_action(self, observation: np.ndarray, legal: np.ndarray) -> int:
        return int(self.greedy_batch(np.asarray(observation)[None], np.asarray(legal)[None])[0])

    def greedy_batch(self, observations: np.ndarray, legal: np.ndarray) -> np.ndarray:
        """Best legal actions by the online network's (noise-free) Q-values."""
        return np.asarray(self.fns.greedy(self.state.params, np.asarray(observations, np.float32),
                                          np.asarray(legal, bool)))

    def q_values(self, observations: np.ndarray) -> np.ndarray:
        return np.asarray(self.fns.q_values(self.state.params,
                                            np.asarray(observations, np.float32)))

    def observe(self, action: int, timestep: TimeStep) -> None:
        for transition in self.accumulator.push(action, timestep):
            self.replay.add(transition)
        self.num_steps += 1

    # ---- learning -------------------------------------------------------------------------
    def update(self) -> UpdateStats | None:
        """Runs one learner call when it is due: replay warm, and every
        `update_period * updates_per_call` environment steps (at most once per step)."""
        cfg = self.config
        period = cfg.update_period * cfg.updates_per_call
        if (self.replay.size < max(cfg.min_replay_size, 1) or self.num_steps % period != 0
                or self._last_update_step == self.num_steps):
            return None
        self._last_update_step = self.num_steps
        return self.learn()

    def learn(self) -> UpdateStats:
        """One learner call (`updates_per_call` updates) now, regardless of the schedule."""
        cfg = self.config
        beta = importance_exponent(cfg, self.num_updates)
        k = cfg.updates_per_call
        if k == 1:
            sample = self.replay.sample(self.rng, cfg.batch_size, beta)
            self.state, out = self.fns.update(self.state, sample.transitions, sample.weights)
            indices = sample.indices
        else:
            sample = self.replay.sample_batches(self.rng, k, cfg.batch_size, beta)
            self.state, out = self.fns.update_many(self.state, sample.transitions,
                                                   sample.weights)
            indices = sample.indices
        self.replay.update_priorities(indices.reshape(-1), np.asarray(out.priorities).reshape(-1))
        self.num_updates += k
        return UpdateStats(loss=float(out.loss), num_updates=self.num_updates)

    # ---- inspection -----------------------------------------------------------------------
    @property
    def epsilon(self) -> float:
        return epsilon_at(self.config, self.num_steps)

    def metrics(self) -> dict[str, float]:
        return {"epsilon": self.epsilon, "replay": float(self.replay.size)}

    def get_params(self) -> Params:
        """Host copies of the online parameters (safe to keep across updates)."""
        return jax.tree.map(lambda x: np.array(x, copy=True), self.state.params)

    def set_params(self, params: Params) -> None:
        """Replaces the online (and target) parameters, e.g. to go back to the best network."""
        fresh = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
        self.state = self.state._replace(params=fresh,
                                         target_params=jax.tree.map(jnp.copy, fresh))

    # ---- checkpoints ----------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> None:
        arrays = {
            **checkpoint.flatten("learner", self.state),
            **checkpoint.flatten("noise_key", self.noise_key),
            **{"replay/" + k: v for k, v in self.replay.state_dict().items()},
            **{"nstep/" + k: v
               for k, v in self.accumulator.state_dict(self.observation_size).items()},
        }
        meta = {
            "kind": self.kind, "config": checkpoint.config_to_json(self.config),
            "observation_size": self.observation_size, "num_actions": self.num_actions,
            "seed": self.seed, "num_steps": self.num_steps, "num_updates": self.num_updates,
            "last_update_step": self._last_update_step, "rng": self.rng.bit_generator.state,
            "actor_rng": self.actor_rng.bit_generator.state,
            "num_noisy_calls": self.num_noisy_calls,
            "extra": extra,
        }
        checkpoint.save(path, arrays, meta)
        log.debug("saved DQN checkpoint %s at step %d", path, self.num_steps)

    def restore(self, path: str | os.PathLike[str]) -> dict[str, Any] | None:
        arrays, meta = checkpoint.load(path)
        self._check_compatible(meta, path)
        self.state = checkpoint.unflatten("learner", self.state, arrays)
        self.noise_key = checkpoint.unflatten("noise_key", self.noise_key, arrays)
        self.replay.load_state_dict(checkpoint.subset("replay/", arrays))
        self.accumulator.load_state_dict(checkpoint.subset("nstep/", arrays))
        self.num_steps = int(meta["num_steps"])
        self.num_updates = int(meta["num_updates"])
        self._last_update_step = int(meta["last_update_step"])
        self.rng.bit_generator.state = meta["rng"]
        self.actor_rng.bit_generator.state = meta["actor_rng"]
        self.num_noisy_calls = int(meta["num_noisy_calls"])
        return meta["extra"]

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str], *,
                        functions: DqnFunctions | None = None) -> tuple[DqnAgent, dict | None]:
        """Rebuilds an agent (config, sizes, seed) from a checkpoint and restores it; returns
        the agent and the checkpoint's `extra`."""
        _, meta = checkpoint.load(path)
        agent = cls(checkpoint.config_from_json(DqnConfig, meta["config"]),
                    meta["observation_size"], meta["num_actions"], seed=meta["seed"],
                    functions=functions)
        return agent, agent.restore(path)

    def _check_compatible(self, meta: dict[str, Any], path: str | os.PathLike[str]) -> None:
        mine = (self.kind, checkpoint.config_to_json(self.config), self.observation_size,
                self.num_actions)
        theirs = (meta.get("kind"), meta.get("config"), meta.get("observation_size"),
                  meta.get("num_actions"))
        if mine != theirs:
            raise ValueError(f"{path}: checkpoint is for {theirs}, this agent is {mine}")
