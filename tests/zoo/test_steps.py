"""Tiny entries run real training steps; their HLO carries what hlomap's capture needs."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

import jax
import numpy as np
import pytest

import hlomap.zoo as zoo

TINY = [name for name in zoo.names() if name.endswith("-tiny") or name == "haiku-mlp"]

#: The steps here run 4 times each, so spend little on compiling them (XLA's default CPU
#: pipeline takes several times longer on resnet50-tiny); numerics are unaffected.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


class Run(NamedTuple):
    args: tuple[Any, Any, Any]
    losses: tuple[float, ...]
    first: tuple[Any, Any, jax.Array]  # what the first step returned
    final: tuple[Any, Any, jax.Array]  # what the last step returned


@lru_cache(maxsize=None)
def run_steps(name: str, steps: int = 4) -> Run:
    """Example args of `name` and `steps` Adam steps on the same batch."""
    entry = zoo.get(name)
    args = entry.example_args(seed=0)
    step = jax.jit(entry.train_step()).lower(*args).compile(compiler_options=FAST_COMPILE)
    params, opt_state, batch = args
    outputs = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, batch)
        outputs.append((params, opt_state, loss))
    return Run(args, tuple(float(out[2]) for out in outputs), outputs[0], outputs[-1])


def _same_structure(real: Any, abstract: Any) -> bool:
    if jax.tree_util.tree_structure(real) != jax.tree_util.tree_structure(abstract):
        return False
    pairs = zip(jax.tree_util.tree_leaves(real), jax.tree_util.tree_leaves(abstract))
    return all(r.shape == a.shape and r.dtype == a.dtype for r, a in pairs)


# resnet50-tiny's step takes 20 s to lower on 2 cores: the slow suite checks it
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "resnet50-tiny" else n for n in TINY])
def test_example_args_match_abstract_args(name: str, abstract_args_of) -> None:
    args = run_steps(name).args
    assert _same_structure(args, abstract_args_of(name))
    for leaf in jax.tree_util.tree_leaves(args):
        assert np.all(np.isfinite(np.asarray(leaf)))


# resnet50-tiny (12 s, its convolutions compile slowly on a CPU) in the slow run
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "resnet50-tiny" else n for n in TINY])
def test_loss_decreases_over_three_steps(name: str) -> None:
    losses = run_steps(name).losses
    assert all(np.isfinite(losses)), losses
    # Step i reports the loss before its update, so losses[3] is after three updates.
    assert losses[3] < losses[0], losses
    assert losses[1] < losses[0], losses


# resnet50-tiny's step takes 20+ s to compile here: it runs in the slow set, with its pipelines
# (tests/run/test_pipeline.py) and float64 plans (tests/tasks/sharding/test_acceptance.py)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "resnet50-tiny" else n
                                  for n in TINY])
def test_step_returns_updated_params_and_state(name: str) -> None:
    run = run_steps(name)
    (params, opt_state, _), (new_params, new_opt_state, loss) = run.args, run.final
    assert _same_structure(new_params, params)
    assert _same_structure(new_opt_state, opt_state)
    assert loss.shape == () and loss.dtype == np.float32
    changed = jax.tree_util.tree_map(lambda a, b: not np.array_equal(a, b), params, new_params)
    trainable = {k: v for k, v in changed.items() if k != zoo.OTHER_KEY}
    # Every trainable leaf gets a gradient somewhere (no dead parameters), so Adam moves it.
    unchanged = [path for path, flag in zip(zoo.tree_paths(trainable), jax.tree_util.tree_leaves(trainable))
                 if not flag]
    assert not unchanged


def test_resnet_updates_running_statistics_outside_adam() -> None:
    run = run_steps("resnet50-tiny")
    params, _, batch = run.args
    old_mean = np.asarray(params[zoo.OTHER_KEY]["stem"]["bn"]["mean"])
    new_mean = np.asarray(run.first[0][zoo.OTHER_KEY]["stem"]["bn"]["mean"])
    assert np.all(old_mean == 0)
    # The stem's batch mean, computed here from the inputs: running = 0.9 * 0 + 0.1 * batch mean.
    stem_out = jax.lax.conv_general_dilated(
        batch["images"], params["stem"]["conv"]["kernel"], (2, 2), "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    np.testing.assert_allclose(new_mean, 0.1 * np.asarray(stem_out).mean(axis=(0, 1, 2)),
                               rtol=1e-4, atol=1e-6)
    adam_paths = set(zoo.tree_paths(run.final[1]))
    assert not any(zoo.OTHER_KEY in p for p in adam_paths)
    assert any("stem/conv/kernel" in p for p in adam_paths)


def test_example_args_are_deterministic_in_the_seed() -> None:
    entry = zoo.get("haiku-mlp")
    a, b, c = entry.example_args(seed=3), entry.example_args(seed=3), entry.example_args(seed=4)
    kernel = lambda args: np.asarray(args[0]["mlp/~/linear_0"]["w"])  # noqa: E731
    np.testing.assert_array_equal(kernel(a), kernel(b))
    np.testing.assert_array_equal(np.asarray(a[2]["images"]), np.asarray(b[2]["images"]))
    assert not np.array_equal(kernel(a), kernel(c))
    assert not np.array_equal(np.asarray(a[2]["images"]), np.asarray(c[2]["images"]))


def test_example_batches_stay_in_range() -> None:
    for name in ("gpt-tiny", "bert-tiny", "vgg19-tiny"):
        _, _, batch = run_steps(name).args
        fields = zoo.get(name).config.batch_fields()
        for key, field in fields.items():
            if field.high is not None:
                values = np.asarray(batch[key])
                assert values.min() >= 0 and values.max() < field.high, (name, key)


@pytest.mark.parametrize("name", TINY)
def test_hlo_text_has_dots_backward_metadata_and_all_arguments(name: str, abstract_args_of) -> None:
    text = zoo.get(name).hlo_text()
    entry_lines = text[text.index("\nENTRY "):].splitlines()
    assert any(" dot(" in line or " convolution(" in line for line in entry_lines)
    assert "transpose(jvp(" in text
    parameters = [line for line in entry_lines if " parameter(" in line]
    assert len(parameters) == len(jax.tree_util.tree_leaves(abstract_args_of(name)))


def test_hlo_text_is_the_module_a_zoo_source_captures() -> None:
    """A file written from `hlo_text` is the step `zoo:NAME` names (a plan explored on the dump
    prices and runs on the zoo step): the same instructions, unused arguments kept."""
    from hlomap import api
    from hlomap.hlo.parser import parse

    for name in ("gpt-tiny", "haiku-mlp"):
        dumped = parse(zoo.get(name).hlo_text())
        captured = api.load_source(f"zoo:{name}").module
        assert dumped.instruction_count == captured.instruction_count, name
        assert len(dumped.entry.parameters) == len(captured.entry.parameters), name


def test_hlo_text_has_one_dot_per_layer_weight() -> None:
    """Layers are unrolled: each query kernel feeds its own forward dot."""
    entry = zoo.get("gpt-tiny")
    text = entry.hlo_text()
    for layer in range(entry.config.num_layers):
        assert f"layers_{layer}" in text
    forward_dots = [line for line in text.splitlines()
                    if " dot(" in line and "transpose(jvp(" not in line]
    # q, k, v, out, fc_in, fc_out per layer, plus the tied output projection.
    assert len(forward_dots) >= 6 * entry.config.num_layers + 1
