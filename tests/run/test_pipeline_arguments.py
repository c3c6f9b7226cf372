"""A pipeline step called with arguments other than those it was cut for: refused by name on
every call, on both executors, not run on the wrong leaves or failing deep inside."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

import hlomap
from hlomap.run.errors import RunError
from tests.run.helpers import boundary_pivots, chain_of, pipeline_plan
from tests.run.user_step import make

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@pytest.fixture(scope="module")
def user_plan() -> tuple[Any, tuple[Any, ...], Any]:
    step, args = make()
    cap = hlomap.capture(step, *args)
    chain = chain_of(cap)
    plan = pipeline_plan(cap, chain, boundary_pivots(chain, 1), microbatches=2, schedule="gpipe", devices_per_stage=1)
    return step, args, plan


@pytest.mark.parametrize("executor", ["spmd", "mpmd"])
def test_a_pipeline_step_names_the_argument_it_was_not_cut_for(user_plan: tuple[Any, ...], executor: str) -> None:
    train_step, args, plan = user_plan
    step = hlomap.parallelize(train_step, plan, executor=executor, compiler_options=FAST_COMPILE)
    params, opt_state = step.place(args[0], args[1])
    batch = args[2]
    params, opt_state, loss = step(params, opt_state, batch)  # a good call first: the programs are built
    cases = [
        ({"x": batch["x"]}, "the arguments after the state are PyTreeDef(({'x': *},)), but the pipeline was cut "
                            "for PyTreeDef(({'x': *, 'y': *},))"),
        ({"a": batch["x"], "b": batch["y"]}, "the arguments after the state are PyTreeDef(({'a': *, 'b': *},))"),
        ({"x": batch["x"], "y": np.asarray(batch["y"], np.float16)},
         "argument [2]['y'] is float16, but the pipeline was cut for float32 there"),
        ({"x": batch["x"][:, :8], "y": batch["y"]}, "argument [2]['x'] is shaped [16, 8], but the pipeline was cut "
                                                    "for [16, 32] there"),
        ({"x": batch["x"][:8], "y": batch["y"][:8]}, "the pipeline was cut for batches of 16 examples"),
    ]
    for wrong, message in cases:
        with pytest.raises(RunError, match=re.escape(message)):
            step(params, opt_state, wrong)
    with pytest.raises(RunError, match=re.escape("the arguments after the state are")):
        step(params, opt_state, batch, 3)
    with pytest.raises(RunError, match=re.escape("the step was cut for state of 6 leaves; it was given a tuple of 2 "
                                                 "items of 13 leaves: were params and opt_state given in this order?")):
        step.place(opt_state, params)
    again = step(params, opt_state, batch)  # the refused calls consumed nothing
    assert np.isfinite(float(again[2])) and float(again[2]) < float(loss)
