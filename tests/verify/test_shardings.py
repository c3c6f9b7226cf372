"""Acceptance against XLA: compile plans on 8 CPU devices, compare XLA's propagated shardings
with the factor graph's, and run the sharded step against the unsharded one.

The default tests compile one plan (Megatron for the zoo GPT on a 1-D mesh of 8); the full
matrix (5 models x {1x8, 2x4} x {DP, Megatron, DP x Megatron, 20 random plans}) is `slow`.
`python scripts/reproduce_propagation.py gpt-tiny bert-tiny ...` prints the same table.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from hlomap.plan import Plan
from hlomap.propagation import MeshAxes, data_parallel_plan, megatron_plan
from hlomap.verify.shardings import (
    ShardingCategory,
    Verdict,
    check_plan_shardings,
    compare_module,
    spec_coordinates,
    tile_coordinates,
)
from scripts.reproduce_propagation import acceptance_rows, format_rows


def test_tile_coordinates_of_hlo_sharding_text():
    # [2,4] mesh, model axis major in the tile assignment: T(1,0) transposes the iota
    coords = tile_coordinates("{devices=[1,4,2]<=[2,4]T(1,0) last_tile_dim_replicate}", 2, 8)
    mesh = np.arange(8).reshape(2, 4)
    assert np.array_equal(coords, spec_coordinates([None, ("model",)], ("data", "model"), mesh))
    assert np.array_equal(tile_coordinates("{replicated}", 3, 8), np.zeros((8, 3), dtype=np.int64))
    assert np.array_equal(tile_coordinates("{devices=[2,1]0,1}", 2, 2), [[0, 0], [1, 0]])
    assert tile_coordinates("{maximal device=0}", 1, 8) is None
    both = spec_coordinates([("data", "model")], ("data", "model"), mesh)
    assert np.array_equal(both[:, 0], np.arange(8))


@pytest.fixture(scope="module")
def gpt_megatron(zoo_capture, zoo_graph, tmp_path_factory):
    from hlomap import zoo

    cap, graph = zoo_capture("gpt-tiny"), zoo_graph("gpt-tiny")
    axes = MeshAxes.from_mesh({"model": 8})
    plan = Plan.from_groups(cap, graph, megatron_plan(graph, "model", axes), axes)
    mesh = jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    example = zoo.get("gpt-tiny").example_args(seed=0)
    reference = jax.jit(cap.step)(*example)
    workdir = str(tmp_path_factory.mktemp("xla_gpt_megatron"))
    report, numerics = check_plan_shardings(cap, plan, mesh, workdir, example_args=example, reference=reference,
                                            graph=graph)
    return cap, graph, plan, mesh, workdir, report, numerics


def test_gpt_megatron_matches_xla_propagation(gpt_megatron):
    _, _, _, _, _, report, _ = gpt_megatron
    assert report.agreement(ShardingCategory.PARAMETER) == 1.0
    assert report.agreement(ShardingCategory.OUTPUT) == 1.0
    # our derivation on the captured module (not XLA's) gives XLA's output shardings too
    assert len(report.of(ShardingCategory.CAPTURED_OUTPUT)) > 100
    assert report.agreement(ShardingCategory.CAPTURED_OUTPUT) == 1.0
    # the results of the step's nested jits (`jnp.where`, `one_hot`, `log_softmax`), derived on
    # the captured module through its `call`s, against what XLA made of them after inlining
    _check_call_outputs(report, least=8)
    intermediates = report.of(ShardingCategory.INTERMEDIATE)
    assert len(intermediates) > 500
    assert report.agreement(ShardingCategory.INTERMEDIATE) >= 0.95, report.kinds().most_common(10)
    # the comparison is not vacuous: many intermediates are sharded, by us and by XLA
    sharded = [c for c in intermediates if any(s is not None for s in c.ours) and c.verdict is Verdict.MATCH]
    assert len(sharded) > 200


def _check_call_outputs(report, least: int) -> None:
    """XLA shards every compared call result as we derive it, bar those built from constants
    alone (free to materialize in any sharding; XLA shards such a broadcast like its user), and
    the comparison is not vacuous: at least `least` of them are split."""
    calls = report.of(ShardingCategory.CALL_OUTPUT, include_free=False)
    assert report.agreement(ShardingCategory.CALL_OUTPUT, include_free=False) == 1.0, [
        c for c in calls if c.verdict is not Verdict.MATCH]
    assert sum(any(s is not None for s in c.ours) for c in calls) >= least, calls


def test_gpt_data_parallel_call_outputs_match_xla(zoo_capture, zoo_graph, tmp_path):
    """The data-parallel plan of the zoo GPT splits the results of its nested jits over the
    batch as XLA does (they were left whole, and counted at the full batch, before calls were
    followed); a `call` result built from constants alone is free, as the cost model reads it."""
    cap, graph = zoo_capture("gpt-tiny"), zoo_graph("gpt-tiny")
    axes = MeshAxes.from_mesh({"data": 8})
    plan = Plan.from_groups(cap, graph, data_parallel_plan(graph, "data", axes), axes)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    report, _ = check_plan_shardings(cap, plan, mesh, str(tmp_path), graph=graph)
    _check_call_outputs(report, least=10)
    free = [c for c in report.of(ShardingCategory.CALL_OUTPUT) if c.free]
    assert free and all("broadcast_in_dim" in (c.op_name or "") for c in free)


def test_comparison_detects_a_different_plan(gpt_megatron, zoo_graph):
    """Comparing XLA's Megatron shardings with the data-parallel plan's must disagree a lot."""
    import glob
    import os

    from hlomap.hlo.parser import parse
    from hlomap.propagation import data_parallel_plan

    cap, graph, _, mesh, workdir, _, _ = gpt_megatron
    axes = MeshAxes.from_mesh({"model": 8})
    other = Plan.from_groups(cap, graph, data_parallel_plan(graph, "model", axes), axes)
    path = sorted(glob.glob(os.path.join(workdir, "*before_spmd-partitioning*")))[-1]
    with open(path) as f:
        module = parse(f.read())
    report = compare_module(module, [p.spec for p in other.parameters], ("model",), np.asarray(mesh.device_ids))
    assert report.agreement(ShardingCategory.PARAMETER) < 0.6
    assert report.agreement(ShardingCategory.INTERMEDIATE) < 0.6


def test_gpt_megatron_sharded_step_equals_unsharded(gpt_megatron):
    *_, numerics = gpt_megatron
    assert numerics is not None and numerics.leaves > 100
    assert numerics.ok, numerics.failing


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt-tiny", "bert-tiny", "t5-tiny", "vgg19-tiny", "moe-tiny"])
def test_acceptance_matrix(model, tmp_path, capsys):
    rows = acceptance_rows(model, str(tmp_path), random_per_mesh=10)
    with capsys.disabled():
        print("\n" + format_rows(rows))
    assert len(rows) == 2 + 3 + 20
    for row in rows:
        assert row.parameters == 1.0, row
        assert row.outputs == 1.0, row
        assert row.captured_outputs == 1.0, row
        assert row.call_outputs == 1.0, row
        assert row.intermediates >= 0.95, row
        # strict allclose, except isolated elements of Adam's first update where the gradient is
        # of the order of Adam's eps (see OutputComparison.isolated_only; reported in the table)
        assert row.numerics is not None and (row.numerics.ok or row.numerics.isolated_only), row
    # every reference plan shards something
    assert all(r.groups_sharded > 0 for r in rows if not r.plan.startswith("random"))
