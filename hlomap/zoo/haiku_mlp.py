"""A multi-layer perceptron image classifier written in dm-haiku.

It is here to show that the zoo (and hlomap) is not tied to Flax: a `hk.transform`ed function
already is a pure (params, inputs) function over a nested dict, with Haiku's own parameter
paths, e.g. `mlp/~/linear_0/w`, `mlp/~/linear_0/b`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import haiku as hk
import jax
import jax.numpy as jnp

from hlomap.zoo.layers import softmax_cross_entropy
from hlomap.zoo.model import Batch, BatchField, Family, LossFn, Params


@dataclass(frozen=True)
class MlpConfig:
    """Sizes of the MLP and its batch (`images`: f32[b, h, w, c], `labels`: int32[b])."""

    family: ClassVar[Family] = Family.MLP

    hidden: tuple[int, ...]
    num_classes: int
    image_shape: tuple[int, int, int]
    batch_size: int
    learning_rate: float = 1e-3

    def transformed(self) -> hk.Transformed:
        sizes = self.hidden + (self.num_classes,)

        def logits(images: jax.Array) -> jax.Array:
            return hk.nets.MLP(sizes, name="mlp")(hk.Flatten()(images))

        return hk.without_apply_rng(hk.transform(logits))

    def init(self, key: jax.Array) -> Params:
        dummy = jnp.zeros((self.batch_size,) + self.image_shape, jnp.float32)
        # Haiku returns a dict of dicts keyed by module path; make it a plain dict.
        params = self.transformed().init(key, dummy)
        return {module: dict(leaves) for module, leaves in params.items()}

    def make_loss(self) -> LossFn:
        apply = self.transformed().apply

        def loss(trainable: Params, other: Params, batch: Batch) -> tuple[jax.Array, Params]:
            del other  # the MLP has no non-trained state
            return softmax_cross_entropy(apply(trainable, batch["images"]), batch["labels"]), {}

        return loss

    def batch_fields(self) -> dict[str, BatchField]:
        return {"images": BatchField((self.batch_size,) + self.image_shape, jnp.float32),
                "labels": BatchField((self.batch_size,), jnp.int32, self.num_classes)}
