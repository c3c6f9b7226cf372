"""T5 (v1.0) encoder-decoder in Flax NNX, with the published T5 configurations.

Faithful to the original T5 (Raffel et al. 2020; HF `T5ForConditionalGeneration`): RMS layer
norms with a scale only, no biases anywhere, unscaled dot-product attention (the 1/sqrt(d_kv) is
folded into the initialisation), ReLU MLP, a relative position bias (32 log-spaced buckets up to
distance 128) owned by each stack and shared by all its layers, one embedding shared by encoder
input, decoder input and (scaled by d_model**-0.5) the output projection. Dropout is omitted.
With these rules t5-base has exactly the 222,903,552 parameters of the released checkpoint.
Parameters are float32; `compute_dtype` is the dtype of the activations and dots (the loss is
taken in float32).

Parameter paths: `shared/embedding`, `{encoder,decoder}/relative_bias/embedding`,
`{encoder,decoder}/layers_{i}/{ln_self_attn,self_attn,ln_mlp,mlp/{fc_in,fc_out}}/...`, decoder
layers also `{ln_cross_attn,cross_attn}`, and `{encoder,decoder}/ln_f/scale`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hlomap.zoo import nnx_bridge
from hlomap.zoo.nnx_bridge import ParamKeys
from hlomap.zoo.layers import Activation, Attention, FeedForward, layer_name, normal, softmax_cross_entropy
from hlomap.zoo.model import Batch, BatchField, Family, LossFn, Params, ZooError, check_compute_dtype

_EPSILON = 1e-6


@dataclass(frozen=True)
class T5Config:
    """Sizes of a T5 model and its batch (`inputs`: int32[b, input_len], `targets`:
    int32[b, target_len]; the decoder input is `targets` shifted right in the graph)."""

    family: ClassVar[Family] = Family.T5

    num_layers: int  # per stack: the encoder and the decoder each have this many
    d_model: int
    d_ff: int
    num_heads: int
    d_kv: int
    vocab_size: int
    batch_size: int
    input_len: int
    target_len: int
    num_buckets: int = 32
    max_distance: int = 128
    learning_rate: float = 1e-3
    #: dtype of activations and dots, one of `COMPUTE_DTYPES`; parameters stay float32
    compute_dtype: str = "float32"

    def __post_init__(self) -> None:
        check_compute_dtype(type(self).__name__, self.compute_dtype)
        if self.num_buckets % 2:
            raise ZooError(f"num_buckets={self.num_buckets} must be even (half per direction)")

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.compute_dtype)

    def build(self, rngs: ParamKeys) -> "T5":
        return T5(self, rngs)

    def init(self, key: jax.Array) -> Params:
        return nnx_bridge.init_params(self.build, key)

    def make_loss(self) -> LossFn:
        return nnx_bridge.make_loss(self.build, _forward_loss)

    def batch_fields(self) -> dict[str, BatchField]:
        return {
            "inputs": BatchField((self.batch_size, self.input_len), jnp.int32, self.vocab_size),
            "targets": BatchField((self.batch_size, self.target_len), jnp.int32, self.vocab_size),
        }


def relative_position_buckets(
    query_len: int, key_len: int, *, bidirectional: bool, num_buckets: int, max_distance: int
) -> np.ndarray:
    """int32[query_len, key_len] bucket of each (query, key) offset, as in T5.

    Half the buckets (per direction when bidirectional) hold exact offsets 0..n/2-1; the rest
    cover larger offsets logarithmically up to `max_distance`, beyond which all share the last.
    Computed with numpy: the buckets are constants of the graph, not traced values.
    """
    offset = np.arange(key_len)[None, :] - np.arange(query_len)[:, None]  # key - query
    buckets = np.zeros_like(offset)
    n = num_buckets
    if bidirectional:
        n //= 2
        buckets += (offset > 0) * n
        distance = np.abs(offset)
    else:
        distance = np.maximum(-offset, 0)  # a decoder only looks back
    max_exact = n // 2
    # log of a distance < max_exact is never used; clamp so it is finite.
    scaled = np.log(np.maximum(distance, max_exact) / max_exact) / math.log(max_distance / max_exact)
    large = np.minimum(max_exact + (scaled * (n - max_exact)).astype(np.int64), n - 1)
    buckets += np.where(distance < max_exact, distance, large)
    return buckets.astype(np.int32)


class T5Layer(nnx.Module):
    """One encoder layer (self-attention, MLP) or decoder layer (+ cross-attention), pre-RMS-norm."""

    def __init__(self, config: T5Config, *, decoder: bool, rngs: ParamKeys):
        d, h, kv = config.d_model, config.num_heads, config.d_kv

        def attention() -> Attention:
            # Mesh-TensorFlow T5 initialisation, which is why no 1/sqrt(d_kv) is needed.
            return Attention(d, h, kv, use_bias=False, scale_queries=False, dtype=config.dtype, rngs=rngs,
                             qkv_std=((d * kv) ** -0.5, d ** -0.5, d ** -0.5), out_std=(h * kv) ** -0.5)

        def rms_norm() -> nnx.RMSNorm:
            return nnx.RMSNorm(d, epsilon=_EPSILON, dtype=config.dtype, rngs=rngs)

        self.decoder = decoder
        self.ln_self_attn = rms_norm()
        self.self_attn = attention()
        if decoder:
            self.ln_cross_attn = rms_norm()
            self.cross_attn = attention()
        self.ln_mlp = rms_norm()
        self.mlp = FeedForward(d, config.d_ff, activation=Activation.RELU, use_bias=False, dtype=config.dtype,
                               rngs=rngs, in_std=d ** -0.5, out_std=config.d_ff ** -0.5)

    def __call__(self, x: jax.Array, position_bias: jax.Array, encoded: jax.Array | None) -> jax.Array:
        x = x + self.self_attn(self.ln_self_attn(x), bias=position_bias, causal=self.decoder)
        if self.decoder:
            x = x + self.cross_attn(self.ln_cross_attn(x), encoded)
        return x + self.mlp(self.ln_mlp(x))


class T5Stack(nnx.Module):
    def __init__(self, config: T5Config, *, decoder: bool, rngs: ParamKeys):
        self.config = config
        self.decoder = decoder
        self.relative_bias = nnx.Embed(config.num_buckets, config.num_heads,
                                       embedding_init=normal(config.d_model ** -0.5), dtype=config.dtype,
                                       rngs=rngs)
        for i in range(config.num_layers):
            setattr(self, layer_name(i), T5Layer(config, decoder=decoder, rngs=rngs))
        self.ln_f = nnx.RMSNorm(config.d_model, epsilon=_EPSILON, dtype=config.dtype, rngs=rngs)

    def __call__(self, x: jax.Array, encoded: jax.Array | None = None) -> jax.Array:
        seq_len = x.shape[1]
        buckets = relative_position_buckets(
            seq_len, seq_len, bidirectional=not self.decoder,
            num_buckets=self.config.num_buckets, max_distance=self.config.max_distance)
        # Gather [q, k] buckets from the [buckets, heads] table -> [1, heads, q, k].
        position_bias = jnp.transpose(self.relative_bias(jnp.asarray(buckets)), (2, 0, 1))[None]
        for i in range(self.config.num_layers):
            with jax.named_scope(layer_name(i)):
                x = getattr(self, layer_name(i))(x, position_bias, encoded)
        return self.ln_f(x)


class T5(nnx.Module):
    def __init__(self, config: T5Config, rngs: ParamKeys):
        self.d_model = config.d_model
        self.shared = nnx.Embed(config.vocab_size, config.d_model, embedding_init=normal(1.0),
                                dtype=config.dtype, rngs=rngs)
        self.encoder = T5Stack(config, decoder=False, rngs=rngs)
        self.decoder = T5Stack(config, decoder=True, rngs=rngs)

    def __call__(self, inputs: jax.Array, targets: jax.Array) -> jax.Array:
        """inputs int32[b, s_in], targets int32[b, s_out] -> logits [b, s_out, vocab] in the compute
        dtype."""
        with jax.named_scope("encoder"):
            encoded = self.encoder(self.shared(inputs))
        # Teacher forcing: the decoder sees the targets shifted right behind start token 0.
        decoder_inputs = jnp.pad(targets[:, :-1], ((0, 0), (1, 0)))
        with jax.named_scope("decoder"):
            decoded = self.decoder(self.shared(decoder_inputs), encoded)
        return self.shared.attend(decoded * self.d_model ** -0.5)


def _forward_loss(model: nnx.Module, batch: Batch) -> jax.Array:
    return softmax_cross_entropy(model(batch["inputs"], batch["targets"]), batch["targets"])
