"""The two plans of the multi-host test, run the same way in one process and in two."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

import hlomap
from hlomap.plan import Plan, reference_plan
from hlomap.propagation.graph import FactorGraph
from tests.run.helpers import FAST_COMPILE, boundary_pivots, chain_of, pipeline_plan
from tests.run.user_step import make


def plans() -> tuple[Any, Any, Any, tuple[Any, ...]]:
    """(hybrid SPMD plan on data=2 x model=4, 2-stage GPipe plan with data=4 inside each stage,
    the step, its arguments)."""
    step, args = make()
    cap = hlomap.capture(step, *args)
    graph = FactorGraph.from_capture(cap)
    array, axes = reference_plan(graph, "dp+megatron", {"data": 2, "model": 4})
    hybrid = Plan.from_groups(cap, graph, array, axes)
    chain = chain_of(cap)
    pipeline = pipeline_plan(cap, chain, boundary_pivots(chain, 1), microbatches=4, devices_per_stage=4)
    return hybrid, pipeline, step, args


def run_both() -> dict[str, np.ndarray]:
    """Loss and updated parameters of one step under each plan, gradients of the pipeline."""
    hybrid, pipeline, step, args = plans()
    out: dict[str, np.ndarray] = {}
    spmd = hlomap.parallelize(step, hybrid, compiler_options=FAST_COMPILE)
    params, opt_state, loss = spmd(*spmd.place(args[0], args[1]), args[2])
    new_params, _ = spmd.gather(params, opt_state)
    out["hybrid_loss"] = np.asarray(jax.device_get(loss.addressable_data(0)))
    for name, value in new_params.items():
        out[f"hybrid_{name}"] = np.asarray(value)
    runner = hlomap.parallelize(step, pipeline, executor="spmd", example_args=args, compiler_options=FAST_COMPILE)
    if jax.process_count() > 1:  # the axes the test is about do span the processes
        data = spmd._spmd.mesh.devices  # [data, model]
        assert data[0, 0].process_index != data[1, 0].process_index
        stages = runner._runner.mesh.devices  # [stage, data]
        assert stages[0, 0].process_index != stages[1, 0].process_index
    loss, _, grads = runner.value_and_grad(*args)
    out["pipeline_grad_loss"] = np.asarray(loss)
    for k, g in enumerate(grads):
        out[f"pipeline_grad_{k}"] = np.asarray(g)
    params, opt_state, loss = runner(*runner.place(args[0], args[1]), args[2])
    new_params, _ = runner.gather(params, opt_state)
    out["pipeline_loss"] = np.asarray(jax.device_get(loss.addressable_data(0)))
    for name, value in new_params.items():
        out[f"pipeline_{name}"] = np.asarray(value)
    return out
