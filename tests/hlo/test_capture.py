"""Capture from jax.jit: parameter order, paths, roles, phases, and no allocation."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hlomap.hlo.capture import Phase, Role, capture, from_module, instruction_phase

OPT = optax.adam(1e-3)


def _loss(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(_loss)(params, batch)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _abstract():
    params = {"w1": jax.ShapeDtypeStruct((16, 32), jnp.float32), "w2": jax.ShapeDtypeStruct((32, 4), jnp.float32)}
    opt_state = jax.eval_shape(OPT.init, params)
    batch = {"x": jax.ShapeDtypeStruct((8, 16), jnp.float32), "y": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
    return params, opt_state, batch


def test_parameters_follow_flatten_order_with_paths_and_roles():
    args = _abstract()
    cap = capture(train_step, *args)
    flat = jax.tree_util.tree_leaves(args)
    assert len(cap.parameters) == len(flat) == len(cap.module.entry.parameters)
    for param, leaf in zip(cap.parameters, flat):
        assert param.shape.dims == tuple(leaf.shape)
    by_path = {p.path: p.role for p in cap.parameters}
    assert by_path["params/w1"] is Role.TRAINABLE
    assert by_path["params/w2"] is Role.TRAINABLE
    assert by_path["opt_state/0/mu/w1"] is Role.OPTIMIZER_STATE
    assert by_path["opt_state/0/nu/w2"] is Role.OPTIMIZER_STATE
    assert by_path["opt_state/0/count"] is Role.OTHER  # the integer step counter
    assert by_path["batch/x"] is Role.DATA
    assert [p.path for p in cap.trainable] == ["params/w1", "params/w2"]


def test_optimizer_state_found_by_type_even_under_an_unknown_argument_name():
    def step(a, b, c):
        return train_step(a, b, c)

    cap = capture(step, *_abstract())
    roles = {p.path: p.role for p in cap.parameters}
    assert roles["b/0/mu/w1"] is Role.OPTIMIZER_STATE
    assert roles["a/w1"] is Role.TRAINABLE  # first argument, floating point
    assert roles["c/x"] is Role.DATA


def test_role_overrides_by_prefix_and_by_function():
    cap = capture(train_step, *_abstract(), roles={"params/w2": Role.OTHER, "batch": Role.OTHER})
    roles = {p.path: p.role for p in cap.parameters}
    assert roles["params/w2"] is Role.OTHER and roles["params/w1"] is Role.TRAINABLE
    assert roles["batch/x"] is Role.OTHER
    cap = capture(train_step, *_abstract(), roles=lambda path, leaf: Role.DATA if path.endswith("w1") else None)
    roles = {p.path: p.role for p in cap.parameters}
    assert roles["params/w1"] is Role.DATA and roles["opt_state/0/mu/w1"] is Role.DATA
    assert roles["params/w2"] is Role.TRAINABLE


@pytest.mark.parametrize("roles, error, message", [
    ({"bogus": Role.OTHER}, ValueError, "roles key 'bogus' matches no argument path (paths start with batch, "
                                        "opt_state, params"),
    ({"batch": "weights"}, TypeError, "roles['batch'] is 'weights'; expected a hlomap.Role"),
    ({3: Role.OTHER}, ValueError, "roles key 3: the step takes 3 arguments"),
])
def test_role_overrides_that_name_nothing_are_refused(roles, error, message):
    """A misspelt path was ignored, and a role that is not a Role failed much later."""
    with pytest.raises(error, match=re.escape(f"capture: {message}")):
        capture(train_step, *_abstract(), roles=roles)


def test_an_argument_jax_cannot_trace_is_named():
    def step(params, opt_state, batch, mode):
        return train_step(params, opt_state, batch)

    with pytest.raises(TypeError, match=re.escape("capture: argument [3] (mode) is a str, not an array or a number")):
        capture(step, *_abstract(), "train")
    capture(step, *_abstract(), 0.5)  # a number is traced as a scalar


def test_phases_come_from_jax_metadata():
    cap = capture(train_step, *_abstract())
    phases = {}
    for _, inst in cap.module.instructions():
        phases.setdefault(instruction_phase(inst), []).append(inst)
    dots_by_phase = {ph: sum(i.opcode == "dot" for i in insts) for ph, insts in phases.items()}
    # two forward matmuls; the backward pass has the weight and activation gradients (three dots:
    # dW2, dH, dW1 - the input gradient of the first layer is never needed).
    assert dots_by_phase[Phase.FORWARD] == 2
    assert dots_by_phase[Phase.BACKWARD] == 3
    assert all(i.is_backward for i in phases[Phase.BACKWARD])
    assert not any(i.is_backward for i in phases[Phase.FORWARD])


def test_real_arrays_are_accepted_and_not_needed(monkeypatch):
    params = {"w1": jnp.ones((16, 32)), "w2": jnp.ones((32, 4))}
    batch = {"x": jnp.ones((8, 16)), "y": jnp.ones((8, 4))}
    cap = capture(train_step, params, OPT.init(params), batch)
    assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree_util.tree_leaves(cap.args))


def test_abstract_capture_allocates_nothing():
    """A 4 GiB weight captured abstractly must not allocate device memory."""
    big = {"w1": jax.ShapeDtypeStruct((32768, 32768), jnp.float32), "w2": jax.ShapeDtypeStruct((32768, 4), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((8, 32768), jnp.float32), "y": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
    device = jax.devices()[0]
    before = sum(np.prod(a.shape) for a in jax.live_arrays())
    cap = capture(train_step, big, jax.eval_shape(OPT.init, big), batch)
    after = sum(np.prod(a.shape) for a in jax.live_arrays())
    assert after - before < 1_000_000, device
    assert cap.parameter("params/w1").byte_size == 32768 * 32768 * 4


def test_bare_module_roles_are_unknown_until_named():
    cap = capture(train_step, *_abstract())
    bare = from_module(cap.module)
    assert not bare.has_roles
    named = from_module(cap.module, trainable=[0, 1])
    assert [p.index for p in named.trainable] == [0, 1]
    # the other non-scalar parameters become data candidates (Auto-MAP's ADP candidates), except
    # the optimizer's moments, which JAX's metadata names as opt_state: splitting them as data
    # was the nonsense ADP plan a user saw on a dump
    assert {p.index for p in named.with_role(Role.DATA)} == {7, 8}
    assert {p.index for p in named.with_role(Role.OPTIMIZER_STATE)} == {3, 4, 5, 6}
    with pytest.raises(ValueError, match="unknown entry parameter"):
        from_module(cap.module, trainable=[42])


def test_zoo_source_marks_batch_norm_statistics_as_other():
    from hlomap import zoo
    from hlomap.api import load_source

    cap = load_source("zoo:resnet50-tiny")
    stats = {f"params/{p}" for p in zoo.get("resnet50-tiny").other_paths()}
    assert stats, "resnet50-tiny should carry batch-norm statistics"
    roles = {p.path: p.role for p in cap.parameters}
    assert all(roles[path] is Role.OTHER for path in stats)
    trainable = {p.path for p in cap.trainable}
    assert trainable and not trainable & stats
    # Adam keeps one mu and one nu per trainable leaf, and none for the statistics
    assert len(cap.with_role(Role.OPTIMIZER_STATE)) == 2 * len(trainable)


def test_fingerprint_ignores_where_the_step_was_traced_from() -> None:
    from hlomap.hlo.capture import module_fingerprint

    body = 'ENTRY main {\n  ROOT p = f32[2]{0} parameter(0), metadata={op_name="x" source_file="/a.py" source_line=3}\n}\n'
    here = 'HloModule m\n\nFileNames\n1 "/a.py"\n\nStackFrames\n1 1 0\n\n' + body
    there = 'HloModule m\n\nFileNames\n1 "/elsewhere/b.py"\n\nStackFrames\n1 1 0\n2 1 1\n\n' + body.replace(
        'source_file="/a.py" source_line=3', 'source_file="/b.py" source_line=99')
    assert module_fingerprint(here) == module_fingerprint(there)
    assert module_fingerprint(here) != module_fingerprint(here.replace("f32[2]", "f32[3]"))


def test_the_captured_program_computes_the_step_without_tracing_the_model_again():
    traced = []

    def counted(params, opt_state, batch):
        traced.append(1)
        return train_step(params, opt_state, batch)

    cap = capture(counted, *_abstract())
    keys = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(keys[0], (16, 32)), "w2": jax.random.normal(keys[1], (32, 4))}
    batch = {"x": jax.random.normal(keys[2], (8, 16)), "y": jax.random.normal(keys[3], (8, 4))}
    args = (params, OPT.init(params), batch)
    program = cap.program()
    got = jax.jit(program)(*args)
    assert len(traced) == 1  # the capture's trace only
    want = jax.jit(train_step)(*args)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="structure"):
        program(params, batch)
    dump = from_module(cap.module, trainable=[0, 1])
    with pytest.raises(ValueError, match="not captured from JAX"):
        dump.program()
