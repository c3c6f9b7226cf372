"""Mixture-of-Experts decoder (GShard / Switch style) in Flax NNX.

A GPT-style pre-LN decoder in which every `moe_every`-th layer's MLP is a mixture of experts:
a token-choice top-k router (softmax gates, capacity per expert, tokens over capacity dropped,
GShard's load-balancing auxiliary loss) and E experts whose weights are stacked, `wi`:
[E, d_model, d_ff] and `wo`: [E, d_ff, d_model]. Dispatch and combine are einsums with a
one-hot [group, token, expert, slot] tensor, so the expert dimension is an ordinary tensor
dimension: an expert-parallel plan shards it (and XLA turns the dispatch into an all-to-all).
A group is one sequence of the batch.

Parameter paths: as GPT (`embed`, `pos_embed`, `layers_{i}/{ln_1,attn,ln_2}`, `ln_f`), with
`layers_{i}/mlp/{fc_in,fc_out}` in dense layers and `layers_{i}/moe/{router/kernel,wi,wo}` in
expert layers.

Parameters are float32; `compute_dtype` is the dtype of the activations and the attention, MLP
and expert dots. The router runs in float32 whatever the compute dtype (Switch Transformer's
selective precision: the router's softmax is where bfloat16 made training unstable), and so do
the auxiliary and cross-entropy losses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from hlomap.zoo import nnx_bridge
from hlomap.zoo.nnx_bridge import ParamKeys
from hlomap.zoo.layers import Activation, Attention, FeedForward, layer_name, normal, softmax_cross_entropy
from hlomap.zoo.model import Batch, BatchField, Family, LossFn, Params, ZooError, check_compute_dtype


@dataclass(frozen=True)
class MoeConfig:
    """Sizes of an MoE decoder and its batch (`tokens`, `targets`: int32[b, s])."""

    family: ClassVar[Family] = Family.MOE

    num_layers: int
    d_model: int
    num_heads: int
    d_ff: int
    num_experts: int
    vocab_size: int
    max_positions: int
    batch_size: int
    seq_len: int
    top_k: int = 2
    capacity_factor: float = 1.25
    moe_every: int = 2  # layers i with i % moe_every == moe_every - 1 are MoE layers
    aux_loss_weight: float = 0.01
    learning_rate: float = 1e-3
    #: dtype of activations and dots, one of `COMPUTE_DTYPES`; parameters stay float32
    compute_dtype: str = "float32"

    def __post_init__(self) -> None:
        check_compute_dtype(type(self).__name__, self.compute_dtype)
        if self.d_model % self.num_heads:
            raise ZooError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ZooError(f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        if self.seq_len > self.max_positions:
            raise ZooError(f"seq_len={self.seq_len} exceeds max_positions={self.max_positions}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.compute_dtype)

    @property
    def capacity(self) -> int:
        """Slots per expert per group: capacity_factor x an even share of the k x seq_len
        assignments, rounded up to a multiple of 8 so the slot dim can be sharded too."""
        share = math.ceil(self.capacity_factor * self.top_k * self.seq_len / self.num_experts)
        return 8 * math.ceil(share / 8)

    def is_moe_layer(self, index: int) -> bool:
        return index % self.moe_every == self.moe_every - 1

    def build(self, rngs: ParamKeys) -> "MoeDecoder":
        return MoeDecoder(self, rngs)

    def init(self, key: jax.Array) -> Params:
        return nnx_bridge.init_params(self.build, key)

    def make_loss(self) -> LossFn:
        return nnx_bridge.make_loss(self.build, _forward_loss)

    def batch_fields(self) -> dict[str, BatchField]:
        shape = (self.batch_size, self.seq_len)
        return {"tokens": BatchField(shape, jnp.int32, self.vocab_size),
                "targets": BatchField(shape, jnp.int32, self.vocab_size)}


class Routing(NamedTuple):
    """dispatch: 0/1 [G, S, E, C] (token s goes to slot c of expert e); combine: the same with
    the token's normalised gate weight; aux_loss: GShard's load-balancing loss (1.0 = balanced)."""

    dispatch: jax.Array
    combine: jax.Array
    aux_loss: jax.Array


def route_top_k(router_logits: jax.Array, *, top_k: int, capacity: int) -> Routing:
    """Token-choice top-k routing of router_logits [G, S, E] into `capacity` slots per expert.

    Each token picks its k most probable experts in turn; within an expert, slots are filled in
    token order, first choices of all tokens before second choices (GShard), and a token that
    finds its expert full is dropped for that choice. Gate weights are the router probabilities
    of the chosen experts, renormalised over the k choices.
    """
    num_experts = router_logits.shape[-1]
    probs = jax.nn.softmax(router_logits, axis=-1)
    remaining = probs
    filled = jnp.zeros(router_logits.shape[:1] + (num_experts,), probs.dtype)  # [G, E]
    dispatch = jnp.zeros(router_logits.shape + (capacity,), probs.dtype)
    combine = jnp.zeros_like(dispatch)
    chosen_probs = jnp.zeros(router_logits.shape[:2], probs.dtype)
    first_choice = None
    for _ in range(top_k):
        choice = jax.nn.one_hot(jnp.argmax(remaining, axis=-1), num_experts, dtype=probs.dtype)
        first_choice = choice if first_choice is None else first_choice
        # Slot of each token in its chosen expert: earlier tokens (and earlier rounds) first.
        position = (jnp.cumsum(choice, axis=1) - 1.0 + filled[:, None, :]) * choice
        kept = choice * (position < capacity)
        filled = filled + jnp.sum(kept, axis=1)
        slot = jax.nn.one_hot(jnp.sum(position, axis=-1).astype(jnp.int32), capacity, dtype=probs.dtype)
        assignment = kept[..., None] * slot[:, :, None, :]  # [G, S, E, C]
        gate = jnp.sum(probs * choice, axis=-1)  # [G, S]
        dispatch = dispatch + assignment
        combine = combine + gate[..., None, None] * assignment
        chosen_probs = chosen_probs + gate
        remaining = remaining * (1.0 - choice)
    combine = combine / chosen_probs[..., None, None]
    # Fraction of first choices per expert times mean router probability, scaled so that a
    # uniform router gives 1 (GShard eq. 4 with the mean-probability differentiable proxy).
    density = jnp.mean(first_choice, axis=1)
    density_proxy = jnp.mean(probs, axis=1)
    aux_loss = jnp.mean(density * density_proxy) * num_experts**2
    return Routing(dispatch, combine, aux_loss)


class MoeFeedForward(nnx.Module):
    def __init__(self, config: MoeConfig, rngs: ParamKeys, out_std: float):
        e, d, f = config.num_experts, config.d_model, config.d_ff
        self.top_k = config.top_k
        self.capacity = config.capacity
        self.dtype = config.dtype
        self.router = nnx.Linear(d, e, use_bias=False, kernel_init=normal(0.02), dtype=jnp.float32,
                                 rngs=rngs)
        self.wi = nnx.Param(normal(0.02)(rngs.params(), (e, d, f), jnp.float32))
        self.wo = nnx.Param(normal(out_std)(rngs.params(), (e, f, d), jnp.float32))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [G, S, d] -> (y [G, S, d], auxiliary loss)."""
        routing = route_top_k(self.router(x), top_k=self.top_k, capacity=self.capacity)
        # Dispatch and combine come out of the float32 router; the expert dots take them, and
        # the stacked expert weights, in the compute dtype (all no-ops in float32).
        dispatch, combine = routing.dispatch.astype(self.dtype), routing.combine.astype(self.dtype)
        expert_inputs = jnp.einsum("gsec,gsd->egcd", dispatch, x)
        hidden = jax.nn.gelu(jnp.einsum("egcd,edf->egcf", expert_inputs, self.wi[...].astype(self.dtype)))
        expert_outputs = jnp.einsum("egcf,efd->egcd", hidden, self.wo[...].astype(self.dtype))
        return jnp.einsum("gsec,egcd->gsd", combine, expert_outputs), routing.aux_loss


class MoeBlock(nnx.Module):
    def __init__(self, config: MoeConfig, *, moe: bool, rngs: ParamKeys):
        out_std = 0.02 / math.sqrt(2 * config.num_layers)
        self.is_moe = moe
        self.ln_1 = nnx.LayerNorm(config.d_model, dtype=config.dtype, rngs=rngs)
        self.attn = Attention(config.d_model, config.num_heads, config.head_dim, use_bias=True,
                              scale_queries=True, out_std=out_std, dtype=config.dtype, rngs=rngs)
        self.ln_2 = nnx.LayerNorm(config.d_model, dtype=config.dtype, rngs=rngs)
        if moe:
            self.moe = MoeFeedForward(config, rngs, out_std)
        else:
            self.mlp = FeedForward(config.d_model, config.d_ff, activation=Activation.GELU,
                                   use_bias=True, out_std=out_std, dtype=config.dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = x + self.attn(self.ln_1(x), causal=True)
        if self.is_moe:
            y, aux_loss = self.moe(self.ln_2(x))
            return x + y, aux_loss
        return x + self.mlp(self.ln_2(x)), jnp.zeros((), jnp.float32)  # the aux loss is float32


class MoeDecoder(nnx.Module):
    def __init__(self, config: MoeConfig, rngs: ParamKeys):
        self.num_layers = config.num_layers
        self.aux_loss_weight = config.aux_loss_weight
        self.dtype = config.dtype
        self.embed = nnx.Embed(config.vocab_size, config.d_model, embedding_init=normal(0.02),
                               dtype=config.dtype, rngs=rngs)
        self.pos_embed = nnx.Embed(config.max_positions, config.d_model, embedding_init=normal(0.01),
                                   dtype=config.dtype, rngs=rngs)
        for i in range(config.num_layers):
            setattr(self, layer_name(i), MoeBlock(config, moe=config.is_moe_layer(i), rngs=rngs))
        self.ln_f = nnx.LayerNorm(config.d_model, dtype=config.dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """tokens int32[b, s] -> (logits [b, s, vocab] in the compute dtype, summed float32
        auxiliary loss)."""
        # The position table is read directly, not through the Embed, so it is cast here.
        x = self.embed(tokens) + self.pos_embed.embedding[: tokens.shape[-1]].astype(self.dtype)
        aux_total = jnp.zeros((), jnp.float32)
        for i in range(self.num_layers):
            with jax.named_scope(layer_name(i)):
                x, aux_loss = getattr(self, layer_name(i))(x)
            aux_total = aux_total + aux_loss
        return self.embed.attend(self.ln_f(x)), aux_total


def _forward_loss(model: nnx.Module, batch: Batch) -> jax.Array:
    logits, aux_loss = model(batch["tokens"])
    return softmax_cross_entropy(logits, batch["targets"]) + model.aux_loss_weight * aux_loss
