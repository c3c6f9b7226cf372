"""Mixed precision in the zoo: a transformer's `compute_dtype` puts its activations and dots in
bfloat16 while its parameters and Adam state stay float32; the cost model then prices its dots
at the bf16 rate and its activations at 2 bytes, and the step trains like the float32 one within
bfloat16's precision, sharded or not."""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlomap
import hlomap.zoo as zoo
from hlomap import api
from hlomap.cli import run
from hlomap.cost.cluster import hierarchical
from hlomap.hlo.capture import Role
from hlomap.plan import Plan
from hlomap.plan.reference import reference_plan
from hlomap.propagation.graph import FactorGraph
from hlomap.run.compare import FLOAT32, HALF_PRECISION, tolerances_for
from hlomap.zoo.model import split_other, tree_paths

#: bf16 peak 312 TFLOP/s, f32 19.5: the dots of a bfloat16 step cost about a sixteenth.
A100 = hierarchical(1, 8, "A100-80GB")
TRANSFORMERS = ("gpt-tiny", "bert-tiny", "t5-tiny", "moe-tiny")
LARGE_BFLOAT16 = {"bert-large", "bert-48", "t5-large", "t5-3b", "t5-11b", "gpt-1.3b", "gpt-2.6b", "moe-base"}
#: bfloat16 keeps 8 bits of mantissa (relative rounding 2^-9); a loss is a mean of many such terms.
LOSS_RTOL = 1e-2
#: Gradient leaves that are sums over the batch (biases, layer-norm parameters) reduce thousands of
#: bfloat16 terms: a few percent of the leaf's scale (measured up to 3.8% on gpt-tiny).
GRADIENT_TOLERANCE = 6e-2
#: A leaf's scale is at least this fraction of the largest gradient: the key biases' gradients are
#: zero in exact arithmetic (softmax ignores a shift of its logits), rounding noise in both runs.
SCALE_FLOOR = 1e-2
#: Each function here runs once: spend little on compiling it (numerics are unaffected).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@lru_cache(maxsize=None)
def _capture(name: str) -> Any:
    return api.load_source(f"zoo:{name}")


@lru_cache(maxsize=None)
def _example(name: str) -> tuple[Any, Any, Any]:
    """gpt-tiny's example arguments (the float32 weights are the same whatever the compute dtype)."""
    return zoo.get(name).example_args(seed=0)


def _gradient_errors(actual: Any, expected: Any) -> dict[str, float]:
    """Each leaf's largest difference relative to its scale (floored, see SCALE_FLOOR)."""
    top = max(float(jnp.max(jnp.abs(leaf))) for leaf in jax.tree.leaves(expected))
    return {path: float(jnp.max(jnp.abs(a - e))) / max(float(jnp.max(jnp.abs(e))), SCALE_FLOOR * top)
            for path, a, e in zip(tree_paths(expected), jax.tree.leaves(actual), jax.tree.leaves(expected))}


def _run_once(fn: Any, *args: Any, shardings: Any = None) -> Any:
    jitted = jax.jit(fn) if shardings is None else jax.jit(fn, in_shardings=shardings)
    return jitted.lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


def _loss(model: zoo.ZooModel, params: Any, batch: Any) -> float:
    loss_fn = model.config.make_loss()
    trainable, other = split_other(params)
    return float(_run_once(lambda p, b: loss_fn(p, other, b)[0], trainable, batch))


def _loss_and_grads(model: zoo.ZooModel, params: Any, batch: Any, shardings: Any = None) -> tuple[float, Any]:
    loss_fn = model.config.make_loss()
    trainable, other = split_other(params)
    value_and_grad = jax.value_and_grad(lambda p, b: loss_fn(p, other, b)[0])
    loss, grads = _run_once(value_and_grad, trainable, batch, shardings=shardings)
    return float(loss), jax.tree.map(np.asarray, grads)


@lru_cache(maxsize=None)
def _unsharded(name: str) -> tuple[float, Any]:
    params, _, batch = _example("gpt-tiny")
    return _loss_and_grads(zoo.get(name), params, batch)


# --- choosing the dtype --------------------------------------------------------------------------


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_a_bad_compute_dtype_names_the_config_and_the_value(name: str) -> None:
    config = zoo.get(name).config
    with pytest.raises(zoo.ZooError, match=rf"{type(config).__name__}: compute_dtype='bf16' is not one of "
                                           r"float32, bfloat16"):
        dataclasses.replace(config, compute_dtype="bf16")


def test_a_bad_dtype_suffix_names_the_entry_and_the_known_dtypes() -> None:
    with pytest.raises(zoo.ZooError, match=r"zoo model 'gpt-tiny': compute_dtype='half' is not one of float32, "
                                           r"bfloat16"):
        zoo.get("gpt-tiny:half")
    with pytest.raises(zoo.ZooError, match=r"'vgg19-tiny' computes in float32 only"):
        zoo.get("vgg19-tiny:bfloat16")
    assert zoo.get("vgg19-tiny:float32") is zoo.get("vgg19-tiny")
    with pytest.raises(api.SourceError, match=r"unknown zoo model 'gpt-7b'"):
        api.load_source("zoo:gpt-7b:float32")


def test_the_cli_names_a_bad_dtype_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["inspect", "zoo:gpt-tiny:fp8"]) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "compute_dtype='fp8'" in err and "float32, bfloat16" in err, err


def test_the_large_transformers_default_to_bfloat16_and_a_suffix_picks_float32() -> None:
    listed = {entry.name: entry.compute_dtype for entry in api.zoo_entries()}
    assert {name for name, dtype in listed.items() if dtype == "bfloat16"} == LARGE_BFLOAT16
    assert set(listed.values()) == {"float32", "bfloat16"}
    variant = zoo.get("gpt-1.3b:float32")
    assert (variant.name, variant.compute_dtype, variant.config.compute_dtype) == ("gpt-1.3b:float32", "float32",
                                                                                   "float32")
    assert dataclasses.replace(variant.config, compute_dtype="bfloat16") == zoo.get("gpt-1.3b").config
    assert zoo.get("gpt-tiny:float32") is zoo.get("gpt-tiny")  # its own dtype: the entry itself


# --- what the bfloat16 step lowers to ------------------------------------------------------------


def test_the_float32_default_has_no_bfloat16_in_its_hlo() -> None:
    assert "bf16" not in str(_capture("gpt-tiny").module)


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_bf16_dots_take_bf16_operands_while_parameters_and_adam_state_stay_f32(name: str) -> None:
    cap = _capture(f"{name}:bfloat16")
    floating = {p.shape.dtype for p in cap.parameters if p.role in (Role.TRAINABLE, Role.OPTIMIZER_STATE)} - {"s32"}
    assert floating == {"f32"}
    operand_dtypes = []
    for computation, instruction in cap.module.instructions():
        if instruction.opcode == "dot":
            operand_dtypes.append(tuple(computation[o].shape.dtype for o in instruction.operands))
    f32_dots = [dtypes for dtypes in operand_dtypes if dtypes != ("bf16", "bf16")]
    # the MoE router alone runs in float32: its forward dot and the two of its backward
    assert len(f32_dots) == (3 if name == "moe-tiny" else 0), f32_dots
    assert len(operand_dtypes) > 3 * len(f32_dots)


def test_bf16_dots_are_priced_at_the_bf16_rate_and_activations_at_two_bytes() -> None:
    f32 = hlomap.estimate(_capture("gpt-tiny"), "dp", mesh={"data": 1}, cluster=A100)
    bf16 = hlomap.estimate(_capture("gpt-tiny:bfloat16"), "dp", mesh={"data": 1}, cluster=A100)

    def dot_seconds(estimate: Any) -> float:
        return sum(i.seconds for i in estimate.instructions if i.opcode == "dot")

    assert dot_seconds(bf16) < dot_seconds(f32) / 4
    assert bf16.compute_seconds < 0.6 * f32.compute_seconds
    assert (bf16.memory.parameters, bf16.memory.optimizer) == (f32.memory.parameters, f32.memory.optimizer)
    # bfloat16 activations, but float32 logits for the loss and float32 gradients
    assert 0.45 * f32.memory.max_activations <= bf16.memory.max_activations <= 0.75 * f32.memory.max_activations


# --- numerics --------------------------------------------------------------------------------------


def test_bf16_loss_and_gradients_match_float32_within_bf16_precision() -> None:
    f32_loss, f32_grads = _unsharded("gpt-tiny")
    bf16_loss, bf16_grads = _unsharded("gpt-tiny:bfloat16")
    assert {leaf.dtype for leaf in jax.tree.leaves(bf16_grads)} == {np.dtype("float32")}
    assert bf16_loss == pytest.approx(f32_loss, rel=LOSS_RTOL)
    errors = _gradient_errors(bf16_grads, f32_grads)
    assert max(errors.values()) < GRADIENT_TOLERANCE, errors
    assert max(errors.values()) > 1e-4  # it did compute in bfloat16


@pytest.mark.slow  # about 5 s each; gpt-tiny's loss and gradients are checked in the fast suite
@pytest.mark.parametrize("name", ["bert-tiny", "t5-tiny", "moe-tiny"])
def test_each_bf16_transformer_has_the_float32_loss(name: str) -> None:
    params, _, batch = _example(name)
    f32_loss = _loss(zoo.get(name), params, batch)
    assert _loss(zoo.get(f"{name}:bfloat16"), params, batch) == pytest.approx(f32_loss, rel=LOSS_RTOL)


def test_a_data_parallel_plan_runs_the_bf16_step_as_unsharded_within_bf16_precision() -> None:
    assert jax.device_count() >= 8
    model = zoo.get("gpt-tiny:bfloat16")
    plan = _dp_plan(_capture("gpt-tiny:bfloat16"))
    params, opt_state, batch = _example("gpt-tiny")
    parallel = hlomap.parallelize(model.train_step(), plan)
    param_shardings, _, batch_shardings = parallel.arg_shardings((params, opt_state, batch))
    assert any(s.spec != jax.sharding.PartitionSpec() for s in jax.tree.leaves(batch_shardings))

    loss, grads = _loss_and_grads(model, params, batch, (param_shardings, batch_shardings))
    want_loss, want_grads = _unsharded("gpt-tiny:bfloat16")
    assert loss == pytest.approx(want_loss, rel=LOSS_RTOL)
    errors = _gradient_errors(grads, want_grads)
    assert max(errors.values()) < GRADIENT_TOLERANCE, errors

    _, _, step_loss = parallel(*parallel.place(params, opt_state), batch)
    assert float(step_loss) == pytest.approx(want_loss, rel=LOSS_RTOL)


def _dp_plan(cap: Any) -> Plan:
    graph = FactorGraph.from_capture(cap)
    return Plan.from_groups(cap, graph, *reference_plan(graph, "dp", {"data": 8}))


def test_a_bf16_step_is_checked_within_mixed_precision_tolerances() -> None:
    """`hlomap run`'s check holds a step to its precision: its dots' operand dtypes decide."""
    assert tolerances_for(api._dot_operand_dtypes(_capture("gpt-tiny").module)) is FLOAT32
    assert tolerances_for(api._dot_operand_dtypes(_capture("gpt-tiny:bfloat16").module)) is HALF_PRECISION
    # a sign the update check trusts is one no allowed gradient difference can flip
    assert HALF_PRECISION.noise > HALF_PRECISION.gradient > FLOAT32.gradient


@pytest.mark.slow  # about 30 s: the unsharded and sharded steps, the update, a timed step
def test_check_run_finds_a_dp_plan_of_the_bf16_step_equal_to_the_unsharded_step() -> None:
    checked = api.check_run(_dp_plan(_capture("gpt-tiny:bfloat16")), "zoo:gpt-tiny:bfloat16")
    assert checked.ok, checked.check
    assert "half precision" in (checked.note or "")
    gradients = next(c for c in checked.check.comparisons if c.what == "gradients")
    assert gradients.tolerance == HALF_PRECISION.gradient
    assert max(leaf.relative for leaf in gradients.leaves) > FLOAT32.gradient  # bf16 needed the wider tolerance
