"""The pipeline model of a captured train step: chain, pivots, and C / A / W conservation."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hlomap.cost.compute import instruction_cost
from hlomap.cost.devices import device_preset
from hlomap.hlo.capture import Phase, Role, capture, instruction_phase
from hlomap.cost.pipeline.profile import merge_layers
from hlomap.cost.pipeline.chain import (
    PivotOptions,
    chain_arrays,
    forward_chain,
    step_chain,
    thin_pivots,
)
from hlomap.hlo.graph import topological_order
from tests.tasks.pipeline.strategies import profiles

BATCH, WIDTH, DEPTH = 16, 64, 4
DEVICE = device_preset("V100-16GB")


def _train_step(params, batch):
    def loss_fn(params):
        h = batch["x"]
        for i in range(DEPTH):
            with jax.named_scope(f"dense_{i}"):
                h = jnp.tanh(h @ params[f"w{i}"] + params[f"b{i}"])
        return jnp.mean((h - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


@pytest.fixture(scope="module")
def mlp():
    params = {}
    for i in range(DEPTH):
        params[f"w{i}"] = jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)
        params[f"b{i}"] = jax.ShapeDtypeStruct((WIDTH,), jnp.float32)
    batch = {"x": jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32),
             "y": jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32)}
    return capture(_train_step, params, batch)


def test_chain_is_forward_and_time_and_parameters_are_conserved(mlp):
    chain = chain_arrays(mlp, DEVICE)
    entry = mlp.module.entry
    names = set(chain.profile.names)
    assert all(instruction_phase(entry[name]) is Phase.FORWARD for name in names)
    # Every forward and backward instruction's time lands somewhere, once; updates are apart.
    totals = {phase: 0.0 for phase in Phase}
    for inst in entry.instructions:
        totals[instruction_phase(inst)] += instruction_cost(inst, entry, mlp.module, DEVICE).seconds
    profile = chain.profile
    assert profile.forward_time.sum() + profile.backward_time.sum() == pytest.approx(
        totals[Phase.FORWARD] + totals[Phase.BACKWARD], rel=1e-12)
    assert profile.backward_time.sum() > profile.forward_time.sum() > 0
    trainable = sum(p.byte_size for p in mlp.parameters if p.role is Role.TRAINABLE)
    assert profile.parameter_bytes.sum() == trainable == DEPTH * (WIDTH * WIDTH + WIDTH) * 4
    # The update is priced as one fused pass over the parameters, their gradients and their state
    # (every byte moved once), below its instructions priced one by one, and per parameter byte.
    state = sum(p.byte_size for p in mlp.parameters if p.role is Role.OPTIMIZER_STATE)
    assert chain.update_seconds == pytest.approx((3 * trainable + 2 * state) / DEVICE.hbm_bandwidth, rel=1e-12)
    assert 0 < chain.update_seconds < totals[Phase.UPDATE]
    assert profile.update_time.sum() == pytest.approx(chain.update_seconds, rel=1e-12)


def _chain_by_walks(entry):
    """The forward chain by its definition: the ancestors of the first forward sink with the
    most of them, one walk per sink."""
    forward = [inst for inst in topological_order(entry) if instruction_phase(inst) is Phase.FORWARD]
    by_name = {inst.name: inst for inst in forward}
    read = {o for inst in forward for o in inst.operands if o in by_name}
    best: set[str] = set()
    for sink in (inst.name for inst in forward if inst.name not in read):
        seen, stack = {sink}, [sink]
        while stack:
            for operand in by_name[stack.pop()].operands:
                if operand in by_name and operand not in seen:
                    seen.add(operand)
                    stack.append(operand)
        if len(seen) > len(best):
            best = seen
    return [inst.name for inst in forward if inst.name in best]


@pytest.mark.parametrize("name", ["mlp", "gpt-small"])
def test_the_forward_chain_is_the_largest_sinks_ancestors(mlp, zoo_capture, name):
    """`forward_chain` finds the sink with the most ancestors from one pass over the graph (a bit
    per sink); a walk per sink gives the same chain, on a step with residual side sinks too."""
    cap = mlp if name == "mlp" else zoo_capture(name)
    chain = [inst.name for inst in forward_chain(cap.module.entry)]
    assert chain == _chain_by_walks(cap.module.entry)
    assert len(chain) > 10


def test_each_weight_is_charged_at_its_first_use_with_its_gradient(mlp):
    chain = chain_arrays(mlp, DEVICE)
    entry = mlp.module.entry
    names = chain.profile.names
    for p in mlp.parameters:
        weights = tuple(f"w{i}" for i in range(DEPTH))
        if p.role is not Role.TRAINABLE or not p.path.endswith(weights):
            continue
        first = next(i for i, name in enumerate(names) if p.name in entry[name].operands)
        assert chain.profile.parameter_bytes[first] >= p.byte_size
        # The weight gradient dot (x^T g) is charged where the forward dot reads x, not where
        # x was made (the previous layer's tanh).
        assert entry[names[first]].opcode == "dot"
        assert chain.profile.backward_time[first] > 0


def test_each_parameter_array_is_one_buffer_of_its_layers_gradient_all_reduce(mlp):
    """A stage's gradient all-reduce combines one buffer per trainable array: the profile counts
    each weight and bias once, at the layer that owns its bytes, and merging keeps the count."""
    profile = chain_arrays(mlp, DEVICE).profile
    assert profile.gradient_buffers.sum() == 2 * DEPTH
    np.testing.assert_array_equal(profile.gradient_buffers > 0, profile.parameter_bytes > 0)
    merged = merge_layers(profile, [profile.n_pivots // 2])
    assert merged.gradient_buffers.sum() == 2 * DEPTH
    assert merged.gradient_buffers_of(slice(0, 1)) == profile.gradient_buffers_of(slice(0, profile.n_pivots // 2 + 1))


def test_each_weight_gradient_transposes_after_the_all_reduce_on_replicas(mlp):
    """Each weight's gradient is a product XLA all-reduces untransposed over a stage's replicas
    and transposes after (folded on one replica): the profile prices one such copy per weight, at
    the layer its gradient is charged to, and merging keeps the sum."""
    from hlomap.cost.compute import transposed_product_cost

    profile = chain_arrays(mlp, DEVICE).profile
    entry = mlp.module.entry
    copies = [transposed_product_cost(inst, entry, DEVICE).seconds for inst in entry.instructions
              if inst.opcode == "transpose" and entry[inst.operands[0]].opcode == "dot"
              and inst.shape.dims == (WIDTH, WIDTH)]
    assert len(copies) == DEPTH and min(copies) > 0
    assert np.count_nonzero(profile.replica_transposes) == DEPTH
    assert profile.replica_transposes.sum() == pytest.approx(sum(copies))
    np.testing.assert_array_equal(profile.replica_transposes > 0, (profile.backward_time > 0) & (profile.parameter_bytes > 0))
    merged = merge_layers(profile, [profile.n_pivots // 2])
    assert merged.replica_transposes.sum() == pytest.approx(profile.replica_transposes.sum())


def test_pivots_between_layers_carry_one_activation(mlp):
    hlo = step_chain(mlp, DEVICE)
    activation = BATCH * WIDTH * 4
    boundaries = [p for p in hlo.pivots if p.live_tensors == 1
                  and p.crossing_bytes == activation]
    # After each of the first DEPTH - 1 layers' tanh only its output crosses.
    tanh_cuts = [p for p in boundaries if p.layer.endswith("tanh")]
    assert len(tanh_cuts) >= DEPTH - 1
    assert [p.instruction for p in hlo.pivots] == [
        hlo.chain.profile.names[p.position] for p in hlo.pivots]
    assert hlo.describe_cuts([0])[0] == str(hlo.pivots[0])


def test_every_pivot_names_its_layer_scope_and_source_line(mlp):
    hlo = step_chain(mlp, DEVICE)
    scopes = {p.scope for p in hlo.pivots}
    dense = {f"dense_{i}" for i in range(DEPTH)}
    # The dense layers are named scopes; the loss (mean of squares) is traced outside any
    # scope, so its pivots name the layer before them.
    assert dense <= scopes <= dense | {f"after dense_{DEPTH - 1}"}
    for p in hlo.pivots:
        # JAX's stack frames point at _train_step in this file.
        assert re.fullmatch(r".*test_chain\.py:\d+", p.source or ""), p.source


def test_merged_profile_keeps_the_chain_totals(mlp):
    hlo = step_chain(mlp, DEVICE, options=PivotOptions(max_pivots=3))
    assert len(hlo.pivots) <= 3 == hlo.profile.n_pivots
    chain = hlo.chain.profile
    for field in ("forward_time", "backward_time", "parameter_bytes", "stash_bytes"):
        assert getattr(hlo.profile, field).sum() == pytest.approx(getattr(chain, field).sum())
    assert list(hlo.profile.activation_bytes) == [p.crossing_bytes for p in hlo.pivots]


def test_a_step_without_jax_metadata_is_refused(mlp):
    from hlomap.hlo.capture import from_module
    from hlomap.hlo.parser import parse

    bare = parse("HloModule m\nENTRY e {\n  p = f32[2] parameter(0)\n"
                 "  ROOT n = f32[2] negate(p)\n}\n")
    with pytest.raises(ValueError, match="no forward instructions"):
        step_chain(from_module(bare), DEVICE)


@settings(max_examples=60, deadline=None)
@given(profile=profiles(min_layers=2, max_layers=12), limit=st.integers(1, 6), data=st.data())
def test_thinning_keeps_at_most_the_limit_and_the_cheapest_of_free_runs(profile, limit, data):
    candidates = data.draw(st.lists(st.integers(0, profile.n_pivots - 1), max_size=12))
    kept = thin_pivots(profile, candidates, limit)
    assert len(kept) <= max(limit, 0) and kept == sorted(set(kept))
    assert set(kept) <= set(candidates)
    if candidates:
        assert kept
    # Merging at the kept pivots never changes totals.
    merged = merge_layers(profile, kept)
    assert merged.compute_time.sum() == pytest.approx(profile.compute_time.sum())


def test_thinning_bins_follow_compute_and_prefer_few_bytes():
    from hlomap.cost.pipeline.profile import PipelineProfile

    # 9 layers; one huge layer at the end, as an LM head.
    compute = np.array([1.0] * 8 + [100.0])
    crossing = np.array([5.0, 1.0, 5.0, 5.0, 1.0, 5.0, 5.0, 1.0])
    profile = PipelineProfile(tuple(f"l{i}" for i in range(9)), compute, np.zeros(9), crossing,
                              np.zeros(9))
    kept = thin_pivots(profile, range(8), 3)
    assert kept == [1, 4, 7]  # the cheap cuts, spread over the small layers
