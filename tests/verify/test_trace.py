"""Kernel times from JAX's profiler trace of an XLA:CPU program."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hlomap.verify.trace import is_matrix_kernel, kernel_times, profile_kernels, read_trace_events


def test_kernel_events_are_summed_per_name_and_runtime_events_left_out(tmp_path: Path) -> None:
    run = tmp_path / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    events = [
        {"ph": "X", "name": "dot.52", "dur": 30.0}, {"ph": "X", "name": "dot.52", "dur": 10.0},
        {"ph": "X", "name": "multiply_add_fusion.11", "dur": 20.0},
        {"ph": "X", "name": "ThunkExecutor::Execute", "dur": 500.0},
        {"ph": "X", "name": "Wait for usage holds", "dur": 7.0},
        {"ph": "X", "name": "$api.py:2479 block_until_ready", "dur": 9.0},
        {"ph": "X", "name": "ParseArguments", "dur": 3.0},
        {"ph": "X", "name": "end: dot.52", "dur": 1.0},
        {"ph": "i", "name": "dot.53", "dur": 99.0},  # not a complete event
    ]
    with gzip.open(run / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    rows = kernel_times(read_trace_events(tmp_path), per=2)
    assert [(r.name, r.calls) for r in rows] == [("dot.52", 1.0), ("multiply_add_fusion.11", 0.5)]
    assert [r.seconds for r in rows] == pytest.approx([20e-6, 10e-6], rel=1e-12)
    assert [r.matrix for r in rows] == [True, False]
    with pytest.raises(FileNotFoundError, match="no \\*.trace.json.gz"):
        read_trace_events(tmp_path / "nothing")


@pytest.mark.parametrize("name, matrix", [("dot.52", True), ("ynn_fusion.5", True), ("convolution.54", True),
                                          ("conv_general_dilated.158", True), ("convolution-base-dilated.6", True),
                                          ("multiply_add_fusion.11", False), ("copy_bitcast_fusion.26", False),
                                          ("wrapped_reduce-window.1", False), ("transpose.3", False),
                                          ("dot", True), ("dot_general.67", True), ("convert.5", False),
                                          ("convert_element_type_fusion.3", False), ("dotted_fusion.1", False)])
def test_matrix_kernels_are_named_by_their_product(name: str, matrix: bool) -> None:
    assert is_matrix_kernel(name) is matrix


def test_a_real_program_shows_its_dot_and_its_elementwise_kernel() -> None:
    """A jitted matmul followed by tanh on one host device: the trace holds a matrix kernel and
    another, each called once per step, and their time fits inside the step's wall time."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((256, 256)), jnp.float32)
    f = jax.jit(lambda x: jnp.tanh(x @ x) * 2.0)
    profiled = profile_kernels(lambda: f(a).block_until_ready(), steps=3)
    assert profiled.matrix_seconds > 0 and profiled.kernel_seconds > profiled.matrix_seconds
    assert all(k.calls == pytest.approx(1.0) for k in profiled.kernels)
    assert 0 < profiled.kernel_seconds <= profiled.wall_seconds
