"""VGG-19 image classifier (Simonyan & Zisserman 2014, configuration E) in Flax NNX.

Five blocks of 3x3 convolutions with biases and ReLU, each followed by 2x2 max pooling, then
three fully connected layers. At 224x224 with 1000 classes this has the 143,667,240 parameters
of the published model. No dropout. Images are NHWC.

Parameter paths (Keras naming): `block{b}_conv{i}/{kernel,bias}`, `fc1`, `fc2`, `predictions`.
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
from hlomap.zoo.layers import softmax_cross_entropy
from hlomap.zoo.model import Batch, BatchField, Family, LossFn, Params, ZooError

#: Output channels of each convolution, grouped by block (VGG-19).
VGG19_CHANNELS: tuple[tuple[int, ...], ...] = (
    (64, 64), (128, 128), (256, 256, 256, 256), (512, 512, 512, 512), (512, 512, 512, 512))


@dataclass(frozen=True)
class VggConfig:
    """Sizes of a VGG network and its batch (`images`: f32[b, h, w, c], `labels`: int32[b])."""

    family: ClassVar[Family] = Family.VGG

    block_channels: tuple[tuple[int, ...], ...]
    fc_features: tuple[int, ...]
    num_classes: int
    image_size: int
    batch_size: int
    image_channels: int = 3
    learning_rate: float = 1e-3

    def __post_init__(self) -> None:
        reduction = 2 ** len(self.block_channels)
        if self.image_size % reduction:
            raise ZooError(f"image_size={self.image_size} is not divisible by {reduction} "
                           f"(one 2x2 pooling per block, {len(self.block_channels)} blocks)")

    @property
    def final_spatial(self) -> int:
        return self.image_size // 2 ** len(self.block_channels)

    def build(self, rngs: ParamKeys) -> "Vgg":
        return Vgg(self, rngs)

    def init(self, key: jax.Array) -> Params:
        return nnx_bridge.init_params(self.build, key)

    def make_loss(self) -> LossFn:
        return nnx_bridge.make_loss(self.build, _forward_loss)

    def batch_fields(self) -> dict[str, BatchField]:
        size, channels = self.image_size, self.image_channels
        return {"images": BatchField((self.batch_size, size, size, channels), jnp.float32),
                "labels": BatchField((self.batch_size,), jnp.int32, self.num_classes)}


def conv_name(block: int, index: int) -> str:
    return f"block{block + 1}_conv{index + 1}"


class Vgg(nnx.Module):
    def __init__(self, config: VggConfig, rngs: ParamKeys):
        self.block_sizes = tuple(len(block) for block in config.block_channels)
        in_channels = config.image_channels
        for b, block in enumerate(config.block_channels):
            for i, out_channels in enumerate(block):
                setattr(self, conv_name(b, i),
                        nnx.Conv(in_channels, out_channels, (3, 3), padding="SAME",
                                 kernel_init=nnx.initializers.he_normal(), rngs=rngs))
                in_channels = out_channels
        features = in_channels * config.final_spatial ** 2
        self.fc_names = tuple(f"fc{i + 1}" for i in range(len(config.fc_features))) + ("predictions",)
        for name, out_features in zip(self.fc_names, config.fc_features + (config.num_classes,)):
            # He-style scaling keeps the deep ReLU stack's activations O(1) at any width.
            init = nnx.initializers.normal(stddev=math.sqrt(2.0 / features))
            setattr(self, name, nnx.Linear(features, out_features, kernel_init=init, rngs=rngs))
            features = out_features

    def __call__(self, images: jax.Array) -> jax.Array:
        x = images
        for b, size in enumerate(self.block_sizes):
            with jax.named_scope(f"block{b + 1}"):
                for i in range(size):
                    x = jax.nn.relu(getattr(self, conv_name(b, i))(x))
                x = nnx.max_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        for name in self.fc_names[:-1]:
            x = jax.nn.relu(getattr(self, name)(x))
        return getattr(self, self.fc_names[-1])(x)


def _forward_loss(model: nnx.Module, batch: Batch) -> jax.Array:
    return softmax_cross_entropy(model(batch["images"]), batch["labels"])
