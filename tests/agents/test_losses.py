"""The batch losses equal direct, per-sample rlax calls on random inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rlax

from hlomap.agents.losses import (categorical_double_q_loss, double_q_loss, mask_illegal,
                                  ppo_loss)

pytestmark = pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")

B, A, K = 16, 5, 11


def _random_batch(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    legal = rng.random((B, A)) < 0.6
    legal[np.arange(B), rng.integers(A, size=B)] = True
    return dict(
        q_tm1=rng.normal(size=(B, A)).astype(np.float32),
        a_tm1=rng.integers(A, size=B).astype(np.int32),
        r_t=rng.normal(size=B).astype(np.float32),
        discount_t=(rng.random(B) * (rng.random(B) > 0.2)).astype(np.float32),
        q_t_value=rng.normal(size=(B, A)).astype(np.float32),
        q_t_selector=rng.normal(size=(B, A)).astype(np.float32),
        legal_t=legal,
        weights=rng.random(B).astype(np.float32),
    )


@pytest.mark.parametrize("huber_delta", [None, 1.0, 0.3])
def test_double_q_loss_equals_rlax(huber_delta: float | None) -> None:
    b = _random_batch(0)
    out = double_q_loss(**b, huber_delta=huber_delta)
    losses, tds = [], []
    for i in range(B):
        # rlax on the selector with illegal actions pushed below every legal one.
        selector = np.where(b["legal_t"][i], b["q_t_selector"][i], -1e30).astype(np.float32)
        td = rlax.double_q_learning(b["q_tm1"][i], b["a_tm1"][i], b["r_t"][i],
                                    b["discount_t"][i], b["q_t_value"][i], selector)
        tds.append(float(td))
        per = 0.5 * td**2 if huber_delta is None else rlax.huber_loss(td, huber_delta)
        losses.append(float(b["weights"][i] * per))
    np.testing.assert_allclose(out.priorities, np.abs(tds), rtol=1e-5, atol=1e-6)
    assert float(out.loss) == pytest.approx(np.mean(losses), rel=1e-5)


def test_double_q_bootstrap_ignores_illegal_actions() -> None:
    q_t_selector = jnp.array([[5.0, 1.0, 2.0]])  # the illegal action 0 looks best
    q_t_value = jnp.array([[100.0, 10.0, 20.0]])
    out = double_q_loss(jnp.zeros((1, 3)), jnp.array([0]), jnp.array([0.0]), jnp.array([1.0]),
                        q_t_value, q_t_selector, jnp.array([[False, True, True]]),
                        jnp.ones(1), huber_delta=None)
    assert float(out.priorities[0]) == pytest.approx(20.0)  # bootstraps from action 2, not 0


def test_categorical_double_q_loss_equals_rlax() -> None:
    b = _random_batch(1)
    rng = np.random.default_rng(2)
    atoms = jnp.linspace(-2.0, 2.0, K)
    logits_tm1 = rng.normal(size=(B, A, K)).astype(np.float32)
    logits_t = rng.normal(size=(B, A, K)).astype(np.float32)
    out = categorical_double_q_loss(atoms, logits_tm1, b["a_tm1"], b["r_t"], b["discount_t"],
                                    logits_t, b["q_t_selector"], b["legal_t"], b["weights"])
    expected = []
    for i in range(B):
        selector = np.where(b["legal_t"][i], b["q_t_selector"][i], -1e30).astype(np.float32)
        expected.append(float(rlax.categorical_double_q_learning(
            atoms, logits_tm1[i], b["a_tm1"][i], b["r_t"][i], b["discount_t"][i], atoms,
            logits_t[i], selector)))
    np.testing.assert_allclose(out.priorities, expected, rtol=1e-5)
    assert float(out.loss) == pytest.approx(np.mean(b["weights"] * np.asarray(expected)),
                                            rel=1e-5)


def test_ppo_loss_equals_rlax_parts() -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(B, A)).astype(np.float32)
    legal = np.ones((B, A), bool)
    legal[:, 0] = rng.random(B) < 0.5
    actions = np.array([rng.choice(np.flatnonzero(row)) for row in legal], np.int32)
    old_log_probs = (np.log(rng.uniform(0.1, 0.9, B))).astype(np.float32)
    adv = rng.normal(size=B).astype(np.float32)
    values = rng.normal(size=B).astype(np.float32)
    targets = rng.normal(size=B).astype(np.float32)
    out = ppo_loss(logits, legal, actions, old_log_probs, adv, values, targets,
                   clip_epsilon=0.2, entropy_coef=0.01, value_coef=0.5)

    # Reference: the policy restricted to legal actions, computed independently in numpy.
    masked = np.where(legal, logits, -np.inf)
    probs = np.exp(masked - masked.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    log_p = np.log(probs[np.arange(B), actions])
    ratio = np.exp(log_p - old_log_probs)
    pg = rlax.clipped_surrogate_pg_loss(jnp.asarray(ratio, jnp.float32), jnp.asarray(adv), 0.2)
    entropy = -np.sum(np.where(legal, probs * np.log(np.where(legal, probs, 1.0)), 0.0), 1).mean()
    value_loss = 0.5 * np.mean((targets - values) ** 2)
    assert float(out.policy_loss) == pytest.approx(float(pg), rel=1e-5)
    assert float(out.entropy) == pytest.approx(entropy, rel=1e-5)
    assert float(out.value_loss) == pytest.approx(value_loss, rel=1e-5)
    assert float(out.loss) == pytest.approx(float(pg) - 0.01 * entropy + 0.5 * value_loss,
                                            rel=1e-5)
    # With every action legal the entropy term is exactly rlax's entropy loss.
    all_legal = ppo_loss(logits, np.ones((B, A), bool), actions, old_log_probs, adv, values,
                         targets, clip_epsilon=0.2, entropy_coef=0.01, value_coef=0.5)
    assert float(all_legal.entropy) == pytest.approx(
        -float(rlax.entropy_loss(jnp.asarray(logits), jnp.ones(B))), rel=1e-5)


def test_ppo_loss_gradient_is_finite_and_zero_on_illegal_logits() -> None:
    logits = jnp.array([[0.3, -0.2, 1.0]])
    legal = jnp.array([[True, False, True]])

    def f(x: jax.Array) -> jax.Array:
        return ppo_loss(x, legal, jnp.array([2]), jnp.log(jnp.array([0.5])), jnp.array([1.0]),
                        jnp.zeros(1), jnp.zeros(1), clip_epsilon=0.2, entropy_coef=0.1,
                        value_coef=0.0).loss

    g = jax.grad(f)(logits)
    assert np.all(np.isfinite(np.asarray(g)))
    assert float(g[0, 1]) == 0.0 and float(jnp.abs(g).sum()) > 0


def test_mask_illegal_sets_lowest_value() -> None:
    x = mask_illegal(jnp.array([1.0, 2.0, -3.0]), jnp.array([True, False, True]))
    assert float(x[1]) == float(jnp.finfo(jnp.float32).min)
    assert int(jnp.argmax(x)) == 0
