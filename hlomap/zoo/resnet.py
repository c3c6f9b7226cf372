"""ResNet-50 (v1.5: stride on the 3x3 convolution, as torchvision) with batch norm, in Flax NNX.

Stem (7x7/2 convolution, batch norm, ReLU, 3x3/2 max pooling), four stages of bottleneck blocks
(1x1, 3x3, 1x1 convolutions without bias, each followed by batch norm; a 1x1 projection with
batch norm where the shape changes), global average pooling and a dense classifier. At 1000
classes this has the 25,557,032 trainable parameters of the published model.

Batch norm in the train step normalises with the statistics of the current batch and updates
the running statistics (momentum 0.9). The running statistics are carried in params under the
top-level key "batch_stats" (`model.OTHER_KEY`), e.g. `batch_stats/stage1_block0/bn1/mean`;
they are not trained and have no Adam state. Images are NHWC.

Parameter paths: `stem/{conv,bn}`, `stage{s}_block{b}/{conv1,bn1,conv2,bn2,conv3,bn3}` and,
in the first block of a stage, `stage{s}_block0/{proj_conv,proj_bn}`; `head/{kernel,bias}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from hlomap.zoo import nnx_bridge
from hlomap.zoo.nnx_bridge import ParamKeys
from hlomap.zoo.layers import softmax_cross_entropy
from hlomap.zoo.model import Batch, BatchField, Family, LossFn, Params, ZooError

_EXPANSION = 4  # bottleneck output channels = 4 x its width
_MOMENTUM = 0.9
_EPSILON = 1e-5


@dataclass(frozen=True)
class ResNetConfig:
    """Sizes of a bottleneck ResNet and its batch (`images`: f32[b, h, w, c], `labels`: int32[b])."""

    family: ClassVar[Family] = Family.RESNET

    stage_sizes: tuple[int, ...]  # bottleneck blocks per stage; (3, 4, 6, 3) is ResNet-50
    base_width: int  # width of the first stage; it doubles every stage
    num_classes: int
    image_size: int
    batch_size: int
    image_channels: int = 3
    learning_rate: float = 1e-3

    def __post_init__(self) -> None:
        reduction = 4 * 2 ** (len(self.stage_sizes) - 1)  # stem /4, every later stage /2
        if self.image_size % reduction:
            raise ZooError(f"image_size={self.image_size} is not divisible by {reduction}")

    def build(self, rngs: ParamKeys) -> "ResNet":
        return ResNet(self, rngs)

    def init(self, key: jax.Array) -> Params:
        return nnx_bridge.init_params(self.build, key)

    def make_loss(self) -> LossFn:
        return nnx_bridge.make_loss(self.build, _forward_loss)

    def batch_fields(self) -> dict[str, BatchField]:
        size, channels = self.image_size, self.image_channels
        return {"images": BatchField((self.batch_size, size, size, channels), jnp.float32),
                "labels": BatchField((self.batch_size,), jnp.int32, self.num_classes)}


def _conv(in_channels: int, out_channels: int, size: int, stride: int, rngs: ParamKeys) -> nnx.Conv:
    return nnx.Conv(in_channels, out_channels, (size, size), strides=(stride, stride), padding="SAME",
                    use_bias=False, kernel_init=nnx.initializers.he_normal(), rngs=rngs)


def _batch_norm(channels: int, rngs: ParamKeys) -> nnx.BatchNorm:
    return nnx.BatchNorm(channels, use_running_average=False, momentum=_MOMENTUM, epsilon=_EPSILON,
                         rngs=rngs)


class Stem(nnx.Module):
    def __init__(self, in_channels: int, width: int, rngs: ParamKeys):
        self.conv = _conv(in_channels, width, 7, 2, rngs)
        self.bn = _batch_norm(width, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jax.nn.relu(self.bn(self.conv(x)))
        return nnx.max_pool(x, window_shape=(3, 3), strides=(2, 2), padding="SAME")


class Bottleneck(nnx.Module):
    def __init__(self, in_channels: int, width: int, stride: int, rngs: ParamKeys):
        out_channels = width * _EXPANSION
        self.conv1 = _conv(in_channels, width, 1, 1, rngs)
        self.bn1 = _batch_norm(width, rngs)
        self.conv2 = _conv(width, width, 3, stride, rngs)
        self.bn2 = _batch_norm(width, rngs)
        self.conv3 = _conv(width, out_channels, 1, 1, rngs)
        self.bn3 = _batch_norm(out_channels, rngs)
        self.project = stride != 1 or in_channels != out_channels
        if self.project:
            self.proj_conv = _conv(in_channels, out_channels, 1, stride, rngs)
            self.proj_bn = _batch_norm(out_channels, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jax.nn.relu(self.bn1(self.conv1(x)))
        y = jax.nn.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        shortcut = self.proj_bn(self.proj_conv(x)) if self.project else x
        return jax.nn.relu(y + shortcut)


def block_name(stage: int, block: int) -> str:
    return f"stage{stage + 1}_block{block}"


class ResNet(nnx.Module):
    def __init__(self, config: ResNetConfig, rngs: ParamKeys):
        self.stage_sizes = config.stage_sizes
        self.stem = Stem(config.image_channels, config.base_width, rngs)
        channels = config.base_width
        for s, size in enumerate(config.stage_sizes):
            width = config.base_width * 2 ** s
            for b in range(size):
                stride = 2 if s > 0 and b == 0 else 1
                setattr(self, block_name(s, b), Bottleneck(channels, width, stride, rngs))
                channels = width * _EXPANSION
        self.head = nnx.Linear(channels, config.num_classes, kernel_init=nnx.initializers.normal(0.01),
                               rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = self.stem(images)
        for s, size in enumerate(self.stage_sizes):
            for b in range(size):
                with jax.named_scope(block_name(s, b)):
                    x = getattr(self, block_name(s, b))(x)
        return self.head(jnp.mean(x, axis=(1, 2)))


def _forward_loss(model: nnx.Module, batch: Batch) -> jax.Array:
    return softmax_cross_entropy(model(batch["images"]), batch["labels"])
