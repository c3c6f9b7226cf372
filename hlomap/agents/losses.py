"""Thin, pure loss functions over batches, built on rlax's per-sample losses.

rlax defines its value-learning losses for one transition; here they are `jax.vmap`ped over the
batch, the illegal actions of the bootstrap state are masked out of the greedy selection, and the
per-sample losses are weighted by prioritized replay's importance weights. Each function also
returns the per-sample quantity that becomes the new replay priority.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import rlax


@contextlib.contextmanager
def _quiet_rlax() -> Iterator[None]:
    """rlax 0.1.9 announces the move of its distributions to distrax on every trace; the
    functions still behave as documented, so the notice is noise here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        yield


class ValueLoss(NamedTuple):
    """A batch loss and the per-sample priorities it implies (|TD error| or cross-entropy)."""

    loss: jax.Array
    priorities: jax.Array


def mask_illegal(values: jax.Array, legal: jax.Array) -> jax.Array:
    """Sets the values of illegal actions to the lowest representable number (Auto-MAP §4.4).

    The lowest finite value rather than -inf: argmax ignores it all the same, and softmax and
    log-softmax stay finite (an illegal action gets probability exactly 0, and 0 * log-prob is 0,
    not NaN).
    """
    return jnp.where(legal, values, jnp.finfo(values.dtype).min)


def double_q_loss(
    q_tm1: jax.Array,
    a_tm1: jax.Array,
    r_t: jax.Array,
    discount_t: jax.Array,
    q_t_value: jax.Array,
    q_t_selector: jax.Array,
    legal_t: jax.Array,
    weights: jax.Array,
    *,
    huber_delta: float | None = 1.0,
) -> ValueLoss:
    """Importance-weighted double Q-learning loss over a batch ([B, A] Q-values, [B] the rest).

    `q_t_value` comes from the target network, `q_t_selector` from the online one; the selector is
    masked with `legal_t` so that bootstrapping never picks an illegal action. `discount_t` is the
    full bootstrap multiplier (gamma^n times the environment discounts for n-step transitions).
    With `huber_delta=None` the per-sample loss is 0.5 * td^2.
    """
    selector = mask_illegal(q_t_selector, legal_t)
    td = jax.vmap(rlax.double_q_learning)(q_tm1, a_tm1, r_t, discount_t, q_t_value, selector)
    per_sample = 0.5 * jnp.square(td) if huber_delta is None else rlax.huber_loss(td, huber_delta)
    return ValueLoss(jnp.mean(weights * per_sample), jnp.abs(td))


def categorical_double_q_loss(
    atoms: jax.Array,
    logits_tm1: jax.Array,
    a_tm1: jax.Array,
    r_t: jax.Array,
    discount_t: jax.Array,
    logits_t: jax.Array,
    q_t_selector: jax.Array,
    legal_t: jax.Array,
    weights: jax.Array,
) -> ValueLoss:
    """Importance-weighted categorical (C51) double Q-learning loss over a batch.

    `logits_*` are [B, A, atoms] on the fixed support `atoms`; `logits_t` comes from the target
    network and `q_t_selector` ([B, A]) from the online one, masked by `legal_t`. The per-sample
    cross-entropy is also the priority, as in Rainbow.
    """
    selector = mask_illegal(q_t_selector, legal_t)
    with _quiet_rlax():
        per_sample = jax.vmap(
            rlax.categorical_double_q_learning, in_axes=(None, 0, 0, 0, 0, None, 0, 0)
        )(atoms, logits_tm1, a_tm1, r_t, discount_t, atoms, logits_t, selector)
    return ValueLoss(jnp.mean(weights * per_sample), per_sample)


class PolicyLoss(NamedTuple):
    """PPO's total loss and its parts (the parts are diagnostics, already inside `loss`)."""

    loss: jax.Array
    policy_loss: jax.Array
    entropy: jax.Array
    value_loss: jax.Array
    approx_kl: jax.Array
    clip_fraction: jax.Array


def masked_log_policy(logits: jax.Array, legal: jax.Array) -> jax.Array:
    """Log-probabilities of the softmax policy restricted to legal actions."""
    return jax.nn.log_softmax(mask_illegal(logits, legal), axis=-1)


def ppo_loss(
    logits: jax.Array,
    legal: jax.Array,
    actions: jax.Array,
    old_log_probs: jax.Array,
    advantages: jax.Array,
    values: jax.Array,
    value_targets: jax.Array,
    *,
    clip_epsilon: float,
    entropy_coef: float,
    value_coef: float,
) -> PolicyLoss:
    """Clipped-surrogate PPO loss with an entropy bonus and an (optional) value loss.

    logits [B, A] (unmasked), legal [B, A], the rest [B]. The policy is the softmax over legal
    actions only, so entropy is that of the legal distribution. `value_coef=0` drops the critic
    (DRL-PP's running-mean baseline needs none).
    """
    masked = mask_illegal(logits, legal)
    log_probs = jax.nn.log_softmax(masked, axis=-1)
    log_prob_a = jnp.take_along_axis(log_probs, actions[:, None], axis=-1)[:, 0]
    log_ratio = log_prob_a - old_log_probs
    ratio = jnp.exp(log_ratio)
    policy_loss = rlax.clipped_surrogate_pg_loss(ratio, advantages, clip_epsilon)
    # rlax.entropy_loss is -mean(entropy); illegal actions have probability exactly 0 here.
    with _quiet_rlax():
        entropy = -rlax.entropy_loss(masked, jnp.ones_like(advantages))
    value_loss = 0.5 * jnp.mean(jnp.square(value_targets - values))
    loss = policy_loss - entropy_coef * entropy + value_coef * value_loss
    approx_kl = jnp.mean(ratio - 1.0 - log_ratio)  # the low-variance k3 estimator of KL(old||new)
    clip_fraction = jnp.mean((jnp.abs(ratio - 1.0) > clip_epsilon).astype(jnp.float32))
    return PolicyLoss(loss, policy_loss, entropy, value_loss, approx_kl, clip_fraction)
