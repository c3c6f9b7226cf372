"""Flax NNX networks for the agents, and a pure (params, inputs) view of them.

The agents keep parameters as plain nested dicts of arrays (`nnx.to_pure_dict`), not as
live NNX modules: plain dicts flatten fast on every jitted call (act runs once per environment
step), serialise trivially into checkpoints, and keep the update functions pure. `PureModel`
re-attaches a dict to the module's graph inside the traced function, which costs nothing at run
time.

Noisy layers take their noise key as an argument rather than from an `nnx.Rngs` stream, so that
randomness is explicit and the same key always gives the same network.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, Any]  # a pure nested dict of arrays, as from nnx.to_pure_dict


class NoisyLinear(nnx.Module):
    """A linear layer with factorised Gaussian parameter noise (Fortunato et al., 2017).

    The caller passes the layer's noise, `noise_size` already-scaled values f(eps) for the input
    and output factors, drawn once for a whole network (see `scaled_noise`): each random-number
    sampler is a large XLA fusion, and drawing one per layer per pass made the noisy learner's
    compile time grow tenfold. `noise=None` is the mean network (greedy evaluation).
    """

    def __init__(self, in_features: int, out_features: int, *, sigma0: float, rngs: nnx.Rngs):
        bound = in_features**-0.5
        init = jax.nn.initializers.uniform(2 * bound)
        self.w_mu = nnx.Param(init(rngs.params(), (in_features, out_features)) - bound)
        self.b_mu = nnx.Param(init(rngs.params(), (out_features,)) - bound)
        self.w_sigma = nnx.Param(jnp.full((in_features, out_features), sigma0 * bound))
        self.b_sigma = nnx.Param(jnp.full((out_features,), sigma0 * bound))
        self.in_features = in_features
        self.out_features = out_features

    @property
    def noise_size(self) -> int:
        return self.in_features + self.out_features

    def __call__(self, x: jax.Array, noise: jax.Array | None = None) -> jax.Array:
        y = x @ self.w_mu[...] + self.b_mu[...]
        if noise is None:
            return y
        eps_in, eps_out = noise[:self.in_features], noise[self.in_features:]
        # x @ (sigma * outer(eps_in, eps_out)) == ((x * eps_in) @ sigma) * eps_out: no [in, out]
        # noise matrix is ever built.
        return y + ((x * eps_in) @ self.w_sigma[...]) * eps_out + self.b_sigma[...] * eps_out


def scaled_noise(key: jax.Array, size: int) -> jax.Array:
    """Factorised-noise values f(eps) = sign(eps) sqrt(|eps|), eps ~ N(0, 1)."""
    eps = jax.random.normal(key, (size,))
    return jnp.sign(eps) * jnp.sqrt(jnp.abs(eps))


class Dense(nnx.Module):
    """`nnx.Linear` or `NoisyLinear` behind one call signature."""

    def __init__(self, in_features: int, out_features: int, *, noisy: bool, sigma0: float,
                 rngs: nnx.Rngs):
        self.noisy = noisy
        if noisy:
            self.layer = NoisyLinear(in_features, out_features, sigma0=sigma0, rngs=rngs)
        else:
            self.layer = nnx.Linear(in_features, out_features, rngs=rngs)

    @property
    def noise_size(self) -> int:
        return self.layer.noise_size if isinstance(self.layer, NoisyLinear) else 0

    def __call__(self, x: jax.Array, noise: jax.Array | None) -> jax.Array:
        if isinstance(self.layer, NoisyLinear):
            return self.layer(x, noise)
        return self.layer(x)


def _split_noise(noise: jax.Array | None, sizes: Sequence[int]) -> list[jax.Array | None]:
    """Consecutive slices of one noise vector, one per layer (None stays None)."""
    if noise is None:
        return [None] * len(sizes)
    offsets = np.cumsum([0, *sizes])
    return [noise[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


class MLP(nnx.Module):
    """A ReLU torso: every layer is followed by a ReLU."""

    def __init__(self, in_features: int, hidden: Sequence[int], *, noisy: bool = False,
                 sigma0: float = 0.5, rngs: nnx.Rngs):
        sizes = [in_features, *hidden]
        self.layers = nnx.List(
            [Dense(a, b, noisy=noisy, sigma0=sigma0, rngs=rngs) for a, b in zip(sizes, sizes[1:])]
        )
        self.out_features = sizes[-1]

    @property
    def noise_size(self) -> int:
        return sum(layer.noise_size for layer in self.layers)

    def __call__(self, x: jax.Array, noise: jax.Array | None = None) -> jax.Array:
        parts = _split_noise(noise, [layer.noise_size for layer in self.layers])
        for layer, part in zip(self.layers, parts):
            x = jax.nn.relu(layer(x, part))
        return x


class QOutput(NamedTuple):
    """Q-network output. `logits` is [..., actions, atoms] for a distributional head, else None."""

    q_values: jax.Array
    logits: jax.Array | None


class QNetwork(nnx.Module):
    """MLP torso, optional dueling head, optional categorical (C51) head.

    Dueling (Wang et al., 2016): Q = V + A - mean(A). With `num_atoms > 1` both streams output
    logits over the fixed support `atoms`, combined the same way in logit space (as Rainbow does),
    and Q is the expectation of the resulting categorical distribution.
    """

    def __init__(self, observation_size: int, num_actions: int, *, hidden: Sequence[int],
                 dueling: bool, atoms: Sequence[float] | np.ndarray | None, noisy: bool,
                 sigma0: float = 0.5, rngs: nnx.Rngs):
        self.num_actions = num_actions
        # The support is a static tuple, part of the graph rather than of the state: it never
        # changes, and this keeps every array of the module a trainable parameter.
        self.atoms = None if atoms is None else tuple(float(a) for a in np.asarray(atoms))
        self.num_atoms = 1 if self.atoms is None else len(self.atoms)
        self.distributional = self.atoms is not None
        self.torso = MLP(observation_size, hidden, noisy=noisy, sigma0=sigma0, rngs=rngs)
        width = self.torso.out_features
        self.dueling = dueling
        self.advantage = Dense(width, num_actions * self.num_atoms, noisy=noisy, sigma0=sigma0,
                               rngs=rngs)
        self.value = (Dense(width, self.num_atoms, noisy=noisy, sigma0=sigma0, rngs=rngs)
                      if dueling else None)

    @property
    def noise_size(self) -> int:
        value = self.value.noise_size if self.value is not None else 0
        return self.torso.noise_size + self.advantage.noise_size + value

    def __call__(self, observation: jax.Array, noise_key: jax.Array | None = None) -> QOutput:
        """Q-values (and C51 logits). With noisy layers, `noise_key` draws one noise sample for
        the whole batch; None gives the mean network. Without noisy layers the key is unused."""
        noise = None
        if noise_key is not None and self.noise_size:
            noise = scaled_noise(noise_key, self.noise_size)
        value_size = self.value.noise_size if self.value is not None else 0
        n_torso, n_adv, n_value = _split_noise(
            noise, [self.torso.noise_size, self.advantage.noise_size, value_size])
        h = self.torso(observation, n_torso)
        out = self.advantage(h, n_adv)
        out = out.reshape(*out.shape[:-1], self.num_actions, self.num_atoms)
        if self.value is not None:
            v = self.value(h, n_value)[..., None, :]
            out = v + out - jnp.mean(out, axis=-2, keepdims=True)
        if not self.distributional:
            return QOutput(out[..., 0], None)
        q = jnp.sum(jax.nn.softmax(out, axis=-1) * jnp.asarray(self.atoms, out.dtype), axis=-1)
        return QOutput(q, out)


class PolicyOutput(NamedTuple):
    """Policy-network output: unmasked action logits and a state value (zeros without a critic)."""

    logits: jax.Array
    value: jax.Array


class PolicyValueNetwork(nnx.Module):
    """Separate actor and (optional) critic MLPs; separate torsos keep the value loss from
    distorting the policy's features, which matters with PPO's few epochs on small batches."""

    def __init__(self, observation_size: int, num_actions: int, *, hidden: Sequence[int],
                 critic: bool, rngs: nnx.Rngs):
        self.actor = MLP(observation_size, hidden, rngs=rngs)
        # A small last layer makes the initial policy close to uniform over legal actions.
        self.policy_head = nnx.Linear(self.actor.out_features, num_actions,
                                      kernel_init=jax.nn.initializers.variance_scaling(
                                          0.01, "fan_in", "truncated_normal"),
                                      rngs=rngs)
        self.critic = MLP(observation_size, hidden, rngs=rngs) if critic else None
        self.value_head = (nnx.Linear(self.critic.out_features, 1, rngs=rngs)
                           if self.critic is not None else None)

    def __call__(self, observation: jax.Array) -> PolicyOutput:
        logits = self.policy_head(self.actor(observation))
        if self.critic is None or self.value_head is None:
            return PolicyOutput(logits, jnp.zeros(logits.shape[:-1], logits.dtype))
        value = self.value_head(self.critic(observation))[..., 0]
        return PolicyOutput(logits, value)


@dataclasses.dataclass(frozen=True)
class PureModel:
    """A module's graph without its parameters: `apply(params, ...)` is a pure function."""

    graphdef: Any

    def apply(self, params: Params, *args: Any, **kwargs: Any) -> Any:
        return nnx.merge(self.graphdef, params)(*args, **kwargs)


def purify(module: nnx.Module) -> tuple[PureModel, Params]:
    """Splits a module (whose only state is `nnx.Param`s) into a `PureModel` and its
    parameters as a plain nested dict."""
    graphdef, params = nnx.split(module, nnx.Param)
    return PureModel(graphdef), nnx.to_pure_dict(params)


# XLA options for functions that run once (parameter initialisation): optimising their machine
# code costs more compile time than the single run could ever save.
RUN_ONCE_COMPILER_OPTIONS: dict[str, Any] = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}


def abstract_model(build: Callable[[nnx.Rngs], nnx.Module]) -> PureModel:
    """The `PureModel` of `build(rngs)` without computing any parameter (shapes only), which
    spares a random initialisation just to learn the graph."""
    module = nnx.eval_shape(lambda: build(nnx.Rngs(0)))
    graphdef, _ = nnx.split(module, nnx.Param)
    return PureModel(graphdef)
