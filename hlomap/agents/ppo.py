"""PPO with masked discrete actions, as DRL-PP used it for pipeline placement.

Clipped surrogate (rlax), entropy bonus, and one of two advantage estimators:
- `Advantage.RUNNING_MEAN` (DRL-PP's appendix): advantage = return - running mean of returns. The
  running mean also stands in for the value of a state where a rollout or a truncated episode is
  cut, so no critic is trained.
- `Advantage.GAE`: generalised advantage estimation with a learned critic (rlax).

`make_ppo` builds pure jitted functions; one `update` call does the whole optimisation phase of a
rollout (advantages, epochs x minibatches under lax.scan). `PpoAgent` is the shell that fills the
rollout buffer one environment step at a time.
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
import rlax

from hlomap.agents import checkpoint
from hlomap.agents.base import UpdateStats
from hlomap.agents.environment import TimeStep
from hlomap.agents.losses import mask_illegal, ppo_loss
from hlomap.agents.networks import (RUN_ONCE_COMPILER_OPTIONS, Params, PolicyValueNetwork,
                                    PureModel, abstract_model, purify)

log = logging.getLogger(__name__)


class Advantage(enum.Enum):
    """How advantages are estimated."""

    RUNNING_MEAN = "running_mean"  # return minus a running mean of returns (DRL-PP)
    GAE = "gae"  # generalised advantage estimation with a learned critic


@dataclasses.dataclass(frozen=True)
class PpoConfig:
    """PPO hyper-parameters; defaults are DRL-PP's (clip 0.2, entropy 0.001, Adam 3e-4,
    gradient-norm clip 1.0, 3 epochs, 4 minibatches)."""

    hidden: tuple[int, ...] = (256, 256)
    advantage: Advantage = Advantage.RUNNING_MEAN
    discount: float = 0.99
    gae_lambda: float = 0.95
    baseline_decay: float = 0.9  # EMA decay of the running mean return, per rollout
    normalize_advantages: bool = True
    clip_epsilon: float = 0.2
    entropy_coef: float = 0.001
    value_coef: float = 0.5  # used with GAE only
    learning_rate: float = 3e-4
    max_grad_norm: float = 1.0
    num_epochs: int = 3
    num_minibatches: int = 4
    rollout_length: int = 128  # environment steps per update

    def __post_init__(self) -> None:
        if self.rollout_length % self.num_minibatches:
            raise ValueError(f"rollout_length {self.rollout_length} is not a multiple of "
                             f"num_minibatches {self.num_minibatches}")
        if self.num_epochs < 1 or self.num_minibatches < 1:
            raise ValueError(f"num_epochs and num_minibatches must be >= 1: {self}")


class PpoState(NamedTuple):
    """The learner's state."""

    params: Params
    opt_state: optax.OptState
    key: jax.Array  # minibatch shuffling
    baseline_ema: jax.Array  # biased EMA of mean returns (RUNNING_MEAN)
    baseline_count: jax.Array  # rollouts folded into the EMA, for bias correction
    num_updates: jax.Array


class Rollout(NamedTuple):
    """One rollout of T steps, in time order; arrays have leading axis T.

    `discount` is gamma times the environment's discount of the step's outcome; `last` marks the
    step that ended an episode; `bootstrap` is the critic's value of the outcome's observation
    where the return is cut without a termination (truncation or the end of the rollout), else 0.
    """

    observation: np.ndarray
    legal: np.ndarray
    action: np.ndarray
    log_prob: np.ndarray
    value: np.ndarray
    reward: np.ndarray
    discount: np.ndarray
    last: np.ndarray
    cut: np.ndarray  # the return is cut here without a termination: needs a bootstrap
    bootstrap: np.ndarray


class PpoStats(NamedTuple):
    """Means over the minibatch updates of one `update` call."""

    loss: jax.Array
    policy_loss: jax.Array
    entropy: jax.Array
    value_loss: jax.Array
    approx_kl: jax.Array
    clip_fraction: jax.Array
    baseline: jax.Array


class PolicyStep(NamedTuple):
    """The policy at a batch of states: log-probabilities over actions (illegal ones ~ -3e38)
    and state values (zeros without a critic)."""

    log_probs: jax.Array
    value: jax.Array


@dataclasses.dataclass(frozen=True)
class PpoFunctions:
    model: PureModel
    init: Callable[[jax.Array], PpoState]
    policy: Callable[..., PolicyStep]  # (params, obs[B,D], legal[B,A])
    value: Callable[[Params, jax.Array], jax.Array]
    logits: Callable[[Params, jax.Array], jax.Array]
    update: Callable[[PpoState, Rollout], tuple[PpoState, PpoStats]]


def advantages_and_targets(config: PpoConfig, rollout: Rollout, baseline: jax.Array
                           ) -> tuple[jax.Array, jax.Array]:
    """(advantages, value targets) for a rollout; `baseline` is used by RUNNING_MEAN only.

    Episode boundaries inside the rollout get a zero continuation discount; where the return is
    cut without termination, the bootstrap value (the critic's, or the running mean) is folded
    into that step's reward, which makes rlax's single-sequence estimators exact across several
    episodes.
    """
    last = rollout.last.astype(jnp.float32)
    cont = rollout.discount * (1.0 - last)
    if config.advantage is Advantage.GAE:
        boot = rollout.bootstrap
    else:
        boot = jnp.full_like(rollout.reward, baseline)
    boot = jnp.where(rollout.cut, boot, 0.0)
    # At an episode end the bootstrap goes into the reward; at the rollout's end (mid-episode) it
    # is the value past the sequence.
    r = rollout.reward + rollout.discount * last * boot
    tail = boot[-1] * (1.0 - last[-1])
    if config.advantage is Advantage.GAE:
        values = jnp.concatenate([rollout.value, tail[None]])
        adv = rlax.truncated_generalized_advantage_estimation(r, cont, config.gae_lambda, values)
        return adv, adv + rollout.value
    returns = rlax.discounted_returns(r, cont, jnp.full_like(r, tail))
    return returns - baseline, returns


def make_ppo(config: PpoConfig, observation_size: int, num_actions: int) -> PpoFunctions:
    """Builds the policy network and the pure jitted PPO functions for these sizes."""
    critic = config.advantage is Advantage.GAE
    optimizer = optax.chain(optax.clip_by_global_norm(config.max_grad_norm),
                            optax.adam(config.learning_rate))
    value_coef = config.value_coef if critic else 0.0

    def build(rngs: nnx.Rngs) -> PolicyValueNetwork:
        return PolicyValueNetwork(observation_size, num_actions, hidden=config.hidden,
                                  critic=critic, rngs=rngs)

    model = abstract_model(build)

    def init(key: jax.Array) -> PpoState:
        k_params, k_state = jax.random.split(key)
        _, params = purify(build(nnx.Rngs(params=k_params)))
        zero = jnp.zeros((), jnp.float32)
        return PpoState(params, optimizer.init(params), k_state, zero, zero,
                        jnp.zeros((), jnp.int32))

    def policy(params: Params, observations: jax.Array, legal: jax.Array) -> PolicyStep:
        out = model.apply(params, observations)
        return PolicyStep(jax.nn.log_softmax(mask_illegal(out.logits, legal), axis=-1),
                          out.value)

    def value(params: Params, observations: jax.Array) -> jax.Array:
        return model.apply(params, observations).value

    def logits(params: Params, observations: jax.Array) -> jax.Array:
        return model.apply(params, observations).logits

    def minibatch_step(params: Params, opt_state: optax.OptState, batch: Rollout,
                       adv: jax.Array, targets: jax.Array
                       ) -> tuple[Params, optax.OptState, PpoStats]:
        def loss_fn(p: Params) -> tuple[jax.Array, Any]:
            out = model.apply(p, batch.observation)
            result = ppo_loss(out.logits, batch.legal, batch.action, batch.log_prob, adv,
                              out.value, targets, clip_epsilon=config.clip_epsilon,
                              entropy_coef=config.entropy_coef, value_coef=value_coef)
            return result.loss, result

        (_, result), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        stats = PpoStats(result.loss, result.policy_loss, result.entropy, result.value_loss,
                         result.approx_kl, result.clip_fraction, jnp.zeros(()))
        return optax.apply_updates(params, updates), opt_state, stats

    def update(state: PpoState, rollout: Rollout) -> tuple[PpoState, PpoStats]:
        rollout = jax.tree.map(jnp.asarray, rollout)
        ema, count = state.baseline_ema, state.baseline_count
        if config.advantage is Advantage.RUNNING_MEAN:
            decay = config.baseline_decay
            # Returns bootstrap from the running mean so far; then this rollout's mean return is
            # folded into the (bias-corrected) mean before it is subtracted, so the very first
            # rollout is measured against its own mean rather than against 0.
            previous = jnp.where(count > 0, ema / (1.0 - decay**jnp.maximum(count, 1.0)), 0.0)
            _, returns = advantages_and_targets(config, rollout, previous)
            ema = decay * ema + (1.0 - decay) * returns.mean()
            count = count + 1.0
            baseline = ema / (1.0 - decay**count)
            adv, targets = returns - baseline, returns
        else:
            baseline = jnp.zeros(())
            adv, targets = advantages_and_targets(config, rollout, baseline)
        if config.normalize_advantages:
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        t = config.rollout_length
        size = t // config.num_minibatches

        def epoch(carry: tuple[Params, optax.OptState, jax.Array], _: None
                  ) -> tuple[tuple[Params, optax.OptState, jax.Array], PpoStats]:
            params, opt_state, key = carry
            key, sub = jax.random.split(key)
            order = jax.random.permutation(sub, t).reshape(config.num_minibatches, size)

            def minibatch(c: tuple[Params, optax.OptState], idx: jax.Array
                          ) -> tuple[tuple[Params, optax.OptState], PpoStats]:
                p, o = c
                take = lambda x: x[idx]  # noqa: E731
                p, o, stats = minibatch_step(p, o, jax.tree.map(take, rollout), adv[idx],
                                             targets[idx])
                return (p, o), stats

            (params, opt_state), stats = jax.lax.scan(minibatch, (params, opt_state), order)
            return (params, opt_state, key), stats

        (params, opt_state, key), stats = jax.lax.scan(
            epoch, (state.params, state.opt_state, state.key), None, length=config.num_epochs)
        stats = jax.tree.map(jnp.mean, stats)._replace(baseline=baseline)
        return PpoState(params, opt_state, key, ema, count, state.num_updates + 1), stats

    return PpoFunctions(model=model,
                        init=jax.jit(init, compiler_options=RUN_ONCE_COMPILER_OPTIONS),
                        policy=jax.jit(policy),
                        value=jax.jit(value), logits=jax.jit(logits),
                        update=jax.jit(update, donate_argnums=0))


def sample_actions(rng: np.random.Generator, log_probs: np.ndarray) -> np.ndarray:
    """One action per row drawn from softmax(log_probs), by the Gumbel-max trick on the host
    (numpy), so that sampling adds no device work to the acting call."""
    gumbel = -np.log(-np.log(rng.random(log_probs.shape)))
    return np.argmax(log_probs + gumbel, axis=-1)


class _RolloutBuffer:
    """Preallocated numpy storage for one rollout, filled one step at a time."""

    def __init__(self, length: int, observation_size: int, num_actions: int):
        self.data = Rollout(
            observation=np.zeros((length, observation_size), np.float32),
            legal=np.zeros((length, num_actions), bool),
            action=np.zeros(length, np.int32),
            log_prob=np.zeros(length, np.float32),
            value=np.zeros(length, np.float32),
            reward=np.zeros(length, np.float32),
            discount=np.zeros(length, np.float32),
            last=np.zeros(length, bool),
            cut=np.zeros(length, bool),
            bootstrap=np.zeros(length, np.float32),
        )
        self.size = 0

    @property
    def full(self) -> bool:
        return self.size == self.data.action.shape[0]


class PpoAgent:
    """The imperative shell around the pure PPO functions; see `hlomap.agents.base.Agent`."""

    kind = "ppo"

    def __init__(self, config: PpoConfig, observation_size: int, num_actions: int, *,
                 seed: int = 0, functions: PpoFunctions | None = None):
        """`functions`: the result of `make_ppo` for the same config and sizes, to share one set
        of compiled functions between agents."""
        self.config = config
        self.observation_size = observation_size
        self.num_actions = num_actions
        self.seed = seed
        self.fns = functions if functions is not None else make_ppo(config, observation_size,
                                                                    num_actions)
        self.state: PpoState = self.fns.init(jax.random.key(seed))
        # Action sampling happens on the host, on its own stream.
        self.actor_rng = np.random.default_rng(np.random.SeedSequence([seed, 0xAC7]))
        self.buffer = _RolloutBuffer(config.rollout_length, observation_size, num_actions)
        self.num_steps = 0
        self.num_updates = 0
        self._pending: tuple[int, float, float] | None = None  # action, log-prob, value
        self._observation = np.zeros(observation_size, np.float32)
        self._legal = np.zeros(num_actions, bool)
        self._last_stats: PpoStats | None = None

    def observe_first(self, timestep: TimeStep) -> None:
        self._pending = None

    def act(self, timestep: TimeStep) -> int:
        """Samples from the softmax policy over legal actions."""
        obs = np.asarray(timestep.observation, np.float32)
        legal = np.asarray(timestep.legal, bool)
        step = self.fns.policy(self.state.params, obs[None], legal[None])
        log_probs = np.asarray(step.log_probs)[0]
        action = int(sample_actions(self.actor_rng, log_probs))
        self._pending = (action, float(log_probs[action]), float(np.asarray(step.value)[0]))
        self._observation, self._legal = obs, legal
        return int(action)

    def observe(self, action: int, timestep: TimeStep) -> None:
        if self._pending is None or self._pending[0] != int(action):
            raise ValueError(f"PPO is on-policy: observe({action}) must follow act() that chose "
                             f"it (pending: {self._pending})")
        if self.buffer.full:
            raise RuntimeError("PPO rollout buffer is full: call update() after each observe()")
        a, log_prob, value = self._pending
        self._pending = None
        i = self.buffer.size
        d = self.buffer.data
        d.observation[i], d.legal[i], d.action[i] = self._observation, self._legal, a
        d.log_prob[i], d.value[i], d.reward[i] = log_prob, value, timestep.reward
        d.discount[i] = self.config.discount * timestep.discount
        d.last[i] = timestep.last
        self.buffer.size += 1
        cut = (timestep.last and timestep.discount > 0) or (self.buffer.full and not timestep.last)
        d.cut[i] = cut
        d.bootstrap[i] = 0.0
        if cut and self.config.advantage is Advantage.GAE:
            obs = np.asarray(timestep.observation, np.float32)[None]
            d.bootstrap[i] = float(np.asarray(self.fns.value(self.state.params, obs))[0])
        self.num_steps += 1

    def update(self) -> UpdateStats | None:
        """Runs the optimisation phase when the rollout buffer is full."""
        if not self.buffer.full:
            return None
        self.state, stats = self.fns.update(self.state, self.buffer.data)
        self.buffer.size = 0
        self.num_updates += 1
        self._last_stats = stats
        return UpdateStats(loss=float(stats.loss), num_updates=self.num_updates)

    @property
    def last_stats(self) -> PpoStats | None:
        return self._last_stats

    def greedy_action(self, observation: np.ndarray, legal: np.ndarray) -> int:
        return int(self.greedy_batch(np.asarray(observation)[None], np.asarray(legal)[None])[0])

    def greedy_batch(self, observations: np.ndarray, legal: np.ndarray) -> np.ndarray:
        """The most probable legal actions."""
        logits = np.asarray(self.fns.logits(self.state.params,
                                            np.asarray(observations, np.float32)))
        return np.argmax(np.where(np.asarray(legal, bool), logits, -np.inf), axis=-1)

    def sample_batch(self, observations: np.ndarray, legal: np.ndarray) -> np.ndarray:
        """Policy samples for a batch of environments in one jitted call (not recorded)."""
        step = self.fns.policy(self.state.params, np.asarray(observations, np.float32),
                               np.asarray(legal, bool))
        return sample_actions(self.actor_rng, np.asarray(step.log_probs))

    def metrics(self) -> dict[str, float]:
        if self._last_stats is None:
            return {}
        return {"entropy": float(self._last_stats.entropy),
                "baseline": float(self._last_stats.baseline)}

    def get_params(self) -> Params:
        return jax.tree.map(lambda x: np.array(x, copy=True), self.state.params)

    def set_params(self, params: Params) -> None:
        self.state = self.state._replace(
            params=jax.tree.map(lambda x: jnp.array(x, copy=True), params))

    # ---- checkpoints ----------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> None:
        arrays = {
            **checkpoint.flatten("learner", self.state),
            **{f"rollout/{k}": np.array(v) for k, v in self.buffer.data._asdict().items()},
            "pending_observation": self._observation, "pending_legal": self._legal,
        }
        meta = {
            "kind": self.kind, "config": checkpoint.config_to_json(self.config),
            "observation_size": self.observation_size, "num_actions": self.num_actions,
            "seed": self.seed, "num_steps": self.num_steps, "num_updates": self.num_updates,
            "rollout_size": self.buffer.size,
            "pending": list(self._pending) if self._pending is not None else None,
            "actor_rng": self.actor_rng.bit_generator.state,
            "extra": extra,
        }
        checkpoint.save(path, arrays, meta)

    def restore(self, path: str | os.PathLike[str]) -> dict[str, Any] | None:
        arrays, meta = checkpoint.load(path)
        mine = (self.kind, checkpoint.config_to_json(self.config), self.observation_size,
                self.num_actions)
        theirs = (meta.get("kind"), meta.get("config"), meta.get("observation_size"),
                  meta.get("num_actions"))
        if mine != theirs:
            raise ValueError(f"{path}: checkpoint is for {theirs}, this agent is {mine}")
        self.state = checkpoint.unflatten("learner", self.state, arrays)
        self.actor_rng.bit_generator.state = meta["actor_rng"]
        for name, target in self.buffer.data._asdict().items():
            target[...] = arrays[f"rollout/{name}"]
        self.buffer.size = int(meta["rollout_size"])
        self._observation = np.array(arrays["pending_observation"])
        self._legal = np.array(arrays["pending_legal"])
        pending = meta["pending"]
        self._pending = None if pending is None else (int(pending[0]), float(pending[1]),
                                                      float(pending[2]))
        self.num_steps = int(meta["num_steps"])
        self.num_updates = int(meta["num_updates"])
        return meta["extra"]

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str], *,
                        functions: PpoFunctions | None = None) -> tuple[PpoAgent, dict | None]:
        """Rebuilds an agent from a checkpoint and restores it; returns (agent, extra)."""
        _, meta = checkpoint.load(path)
        agent = cls(checkpoint.config_from_json(PpoConfig, meta["config"]),
                    meta["observation_size"], meta["num_actions"], seed=meta["seed"],
                    functions=functions)
        return agent, agent.restore(path)
