"""Building blocks: T5 position buckets, MoE routing, causal masking, the one-hot loss."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hlomap.zoo as zoo
from hlomap.zoo.layers import softmax_cross_entropy
from hlomap.zoo.moe import Routing, route_top_k
from hlomap.zoo.nnx_bridge import KeyStream
from hlomap.zoo.t5 import relative_position_buckets


def reference_bucket(offset: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """T5's bucket rule for one key-minus-query offset, written out scalar by scalar."""
    bucket = 0
    n = num_buckets
    if bidirectional:
        n //= 2
        if offset > 0:
            bucket = n
        distance = abs(offset)
    else:
        distance = max(-offset, 0)
    exact = n // 2
    if distance < exact:
        return bucket + distance
    large = exact + int(math.log(distance / exact) / math.log(max_distance / exact) * (n - exact))
    return bucket + min(large, n - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 20)])
def test_relative_position_buckets_match_scalar_rule(
    bidirectional: bool, num_buckets: int, max_distance: int
) -> None:
    q_len, k_len = 40, 300
    buckets = relative_position_buckets(q_len, k_len, bidirectional=bidirectional,
                                        num_buckets=num_buckets, max_distance=max_distance)
    assert buckets.shape == (q_len, k_len) and buckets.dtype == np.int32
    expected = np.array([[reference_bucket(k - q, bidirectional, num_buckets, max_distance)
                          for k in range(k_len)] for q in range(q_len)])
    np.testing.assert_array_equal(buckets, expected)
    assert buckets.min() == 0 and buckets.max() <= num_buckets - 1


def test_relative_position_buckets_known_values() -> None:
    row = relative_position_buckets(1, 300, bidirectional=True, num_buckets=32, max_distance=128)[0]
    # offsets 0..7 exact in the "after" half (16 + offset), far offsets share the last bucket
    assert list(row[:8]) == [0] + [16 + k for k in range(1, 8)]
    assert row[200] == 31
    back = relative_position_buckets(300, 1, bidirectional=False, num_buckets=32, max_distance=128)
    assert list(back[:16, 0]) == list(range(16))
    assert back[299, 0] == 31


#: (groups, tokens, experts, top_k, capacity): few shapes, so each compiles once.
ROUTING_SHAPES = ((1, 24, 4, 2, 8), (2, 10, 6, 2, 3), (3, 7, 2, 1, 5))


@lru_cache(maxsize=None)
def jitted_router(top_k: int, capacity: int) -> Callable[[jax.Array], Routing]:
    return jax.jit(lambda logits: route_top_k(logits, top_k=top_k, capacity=capacity))


@settings(max_examples=20, deadline=None, derandomize=True)
@given(shape=st.sampled_from(ROUTING_SHAPES), seed=st.integers(0, 2**31 - 1),
       temperature=st.sampled_from((0.1, 1.0, 10.0)))
def test_routing_respects_top_k_and_capacity(
    shape: tuple[int, int, int, int, int], seed: int, temperature: float
) -> None:
    groups, tokens, experts, top_k, capacity = shape
    logits = temperature * jax.random.normal(jax.random.key(seed), (groups, tokens, experts))
    routing = jitted_router(top_k, capacity)(logits)
    dispatch, combine = np.asarray(routing.dispatch), np.asarray(routing.combine)
    assert dispatch.shape == (groups, tokens, experts, capacity)
    assert set(np.unique(dispatch)) <= {0.0, 1.0}
    assert np.all(dispatch.sum(axis=(2, 3)) <= top_k)  # a token goes to at most k experts
    assert np.all(dispatch.sum(axis=3) <= 1)  # ... once each
    assert np.all(dispatch.sum(axis=1) <= 1)  # a slot holds at most one token
    np.testing.assert_array_equal(combine > 0, dispatch > 0)
    assert np.all(combine.sum(axis=(2, 3)) <= 1 + 1e-5)
    # Chosen experts are the token's most probable ones.
    order = np.argsort(-np.asarray(logits), axis=-1)
    used = dispatch.sum(axis=3) > 0
    for g, s, e in zip(*np.nonzero(used)):
        assert e in order[g, s, :top_k]
    # First choices are dropped only when their expert is full.
    first = order[..., 0]
    for g in range(groups):
        for e in range(experts):
            wanted = int(np.sum(first[g] == e))
            assert dispatch[g, :, e].sum() >= min(wanted, capacity)
    assert np.isfinite(float(routing.aux_loss))


def test_routing_with_room_for_everyone_keeps_every_token() -> None:
    logits = jax.random.normal(jax.random.key(0), (2, 16, 4))
    routing = route_top_k(logits, top_k=2, capacity=32)
    dispatch = np.asarray(routing.dispatch)
    np.testing.assert_array_equal(dispatch.sum(axis=(2, 3)), 2)
    np.testing.assert_allclose(np.asarray(routing.combine).sum(axis=(2, 3)), 1, rtol=1e-6)
    top2 = np.argsort(-np.asarray(logits), axis=-1)[..., :2]
    np.testing.assert_array_equal(np.sort(np.nonzero(dispatch.sum(axis=3))[2].reshape(2, 16, 2)),
                                  np.sort(top2, axis=-1))


def test_routing_fills_slots_in_token_order_and_drops_overflow() -> None:
    # Every token prefers expert 0; capacity 3 keeps the first three tokens there.
    logits = jnp.tile(jnp.array([[5.0, 0.0, -5.0]]), (1, 6, 1))
    routing = route_top_k(logits, top_k=1, capacity=3)
    dispatch = np.asarray(routing.dispatch)[0]
    for token in range(3):
        assert dispatch[token, 0, token] == 1
    assert dispatch[3:].sum() == 0
    # Perfect imbalance: all first choices on one expert of three -> aux loss well above 1.
    assert float(routing.aux_loss) > 2.0


def test_cross_entropy_matches_optax() -> None:
    logits = jax.random.normal(jax.random.key(1), (4, 5, 16))
    labels = jax.random.randint(jax.random.key(2), (4, 5), 0, 16)
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    np.testing.assert_allclose(softmax_cross_entropy(logits, labels), expected, rtol=1e-6)


@pytest.mark.parametrize("name", ["gpt-tiny", "moe-tiny"])
def test_decoders_are_causal(name: str) -> None:
    config = zoo.get(name).config
    model = config.build(KeyStream(jax.random.key(0)))
    tokens = jax.random.randint(jax.random.key(1), (2, config.seq_len), 0, config.vocab_size)
    cut = config.seq_len // 2
    changed = tokens.at[:, cut:].set((tokens[:, cut:] + 1) % config.vocab_size)
    apply = jax.jit(lambda t: jax.tree_util.tree_leaves(model(t))[0])
    logits = lambda t: np.asarray(apply(t))  # noqa: E731
    before, after = logits(tokens), logits(changed)
    np.testing.assert_allclose(before[:, :cut], after[:, :cut], rtol=1e-5, atol=1e-6)
    assert not np.allclose(before[:, cut:], after[:, cut:])


def test_t5_decoder_is_causal_and_reads_the_encoder() -> None:
    config = zoo.get("t5-tiny").config
    model = config.build(KeyStream(jax.random.key(0)))
    inputs = jax.random.randint(jax.random.key(1), (2, config.input_len), 0, config.vocab_size)
    targets = jax.random.randint(jax.random.key(2), (2, config.target_len), 0, config.vocab_size)
    cut = config.target_len // 2
    apply = jax.jit(lambda i, t: model(i, t))
    base = np.asarray(apply(inputs, targets))
    # Targets from `cut` on enter the decoder (shifted right) at positions cut+1 onward.
    later = np.asarray(apply(inputs, targets.at[:, cut:].set(0)))
    np.testing.assert_allclose(base[:, : cut + 1], later[:, : cut + 1], rtol=1e-5, atol=1e-6)
    assert not np.allclose(base[:, cut + 1:], later[:, cut + 1:])
    other_inputs = np.asarray(apply((inputs + 1) % config.vocab_size, targets))
    assert not np.allclose(base[:, 0], other_inputs[:, 0])


def test_bert_attends_both_ways() -> None:
    config = zoo.get("bert-tiny").config
    model = config.build(KeyStream(jax.random.key(0)))
    tokens = jax.random.randint(jax.random.key(1), (2, config.seq_len), 0, config.vocab_size)
    types = jnp.zeros_like(tokens)
    apply = jax.jit(lambda t: model(t, types))
    base = np.asarray(apply(tokens))
    changed = np.asarray(apply(tokens.at[:, -1].set((tokens[:, -1] + 1) % config.vocab_size)))
    assert not np.allclose(base[:, 0], changed[:, 0])
