"""Per-instruction FLOPs, bytes and roofline times: closed forms, hand-built IR, and XLA itself."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hlomap.cost.compute import (
    TRANSCENDENTAL_FLOPS, InstructionCost, computation_cost, flops_by_opcode, instruction_cost,
    module_cost, module_flops, while_trip_count,
)
from hlomap.cost.devices import device_preset
from hlomap.hlo import parse
from hlomap.hlo.ir import ArrayShape, Computation, Instruction, Module

V100 = device_preset("V100-16GB")


def _module(body: str, extra: str = "") -> Module:
    return parse(f"HloModule m\n\n{extra}\nENTRY main {{\n{body}\n}}\n")


def _cost_of(module: Module, name: str, device=None) -> InstructionCost:
    comp = module.entry
    return instruction_cost(comp[name], comp, module, device)


# -- closed forms on hand-built IR ------------------------------------------------------------


def test_batched_dot_flops_bytes_and_roofline():
    lhs = Instruction("lhs", "parameter", ArrayShape("f16", (4, 16, 32)), payload="0")
    rhs = Instruction("rhs", "parameter", ArrayShape("f16", (4, 32, 8)), payload="1")
    dot = Instruction("dot", "dot", ArrayShape("f16", (4, 16, 8)), ("lhs", "rhs"), (
        ("lhs_batch_dims", "{0}"), ("lhs_contracting_dims", "{2}"),
        ("rhs_batch_dims", "{0}"), ("rhs_contracting_dims", "{1}")), is_root=True)
    comp = Computation("main", (lhs, rhs, dot))
    module = Module("m", (comp,), "main")
    cost = instruction_cost(dot, comp, module, V100)
    flops = 2 * 4 * 16 * 8 * 32  # 2 x batch x M x N x K
    nbytes = 2 * (4 * 16 * 32 + 4 * 32 * 8 + 4 * 16 * 8)
    assert cost.flops == flops and cost.bytes_accessed == nbytes
    assert cost.compute_seconds == pytest.approx(flops / (125e12 * V100.efficiency))  # f16 tensor cores
    assert cost.memory_seconds == pytest.approx(nbytes / 900e9)
    assert cost.seconds == max(cost.compute_seconds, cost.memory_seconds)
    # Parameters are free; the module is the dot alone.
    assert module_cost(module, V100) == cost
    assert module_flops(module) == flops


def test_large_matmul_is_compute_bound_and_a_copy_memory_bound():
    m = _module("""
  a = bf16[4096,4096] parameter(0)
  b = bf16[4096,4096] parameter(1)
  d = bf16[4096,4096] dot(a, b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT c = bf16[4096,4096] copy(d)""")
    a100 = device_preset("A100-80GB")
    dot, copy = _cost_of(m, "d", a100), _cost_of(m, "c", a100)
    assert dot.seconds == dot.compute_seconds == pytest.approx(2 * 4096**3 / (312e12 * a100.efficiency))
    assert copy.flops == 0 and copy.seconds == copy.memory_seconds == pytest.approx(2 * 2 * 4096**2 / 2039e9)


def test_elementwise_and_transcendental_counts():
    m = _module("""
  x = f32[10,20] parameter(0)
  a = f32[10,20] add(x, x)
  e = f32[10,20] exponential(a)
  t = f32[10,20] tanh(e)
  p = pred[10,20] compare(a, e), direction=LT
  s = f32[10,20] select(p, a, t)
  ROOT c = f16[10,20] convert(s)""")
    total = module_cost(m, V100)
    assert total.flops == 4 * 200          # add, compare, select, convert
    assert total.transcendentals == 2 * 200  # exponential, tanh
    t = _cost_of(m, "t", V100)
    assert t.compute_seconds == pytest.approx(200 * TRANSCENDENTAL_FLOPS / (15.7e12 * V100.efficiency))
    assert t.bytes_accessed == 2 * 200 * 4


def test_elementwise_ops_run_at_vector_rates():
    m = _module("""
  x = bf16[1024] parameter(0)
  y = f64[1024] parameter(1)
  a = bf16[1024] add(x, x)
  ROOT b = f64[1024] multiply(y, y)""")
    a100, v100 = device_preset("A100-80GB"), device_preset("V100-16GB")
    # bf16 tensor-core peak (312 TFLOP/s) does not apply to an add: the f32 rate does.
    assert _cost_of(m, "a", a100).compute_seconds == pytest.approx(1024 / (19.5e12 * a100.efficiency))
    # f64 is slower than f32 on V100 (7.8 vs 15.7 TFLOP/s).
    assert _cost_of(m, "b", v100).compute_seconds == pytest.approx(1024 / (7.8e12 * v100.efficiency))


def test_shape_only_ops_cost_nothing():
    m = _module("""
  x = f32[8,16] parameter(0)
  k = f32[] constant(1)
  r = f32[16,8] reshape(x)
  b = f32[16,8] bitcast(r)
  t = (f32[16,8], f32[]) tuple(b, k)
  ROOT g = f32[16,8] get-tuple-element(t), index=0""")
    assert module_cost(m, V100) == InstructionCost()


def test_reduce_and_reduce_window():
    add = """
sum {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
"""
    m = _module("""
  x = f32[8,6,6,3] parameter(0)
  z = f32[] constant(0)
  r = f32[6,6,3] reduce(x, z), dimensions={0}, to_apply=sum
  ROOT w = f32[8,3,3,3] reduce-window(x, z), window={size=1x2x2x1 stride=1x2x2x1}, to_apply=sum""", add)
    r, w = _cost_of(m, "r"), _cost_of(m, "w")
    assert r.flops == 8 * 6 * 6 * 3 - 6 * 6 * 3        # one add per folded element
    assert w.flops == (4 - 1) * 8 * 3 * 3 * 3           # window of 4: 3 adds per output
    assert r.bytes_accessed == 4 * (8 * 6 * 6 * 3 + 1 + 6 * 6 * 3)


def test_fusion_is_one_kernel():
    fused = """
fused {
  p0 = f32[256,256] parameter(0)
  p1 = f32[256,256] parameter(1)
  m = f32[256,256] multiply(p0, p1)
  e = f32[256,256] exponential(m)
  ROOT a = f32[256,256] add(e, p0)
}
"""
    m = _module("""
  x = f32[256,256] parameter(0)
  y = f32[256,256] parameter(1)
  ROOT f = f32[256,256] fusion(x, y), kind=kLoop, calls=fused""", fused)
    cost = _cost_of(m, "f", V100)
    n = 256 * 256
    assert cost.flops == 2 * n and cost.transcendentals == n
    assert cost.bytes_accessed == 3 * 4 * n  # two operands + result; intermediates stay on chip
    assert cost.memory_seconds == pytest.approx(3 * 4 * n / 900e9)
    compute = (2 * n + TRANSCENDENTAL_FLOPS * n) / (15.7e12 * V100.efficiency)
    assert cost.compute_seconds == pytest.approx(compute)
    assert cost.seconds == pytest.approx(max(compute, 3 * 4 * n / 900e9))
    # Unfused, the same work moves every intermediate through memory.
    unfused = computation_cost(m, "fused", V100)
    assert unfused.bytes_accessed > cost.bytes_accessed and unfused.flops == cost.flops


def test_call_conditional_and_async_pairs():
    comps = """
double {
  p = f32[100] parameter(0)
  ROOT a = f32[100] add(p, p)
}

heavy {
  p = f32[100] parameter(0)
  a = f32[100] multiply(p, p)
  ROOT b = f32[100] multiply(a, p)
}

sum {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
"""
    m = _module("""
  x = f32[100] parameter(0)
  i = s32[] parameter(1)
  c = f32[100] call(x), to_apply=double
  k = f32[100] conditional(i, x, x), branch_computations={double, heavy}
  s = f32[100] all-reduce-start(x), replica_groups={}, to_apply=sum
  ROOT d = f32[100] all-reduce-done(s)""", comps)
    assert _cost_of(m, "c").flops == 100
    assert _cost_of(m, "k").flops == 200          # the costlier branch
    assert _cost_of(m, "s").flops == 100          # XLA's one flop per element
    assert _cost_of(m, "d") == InstructionCost()  # the pair is costed at its start


def test_custom_call_moves_bytes_but_has_no_known_flops():
    m = _module("""
  x = f32[64] parameter(0)
  ROOT c = f32[64] custom-call(x), custom_call_target="my_kernel\"""")
    cost = _cost_of(m, "c")
    assert cost.flops == 0 and cost.bytes_accessed == 2 * 4 * 64


# -- while loops ------------------------------------------------------------------------------

_LOOP = """
body {
  p = (s32[], f32[16,16]) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  one = s32[] constant({step})
  n = s32[] add(i, one)
  x = f32[16,16] get-tuple-element(p), index=1
  y = f32[16,16] dot(x, x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT t = (s32[], f32[16,16]) tuple(n, y)
}

cond {
  p = (s32[], f32[16,16]) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  lim = s32[] constant({limit})
  ROOT lt = pred[] compare(i, lim), direction={direction}
}
"""


def _loop_module(start=0, limit=5, step=1, direction="LT", config=""):
    extra = _LOOP.replace("{step}", str(step)).replace("{limit}", str(limit)).replace("{direction}", direction)
    return _module(f"""
  z = s32[] constant({start})
  x = f32[16,16] parameter(0)
  init = (s32[], f32[16,16]) tuple(z, x)
  ROOT w = (s32[], f32[16,16]) while(init), condition=cond, body=body{config}""", extra)


@pytest.mark.parametrize("start, limit, step, direction, trips", [
    (0, 5, 1, "LT", 5), (2, 11, 3, "LT", 3), (0, 5, 1, "LE", 6), (0, 8, 2, "NE", 4), (7, 5, 1, "LT", 0),
])
def test_counted_loop_trip_count_is_inferred(start, limit, step, direction, trips):
    m = _loop_module(start, limit, step, direction)
    assert while_trip_count(m.entry["w"], m.entry, m) == trips
    per_trip = 2 * 16**3 + 1 + 1  # dot, counter add, compare
    assert module_flops(m) == trips * per_trip


def test_known_trip_count_backend_config_wins():
    m = _loop_module(config=', backend_config={"known_trip_count":{"n":"9"}}')
    assert while_trip_count(m.entry["w"], m.entry, m) == 9


def test_unknown_trip_count_costs_one_iteration_and_says_so(caplog):
    m = _loop_module(direction="GT")  # not a counted loop we recognize
    with caplog.at_level(logging.WARNING, logger="hlomap.cost.compute"):
        assert while_trip_count(m.entry["w"], m.entry, m) == 1
    assert "'w'" in caplog.text and "trip count unknown" in caplog.text


# -- XLA as the oracle --------------------------------------------------------------------------


def _xla_and_ours(f, *args):
    lowered = jax.jit(f).lower(*args)
    compiled = lowered.compile()
    return (compiled.cost_analysis()["flops"], module_flops(parse(compiled.as_text())),
            module_flops(parse(lowered.as_text(dialect="hlo"))))


def _mlp_step(params, x, y):
    def loss(p):
        h = jax.nn.relu(x @ p["w1"] + p["b1"])
        return jnp.mean((jax.nn.log_softmax(h @ p["w2"] + p["b2"]) * y).sum(-1))
    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


_MLP_ARGS = ({"w1": jnp.ones((32, 64)), "b1": jnp.ones(64), "w2": jnp.ones((64, 10)), "b2": jnp.ones(10)},
             jnp.ones((16, 32)), jnp.ones((16, 10)))

XLA_CASES = {
    "matmul": (lambda a, b: a @ b, jnp.ones((64, 128)), jnp.ones((128, 32))),
    "batched_matmul": (lambda a, b: jnp.einsum("bij,bjk->bik", a, b), jnp.ones((4, 16, 32)), jnp.ones((4, 32, 8))),
    "conv_same": (lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME"),
                  jnp.ones((2, 3, 16, 16)), jnp.ones((8, 3, 3, 3))),
    "conv_grouped_strided_dilated": (
        lambda x, w: jax.lax.conv_general_dilated(x, w, (2, 1), ((1, 2), (0, 1)), rhs_dilation=(2, 1),
                                                  feature_group_count=2),
        jnp.ones((2, 4, 13, 9)), jnp.ones((6, 2, 3, 3))),
    "conv_transpose": (lambda x, w: jax.lax.conv_transpose(x, w, (2, 2), "SAME"),
                       jnp.ones((1, 8, 8, 3)), jnp.ones((3, 3, 3, 5))),
    "mlp_train_step": (_mlp_step, *_MLP_ARGS),
    "reductions": (lambda x: (x.sum(0), jnp.argmax(x, 0), jnp.cumsum(x, 0)), jnp.ones((10, 7))),
    "pooling": (lambda x: jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"),
                jnp.ones((2, 8, 8, 3))),
    # elementwise kinds of the opcode table: flops, transcendentals, predicates, bit ops
    "elementwise_kinds": (
        lambda x, i: (jnp.sin(x) * jnp.cos(x) + jax.scipy.special.erf(x), jnp.isfinite(x),
                      jax.lax.clz(i) + jax.lax.population_count(i), jax.lax.reduce_precision(x, 5, 10)),
        jnp.ones((8, 16)), jnp.ones((8, 16), jnp.int32)),
}


@pytest.mark.parametrize("case", sorted(XLA_CASES))
def test_flops_match_xla_cost_analysis(case):
    f, *args = XLA_CASES[case]
    xla, compiled, lowered = _xla_and_ours(f, *args)
    assert compiled == xla  # same module, same conventions: exact
    # Before XLA's passes the program is the same computation, up to algebraic rewrites.
    assert lowered == pytest.approx(xla, rel=0.02)


@pytest.mark.parametrize("trips", [3, 7])
def test_loops_count_every_trip_where_xla_counts_one(trips):
    def f(x):
        return jax.lax.fori_loop(0, trips, lambda i, c: jnp.tanh(c @ c), x)
    xla, compiled, lowered = _xla_and_ours(f, jnp.ones((16, 16)))
    assert compiled == trips * xla
    assert lowered == compiled


def test_convolution_flops_equal_twice_the_sum_of_a_ones_convolution():
    # conv(ones, ones) puts at each output the number of input taps it reads: summed, that is
    # the number of multiply-adds, whatever the padding, stride and dilation.
    x, w = jnp.ones((3, 5, 11, 7)), jnp.ones((6, 5, 4, 2))
    args = dict(window_strides=(3, 2), padding=((2, 3), (1, 0)), lhs_dilation=(2, 1), rhs_dilation=(1, 2))
    out = jax.lax.conv_general_dilated(x, w, **args)
    lowered = jax.jit(lambda a, b: jax.lax.conv_general_dilated(a, b, **args)).lower(x, w)
    assert module_flops(parse(lowered.as_text(dialect="hlo"))) == 2 * float(np.asarray(out).sum())


def test_flops_by_opcode_count_loops_fusions_and_calls_under_their_own_opcodes():
    m = parse("""HloModule m

body {
  p = (s32[], f32[8,8]) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  x = f32[8,8] get-tuple-element(p), index=1
  one = s32[] constant(1)
  n = s32[] add(i, one)
  d = f32[8,8] dot(x, x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT t = (s32[], f32[8,8]) tuple(n, d)
}

cond {
  p = (s32[], f32[8,8]) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  c = s32[] constant(3)
  ROOT lt = pred[] compare(i, c), direction=LT
}

fused {
  a = f32[8,8] parameter(0)
  ROOT m = f32[8,8] multiply(a, a)
}

ENTRY main {
  x = f32[8,8] parameter(0)
  z = s32[] constant(0)
  t = (s32[], f32[8,8]) tuple(z, x)
  w = (s32[], f32[8,8]) while(t), condition=cond, body=body
  r = f32[8,8] get-tuple-element(w), index=1
  f = f32[8,8] fusion(r), kind=kLoop, calls=fused
  ROOT e = f32[8,8] exponential(f)
}
""")
    by_opcode = flops_by_opcode(m)
    assert by_opcode == {"dot": 3 * 2 * 8 * 8 * 8, "add": 3, "compare": 3, "multiply": 64}
    assert sum(by_opcode.values()) == module_flops(m)


def test_flops_by_opcode_sum_to_the_module_flops_on_the_corpus(corpus_dir):
    from hlomap.hlo import HloParseError

    checked = 0
    for path in sorted(corpus_dir.glob("hlo/*/*.hlo")):
        try:
            module = parse(path.read_text())
        except HloParseError:
            continue
        assert sum(flops_by_opcode(module).values()) == pytest.approx(module_flops(module), rel=1e-12), path.name
        checked += 1
    assert checked >= 40


def test_every_corpus_module_gets_a_finite_cost(corpus_dir):
    from hlomap.hlo import HloParseError

    a100 = device_preset("A100-80GB")
    costed = 0
    for path in sorted(corpus_dir.glob("hlo/*/*.hlo")):
        try:
            module = parse(path.read_text())
        except HloParseError:
            continue  # the parser's tests cover these
        cost = module_cost(module, a100)
        values = np.array([cost.flops, cost.transcendentals, cost.bytes_accessed, cost.seconds])
        assert np.all(np.isfinite(values)) and np.all(values >= 0), path.name
        assert cost.seconds >= cost.memory_seconds - 1e-18 or cost.seconds == 0, path.name
        costed += 1
    assert costed >= 40


# -- narrow matrix products (DeviceSpec.narrow) -------------------------------------------------


def _narrow_device():
    from hlomap.cost.devices import DeviceSpec, NarrowCurve

    curves = {"dot": NarrowCurve(((8.0, 0.25), (64.0, 1.0))), "convolution": NarrowCurve(((4.0, 0.1), (32.0, 1.0)))}
    return DeviceSpec("narrow", {"f32": 1e11}, 1e15, 2**30, efficiency=1.0, narrow=curves)


def test_a_narrow_dot_runs_at_its_curves_share_of_the_matrix_rate():
    m = _module("""
  a = f32[1024,256] parameter(0)
  b = f32[256,8] parameter(1)
  ROOT d = f32[1024,8] dot(a, b), lhs_contracting_dims={1}, rhs_contracting_dims={0}""")
    device = _narrow_device()
    flops = 2 * 1024 * 256 * 8
    assert _cost_of(m, "d", device).compute_seconds == pytest.approx(flops / (1e11 * 0.25))
    plain = device.__class__("plain", {"f32": 1e11}, 1e15, 2**30, efficiency=1.0)
    assert _cost_of(m, "d", plain).compute_seconds == pytest.approx(flops / 1e11)  # no curve: full rate


def test_matrix_sides_of_a_convolution_and_a_batched_dot():
    from hlomap.cost.compute import matrix_sides

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    module = parse(jax.jit(conv).lower(jnp.ones((2, 6, 6, 8)), jnp.ones((3, 3, 8, 4))).as_text(dialect="hlo"))
    inst = next(i for i in module.entry.instructions if i.opcode == "convolution")
    sides = matrix_sides(inst, module.entry)
    assert sides.inner == 8 * 9 and sides.width(inst.shape.dims) == 4  # min(2 x 6 x 6, 72, 4 channels)
    device = _narrow_device()
    cost = instruction_cost(inst, module.entry, module, device)
    assert cost.compute_seconds == pytest.approx(cost.flops / (1e11 * 0.1))
    lhs = Instruction("lhs", "parameter", ArrayShape("f32", (4, 16, 32)), payload="0")
    rhs = Instruction("rhs", "parameter", ArrayShape("f32", (4, 32, 8)), payload="1")
    dot = Instruction("dot", "dot", ArrayShape("f32", (4, 16, 8)), ("lhs", "rhs"), (
        ("lhs_batch_dims", "{0}"), ("lhs_contracting_dims", "{2}"),
        ("rhs_batch_dims", "{0}"), ("rhs_contracting_dims", "{1}")), is_root=True)
    sides = matrix_sides(dot, Computation("main", (lhs, rhs, dot)))
    assert (sides.rows, sides.columns, sides.inner) == ((1,), (2,), 32)  # the batch dim is neither
    assert sides.width((4, 16, 2), inner_split=8) == 2 and sides.width((4, 16, 8), inner_split=8) == 4


def _convolutions() -> Module:
    """A module of four convolutions over NHWC images of 8 channels: a 1x1 window over 4x4 images,
    3x3 windows over 4x4 and over 2x2 images, and a 2x2 window dilated 2 (it spans 3 pixels) over
    2x2 images."""
    return _module("""
  a = f32[2,4,4,8] parameter(0)
  b = f32[2,2,2,8] parameter(1)
  k1 = f32[1,1,8,8] parameter(2)
  k3 = f32[3,3,8,8] parameter(3)
  k2 = f32[2,2,8,8] parameter(4)
  one = f32[2,4,4,8] convolution(a, k1), window={size=1x1}, dim_labels=b01f_01io->b01f
  wide = f32[2,4,4,8] convolution(a, k3), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
  over = f32[2,2,2,8] convolution(b, k3), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
  ROOT dilated = f32[2,1,1,8] convolution(b, k2), window={size=2x2 pad=1_0x1_0 rhs_dilate=2x2}, dim_labels=b01f_01io->b01f""")


def test_a_convolution_is_priced_by_the_curve_of_its_kind():
    """A window that reaches past its input (the dilated one too) has the oversized curve; any
    other window, 1x1 included, the convolution curve. A device calibrated before the oversized
    kind was measured prices those by the convolution curve."""
    from hlomap.cost.compute import curve_kind, matrix_kind, matrix_sides, narrow_factor
    from hlomap.cost.devices import OVERSIZED_CONVOLUTION, DeviceSpec, NarrowCurve

    module = _convolutions()
    comp = module.entry
    kinds = {name: matrix_kind(comp[name], comp) for name in ("one", "wide", "over", "dilated", "a")}
    assert kinds == {"one": "convolution", "wide": "convolution", "over": OVERSIZED_CONVOLUTION,
                     "dilated": OVERSIZED_CONVOLUTION, "a": None}
    curves = {**_narrow_device().narrow, OVERSIZED_CONVOLUTION: NarrowCurve(((32.0, 0.02),))}
    device = DeviceSpec("narrow", {"f32": 1e11}, 1e15, 2**30, efficiency=1.0, narrow=curves)
    for name, kind in (("one", "convolution"), ("wide", "convolution"), ("over", OVERSIZED_CONVOLUTION)):
        inst = comp[name]
        width = matrix_sides(inst, comp).width(inst.shape.dims)
        assert curve_kind(inst, comp, device) == kind
        share = device.narrow_factor(kind, width)
        assert narrow_factor(inst, comp, device) == pytest.approx(share)
        assert _cost_of(module, name, device).compute_seconds == pytest.approx(_cost_of(module, name).flops / (1e11 * share))
    assert narrow_factor(comp["over"], comp, device) == pytest.approx(0.02)  # a flat curve: the same at any width
    older = _narrow_device()  # no oversized curve: the convolution curve, as before that kind was measured
    assert curve_kind(comp["over"], comp, older) == "convolution"
    assert narrow_factor(comp["over"], comp, older) == pytest.approx(older.narrow_factor("convolution", 8))
    assert curve_kind(comp["one"], comp, DeviceSpec("plain", {"f32": 1e11}, 1e15, 2**30)) is None


def test_a_split_oversized_convolution_runs_at_its_flat_rate():
    """Splitting an oversized convolution's output channels 8 ways leaves each device an eighth of
    the work at the same flat rate (slowdown 1), where the convolution curve would have priced each
    block of 1 channel far slower than the whole of 8."""
    from hlomap.cost.devices import OVERSIZED_CONVOLUTION, DeviceSpec, NarrowCurve
    from hlomap.cost.sharding import ShardedGraph
    from hlomap.propagation.conflicts import MeshAxes
    from hlomap.propagation.graph import FactorGraph

    module = _convolutions()
    graph = FactorGraph.build(module)
    node = graph.node_of(module.entry.name, "over")
    features = graph.tensor_dims(graph.node_tensors[node][0])[3]
    plan = np.full(graph.num_groups, -1, dtype=np.int64)
    plan[graph.group_of_dim[features]] = 0
    sg = ShardedGraph.build(graph, plan, MeshAxes.from_mesh({"model": 8}))
    assert sg.node_degree[node] == 8
    with_kind = DeviceSpec("o", {"f32": 1e11}, 1e15, 2**30, efficiency=1.0,
                           narrow={**_narrow_device().narrow, OVERSIZED_CONVOLUTION: NarrowCurve(((32.0, 0.02),))})
    assert sg.narrow_slowdown(node, with_kind, {}) == pytest.approx(1.0)
    older = _narrow_device()
    convolution = older.narrow["convolution"]
    assert sg.narrow_slowdown(node, older, {}) == pytest.approx(convolution.factor(8) / convolution.factor(1))


def test_a_sharded_dot_is_priced_at_the_width_of_each_devices_block():
    """Splitting a dot's columns 8 ways leaves each device a product of 8 columns where the whole
    had 64: it runs at the curve's share for 8, not 64 (`ShardedGraph.narrow_slowdown`)."""
    from hlomap.cost.sharding import ShardedGraph
    from hlomap.propagation.conflicts import MeshAxes
    from hlomap.propagation.graph import FactorGraph

    module = _module("""
  a = f32[1024,256] parameter(0)
  b = f32[256,64] parameter(1)
  ROOT d = f32[1024,64] dot(a, b), lhs_contracting_dims={1}, rhs_contracting_dims={0}""")
    graph = FactorGraph.build(module)
    axes = MeshAxes.from_mesh({"model": 8})
    node = graph.node_of(module.entry.name, "d")
    columns, rows = graph.tensor_dims(graph.node_tensors[node][0])[[1, 0]]
    device = _narrow_device()
    for dim, width in ((columns, 8), (rows, 64)):
        plan = np.full(graph.num_groups, -1, dtype=np.int64)
        plan[graph.group_of_dim[dim]] = 0
        sg = ShardedGraph.build(graph, plan, axes)
        assert sg.node_degree[node] == 8
        expected = 1.0 / device.narrow_factor("dot", width)  # the whole runs at full rate (64 columns)
        assert sg.narrow_slowdown(node, device, {}) == pytest.approx(expected)
    assert expected == 1.0  # rows split: 128 x 256 x 64 per device, still full rate


def _xla_copies(fn, *args) -> int:  # type: ignore[no-untyped-def]
    """How many transposes and copies XLA's compiled module of `fn` keeps (fused or not)."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    return sum(1 for line in text.splitlines() if " transpose(" in line or " copy(" in line)


@pytest.mark.parametrize("name,fn,shapes,folds", [
    ("matrix product transposed", lambda a, b: (a @ b).T * 2.0, ((64, 128), (128, 32)), True),
    ("batched product transposed", lambda a, b: jnp.einsum("bij,bjk->bik", a, b).transpose(1, 0, 2) * 2.0,
     ((4, 64, 128), (4, 128, 32)), False),
])
def test_a_transposed_product_folds_where_xla_folds_it(name: str, fn, shapes, folds: bool) -> None:  # type: ignore[no-untyped-def]
    """Oracle: XLA's compiled module computes a matrix product transposed (no transpose or copy
    left) but copies a batched product's transpose; the estimate prices the first transpose as no
    kernel and no bytes, and the second as the copy it is."""
    from hlomap.cost.compute import emits_no_kernel, folds_into_product, instruction_cost
    from hlomap.hlo.capture import capture

    args = [jnp.ones(s, jnp.float32) for s in shapes]
    assert (_xla_copies(fn, *args) == 0) == folds
    entry = capture(fn, *args).module.entry
    transpose = next(i for i in entry.instructions if i.opcode == "transpose")
    assert folds_into_product(transpose, entry) == emits_no_kernel(transpose, entry) == folds
    cost = instruction_cost(transpose, entry, capture(fn, *args).module, device_preset("V100-16GB"))
    assert (cost.bytes_accessed == 0 and cost.seconds == 0) == folds


def _weight_gradient(x: jax.Array, dy: jax.Array) -> jax.Array:
    """A weight gradient as JAX writes one: the batch contracted, then the product transposed."""
    return jnp.dot(x.T, dy).T * 2.0


def test_a_transposed_product_runs_once_the_plan_all_reduces_the_product() -> None:
    """Oracle: with the batch split over 8 devices, XLA's compiled module all-reduces the product
    as the dot computed it and keeps the transpose after the all-reduce; on one device it folds
    the transpose away. The estimate prices the transpose as a copy in the first plan and leaves
    it out of the second."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from hlomap.cost.estimate import instruction_arrays
    from hlomap.cost.memory import Fusion, fused_nodes
    from hlomap.cost.sharding import ShardedGraph
    from hlomap.hlo.capture import capture
    from hlomap.propagation.conflicts import MeshAxes
    from hlomap.propagation.graph import FactorGraph

    x, dy = jnp.ones((256, 128), jnp.float32), jnp.ones((256, 32), jnp.float32)
    split = NamedSharding(Mesh(np.array(jax.devices()[:8]), ("data",)), PartitionSpec("data"))
    sharded_text = jax.jit(_weight_gradient, in_shardings=(split, split)).lower(x, dy).compile().as_text()
    all_reduce = next(line for line in sharded_text.splitlines() if " all-reduce(" in line)
    assert "= f32[128,32]" in all_reduce  # the product as the dot computed it, not transposed
    assert any(" transpose(" in line for line in sharded_text.splitlines())  # in the fusion after it
    assert _xla_copies(_weight_gradient, x, dy) == 0

    module = capture(_weight_gradient, x, dy).module
    graph = FactorGraph.build(module)
    transpose = next(i for i in module.entry.instructions
                     if i.opcode == "transpose" and module.entry[i.operands[0]].opcode == "dot")
    node = graph.node_of(module.entry.name, transpose.name)
    device = device_preset("V100-16GB")
    batch = graph.group_of_dim[graph.tensor_dims(graph.entry_parameter_tensors[0])[0]]
    priced = {}
    for name, group in (("data-parallel", 0), ("one device", -1)):
        plan = np.full(graph.num_groups, -1, dtype=np.int64)
        plan[batch] = group
        sg = ShardedGraph.build(graph, plan, MeshAxes.from_mesh({"data": 8}))
        arrays = instruction_arrays(sg, device, {}, fused_nodes(sg, Fusion.ELEMENTWISE), {})
        rows = np.flatnonzero(arrays.node == node)
        priced[name] = float(arrays.bytes_accessed[rows].sum()) if len(rows) else None
    assert priced["data-parallel"] == 2 * transpose.shape.byte_size  # its operand read, its result written
    assert priced["one device"] is None


def test_an_operand_read_twice_is_read_once() -> None:
    """`x * x` reads x once: the estimate's bytes of the squaring kernel are x and its result."""
    from hlomap.cost.estimate import instruction_arrays
    from hlomap.cost.memory import Fusion, fused_nodes
    from hlomap.cost.sharding import ShardedGraph
    from hlomap.hlo.capture import capture
    from hlomap.propagation.conflicts import REPLICATED, MeshAxes
    from hlomap.propagation.graph import FactorGraph

    x = jnp.ones((1024, 256), jnp.float32)
    graph = FactorGraph.from_capture(capture(lambda v: v * v, x))
    sg = ShardedGraph.build(graph, np.full(graph.num_groups, REPLICATED, dtype=np.intp), MeshAxes.from_mesh({"data": 1}))
    arrays = instruction_arrays(sg, device_preset("V100-16GB"), {}, fused_nodes(sg, Fusion.ELEMENTWISE), {})
    square = [k for k, n in enumerate(arrays.node) if graph.nodes[int(n)].instruction.opcode == "multiply"]
    assert len(square) == 1 and arrays.bytes_accessed[square[0]] == 2 * x.nbytes
