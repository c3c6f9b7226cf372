"""Q-network heads, noisy layers and the pure-parameter view."""

from __future__ import annotations

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hlomap.agents.networks import (NoisyLinear, PolicyValueNetwork, QNetwork, abstract_model,
                                    purify, scaled_noise)

OBS, ACTIONS = 6, 4


def _net(**kw: object) -> QNetwork:
    args: dict = dict(hidden=(8,), dueling=True, atoms=None, noisy=False)
    args.update(kw)
    return QNetwork(OBS, ACTIONS, rngs=nnx.Rngs(0), **args)


def test_dueling_head_combines_value_and_centred_advantage() -> None:
    net = _net()
    x = jax.random.normal(jax.random.key(1), (3, OBS))
    q = net(x).q_values
    h = net.torso(x)
    v = net.value(h, None)
    adv = net.advantage(h, None)
    np.testing.assert_allclose(q, v + adv - adv.mean(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_categorical_head_q_is_expectation_over_atoms() -> None:
    atoms = np.linspace(-1.0, 3.0, 7)
    net = _net(atoms=atoms)
    out = net(jnp.ones((2, OBS)))
    assert out.logits is not None and out.logits.shape == (2, ACTIONS, 7)
    expected = (jax.nn.softmax(out.logits, -1) * atoms).sum(-1)
    np.testing.assert_allclose(out.q_values, expected, rtol=1e-5)
    assert np.all((out.q_values >= -1.0) & (out.q_values <= 3.0))


def test_noisy_layer_noise_is_explicit_and_factorised() -> None:
    layer = NoisyLinear(5, 3, sigma0=0.5, rngs=nnx.Rngs(0))
    x = jnp.ones((2, 5))
    mean = layer(x)
    np.testing.assert_allclose(mean, x @ layer.w_mu[...] + layer.b_mu[...], rtol=1e-6)
    noise = scaled_noise(jax.random.key(7), layer.noise_size)
    assert not np.allclose(layer(x, noise), mean)
    # The shortcut equals building the factorised noise matrix explicitly.
    e_in, e_out = noise[:5], noise[5:]
    w = layer.w_mu[...] + layer.w_sigma[...] * jnp.outer(e_in, e_out)
    b = layer.b_mu[...] + layer.b_sigma[...] * e_out
    np.testing.assert_allclose(layer(x, noise), x @ w + b, rtol=1e-5, atol=1e-6)


def test_noisy_q_network_noise_comes_from_the_key() -> None:
    net = _net(noisy=True)
    x = jnp.ones((2, OBS))
    k = jax.random.key(7)
    np.testing.assert_array_equal(net(x, k).q_values, net(x, k).q_values)
    assert not np.allclose(net(x, k).q_values, net(x, jax.random.key(8)).q_values)
    assert not np.allclose(net(x, k).q_values, net(x).q_values)
    # Every noisy layer gets its own slice: in+out per layer.
    assert net.noise_size == (OBS + 8) + (8 + ACTIONS) + (8 + 1)


def test_pure_model_round_trip_matches_module() -> None:
    net = _net(noisy=True, atoms=np.linspace(0, 1, 3))
    x = jnp.ones((2, OBS))
    expected = net(x, jax.random.key(3))
    model, params = purify(net)
    assert isinstance(params, dict)
    got = jax.jit(model.apply)(params, x, jax.random.key(3))
    np.testing.assert_allclose(got.q_values, expected.q_values, rtol=1e-6)
    abstract = abstract_model(lambda rngs: QNetwork(OBS, ACTIONS, hidden=(8,), dueling=True,
                                                    atoms=np.linspace(0, 1, 3), noisy=True,
                                                    rngs=rngs))
    np.testing.assert_allclose(abstract.apply(params, x, jax.random.key(3)).q_values,
                               expected.q_values, rtol=1e-6)


@pytest.mark.parametrize("critic", [False, True])
def test_policy_value_network_shapes(critic: bool) -> None:
    net = PolicyValueNetwork(OBS, ACTIONS, hidden=(8, 8), critic=critic, rngs=nnx.Rngs(0))
    out = net(jnp.ones((5, OBS)))
    assert out.logits.shape == (5, ACTIONS) and out.value.shape == (5,)
    assert bool(jnp.any(out.value != 0)) == critic
