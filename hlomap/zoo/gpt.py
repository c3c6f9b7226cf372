"""GPT-style decoder-only language model (GPT-2/GPT-3 layout) in Flax NNX.

Pre-layer-norm blocks (`x + attn(ln_1(x))`, `x + mlp(ln_2(x))`), learned absolute position
embeddings, GELU MLP with biases, a final layer norm and an output projection tied to the token
embedding. Parameters are float32; `compute_dtype` is the dtype of the activations and dots
(the loss is taken in float32). Parameter paths: `embed/embedding`, `pos_embed/embedding`,
`layers_{i}/{ln_1,attn/{query,key,value,out},ln_2,mlp/{fc_in,fc_out}}/...`, `ln_f/{scale,bias}`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from hlomap.zoo import nnx_bridge
from hlomap.zoo.nnx_bridge import ParamKeys
from hlomap.zoo.layers import Activation, Attention, FeedForward, layer_name, normal, softmax_cross_entropy
from hlomap.zoo.model import Batch, BatchField, Family, LossFn, Params, ZooError, check_compute_dtype


@dataclass(frozen=True)
class GptConfig:
    """Sizes of a GPT decoder and of its training batch (`tokens`, `targets`: int32[b, s])."""

    family: ClassVar[Family] = Family.GPT

    num_layers: int
    d_model: int
    num_heads: int
    d_ff: int
    vocab_size: int
    max_positions: int
    batch_size: int
    seq_len: int
    learning_rate: float = 1e-3
    #: dtype of activations and dots, one of `COMPUTE_DTYPES`; parameters stay float32
    compute_dtype: str = "float32"

    def __post_init__(self) -> None:
        check_compute_dtype(type(self).__name__, self.compute_dtype)
        if self.d_model % self.num_heads:
            raise ZooError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if self.seq_len > self.max_positions:
            raise ZooError(f"seq_len={self.seq_len} exceeds max_positions={self.max_positions}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.compute_dtype)

    def build(self, rngs: ParamKeys) -> "Gpt":
        return Gpt(self, rngs)

    def init(self, key: jax.Array) -> Params:
        return nnx_bridge.init_params(self.build, key)

    def make_loss(self) -> LossFn:
        return nnx_bridge.make_loss(self.build, _forward_loss)

    def batch_fields(self) -> dict[str, BatchField]:
        shape = (self.batch_size, self.seq_len)
        return {"tokens": BatchField(shape, jnp.int32, self.vocab_size),
                "targets": BatchField(shape, jnp.int32, self.vocab_size)}


class DecoderBlock(nnx.Module):
    """Pre-LN transformer block with causal self-attention."""

    def __init__(self, config: GptConfig, rngs: ParamKeys):
        # GPT-2 scales the residual-output projections by 1/sqrt(2 * layers).
        out_std = 0.02 / math.sqrt(2 * config.num_layers)
        self.ln_1 = nnx.LayerNorm(config.d_model, dtype=config.dtype, rngs=rngs)
        self.attn = Attention(config.d_model, config.num_heads, config.head_dim, use_bias=True,
                              scale_queries=True, out_std=out_std, dtype=config.dtype, rngs=rngs)
        self.ln_2 = nnx.LayerNorm(config.d_model, dtype=config.dtype, rngs=rngs)
        self.mlp = FeedForward(config.d_model, config.d_ff, activation=Activation.GELU,
                               use_bias=True, out_std=out_std, dtype=config.dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln_1(x), causal=True)
        return x + self.mlp(self.ln_2(x))


class Gpt(nnx.Module):
    def __init__(self, config: GptConfig, rngs: ParamKeys):
        self.num_layers = config.num_layers
        self.dtype = config.dtype
        self.embed = nnx.Embed(config.vocab_size, config.d_model, embedding_init=normal(0.02),
                               dtype=config.dtype, rngs=rngs)
        self.pos_embed = nnx.Embed(config.max_positions, config.d_model, embedding_init=normal(0.01),
                                   dtype=config.dtype, rngs=rngs)
        for i in range(config.num_layers):
            setattr(self, layer_name(i), DecoderBlock(config, rngs))
        self.ln_f = nnx.LayerNorm(config.d_model, dtype=config.dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens int32[b, s] -> logits [b, s, vocab] in the compute dtype."""
        seq_len = tokens.shape[-1]
        # A static slice of the position table: positions are 0..s-1 for every sequence. The
        # table is read directly, not through the Embed, so it is cast here (a no-op in float32).
        x = self.embed(tokens) + self.pos_embed.embedding[:seq_len].astype(self.dtype)
        for i in range(self.num_layers):
            with jax.named_scope(layer_name(i)):
                x = getattr(self, layer_name(i))(x)
        return self.embed.attend(self.ln_f(x))


def _forward_loss(model: nnx.Module, batch: Batch) -> jax.Array:
    return softmax_cross_entropy(model(batch["tokens"]), batch["targets"])
