"""The comparison rule: gradients per leaf relative to its scale, updates only above noise, and
the unsharded reference itself."""

from __future__ import annotations

import jax
import numpy as np

from hlomap.run.compare import (LeafDiff, LeafGroupCheck, StepCheck, compare_loss, compare_scaled, compare_updates,
                                reference_gradients)
from tests.run.user_step import make


def test_each_leaf_is_held_to_its_own_scale() -> None:
    big = np.array([1.0, -2.0, 3.0])
    small = np.array([1e-3, -2e-3, 3e-3])
    ok = compare_scaled("gradients", [big + 1e-5, small + 1e-7], [big, small], ["big", "small"])
    assert ok.ok
    # 1e-6 is nothing next to the big leaf's scale, but 3e-4 of the small leaf's: caught.
    bad = compare_scaled("gradients", [big, small + 1e-6], [big, small], ["big", "small"])
    assert not bad.ok and bad.failing == ("small",) and "small" in bad.words()
    # A leaf that is zero in exact arithmetic is held to the rounding of the others.
    noise = compare_scaled("gradients", [big, np.array([3e-9])], [big, np.array([-2e-9])], ["big", "zero"])
    assert noise.ok


def test_updates_are_compared_where_the_gradient_is_above_noise() -> None:
    before = np.zeros(4)
    grads = np.array([1.0, -0.5, 1e-9, 0.0])  # the last two: noise, Adam makes them +-lr either way
    expected = np.array([-1e-3, 1e-3, -1e-3, 1e-3])
    actual = np.array([-1e-3, 1e-3, 1e-3, -1e-3])
    assert compare_updates("updates", [actual], [expected], [before], [grads], ["w"]).ok
    actual[1] = -1e-3  # a real sign error where the gradient is large
    assert not compare_updates("updates", [actual], [expected], [before], [grads], ["w"]).ok


def test_a_float32_difference_is_rounding_only_if_float64_agrees_and_float32_itself_is_off() -> None:
    def comparison(ok: bool) -> LeafGroupCheck:
        return LeafGroupCheck("gradients", 1e-4, (LeafDiff("w", 0.0 if ok else 1.0, 1.0, ok),))

    assert StepCheck((comparison(True),), (), 0.0).ok
    differs = (comparison(False),)
    assert StepCheck(differs, (), 0.0, (comparison(True),), comparison(False)).rounding
    assert not StepCheck(differs, (), 0.0, (comparison(False),), comparison(False)).ok  # wrong in float64 too
    assert not StepCheck(differs, (), 0.0, (comparison(True),), comparison(True)).ok  # float32 was fine alone


def test_the_reference_is_jax_value_and_grad_and_microbatches_average() -> None:
    step, args = make()
    from tests.run.user_step import _loss

    loss, grads = jax.jit(jax.value_and_grad(_loss))(args[0], args[2])
    whole = reference_gradients(step, args, 1)
    np.testing.assert_allclose(whole.loss, loss, rtol=1e-6)
    for a, b in zip(whole.grads, jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    halves = reference_gradients(step, args, 2)  # a mean-squared loss: the mean of halves is the whole
    np.testing.assert_allclose(halves.loss, loss, rtol=1e-6)
    assert compare_scaled("gradients", halves.grads, whole.grads, [str(i) for i in range(len(whole.grads))]).ok


def test_the_words_say_each_leaf_only_for_several() -> None:
    assert "within 1e-05 of its scale (worst loss" in compare_loss(np.float32(2.0), np.float32(2.0)).words()
    two = compare_scaled("gradients", [np.ones(2), np.ones(2)], [np.ones(2), np.ones(2)], ["a", "b"])
    assert "of each leaf's scale" in two.words()
