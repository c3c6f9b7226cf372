"""BERT-style encoder with a masked-language-model head, in Flax NNX.

Word + position + token-type embeddings, embedding layer norm, post-layer-norm blocks
(`ln_1(x + attn(x))`, `ln_2(x + mlp(x))`), GELU MLP, and the MLM head of the original BERT: a
dense transform, GELU, layer norm, then the tied word embedding plus an output bias. There is no
pooler/next-sentence head (RoBERTa-style pre-training), and the loss covers every position: which
positions were masked does not change the graph hlomap plans for. Parameters are float32;
`compute_dtype` is the dtype of the activations and dots (the loss is taken in float32).

Parameter paths: `embed`, `pos_embed`, `type_embed` (`/embedding`), `ln_embed`,
`layers_{i}/{attn/{query,key,value,out},ln_1,mlp/{fc_in,fc_out},ln_2}/...`,
`head/{transform,ln}/...`, `head_bias`.
"""

from __future__ import annotations

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
class BertConfig:
    """Sizes of a BERT encoder and its batch (`tokens`, `token_types`, `targets`: int32[b, s])."""

    family: ClassVar[Family] = Family.BERT

    num_layers: int
    d_model: int
    num_heads: int
    d_ff: int
    vocab_size: int
    max_positions: int
    batch_size: int
    seq_len: int
    type_vocab_size: int = 2
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

    def build(self, rngs: ParamKeys) -> "Bert":
        return Bert(self, rngs)

    def init(self, key: jax.Array) -> Params:
        return nnx_bridge.init_params(self.build, key)

    def make_loss(self) -> LossFn:
        return nnx_bridge.make_loss(self.build, _forward_loss)

    def batch_fields(self) -> dict[str, BatchField]:
        shape = (self.batch_size, self.seq_len)
        return {"tokens": BatchField(shape, jnp.int32, self.vocab_size),
                "token_types": BatchField(shape, jnp.int32, self.type_vocab_size),
                "targets": BatchField(shape, jnp.int32, self.vocab_size)}


class EncoderBlock(nnx.Module):
    """Post-LN transformer block with bidirectional self-attention."""

    def __init__(self, config: BertConfig, rngs: ParamKeys):
        self.attn = Attention(config.d_model, config.num_heads, config.head_dim, use_bias=True,
                              scale_queries=True, dtype=config.dtype, rngs=rngs)
        self.ln_1 = nnx.LayerNorm(config.d_model, epsilon=1e-12, dtype=config.dtype, rngs=rngs)
        self.mlp = FeedForward(config.d_model, config.d_ff, activation=Activation.GELU,
                               use_bias=True, dtype=config.dtype, rngs=rngs)
        self.ln_2 = nnx.LayerNorm(config.d_model, epsilon=1e-12, dtype=config.dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.ln_1(x + self.attn(x))
        return self.ln_2(x + self.mlp(x))


class MlmHead(nnx.Module):
    def __init__(self, config: BertConfig, rngs: ParamKeys):
        self.transform = nnx.Linear(config.d_model, config.d_model, kernel_init=normal(0.02),
                                    dtype=config.dtype, rngs=rngs)
        self.ln = nnx.LayerNorm(config.d_model, epsilon=1e-12, dtype=config.dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.ln(jax.nn.gelu(self.transform(x)))


class Bert(nnx.Module):
    def __init__(self, config: BertConfig, rngs: ParamKeys):
        self.num_layers = config.num_layers
        self.dtype = config.dtype
        self.embed = nnx.Embed(config.vocab_size, config.d_model, embedding_init=normal(0.02),
                               dtype=config.dtype, rngs=rngs)
        self.pos_embed = nnx.Embed(config.max_positions, config.d_model, embedding_init=normal(0.02),
                                   dtype=config.dtype, rngs=rngs)
        self.type_embed = nnx.Embed(config.type_vocab_size, config.d_model, embedding_init=normal(0.02),
                                    dtype=config.dtype, rngs=rngs)
        self.ln_embed = nnx.LayerNorm(config.d_model, epsilon=1e-12, dtype=config.dtype, rngs=rngs)
        for i in range(config.num_layers):
            setattr(self, layer_name(i), EncoderBlock(config, rngs))
        self.head = MlmHead(config, rngs)
        self.head_bias = nnx.Param(jnp.zeros((config.vocab_size,), jnp.float32))

    def __call__(self, tokens: jax.Array, token_types: jax.Array) -> jax.Array:
        """tokens, token_types int32[b, s] -> MLM logits [b, s, vocab] in the compute dtype."""
        seq_len = tokens.shape[-1]
        # The position table and the output bias are read directly, not through a layer, so they
        # are cast here (a no-op in float32).
        x = (self.embed(tokens) + self.type_embed(token_types)
             + self.pos_embed.embedding[:seq_len].astype(self.dtype))
        x = self.ln_embed(x)
        for i in range(self.num_layers):
            with jax.named_scope(layer_name(i)):
                x = getattr(self, layer_name(i))(x)
        return self.embed.attend(self.head(x)) + self.head_bias[...].astype(self.dtype)


def _forward_loss(model: nnx.Module, batch: Batch) -> jax.Array:
    return softmax_cross_entropy(model(batch["tokens"], batch["token_types"]), batch["targets"])
