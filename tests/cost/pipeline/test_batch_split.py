"""The part of a layer's time a split batch does not shrink (`hlomap.cost.pipeline.batch_split`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hlomap.cost.devices import DeviceSpec
from hlomap.cost.pipeline.batch_split import batch_split, fixed_fraction, split_degree
from hlomap.cost.pipeline.chain import chain_arrays
from hlomap.cost.pipeline.profile import replicated_seconds, scale_batch
from hlomap.hlo.capture import Phase, capture, instruction_phase

WIDTH = 256
#: A device whose compute is free: every instruction is priced by the bytes it moves, so the
#: fixed part of a matmul is exactly its weight's share of them.
MEMORY_BOUND = DeviceSpec("memory-bound", {"f32": 1e30}, hbm_bandwidth=1e9, memory_bytes=1e12)
#: A device whose memory is free: every instruction is priced by its flops, all of which scale.
COMPUTE_BOUND = DeviceSpec("compute-bound", {"f32": 1e9}, hbm_bandwidth=1e30, memory_bytes=1e12)


def _step(params, x):
    def loss_fn(params):
        return jnp.mean(jnp.tanh(x @ params["w"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def _capture(batch: int):
    return capture(_step, {"w": jnp.ones((WIDTH, WIDTH))}, jnp.ones((batch, WIDTH)))


def _forward_dot(cap):
    return next(i for i in cap.module.entry.instructions
                if i.opcode == "dot" and instruction_phase(i) is Phase.FORWARD)


@given(t_1=st.floats(1e-6, 1.0), share=st.floats(0.0, 1.0), k=st.sampled_from([2, 4, 8]))
def test_the_fraction_is_the_intercept_of_the_line_through_both_prices(t_1, share, k):
    fixed = share * t_1
    t_k = replicated_seconds(t_1, fixed, k)
    assert fixed_fraction(t_1, t_k, k) == pytest.approx(share, abs=1e-9)
    # a price that shrinks faster than 1 / k (or grows) is clipped to the plausible range
    assert fixed_fraction(t_1, t_1 / (2 * k), k) == 0.0
    assert fixed_fraction(t_1, 2 * t_1, k) == 1.0


def test_split_degree_divides_the_batch():
    assert [split_degree(b) for b in (32, 12, 6, 7, None, 0)] == [8, 4, 2, None, None, None]


def test_a_memory_bound_matmul_keeps_its_weight_read_on_every_replica():
    """x[b, W] @ w[W, W]: it reads x and w and writes y; only w's read does not shrink with the
    batch, so its fixed share is w's bytes over all the bytes it moves."""
    batch = 32
    cap = _capture(batch)
    dot = _forward_dot(cap)
    shares = batch_split(cap, MEMORY_BOUND).fixed
    weight, activations = WIDTH * WIDTH * 4, 2 * batch * WIDTH * 4
    assert shares[dot.name] == pytest.approx(weight / (weight + activations), rel=1e-6)
    assert batch_split(cap, COMPUTE_BOUND).fixed[dot.name] == pytest.approx(0.0, abs=1e-9)


def test_an_odd_batch_has_no_split_and_keeps_the_linear_scaling():
    split = batch_split(_capture(7), MEMORY_BOUND)
    assert split.fixed == {} and split.syncs.level == {}


def test_the_profile_prices_a_microbatch_on_replicas_as_the_step_at_that_batch():
    """The chain's profile at batch 32, scaled to a microbatch of 8 on 4 replicas (2 examples
    each), prices the forward and the backward as the chain of the same step captured at batch 2
    does, within a few percent (the line through batch 32 and 4 is not exact for every op); the
    old linear scaling priced them at a sixteenth of batch 32's, several times less."""
    whole = chain_arrays(_capture(32), MEMORY_BOUND).profile
    small = chain_arrays(_capture(2), MEMORY_BOUND).profile
    assert (whole.forward_fixed <= whole.forward_time).all()
    layers = slice(0, whole.n_layers)
    forward, backward = scale_batch(whole, 8 / 32).on_replicas(layers, 4)
    assert forward == pytest.approx(small.forward_time.sum(), rel=0.05)
    assert backward == pytest.approx(small.backward_time.sum(), rel=0.05)
    assert forward > 4 * whole.forward_time.sum() / 16
    assert backward > 4 * whole.backward_time.sum() / 16


def test_compute_bound_layers_split_over_replicas_as_before():
    """Priced by flops alone, the matmuls shrink with the batch; only the scalar loss arithmetic
    (the mean's division) is the same on every replica."""
    cap = _capture(32)
    profile = chain_arrays(cap, COMPUTE_BOUND).profile
    dots = [p for p, name in enumerate(profile.names) if name.startswith("dot")]
    assert dots
    np.testing.assert_allclose(profile.forward_fixed[dots], 0.0, atol=1e-15)
    forward, _ = profile.on_replicas(slice(dots[0], dots[0] + 1), 4)
    assert forward == pytest.approx(profile.forward_time[dots[0]] / 4)
    assert profile.forward_fixed.sum() < 1e-6 * profile.forward_time.sum()


def _normalized_step(params, x):
    """Two layers, each normalized over the batch as batch norm does (mean and mean square of
    its output, then a scale): the statistics are reductions over the batch the forward reads on."""
    def loss_fn(params):
        h = x
        for w in (params["w1"], params["w2"]):
            y = h @ w
            mean = jnp.mean(y, axis=0)
            var = jnp.mean(y * y, axis=0) - mean * mean
            h = jnp.tanh((y - mean) / jnp.sqrt(var + 1e-5))
        return jnp.mean(h ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def test_the_passes_all_reduce_the_statistics_over_the_batch_but_not_the_weight_gradients():
    """A split batch all-reduces each layer's statistics in the forward (mean and mean square:
    independent, one level), and the backward all-reduces the sums that flow on to the input
    gradient; a weight's gradient (a batch sum nothing else reads) is left to the stage's
    gradient all-reduce, and the loss's mean is read by nothing. The plain matmul step has none."""
    cap = capture(_normalized_step, {"w1": jnp.ones((WIDTH, WIDTH)), "w2": jnp.ones((WIDTH, WIDTH))},
                  jnp.ones((32, WIDTH)))
    syncs = batch_split(cap, MEMORY_BOUND).syncs
    entry = {i.name: i for i in cap.module.entry.instructions}
    forward_levels = {level for name, level in syncs.level.items()
                      if instruction_phase(entry[name]) is Phase.FORWARD}
    backward_levels = {level for name, level in syncs.level.items()
                       if instruction_phase(entry[name]) is Phase.BACKWARD}
    assert len(forward_levels) == 2  # the two layers' statistics
    assert len(backward_levels) >= 2  # each layer's normalization, differentiated
    assert not any(entry[name].opcode == "dot" for name in syncs.level)  # no weight gradient
    assert all(nbytes <= WIDTH * 4 for nbytes in syncs.nbytes.values())  # a statistic, not a batch
    profile = chain_arrays(cap, MEMORY_BOUND).profile
    assert profile.forward_syncs.sum() == 2 and profile.backward_syncs.sum() == len(backward_levels)
    assert batch_split(_capture(32), MEMORY_BOUND).syncs.level == {}
