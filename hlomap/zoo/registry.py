"""The zoo's entries: published benchmark configurations and `-tiny` variants for numeric tests.

Big entries keep their published weight shapes (which is what a plan partitions) with a small
batch (8) and sequence (128): they are meant to be lowered abstractly, not run on a CPU.
Transformer entries of about 300M parameters and more (bert-large, bert-48, t5-large, t5-3b,
t5-11b, gpt-1.3b, gpt-2.6b, moe-base) compute in bfloat16 with float32 parameters and optimizer
state, as models of this size are usually trained (mixed precision); the smaller ones, small
enough to run on a CPU, in float32.
`zoo.get("NAME:DTYPE")` picks the other dtype.
Tiny entries have every size (hidden, heads, ffn, vocab, batch, experts, channels) a multiple of
8, so that they shard over 8 devices or a 2x4 mesh, and take well under a second per step.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from hlomap.zoo.bert import BertConfig
from hlomap.zoo.gpt import GptConfig
from hlomap.zoo.haiku_mlp import MlpConfig
from hlomap.zoo.model import ZooModel
from hlomap.zoo.moe import MoeConfig
from hlomap.zoo.resnet import ResNetConfig
from hlomap.zoo.t5 import T5Config
from hlomap.zoo.vgg import VGG19_CHANNELS, VggConfig

#: GPT-2's 50257-token vocabulary padded to a multiple of 128 (as Megatron-LM does).
GPT_VOCAB = 50304
#: BERT's uncased WordPiece vocabulary (30522) rounded up to a multiple of 8.
BERT_VOCAB = 30528
#: T5's SentencePiece vocabulary as shipped in the checkpoints (32100 rounded up to 32128).
T5_VOCAB = 32128

_BATCH = 8
_SEQ = 128
#: Compute dtype of the large transformer entries (see the module docstring).
_LARGE = "bfloat16"


#: Trainable parameters of each entry, so that listing the zoo traces nothing; the zoo's tests
#: check every number against the model itself (`ZooModel.param_count`).
PARAMETERS: Mapping[str, int] = MappingProxyType({
    "bert-48": 637_489_984,
    "bert-base": 109_518_912,
    "bert-large": 335_180_608,
    "bert-tiny": 141_888,
    "gpt-1.3b": 1_315_819_520,
    "gpt-2.6b": 2_651_673_600,
    "gpt-base": 124_475_904,
    "gpt-small": 45_195_264,
    "gpt-tiny": 136_960,
    "haiku-mlp": 672_784,
    "moe-base": 549_199_872,
    "moe-tiny": 218_944,
    "resnet50": 25_557_032,
    "resnet50-tiny": 378_264,
    "t5-11b": 11_307_321_344,
    "t5-3b": 2_851_598_336,
    "t5-base": 222_903_552,
    "t5-large": 737_668_096,
    "t5-small": 60_506_624,
    "t5-tiny": 263_424,
    "vgg19": 143_667_240,
    "vgg19-tiny": 323_032,
})


def _entry(name: str, description: str, config: object) -> ZooModel:
    return ZooModel(name=name, family=config.family, description=description, config=config,  # type: ignore[attr-defined]
                    parameters=PARAMETERS[name])


def _gpt(layers: int, d: int, heads: int, positions: int, dtype: str = "float32") -> GptConfig:
    return GptConfig(num_layers=layers, d_model=d, num_heads=heads, d_ff=4 * d, vocab_size=GPT_VOCAB,
                     max_positions=positions, batch_size=_BATCH, seq_len=_SEQ, compute_dtype=dtype)


def _bert(layers: int, d: int, heads: int, dtype: str = "float32") -> BertConfig:
    return BertConfig(num_layers=layers, d_model=d, num_heads=heads, d_ff=4 * d, vocab_size=BERT_VOCAB,
                      max_positions=512, batch_size=_BATCH, seq_len=_SEQ, compute_dtype=dtype)


def _t5(layers: int, d: int, d_ff: int, heads: int, d_kv: int, dtype: str = "float32") -> T5Config:
    return T5Config(num_layers=layers, d_model=d, d_ff=d_ff, num_heads=heads, d_kv=d_kv,
                    vocab_size=T5_VOCAB, batch_size=_BATCH, input_len=_SEQ, target_len=_SEQ,
                    compute_dtype=dtype)


def _entries() -> tuple[ZooModel, ...]:
    return (
        # GPT: GPT-2 / GPT-3 table sizes (d_ff = 4 d, head_dim 64 / 128 / 80).
        _entry("gpt-tiny", "GPT decoder, 2 layers, d=64, 8 heads (numeric tests)",
               GptConfig(num_layers=2, d_model=64, num_heads=8, d_ff=256, vocab_size=512,
                         max_positions=64, batch_size=8, seq_len=32)),
        _entry("gpt-small", "GPT decoder, 6 layers, d=512, 8 heads (~45M)", _gpt(6, 512, 8, 1024)),
        _entry("gpt-base", "GPT-2 base: 12 layers, d=768, 12 heads (~124M)", _gpt(12, 768, 12, 1024)),
        _entry("gpt-1.3b", "GPT-3 XL: 24 layers, d=2048, 16 heads (~1.3B)", _gpt(24, 2048, 16, 2048, _LARGE)),
        _entry("gpt-2.6b", "GPT-3 2.7B: 32 layers, d=2560, 32 heads (~2.65B)", _gpt(32, 2560, 32, 2048, _LARGE)),
        # BERT
        _entry("bert-tiny", "BERT encoder + MLM head, 2 layers, d=64, 8 heads (numeric tests)",
               BertConfig(num_layers=2, d_model=64, num_heads=8, d_ff=256, vocab_size=512,
                          max_positions=64, batch_size=8, seq_len=32)),
        _entry("bert-base", "BERT-base: 12 layers, d=768, 12 heads (~110M)", _bert(12, 768, 12)),
        _entry("bert-large", "BERT-large: 24 layers, d=1024, 16 heads (~335M)", _bert(24, 1024, 16, _LARGE)),
        _entry("bert-48", "BERT with 48 layers, d=1024, 16 heads (~640M)", _bert(48, 1024, 16, _LARGE)),
        # T5: the published configurations (Raffel et al. 2020, table 14 / HF configs).
        _entry("t5-tiny", "T5 encoder-decoder, 2+2 layers, d=64, 8 heads (numeric tests)",
               T5Config(num_layers=2, d_model=64, d_ff=256, num_heads=8, d_kv=8, vocab_size=512,
                        batch_size=8, input_len=32, target_len=32)),
        _entry("t5-small", "T5-small: 6+6 layers, d=512, d_ff=2048, 8 heads (~60M)",
               _t5(6, 512, 2048, 8, 64)),
        _entry("t5-base", "T5-base: 12+12 layers, d=768, d_ff=3072, 12 heads (~223M)",
               _t5(12, 768, 3072, 12, 64)),
        _entry("t5-large", "T5-large: 24+24 layers, d=1024, d_ff=4096, 16 heads (~738M)",
               _t5(24, 1024, 4096, 16, 64, _LARGE)),
        _entry("t5-3b", "T5-3B: 24+24 layers, d=1024, d_ff=16384, 32 heads x 128 (~2.85B)",
               _t5(24, 1024, 16384, 32, 128, _LARGE)),
        _entry("t5-11b", "T5-11B: 24+24 layers, d=1024, d_ff=65536, 128 heads x 128 (~11.3B)",
               _t5(24, 1024, 65536, 128, 128, _LARGE)),
        # Convolutional networks
        _entry("vgg19-tiny", "VGG-19 layout at 1/8 width on 32x32 images, 16 classes (numeric tests)",
               VggConfig(block_channels=tuple(tuple(c // 8 for c in block) for block in VGG19_CHANNELS),
                         fc_features=(64, 64), num_classes=16, image_size=32, batch_size=8)),
        _entry("vgg19", "VGG-19 on 224x224 images, 1000 classes (~144M)",
               VggConfig(block_channels=VGG19_CHANNELS, fc_features=(4096, 4096), num_classes=1000,
                         image_size=224, batch_size=_BATCH)),
        _entry("resnet50-tiny", "ResNet-50 layout (3,4,6,3) at 1/8 width on 32x32 images, 16 classes "
               "(numeric tests)",
               ResNetConfig(stage_sizes=(3, 4, 6, 3), base_width=8, num_classes=16, image_size=32,
                            batch_size=8)),
        _entry("resnet50", "ResNet-50 v1.5 with batch norm on 224x224 images, 1000 classes (~25.6M)",
               ResNetConfig(stage_sizes=(3, 4, 6, 3), base_width=64, num_classes=1000, image_size=224,
                            batch_size=_BATCH)),
        # Mixture of experts
        _entry("moe-tiny", "MoE decoder, 2 layers (1 MoE), 8 experts top-2, d=64 (numeric tests)",
               MoeConfig(num_layers=2, d_model=64, num_heads=8, d_ff=128, num_experts=8, vocab_size=512,
                         max_positions=64, batch_size=8, seq_len=32)),
        _entry("moe-base", "MoE decoder, GPT-base with 16 experts top-2 in every other layer (~549M)",
               MoeConfig(num_layers=12, d_model=768, num_heads=12, d_ff=3072, num_experts=16,
                         vocab_size=GPT_VOCAB, max_positions=1024, batch_size=_BATCH, seq_len=_SEQ,
                         compute_dtype=_LARGE)),
        # dm-haiku
        _entry("haiku-mlp", "dm-haiku MLP 784-512-512-16 on 28x28x1 images",
               MlpConfig(hidden=(512, 512), num_classes=16, image_shape=(28, 28, 1), batch_size=32)),
    )


def registry() -> Mapping[str, ZooModel]:
    """Name -> entry, read-only."""
    return MappingProxyType({entry.name: entry for entry in _entries()})
