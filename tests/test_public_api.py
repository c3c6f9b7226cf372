"""The names docs/design.md promises at the top level of `hlomap`, importable without JAX until used."""

from __future__ import annotations

import subprocess
import sys

import pytest

import hlomap


def test_public_names_resolve() -> None:
    for name in hlomap.__all__:
        assert getattr(hlomap, name) is not None, name
    assert callable(hlomap.explore) and callable(hlomap.capture) and callable(hlomap.estimate)
    assert hlomap.Plan.load is not None
    assert set(hlomap.__all__) <= set(dir(hlomap))  # tab completion shows the API


def test_import_does_not_load_jax() -> None:
    code = "import sys, hlomap; dir(hlomap); print('jax' in sys.modules)"  # listing the names loads nothing
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_explore_pipeline_task_returns_a_plan_with_stages(tmp_path) -> None:
    """`hlomap.explore(cap, task="pipeline")` as docs/design.md shows it: one stage per server of
    cluster A (2 servers) by default, the DP's cuts, parameters left replicated."""
    from hlomap.tasks.pipeline.explore import explore_pipeline

    from hlomap.api import load_source

    cap = load_source("zoo:gpt-tiny")
    out = tmp_path / "pipe.json"
    plan = hlomap.explore(cap, task="pipeline", cluster="A", agent="dp", output=out)
    assert plan.pipeline is not None and plan.pipeline.n_stages == 2
    assert all(all(s is None for s in p.spec) for p in plan.parameters)
    assert plan.search["task"] == "pipeline" and plan.search["driver"] == "dp"
    direct = explore_pipeline(cap, stages=2, cluster="A", agent="dp")
    assert plan.estimate["step_seconds"] == direct.latency
    assert hlomap.Plan.load(out).pipeline == plan.pipeline
    with pytest.raises(ValueError, match="pipeline task takes"):
        hlomap.explore(cap, task="pipeline", agent="greedy")


#: The stable names docs/design.md's "Public API" lists.
DESIGN_NAMES = ("capture", "explore", "estimate", "Plan", "parallelize", "auto_shard", "value_and_grad")


def test_every_name_design_promises_is_public() -> None:
    missing = [name for name in DESIGN_NAMES if name not in hlomap.__all__]
    assert not missing, f"docs/design.md promises hlomap.{missing}"
    for method in ("load", "from_specs", "partition_specs", "shardings", "save"):
        assert callable(getattr(hlomap.Plan, method)), method


def test_the_design_example_runs_end_to_end(tmp_path) -> None:
    """docs/design.md's Public API block, in order, on gpt-tiny and 8 CPU devices: capture, explore,
    save/load, partition_specs shaped like the arguments, the user's own specs, estimate, and
    parallelize with place: the sharded step's loss equals the unsharded step's."""
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from hlomap import zoo

    model = zoo.get("gpt-tiny")
    step, args = model.train_step(), model.example_args(0)
    cap = hlomap.capture(step, *args, arg_names=model.arg_names)
    plan = hlomap.explore(cap, task="opp", mesh={"model": 8}, cluster="A", agent="greedy", budget_seconds=20, seed=0)
    plan.save(tmp_path / "plan.json")
    loaded = hlomap.Plan.load(tmp_path / "plan.json")
    assert loaded.parameters == plan.parameters and loaded.mesh == plan.mesh

    specs = plan.partition_specs()
    assert jax.tree_util.tree_structure(specs, is_leaf=lambda x: isinstance(x, P)) == \
        jax.tree_util.tree_structure(tuple(args))
    assert any(any(axis is not None for axis in spec) for spec in jax.tree_util.tree_leaves(
        specs, is_leaf=lambda x: isinstance(x, P)))
    mine = hlomap.Plan.from_specs(cap, specs, mesh={"model": 8})
    assert [p.spec for p in mine.parameters] == [p.spec for p in plan.parameters]

    est = hlomap.estimate(cap, plan, cluster="A")
    assert est.step_seconds > 0 and hlomap.estimate(cap, "dp", cluster="A").step_seconds > 0

    parallel = hlomap.parallelize(step, plan)
    params, opt_state = parallel.place(args[0], args[1])
    _, _, loss = parallel(params, opt_state, *args[2:])
    _, _, want = jax.jit(step)(*args)
    np.testing.assert_allclose(np.asarray(loss), np.asarray(want), rtol=1e-5)
