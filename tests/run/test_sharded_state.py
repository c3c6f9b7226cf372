"""Optimizer state split over the data replicas (ZeRO-1, `Plan.with_sharded_state`), and the
parameters with it (FSDP / ZeRO-3, `parameters=True`): the plan runs with the unsharded step's
loss, gradients and updates, its state stays split between steps, and what the cost model says it
saves and adds is what XLA compiles (`memory_analysis`, the compiled module's all-gathers)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

import hlomap
from hlomap.hlo.capture import Role
from hlomap.plan import Plan, PlanError, resolve_plan
from hlomap.propagation.graph import FactorGraph
from hlomap.run.compare import check_spmd
from hlomap.verify.xla import collective_totals, xla_reference
from hlomap.cost.collectives import Collective
from hlomap.cost.estimate import Reason
from hlomap.hlo.capture import Phase
from tests.run.helpers import FAST_COMPILE


def _plans(cap: Any, name: str, mesh: dict[str, int]) -> tuple[Plan, Plan, FactorGraph]:
    graph = FactorGraph.from_capture(cap)
    array, axes, _ = resolve_plan(graph, name, mesh)
    base = Plan.from_groups(cap, graph, array, axes)
    return base, base.with_sharded_state(graph), graph


def _step_checked(case: Any, plan: Plan) -> tuple[Any, Any]:
    """Run `plan` on the case's step after checking its loss, gradients and updates against the
    unsharded step's (`check_spmd`, float32 tolerances); the new params and optimizer state of
    one step."""
    step = hlomap.parallelize(case.model.train_step(), plan, example_args=case.args, compiler_options=FAST_COMPILE)
    check = check_spmd(step, case.args)
    assert check.exact, "\n".join(c.words() for c in check.comparisons)
    params, opt_state = step.place(case.args[0], case.args[1])
    new_params, new_state, _ = step(params, opt_state, *case.args[2:])
    return new_params, new_state


def test_dp_state_split_eight_ways_matches_xla(zoo_case) -> None:  # type: ignore[no-untyped-def]
    """haiku-mlp, data=8: every Adam moment is split 8 ways (the step count stays whole), the
    arguments XLA allocates are exactly the estimate's persistent bytes, the all-gathers of the
    updated parameters are the estimate's (kind and bytes), FLOPs and peak within 1%."""
    case = zoo_case("haiku-mlp")
    base, zero, graph = _plans(case.cap, "dp", {"data": 8})
    assert zero.state_sharding is not None and zero.state_sharding.axes == ("data",)
    moments = [p for p in case.cap.parameters if p.role is Role.OPTIMIZER_STATE and p.shape.dims]
    assert {index for index, _ in zero.state_sharding.dims} == {p.index for p in moments}

    est_base = hlomap.estimate(case.cap, base, cluster="A")
    est = hlomap.estimate(case.cap, zero, cluster="A")
    ref = xla_reference(case.cap, zero, graph)
    memory = est.memory
    assert memory.parameters + memory.optimizer + memory.inputs == ref.memory.argument_bytes
    saved = sum(p.shape.byte_size for p in moments) * 7 / 8
    assert est_base.memory.optimizer - memory.optimizer == pytest.approx(saved, abs=8)
    ours, theirs = collective_totals(est.collectives), ref.totals
    assert ours[Collective.ALL_GATHER].nbytes == theirs[Collective.ALL_GATHER].nbytes > 0
    assert ours[Collective.ALL_REDUCE].nbytes == theirs[Collective.ALL_REDUCE].nbytes
    assert est.flops == pytest.approx(ref.flops, rel=0.01)
    assert est.flops < est_base.flops  # each replica updates its slice only
    assert memory.total == pytest.approx(ref.memory.peak, rel=0.01)


def test_fsdp_eight_ways_matches_xla(zoo_case) -> None:  # type: ignore[no-untyped-def]
    """haiku-mlp, data=8, parameters stored split too (FSDP): every trainable parameter is listed
    beside its moments, XLA's arguments are the estimate's to the byte (the parameters at 1 / 8 on
    top of ZeRO-1's saving), the peak within 1%, the gradient sync unchanged, and the parameters are
    gathered before their use (forward) rather than after the update, within 5% of XLA's bytes
    (XLA also reshuffles 67 KB of backward activations, which the estimate does not price)."""
    case = zoo_case("haiku-mlp")
    _, zero, graph = _plans(case.cap, "dp", {"data": 8})
    fsdp = zero.with_sharded_state(graph, parameters=True)
    trainable = {p.index for p in case.cap.parameters if p.role is Role.TRAINABLE}
    assert trainable <= set(fsdp.state_sharding.dim_of) and not zero.state_sharding.splits_any(trainable)
    assert set(zero.state_sharding.dims) < set(fsdp.state_sharding.dims)

    est_zero = hlomap.estimate(case.cap, zero, cluster="A")
    est = hlomap.estimate(case.cap, fsdp, cluster="A")
    assert "(FSDP)" in est.plan and "(ZeRO-1)" in est_zero.plan
    ref = xla_reference(case.cap, fsdp, graph)
    memory = est.memory
    assert memory.parameters + memory.optimizer + memory.inputs == ref.memory.argument_bytes
    assert memory.optimizer == est_zero.memory.optimizer
    params = sum(p.shape.byte_size for p in case.cap.parameters if p.index in trainable)
    assert memory.parameters == pytest.approx(params / 8, abs=8)
    assert memory.total == pytest.approx(ref.memory.peak, rel=0.01)
    ours, theirs = collective_totals(est.collectives), ref.totals
    assert ours[Collective.ALL_REDUCE].nbytes == theirs[Collective.ALL_REDUCE].nbytes
    assert ours[Collective.ALL_GATHER].nbytes == pytest.approx(theirs[Collective.ALL_GATHER].nbytes, rel=0.05)
    gathers = [c for c in est.collectives if c.kind is Collective.ALL_GATHER]
    assert gathers and all(c.reason is Reason.SHARDED_PARAMETERS and c.phase is Phase.FORWARD for c in gathers)
    assert ours[Collective.ALL_GATHER].nbytes == collective_totals(est_zero.collectives)[Collective.ALL_GATHER].nbytes


def test_fsdp_plan_runs_with_the_unsharded_numerics_and_keeps_its_parameters_split(zoo_case) -> None:  # type: ignore[no-untyped-def]
    """gpt-tiny, data=2 x model=4 with FSDP over `data`: loss and gradients equal the unsharded
    step's; after a step every listed parameter still holds 1 / 2 of its (model-split) slice."""
    case = zoo_case("gpt-tiny")
    _, zero, graph = _plans(case.cap, "dp+megatron", {"data": 2, "model": 4})
    fsdp = zero.with_sharded_state(graph, parameters=True)
    new_params, _ = _step_checked(case, fsdp)
    split = fsdp.state_sharding.dim_of
    by_index = {p.index: p for p in fsdp.parameters}
    checked = 0
    for k, leaf in enumerate(jax.tree_util.tree_leaves(new_params)):
        if k in split:
            dim = split[k]
            own = by_index[k].spec[dim] if dim < len(by_index[k].spec) and by_index[k].spec[dim] else ()
            pieces = 2 * (4 if "model" in own else 1)
            assert leaf.addressable_shards[0].data.shape[dim] * pieces == leaf.shape[dim], by_index[k].path
            checked += 1
    assert checked == len([i for i in split if i < len(jax.tree_util.tree_leaves(new_params))]) > 0


def test_hybrid_state_split_over_data_only(zoo_case) -> None:  # type: ignore[no-untyped-def]
    """gpt-tiny, data=2 x model=4 (Megatron inside): the state is split over `data` on top of its
    `model` split, and XLA's arguments are the estimate's to the byte."""
    case = zoo_case("gpt-tiny")
    base, zero, graph = _plans(case.cap, "dp+megatron", {"data": 2, "model": 4})
    assert zero.state_sharding.axes == ("data",)
    split = zero.state_sharding.dim_of
    both = [p.path for p in zero.parameters if p.index in split
            and {"data", "model"} <= set(jax.tree_util.tree_leaves(tuple(zero.leaf_spec(p))))]
    assert both, "some moments are split over model (Megatron) and data (ZeRO) at once"
    est = hlomap.estimate(case.cap, zero, cluster="A")
    ref = xla_reference(case.cap, zero, graph)
    assert est.memory.parameters + est.memory.optimizer + est.memory.inputs == ref.memory.argument_bytes
    assert est.memory.total < hlomap.estimate(case.cap, base, cluster="A").memory.total


def test_zero_plan_runs_with_the_unsharded_numerics_and_keeps_its_state_split(zoo_case) -> None:  # type: ignore[no-untyped-def]
    """The loss, gradients and updated parameters equal the unsharded step's (`check_spmd`, float32
    tolerances, no float64 rescue); after a step the moments are still split over `data`."""
    case = zoo_case("haiku-mlp")
    _, zero, _ = _plans(case.cap, "dp", {"data": 8})
    _, new_state = _step_checked(case, zero)
    split = zero.state_sharding.dim_of
    offset = len(jax.tree_util.tree_leaves(case.args[0]))
    for k, leaf in enumerate(jax.tree_util.tree_leaves(new_state)):
        if offset + k in split:
            shard = leaf.addressable_shards[0].data
            assert shard.shape[split[offset + k]] * 8 == leaf.shape[split[offset + k]], k
            assert np.all(np.isfinite(np.asarray(leaf)))


def test_state_sharding_round_trips_and_refuses_what_cannot_apply(zoo_case, tmp_path) -> None:  # type: ignore[no-untyped-def]
    case = zoo_case("haiku-mlp")
    base, zero, graph = _plans(case.cap, "dp", {"data": 8})
    path = tmp_path / "zero.json"
    zero.save(path)
    again = Plan.load(path)
    assert again.state_sharding == zero.state_sharding
    assert again.partition_specs(like=case.args) == zero.partition_specs(like=case.args)
    assert again.partition_specs(like=case.args) != base.partition_specs(like=case.args)
    data = zero.to_json()
    index, dim = zero.state_sharding.dims[0]
    data["state_sharding"]["parameters"][0]["dim"] = 7
    with pytest.raises(PlanError, match=r"state_sharding: .* has rank \d; it has no dim 7"):
        Plan.from_json(data)
    data["state_sharding"] = {"axes": ["nope"], "parameters": []}
    with pytest.raises(PlanError, match="axes \\['nope'\\] are not in the plan's mesh"):
        Plan.from_json(data)
    array, axes, _ = resolve_plan(graph, "megatron", {"model": 8})
    megatron = Plan.from_groups(case.cap, graph, array, axes)
    with pytest.raises(PlanError, match="no data replicas"):
        megatron.with_sharded_state(graph)


def _tight_cluster(capacity: float) -> Any:
    import dataclasses

    from hlomap.cost.cluster import hierarchical
    from hlomap.cost.devices import device_preset

    return hierarchical(1, 8, dataclasses.replace(device_preset("V100-16GB"), memory_bytes=capacity))


def test_explorer_splits_the_state_only_when_the_plan_does_not_fit_otherwise(zoo_case) -> None:  # type: ignore[no-untyped-def]
    """`shard_optimizer_state="auto"` (the default) keeps the plan whole where it fits and splits
    its state where that makes it fit; "on" always splits it, "off" never."""
    from hlomap.api import explore_detailed

    case = zoo_case("haiku-mlp")
    base, zero, _ = _plans(case.cap, "dp", {"data": 8})
    whole = hlomap.estimate(case.cap, base, cluster="A").memory.total
    split = hlomap.estimate(case.cap, zero, cluster="A").memory.total
    assert split < whole
    roomy, tight = _tight_cluster(16e9), _tight_cluster((whole + split) / 2)

    def found(cluster: Any, mode: str) -> Plan:
        return explore_detailed(case.cap, "adp", {"data": 8}, cluster, "exact", None,
                                shard_optimizer_state=mode).plan

    assert found(roomy, "auto").state_sharding is None
    fitted = found(tight, "auto")
    assert fitted.state_sharding is not None and fitted.estimate["memory"]["fits"]
    assert found(tight, "off").estimate["memory"]["fits"] is False
    forced = found(roomy, "on")
    assert forced.state_sharding is not None
    assert any(c["reason"] == "sharded optimizer state" for c in forced.estimate["collectives"])


def test_explorer_splits_the_parameters_only_when_the_split_state_does_not_fit(zoo_case) -> None:  # type: ignore[no-untyped-def]
    """`shard_parameters="auto"` (the default) goes on to FSDP only where the plan with its state
    split (ZeRO-1) still does not fit and FSDP does; "on" always stores the parameters split, "off"
    never; with the optimizer state "off", "auto" splits nothing."""
    from hlomap.api import explore_detailed

    case = zoo_case("haiku-mlp")
    _, zero, graph = _plans(case.cap, "dp", {"data": 8})
    fsdp = zero.with_sharded_state(graph, parameters=True)
    trainable = {p.index for p in case.cap.parameters if p.role is Role.TRAINABLE}
    zero_total = hlomap.estimate(case.cap, zero, cluster="A").memory.total
    fsdp_total = hlomap.estimate(case.cap, fsdp, cluster="A").memory.total
    assert fsdp_total < zero_total
    tight = _tight_cluster((zero_total + fsdp_total) / 2)

    def found(cluster: Any, **modes: str) -> Plan:
        return explore_detailed(case.cap, "adp", {"data": 8}, cluster, "exact", None, **modes).plan

    fitted = found(tight)
    assert fitted.state_sharding.splits_any(trainable) and fitted.estimate["memory"]["fits"]
    assert any(c["reason"] == "sharded parameters" for c in fitted.estimate["collectives"])
    # ZeRO-1 alone does not fit either, so "auto" leaves the state whole too
    only_state = found(tight, shard_parameters="off")
    assert only_state.state_sharding is None and not only_state.estimate["memory"]["fits"]
    state_on = found(tight, shard_optimizer_state="on", shard_parameters="off")
    assert not state_on.state_sharding.splits_any(trainable) and not state_on.estimate["memory"]["fits"]
    assert found(tight, shard_optimizer_state="off").state_sharding is None
    roomy = _tight_cluster(16e9)
    assert found(roomy).state_sharding is None
    assert found(roomy, shard_parameters="on").state_sharding.splits_any(trainable)
