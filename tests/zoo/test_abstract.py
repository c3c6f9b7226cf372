"""Abstract arguments: nothing allocated, the right structure, and parameter counts that match
closed-form counts from the configs and the published model sizes."""

from __future__ import annotations

import math

import jax
import optax
import pytest

import hlomap.zoo as zoo
from hlomap.zoo.bert import BertConfig
from hlomap.zoo.gpt import GptConfig
from hlomap.zoo.moe import MoeConfig
from hlomap.zoo.t5 import T5Config
from tests.zoo.abstract_cache import abstract_with_allocation

ALL = zoo.names()


@pytest.mark.parametrize("name", ALL)
def test_abstract_args_allocate_nothing(name: str) -> None:
    args, new_bytes = abstract_with_allocation(name)
    assert new_bytes < 1024, f"{name}: abstract_args left {new_bytes} bytes of live arrays"
    leaves = jax.tree_util.tree_leaves(args)
    assert leaves
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)


@pytest.mark.parametrize("name", ALL)
def test_opt_state_is_adam_over_exactly_the_trainable_params(name: str, abstract_args_of) -> None:
    params, opt_state, _ = abstract_args_of(name)
    adam = [s for s in jax.tree_util.tree_leaves(opt_state, is_leaf=_is_adam) if _is_adam(s)]
    assert len(adam) == 1
    trainable = {k: v for k, v in params.items() if k != zoo.OTHER_KEY}
    for moments in (adam[0].mu, adam[0].nu):
        assert jax.tree_util.tree_structure(moments) == jax.tree_util.tree_structure(trainable)
        same = jax.tree_util.tree_map(lambda a, b: a.shape == b.shape, moments, trainable)
        assert all(jax.tree_util.tree_leaves(same))
    assert adam[0].count.shape == ()


def _is_adam(node: object) -> bool:
    return isinstance(node, optax.ScaleByAdamState)


@pytest.mark.parametrize("name", ALL)
def test_params_paths_are_readable_and_batch_is_a_dict(name: str, abstract_args_of) -> None:
    params, _, batch = abstract_args_of(name)
    paths = zoo.tree_paths(params)
    assert len(paths) == len(set(paths))
    assert all(path and "[" not in path and "'" not in path for path in paths), paths[:5]
    assert isinstance(batch, dict) and batch
    entry = zoo.get(name)
    if entry.family in (zoo.Family.GPT, zoo.Family.BERT, zoo.Family.MOE):
        assert "layers_0/attn/query/kernel" in paths
        assert "embed/embedding" in paths
    if entry.family == zoo.Family.T5:
        assert "encoder/layers_0/self_attn/query/kernel" in paths
        assert "decoder/layers_0/cross_attn/key/kernel" in paths


def test_only_resnet_has_other_state(abstract_args_of) -> None:
    for name in ALL:
        params, _, _ = abstract_args_of(name)
        is_resnet = zoo.get(name).family == zoo.Family.RESNET
        assert (zoo.OTHER_KEY in params) == is_resnet, name
    for name in ("resnet50-tiny", "gpt-tiny"):
        other = zoo.get(name).other_paths()
        if name.startswith("resnet"):
            assert other and all(p.startswith("batch_stats/") for p in other)
            assert {p.rsplit("/", 1)[1] for p in other} == {"mean", "var"}
            assert set(other) <= set(zoo.tree_paths(abstract_args_of(name)[0]))
        else:
            assert other == ()


# --- closed-form parameter counts, written from the architecture descriptions ---------------


def gpt_count(c: GptConfig) -> int:
    d, f = c.d_model, c.d_ff
    attention = 4 * (d * d + d)  # q, k, v, out with biases
    mlp = d * f + f + f * d + d
    norms = 2 * 2 * d
    return c.vocab_size * d + c.max_positions * d + c.num_layers * (attention + mlp + norms) + 2 * d


def bert_count(c: BertConfig) -> int:
    d, f = c.d_model, c.d_ff
    embeddings = (c.vocab_size + c.max_positions + c.type_vocab_size) * d + 2 * d
    layer = 4 * (d * d + d) + (d * f + f + f * d + d) + 2 * 2 * d
    head = (d * d + d) + 2 * d + c.vocab_size
    return embeddings + c.num_layers * layer + head


def t5_count(c: T5Config) -> int:
    d, f, inner = c.d_model, c.d_ff, c.num_heads * c.d_kv
    attention = 4 * d * inner
    encoder_layer = attention + 2 * d * f + 2 * d
    decoder_layer = 2 * attention + 2 * d * f + 3 * d
    per_stack = c.num_buckets * c.num_heads + d
    return c.vocab_size * d + c.num_layers * (encoder_layer + decoder_layer) + 2 * per_stack


def moe_count(c: MoeConfig) -> int:
    d, f, e = c.d_model, c.d_ff, c.num_experts
    total = c.vocab_size * d + c.max_positions * d + 2 * d
    for i in range(c.num_layers):
        total += 4 * (d * d + d) + 2 * 2 * d
        is_moe = i % c.moe_every == c.moe_every - 1
        total += d * e + 2 * e * d * f if is_moe else d * f + f + f * d + d
    return total


CLOSED_FORM = {zoo.Family.GPT: gpt_count, zoo.Family.BERT: bert_count, zoo.Family.T5: t5_count,
               zoo.Family.MOE: moe_count}


def trainable_size(params: dict) -> int:
    trainable = {k: v for k, v in params.items() if k != zoo.OTHER_KEY}
    return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(trainable))


@pytest.mark.parametrize("name", ["gpt-tiny", "t5-tiny", "resnet50-tiny", "haiku-mlp"])
def test_param_count_counts_trainable_scalars(name: str, abstract_args_of) -> None:
    params, _, _ = abstract_args_of(name)
    everything = sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(params))
    count = zoo.get(name).param_count()
    assert count == trainable_size(params)
    assert (count < everything) == (zoo.OTHER_KEY in params)


@pytest.mark.parametrize(
    "name", [n for n in ALL if zoo.get(n).family in CLOSED_FORM])
def test_param_count_matches_closed_form(name: str, abstract_args_of) -> None:
    entry = zoo.get(name)
    assert trainable_size(abstract_args_of(name)[0]) == CLOSED_FORM[entry.family](entry.config)


@pytest.mark.parametrize("name", ALL)
def test_declared_parameter_counts_match_the_models(name: str, abstract_args_of) -> None:
    """`hlomap zoo list` shows the registry's declared counts without tracing a model."""
    assert zoo.get(name).parameters == trainable_size(abstract_args_of(name)[0])


#: Parameter counts of the released models (HF checkpoints / torchvision / Keras).
PUBLISHED = {
    "t5-small": 60_506_624,
    "t5-base": 222_903_552,
    "t5-large": 737_668_096,
    "t5-3b": 2_851_598_336,
    "t5-11b": 11_307_321_344,
    "resnet50": 25_557_032,
    "vgg19": 143_667_240,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_param_count_matches_published_model(name: str, abstract_args_of) -> None:
    assert trainable_size(abstract_args_of(name)[0]) == PUBLISHED[name]


@pytest.mark.parametrize("name,low,high", [
    ("gpt-base", 120e6, 130e6), ("gpt-1.3b", 1.25e9, 1.4e9), ("gpt-2.6b", 2.5e9, 2.8e9),
    ("bert-48", 620e6, 660e6), ("bert-large", 320e6, 350e6)])
def test_param_count_is_the_advertised_size(
    name: str, low: float, high: float, abstract_args_of
) -> None:
    assert low <= trainable_size(abstract_args_of(name)[0]) <= high


def test_example_args_refuse_to_allocate_t5_11b() -> None:
    before = {id(array) for array in jax.live_arrays()}
    with pytest.raises(zoo.ZooError, match="t5-11b.*GiB"):
        zoo.get("t5-11b").example_args()
    assert sum(a.nbytes for a in jax.live_arrays() if id(a) not in before) < 1024
