"""The names DESIGN.md promises at the top level of `hlomap`, importable without JAX until used."""

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


def test_import_does_not_load_jax() -> None:
    code = "import sys, hlomap; print('jax' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_explore_pipeline_task_returns_a_plan_with_stages(tmp_path) -> None:
    """`hlomap.explore(cap, task="pipeline")` as DESIGN.md shows it: one stage per server of
    cluster A (2 servers) by default, the DP's cuts, parameters left replicated."""
    from hlomap.tasks.pipeline.explore import explore_pipeline

    from hlomap.api import load_source

    cap = load_source("zoo:gpt-tiny")
    out = tmp_path / "pipe.json"
    plan = hlomap.explore(cap, task="pipeline", cluster="A", agent="dp", output=out)
    assert plan.pipeline is not None and len(plan.pipeline["stages"]) == 2
    assert all(all(s is None for s in p.spec) for p in plan.parameters)
    assert plan.search["task"] == "pipeline" and plan.search["driver"] == "dp"
    direct = explore_pipeline(cap, stages=2, cluster="A", agent="dp")
    assert plan.estimate["step_seconds"] == direct.latency
    assert hlomap.Plan.load(out).pipeline["cuts"] == plan.pipeline["cuts"]
    with pytest.raises(ValueError, match="pipeline task takes"):
        hlomap.explore(cap, task="pipeline", agent="greedy")
