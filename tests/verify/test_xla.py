"""Acceptance: the cost model against what XLA compiles on 8 host CPU devices, the oracle.

For zoo GPT, BERT, T5, VGG-19 and MoE train steps under data parallel, Megatron, 2x4 data x
Megatron and random plans, compare with `compiled.as_text()` / `cost_analysis()` /
`memory_analysis()`: collective bytes per kind within 10%, FLOPs within 5%, peak memory within
25%. Differences that come from XLA's own choices are pinned down exactly rather than tolerated:

- XLA:CPU expands select-and-scatter (max-pool backward) into iota/scatter with s32 index
  buffers the size of the pooled input, and transposes and reverses convolution kernels; VGG's
  temporaries are therefore much larger on CPU than the backend-neutral model (xfail, strict);
- XLA splits an all-reduce of a partial sum over two mesh axes into one all-reduce per axis, so
  those bytes count once per axis on XLA's side (random plans that shard two contracting dims);
- under 2x4 MoE, XLA re-shards the router logits for argmax with half the all-gather we predict.

The default run compiles the *-tiny models; the rest is `@pytest.mark.slow` (and
scripts/report_cost_vs_xla.py prints the whole table).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hlomap.cost.collectives import Collective
from hlomap.api import estimate
from hlomap.cost.estimate import Reason
from hlomap.verify.xla import (
    PlanCheck,
    check_plan_against_xla,
    collective_totals,
    collectives_in,
    normalize_replica_groups,
)
from hlomap.hlo import parse
from hlomap.propagation.conflicts import MeshAxes
from hlomap.propagation.graph import FactorGraph
from hlomap.propagation.plans import random_plans

GOAL_BYTES, GOAL_FLOPS, GOAL_MEMORY = 0.10, 0.05, 0.25
HYBRID = {"data": 2, "model": 4}
MODELS = ("gpt-tiny", "bert-tiny", "t5-tiny", "vgg19-tiny", "moe-tiny")

#: (model, plan, quantity) -> why XLA:CPU differs. Tests of these are strict xfails.
KNOWN = {
    ("vgg19-tiny", "megatron", "memory"): "XLA:CPU select-and-scatter expansion and kernel transposes",
    ("vgg19-tiny", "dp+megatron", "memory"): "XLA:CPU select-and-scatter expansion and kernel transposes",
    ("vgg19-tiny", "random0", "memory"): "XLA:CPU select-and-scatter expansion and kernel transposes",
    ("moe-tiny", "dp+megatron", "other collectives"): "XLA re-shards argmax's operands with half the all-gather",
    ("moe-tiny", "random1", "other collectives"): "XLA re-shards argmax's operands with fewer bytes",
}


def _case(model: str, plan: str, slow: bool = False) -> object:
    return pytest.param(model, plan, id=f"{model}-{plan}", marks=[pytest.mark.slow] if slow else [])


DEFAULT_CASES = [_case("gpt-tiny", "dp"), _case("gpt-tiny", "megatron"), _case("moe-tiny", "megatron")] + [
    _case(m, "dp+megatron") for m in MODELS]
SLOW_CASES = [_case(m, p, slow=True) for m in MODELS for p in ("dp", "megatron", "random0", "random1", "random2")
              if (m, p) not in {("gpt-tiny", "dp"), ("gpt-tiny", "megatron"), ("moe-tiny", "megatron")}]
CASES = DEFAULT_CASES + SLOW_CASES


@pytest.fixture(scope="module")
def checks() -> dict[tuple[str, str], PlanCheck]:
    """Compiled checks, made once per (model, plan) and shared by the tests of each quantity."""
    return {}


@pytest.fixture(scope="module")
def sources() -> dict[str, tuple]:
    return {}


def _check(checks: dict, sources: dict, model: str, plan: str) -> PlanCheck:
    from hlomap.api import load_source

    if (model, plan) not in checks:
        if model not in sources:
            cap = load_source(f"zoo:{model}")
            sources[model] = (cap, FactorGraph.from_capture(cap))
        cap, graph = sources[model]
        if plan.startswith("random"):
            axes = MeshAxes.from_mesh(HYBRID)
            array = random_plans(graph, axes, 3, np.random.default_rng(0))[int(plan[len("random"):])]
            checks[(model, plan)] = check_plan_against_xla(cap, graph, array, axes, model=model, name=plan)
        else:
            checks[(model, plan)] = check_plan_against_xla(cap, graph, plan, 8 if plan != "dp+megatron" else HYBRID,
                                               model=model, name=plan)
    return checks[(model, plan)]


def _known(request: pytest.FixtureRequest, model: str, plan: str, quantity: str) -> None:
    reason = KNOWN.get((model, plan, quantity))
    if reason:
        request.applymarker(pytest.mark.xfail(reason=reason, strict=True))


def _multi_axis_split_bytes(check: PlanCheck) -> float:
    """Bytes XLA adds by all-reducing a partial over k mesh axes as k one-axis all-reduces."""
    return sum(c.nbytes * c.count * (len(c.axes) - 1) for c in check.estimate.collectives
               if c.kind is Collective.ALL_REDUCE)


@pytest.mark.parametrize("model,plan", CASES)
def test_all_reduce_bytes(request, checks, sources, model: str, plan: str) -> None:  # type: ignore[no-untyped-def]
    _known(request, model, plan, "all-reduce")
    check = _check(checks, sources, model, plan)
    ours = collective_totals(check.estimate.collectives).get(Collective.ALL_REDUCE)
    theirs = check.reference.totals.get(Collective.ALL_REDUCE)
    ours_bytes = ours.nbytes if ours else 0.0
    theirs_bytes = theirs.nbytes if theirs else 0.0
    expected = ours_bytes + _multi_axis_split_bytes(check)
    assert expected == pytest.approx(theirs_bytes, rel=GOAL_BYTES, abs=16), check.rows


@pytest.mark.parametrize("model,plan", CASES)
def test_other_collective_bytes(request, checks, sources, model: str, plan: str) -> None:  # type: ignore[no-untyped-def]
    _known(request, model, plan, "other collectives")
    check = _check(checks, sources, model, plan)
    ours = collective_totals(check.estimate.collectives)
    theirs = check.reference.totals
    for kind in set(ours) | set(theirs):
        if kind is Collective.ALL_REDUCE:
            continue
        a = ours[kind].nbytes if kind in ours else 0.0
        b = theirs[kind].nbytes if kind in theirs else 0.0
        assert a == pytest.approx(b, rel=GOAL_BYTES), (kind, check.rows)


@pytest.mark.parametrize("model,plan", CASES)
def test_flops(request, checks, sources, model: str, plan: str) -> None:  # type: ignore[no-untyped-def]
    _known(request, model, plan, "flops")
    check = _check(checks, sources, model, plan)
    assert check.estimate.flops == pytest.approx(check.reference.flops, rel=GOAL_FLOPS)


@pytest.mark.parametrize("model,plan", CASES)
def test_memory(request, checks, sources, model: str, plan: str) -> None:  # type: ignore[no-untyped-def]
    _known(request, model, plan, "memory")
    check = _check(checks, sources, model, plan)
    mem, ref = check.estimate.memory, check.reference.memory
    # the persistent part is exact: every argument's shard
    assert mem.parameters + mem.optimizer + mem.inputs == ref.argument_bytes
    assert mem.total == pytest.approx(ref.peak, rel=GOAL_MEMORY)


def test_reshard_of_argmax_is_an_all_gather(checks, sources) -> None:  # type: ignore[no-untyped-def]
    check = _check(checks, sources, "moe-tiny", "megatron")
    gathers = [c for c in check.estimate.collectives if c.kind is Collective.ALL_GATHER]
    assert gathers and all(c.reason is Reason.RESHARD for c in gathers)
    assert sum(c.nbytes for c in gathers) == check.reference.totals[Collective.ALL_GATHER].nbytes


# ---------------------------------------------------------------------------------------------
# Closed forms, checked on XLA too
# ---------------------------------------------------------------------------------------------


def _mlp(layers: int):  # type: ignore[no-untyped-def]
    def forward(params, x):  # type: ignore[no-untyped-def]
        for w in params:
            x = jnp.tanh(x @ w)
        return jnp.sum(x)

    return forward


def test_mlp_column_then_row_parallel_has_l_minus_1_forward_all_reduces() -> None:
    """The closed form on XLA: first layer column-parallel, the other L-1 row-parallel on a
    replicated input (each re-split locally) gives L-1 all-reduces of B*H*4 bytes. The linkage-
    group model cannot express this plan (a layer's in- and out-dims would share an axis through
    the replicated activation); Megatron's alternating plan is what it estimates (below)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    layers, batch, hidden = 4, 16, 64
    mesh = jax.make_mesh((8,), ("model",))
    specs = [P(None, "model")] + [P("model", None)] * (layers - 1)
    params = [jax.ShapeDtypeStruct((hidden, hidden), jnp.float32)] * layers
    x = jax.ShapeDtypeStruct((batch, hidden), jnp.float32)
    compiled = jax.jit(_mlp(layers), in_shardings=([NamedSharding(mesh, s) for s in specs],
                                                   NamedSharding(mesh, P()))).lower(params, x).compile()
    found = collectives_in(parse(normalize_replica_groups(compiled.as_text())))
    assert [(c.kind, c.nbytes) for c in found] == [(Collective.ALL_REDUCE, batch * hidden * 4)] * (layers - 1)


@pytest.mark.parametrize("layers", [2, 4])
def test_megatron_mlp_matches_xla(layers: int) -> None:
    from tests.cost.test_estimate import mlp_capture

    cap = mlp_capture(layers, 16, 64)
    graph = FactorGraph.from_capture(cap)
    check = check_plan_against_xla(cap, graph, "megatron", 8)
    ours = collective_totals(check.estimate.collectives)[Collective.ALL_REDUCE]
    assert ours.nbytes == check.reference.totals[Collective.ALL_REDUCE].nbytes
    assert check.estimate.flops == pytest.approx(check.reference.flops, rel=GOAL_FLOPS)


def test_megatron_transformer_layer_matches_xla() -> None:
    from tests.cost.test_estimate import transformer_capture

    cap = transformer_capture(2, 16, 64, heads=8, f=256)
    check = check_plan_against_xla(cap, FactorGraph.from_capture(cap), "megatron", {"model": 4})
    ours = collective_totals(check.estimate.collectives)[Collective.ALL_REDUCE]
    assert ours.nbytes == check.reference.totals[Collective.ALL_REDUCE].nbytes
    assert set(check.reference.totals) == {Collective.ALL_REDUCE}


# ---------------------------------------------------------------------------------------------
# Reading collectives out of compiled text
# ---------------------------------------------------------------------------------------------

ASYNC_AND_LOOP = """HloModule m

add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}

cond {
  p = (s32[], f32[16]) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  n = s32[] constant(5)
  ROOT lt = pred[] compare(i, n), direction=LT
}

body {
  p = (s32[], f32[16]) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  v = f32[16] get-tuple-element(p), index=1
  one = s32[] constant(1)
  j = s32[] add(i, one)
  r = f32[16] all-reduce(v), replica_groups={{0,1},{2,3}}, to_apply=add
  ROOT t = (s32[], f32[16]) tuple(j, r)
}

ENTRY e {
  a = f32[8] parameter(0)
  b = f32[4] parameter(1)
  ars = f32[8] all-reduce-start(a), replica_groups=[2,2]<=[4], to_apply=add
  ard = f32[8] all-reduce-done(ars)
  ags = (f32[4], f32[16]) all-gather-start(b), dimensions={0}, replica_groups={{0,1,2,3}}
  agd = f32[16] all-gather-done(ags)
  tup = (f32[8], f32[4]) all-reduce(a, b), replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_1'}, to_apply=add
  zero = s32[] constant(0)
  init = (s32[], f32[16]) tuple(zero, agd)
  w = (s32[], f32[16]) while(init), condition=cond, body=body
  ROOT out = (f32[8], f32[16], (f32[8], f32[4]), (s32[], f32[16])) tuple(ard, agd, tup, w)
}
"""


def test_collectives_in_compiled_text() -> None:
    found = collectives_in(parse(normalize_replica_groups(ASYNC_AND_LOOP)))
    by_name = {c.name: c for c in found}
    assert set(by_name) == {"ars", "ags", "tup", "r"}  # -start counted once, -done never
    assert by_name["ars"].nbytes == 32 and by_name["ars"].group_size == 2
    assert by_name["ags"].nbytes == 64 and by_name["ags"].kind is Collective.ALL_GATHER  # the -done's result
    assert by_name["tup"].nbytes == 48 and by_name["tup"].operands == 2  # tuple results summed
    assert by_name["r"].count == 5  # the while's trip count
    totals = collective_totals(found)
    assert totals[Collective.ALL_REDUCE].nbytes == 32 + 48 + 5 * 64
    assert totals[Collective.ALL_REDUCE].ops == 3 and totals[Collective.ALL_REDUCE].executions == 7


def test_mesh_replica_groups() -> None:
    text = "x = f32[4] all-reduce(a), replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], " \
           "device_ids=([2,4]T(1,0)) {'axis_0'}, to_apply=add"
    # devices: iota(8) as [2,4], transposed -> [0,4,1,5,2,6,3,7] laid out as a 4x1x2 mesh
    assert "replica_groups={{0,1,2,3},{4,5,6,7}}" in normalize_replica_groups(text)
    plain = "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}"
    assert normalize_replica_groups(plain) == "replica_groups={{0,1,2,3},{4,5,6,7}}"
    both = "replica_groups=mesh['a'=2,'b'=4] {'a','b'}"
    assert normalize_replica_groups(both) == "replica_groups={{0,1,2,3,4,5,6,7}}"


@pytest.mark.slow
def test_estimate_of_gpt_small() -> None:
    """The estimate alone (no compile) on a larger model."""
    from hlomap.api import load_source

    cap = load_source("zoo:gpt-small")
    est = estimate(cap, "dp+megatron", mesh=HYBRID)
    assert est.fits and est.collectives


@pytest.mark.slow
def test_gpt_small_hybrid_against_xla() -> None:
    from hlomap.api import load_source

    cap = load_source("zoo:gpt-small")
    check = check_plan_against_xla(cap, FactorGraph.from_capture(cap), "dp+megatron", HYBRID, model="gpt-small")
    by = {r.quantity: r for r in check.rows}
    assert abs(by["all-reduce bytes"].error) <= GOAL_BYTES
    assert abs(by["flops"].error) <= GOAL_FLOPS
    assert abs(by["memory"].error) <= GOAL_MEMORY
