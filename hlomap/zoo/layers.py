"""Flax NNX building blocks shared by the transformer families, and the losses.

Choices that matter to hlomap's planner:
- Q/K/V kernels are `[d_model, heads, head_dim]` and the output kernel `[heads, head_dim,
  d_model]`: the head dimension is its own tensor dimension, so head-parallel (Megatron) sharding
  is one dim of one tensor rather than a factor of a reshaped dim.
- Layers are Python-unrolled (no `lax.scan`), so each layer's weight gets its own HLO dot.
- The cross-entropy is written with a one-hot (compare against an iota) instead of a gather of
  the target logit: with a gather the vocabulary dim of the logits would have to be replicated;
  with a one-hot a vocabulary-parallel plan stays expressible.
- Mixed precision: every layer takes a compute `dtype` (Flax's `dtype=`) while its parameters
  stay float32 (`param_dtype`), so the dots and activations are in the compute dtype and the
  gradients, the optimizer state and the update in float32. The loss is taken in float32.
"""

from __future__ import annotations

import enum
import math

import jax
import jax.numpy as jnp
from flax import nnx

from hlomap.zoo.nnx_bridge import ParamKeys

#: Added to masked attention logits; finite so a fully masked row gives a uniform softmax, not NaN.
MASK_VALUE = -1e9


class Activation(enum.Enum):
    GELU = "gelu"
    RELU = "relu"

    def __call__(self, x: jax.Array) -> jax.Array:
        if self is Activation.GELU:
            return jax.nn.gelu(x)
        return jax.nn.relu(x)


def normal(std: float) -> nnx.Initializer:
    return nnx.initializers.normal(stddev=std)


class Attention(nnx.Module):
    """Multi-head attention with separate query/key/value/out projections."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        head_dim: int,
        *,
        use_bias: bool,
        scale_queries: bool,
        dtype: jnp.dtype,
        rngs: ParamKeys,
        qkv_std: tuple[float, float, float] = (0.02, 0.02, 0.02),
        out_std: float = 0.02,
    ):
        def projection(std: float) -> nnx.LinearGeneral:
            return nnx.LinearGeneral(
                d_model, (num_heads, head_dim), use_bias=use_bias, kernel_init=normal(std), dtype=dtype,
                rngs=rngs,
            )

        self.query = projection(qkv_std[0])
        self.key = projection(qkv_std[1])
        self.value = projection(qkv_std[2])
        self.out = nnx.LinearGeneral(
            (num_heads, head_dim), d_model, axis=(-2, -1), use_bias=use_bias,
            kernel_init=normal(out_std), dtype=dtype, rngs=rngs,
        )
        # T5 folds the 1/sqrt(head_dim) into its initialisation; BERT/GPT scale the queries.
        self.query_scale = 1.0 / math.sqrt(head_dim) if scale_queries else 1.0

    def __call__(
        self,
        x: jax.Array,
        context: jax.Array | None = None,
        *,
        causal: bool = False,
        bias: jax.Array | None = None,
    ) -> jax.Array:
        """x: [batch, q, d]; context (keys/values source, default x): [batch, k, d];
        bias: additive logits bias broadcastable to [batch, heads, q, k]."""
        context = x if context is None else context
        q = self.query(x) * self.query_scale
        k = self.key(context)
        v = self.value(context)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        if bias is not None:
            logits = logits + bias
        if causal:
            q_len, k_len = logits.shape[-2:]
            mask = jnp.tril(jnp.ones((q_len, k_len), dtype=bool))
            logits = jnp.where(mask, logits, MASK_VALUE)
        # In the compute dtype (MASK_VALUE is within bfloat16's range): a float32 softmax would
        # keep float32 weights, the largest activation of attention, for the backward pass.
        weights = jax.nn.softmax(logits, axis=-1)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", weights, v))


class FeedForward(nnx.Module):
    """Position-wise MLP: fc_in, activation, fc_out."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        activation: Activation,
        use_bias: bool,
        dtype: jnp.dtype,
        rngs: ParamKeys,
        in_std: float = 0.02,
        out_std: float = 0.02,
    ):
        self.fc_in = nnx.Linear(d_model, d_ff, use_bias=use_bias, kernel_init=normal(in_std), dtype=dtype,
                                rngs=rngs)
        self.fc_out = nnx.Linear(d_ff, d_model, use_bias=use_bias, kernel_init=normal(out_std), dtype=dtype,
                                 rngs=rngs)
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc_out(self.activation(self.fc_in(x)))


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean cross-entropy of integer `labels` under `logits` (last dim = classes), via one-hot.

    Taken in float32 whatever the logits' dtype: a bfloat16 log-softmax over a large vocabulary
    loses the small differences between logits that the loss and its gradient are made of."""
    logits = logits.astype(jnp.float32)
    one_hot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
    return -jnp.mean(jnp.sum(one_hot * jax.nn.log_softmax(logits, axis=-1), axis=-1))


def layer_name(index: int) -> str:
    """Attribute (and params path) name of the `index`-th layer: `layers_0`, `layers_1`, ..."""
    return f"layers_{index}"
