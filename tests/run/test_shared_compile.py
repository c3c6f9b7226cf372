"""Stages with identical programs share one compiled executable: the second stage loads the
first one's executable for its own devices, runs there with the same results, and a program
that differs in its shapes, or a mesh of another shape, is compiled anew."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hlomap.run.pipeline.shared_compile import ExecutableCache, SharedProgram


def _layer(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.tanh(x @ w)


def _on(mesh: Mesh, x: np.ndarray, w: np.ndarray) -> tuple[jax.Array, jax.Array]:
    return jax.device_put(x, NamedSharding(mesh, P("data"))), jax.device_put(w, NamedSharding(mesh, P()))


def test_identical_stage_programs_compile_once_and_run_on_each_stages_devices() -> None:
    devices = jax.devices()
    meshes = [Mesh(np.array(devices[k:k + 2]), ("data",)) for k in (0, 2, 4)]
    cache = ExecutableCache()
    programs = [SharedProgram(jax.jit(_layer), mesh, cache) for mesh in meshes]
    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 100
    w = np.ones((16, 16), np.float32) / 16
    for mesh, program in zip(meshes, programs):
        out = program(*_on(mesh, x, w))
        assert out.sharding.device_set == set(mesh.devices.flat)
        np.testing.assert_allclose(np.asarray(out), np.tanh(x @ w), rtol=1e-6)
    assert (cache.compiled, cache.loaded) == (1, 2)
    wider = programs[1](*_on(meshes[1], np.ones((8, 32), np.float32), np.ones((32, 16), np.float32)))  # other shapes
    assert wider.shape == (8, 16) and (cache.compiled, cache.loaded) == (2, 2)
    four = Mesh(np.array(devices[4:8]), ("data",))  # a mesh of another shape: compiled for it
    SharedProgram(jax.jit(_layer), four, cache)(*_on(four, x, w))
    assert cache.compiled == 3


def test_a_loaded_program_keeps_its_donation() -> None:
    devices = jax.devices()
    meshes = [Mesh(np.array(devices[k:k + 2]), ("data",)) for k in (0, 2)]
    cache = ExecutableCache()
    for mesh in meshes:
        x = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P("data")))
        out = SharedProgram(jax.jit(lambda a: a * 2, donate_argnums=0), mesh, cache)(x)
        assert x.is_deleted() and float(out.sum()) == 64.0
    assert cache.loaded == 1


def test_a_decoders_identical_middle_stages_share_executables_and_compute_the_plain_gradients() -> None:
    """4 decoder layers on 4 stages (1F1B, M = 2): the middle stages run the same layer, so their
    programs load the first one's executable; loss and gradients equal the unsharded step's."""
    from dataclasses import replace

    import hlomap
    from hlomap import zoo
    from hlomap.run.compare import check_pipeline
    from tests.run.helpers import FAST_COMPILE, boundary_pivots, chain_of, pipeline_plan

    tiny = zoo.get("gpt-tiny")
    model = replace(tiny, config=replace(tiny.config, num_layers=4, batch_size=8))
    args = model.example_args(seed=0)
    cap = hlomap.capture(model.train_step(), *model.abstract_args())
    chain = chain_of(cap)
    plan = pipeline_plan(cap, chain, boundary_pivots(chain, 3), microbatches=2, schedule="1f1b", devices_per_stage=2)
    step = hlomap.parallelize(model.train_step(), plan, executor="mpmd", compiler_options=FAST_COMPILE)
    check = check_pipeline(step, args)
    assert check.exact, "\n".join(c.words() for c in check.comparisons)  # float32 agrees, no float64 rescue
    assert step._runner.executables.loaded > 0


def test_a_program_called_with_two_structures_keeps_an_executable_for_each() -> None:
    """A pipeline's gradient accumulator sums parameter tuples and auxiliary tuples in turn: after
    one call with each, neither lowers again (lowering every call made a 4-stage gpt-tiny step
    take 1.7x as long)."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    program = SharedProgram(jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b)), mesh, ExecutableCache())
    pair = (jnp.ones(4), jnp.ones(4))
    single = (jnp.ones(3),)
    for _ in range(3):
        program(pair, pair)
        out = program(single, single)
    assert program.lowerings == 2
    np.testing.assert_allclose(np.asarray(out[0]), 2 * np.ones(3))
