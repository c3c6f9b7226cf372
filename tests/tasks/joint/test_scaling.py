"""Every data width of a stage option priced from three estimates (`tasks.joint.scaling`) equals
the full estimate at that width: compute, collectives, gradient sync, parameter, stash and
crossing bytes, on a datasheet cluster and on a measured one."""

from __future__ import annotations

import numpy as np
import pytest

from hlomap.cost.cluster import hierarchical, load_cluster
from hlomap.tasks.joint.costs import JointModel, PlanKind, StageOption

FIELDS = ("compute", "alpha", "beta", "update", "grads", "params", "stash", "crossing", "buffers", "forward", "inputs")


def _model(cap, cluster, layers: int = 5) -> JointModel:
    probe = JointModel.build(cap, cluster, ())
    n = probe.attribution.length
    pivots = tuple(round(k * n / layers) - 1 for k in range(1, layers))
    return JointModel.build(cap, cluster, pivots, graph=probe.graph)


@pytest.fixture(scope="module")
def wide_batch():  # type: ignore[no-untyped-def]
    """gpt-tiny with a batch of 64: data widths up to 64 split it, beyond the three fitted ones."""
    import dataclasses

    from hlomap import zoo
    from hlomap.hlo.capture import capture

    tiny = zoo.get("gpt-tiny")
    model = dataclasses.replace(tiny, config=dataclasses.replace(tiny.config, batch_size=64))
    return capture(model.train_step(), *model.abstract_args())


def _full(model: JointModel, option: StageOption):  # type: ignore[no-untyped-def]
    plan, axes = model.plan_for(option)
    return model._arrays_of(option, plan, axes, model._work(option, plan, axes))


def _same(fast, full) -> None:  # type: ignore[no-untyped-def]
    for name in FIELDS:
        np.testing.assert_allclose(getattr(fast, name), getattr(full, name), rtol=1e-9, atol=1e-18, err_msg=name)
    assert fast.sync_alpha == pytest.approx(full.sync_alpha, rel=1e-12)
    assert fast.sync_beta == pytest.approx(full.sync_beta, rel=1e-12)
    assert np.array_equal(fast.plan, full.plan)


@pytest.mark.parametrize("model_width", [1, 2, 4])
def test_every_data_width_equals_its_full_estimate(wide_batch, model_width: int) -> None:
    model = _model(wide_batch, hierarchical(8, 8, "V100-16GB"))
    assert model.batch == 64
    widths = [d for d in (2, 4, 8, 16, 32) if d * model_width <= 64]
    assert len(widths) >= 4
    options = [StageOption(d * model_width, d, model_width, PlanKind.EXPERT) for d in widths]
    full = [_full(model, o) for o in options]
    assert model._family(options[0]) is not None
    model._work = None  # type: ignore[assignment]  # every width must now come from the fitted family
    for option, expected in zip(options, full):
        _same(model.arrays(option), expected)


def test_a_measured_cluster_s_widths_equal_their_full_estimates(cap_of) -> None:
    """Kernel launches, dispatch-free stage work and the shared-core speedup of a calibrated
    cluster of 8 CPU devices: the fitted family still reproduces each width."""
    from tests.local_cluster import LOCAL_CLUSTER_FILE

    cap = cap_of("gpt-tiny")
    model = _model(cap, load_cluster(str(LOCAL_CLUSTER_FILE)))
    assert model.cluster.measured is not None
    for d in (2, 4, 8):
        option = StageOption(d, d, 1)
        _same(model.arrays(option), _full(model, option))


def test_a_family_is_not_fitted_where_the_cluster_is_too_small(cap_of) -> None:
    cap = cap_of("gpt-tiny")
    model = _model(cap, hierarchical(1, 8, "V100-16GB"))
    assert model._family(StageOption(4, 2, 2)) is None  # 8 x 2 devices needed to fit it
    option = StageOption(8, 4, 2)
    _same(model.arrays(option), _full(model, option))


def test_the_megatron_part_kept_per_model_width_is_the_plan_at_every_data_width(wide_batch) -> None:
    """`JointModel` keeps one Megatron plan per model width; computed afresh for each mesh it is
    the same array, data widths that divide the batch or not."""
    from hlomap.propagation.conflicts import MeshAxes
    from hlomap.propagation.plans import combine, data_parallel_plan, megatron_plan

    model = _model(wide_batch, hierarchical(16, 8, "V100-16GB"))
    for model_width in (2, 4, 8):
        for data in (2, 3, 4, 6, 8, 16):
            plan, axes = model.plan_for(StageOption(data * model_width, data, model_width, PlanKind.EXPERT))
            fresh = MeshAxes.from_mesh({"data": data, "model": model_width})
            expected = combine(data_parallel_plan(model.graph, "data", fresh),
                               megatron_plan(model.graph, "model", fresh))
            assert np.array_equal(plan, expected), (data, model_width)
            assert (plan == axes.index("model")).any()
