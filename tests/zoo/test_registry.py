"""The zoo's name registry and the sizes of its entries."""

from __future__ import annotations

import dataclasses

import jax
import pytest

import hlomap.zoo as zoo

REQUIRED = (
    "gpt-small", "gpt-base", "gpt-1.3b", "gpt-2.6b", "bert-48", "t5-base", "t5-3b", "t5-11b",
    "vgg19", "resnet50", "haiku-mlp",
    "gpt-tiny", "bert-tiny", "t5-tiny", "vgg19-tiny", "resnet50-tiny", "moe-tiny",
)

#: Config fields that are sizes a plan may shard; in tiny entries every one must divide by 8.
SHARDABLE_FIELDS = {
    "d_model", "num_heads", "d_ff", "vocab_size", "batch_size", "num_experts", "d_kv",
    "base_width", "num_classes", "hidden", "fc_features", "block_channels", "seq_len",
    "input_len", "target_len", "image_size",
}


def tiny_names() -> list[str]:
    return [name for name in zoo.names() if name.endswith("-tiny") or name == "haiku-mlp"]


def test_names_are_sorted_unique_and_complete() -> None:
    names = zoo.names()
    assert list(names) == sorted(set(names))
    missing = set(REQUIRED) - set(names)
    assert not missing, f"zoo lacks {sorted(missing)}"


def test_every_family_has_a_tiny_entry() -> None:
    families_with_tiny = {zoo.get(name).family for name in tiny_names()}
    assert families_with_tiny == set(zoo.Family)


@pytest.mark.parametrize("name", REQUIRED)
def test_get_returns_the_named_entry(name: str) -> None:
    entry = zoo.get(name)
    assert entry.name == name
    assert isinstance(entry.family, zoo.Family)
    assert entry.family == entry.config.family
    assert entry.description
    assert entry.arg_names == ("params", "opt_state", "batch")
    assert dataclasses.is_dataclass(entry.config)
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.config.batch_size = 1  # type: ignore[misc]


def test_family_compares_as_string() -> None:
    assert zoo.get("gpt-base").family == "gpt"
    assert zoo.get("t5-11b").family == "t5"
    assert str(zoo.get("resnet50").family) == "resnet"


def test_unknown_name_is_a_key_error_listing_the_names() -> None:
    with pytest.raises(KeyError) as info:
        zoo.get("gpt-7b")
    assert isinstance(info.value, zoo.ZooError)
    message = str(info.value)
    assert "'gpt-7b'" in message
    for name in ("gpt-base", "t5-11b", "haiku-mlp"):
        assert name in message


def _sizes(value: object) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, tuple):
        return [size for item in value for size in _sizes(item)]
    return []


@pytest.mark.parametrize("name", tiny_names())
def test_tiny_entries_shard_over_8_devices(name: str) -> None:
    config = zoo.get(name).config
    checked = 0
    for field in dataclasses.fields(config):
        if field.name in SHARDABLE_FIELDS:
            for size in _sizes(getattr(config, field.name)):
                assert size % 8 == 0, f"{name}: {field.name}={getattr(config, field.name)}"
                checked += 1
    assert checked >= 3, f"{name}: no shardable size fields found"
    for batch_field in config.batch_fields().values():
        assert batch_field.shape[0] % 8 == 0


@pytest.mark.parametrize("name", [n for n in zoo.names() if n not in tiny_names()])
def test_big_entries_have_dims_divisible_by_8(name: str, abstract_args_of) -> None:
    params, _, batch = abstract_args_of(name)
    assert all(leaf.shape[0] % 8 == 0 for leaf in batch.values())
    # Every weight dim that is not a convolution window, an image channel count, a head count
    # of a published config (12) or a small table (token types, relative-position buckets).
    small_ok = {1, 2, 3, 7, 12, 32}
    for path, leaf in zip(zoo.tree_paths(params), jax.tree_util.tree_leaves(params)):
        for dim in leaf.shape:
            assert dim % 8 == 0 or dim in small_ok, f"{name}: {path} has shape {leaf.shape}"
