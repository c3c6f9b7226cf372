"""The one output comparison: tolerance rule, NaN rule, failing leaves, isolated mismatches."""

from __future__ import annotations

import numpy as np
import pytest

from hlomap.verify.numerics import Tolerance, compare_outputs


def test_equal_trees_and_the_tolerance_rule() -> None:
    want = {"w": np.linspace(1.0, 2.0, 10), "b": np.zeros(3)}
    same = compare_outputs(want, want)
    assert same.ok and same.leaves == 2 and same.max_abs_error == 0.0 and same.worst_leaf == ""
    # |got - want| <= atol + rtol |want|: 1e-5 + 1e-4 * 2 at the largest element
    inside = compare_outputs({"w": want["w"] + 1e-5, "b": want["b"] + 0.9e-5}, want)
    assert inside.ok and inside.max_abs_error == pytest.approx(1e-5)
    outside = compare_outputs({"w": want["w"], "b": want["b"] + 2e-5}, want)
    assert not outside.ok and outside.failing_leaves == ("['b']",)
    assert outside.mismatched_elements == 3 and outside.worst_leaf == "['b']"
    assert "leaf 0 ['b']: 3 of 3 elements" in str(outside.failing[0])  # leaves in tree order: b, w


def test_relative_error_is_taken_over_elements_beyond_atol() -> None:
    want = np.array([1e-9, 1.0])
    got = np.array([2e-9, 1.001])  # 100% off below atol, 0.1% off above it
    result = compare_outputs(got, want)
    assert result.max_rel_error == pytest.approx(1e-3)
    assert result.failing_leaves == ("",)  # a bare array is the root leaf


def test_one_nan_rule() -> None:
    want = np.array([np.nan, np.inf, 1.0])
    assert compare_outputs(want.copy(), want).ok  # NaN == NaN, inf == inf
    one_sided = compare_outputs(np.array([0.0, np.inf, 1.0]), want)
    assert not one_sided.ok and one_sided.max_abs_error == np.inf and one_sided.max_rel_error == np.inf
    other_inf = compare_outputs(np.array([np.nan, 1e300, 1.0]), want)
    assert not other_inf.ok  # an infinite reference does not make every value close


def test_per_leaf_tolerance() -> None:
    want = {"small": np.full(4, 1e-3), "large": np.full(4, 1e3)}
    got = {"small": want["small"] + 1e-8, "large": want["large"] + 1e-2}  # both 1e-5 of their scale
    assert compare_outputs(got, want, Tolerance(rtol=0.0, atol=1e-5)).failing_leaves == ("['large']",)

    def scale_relative(path: str, reference: np.ndarray) -> Tolerance:
        return Tolerance(rtol=0.0, atol=1e-4 * float(np.abs(reference).max()))

    seen = compare_outputs(got, want, scale_relative)
    assert seen.ok and seen.leaves == 2


def test_isolated_mismatches() -> None:
    want = np.zeros(100_000)
    one = want.copy()
    one[7] = 5e-5
    isolated = compare_outputs(one, want)
    assert not isolated.ok and isolated.isolated_only and isolated.worst_fraction == 1e-5
    block = want.copy()
    block[:100] = 5e-5
    assert not compare_outputs(block, want).isolated_only
    big = want.copy()
    big[7] = 1e-3
    assert not compare_outputs(big, want).isolated_only
    # in a small leaf a single element is isolated too (more than 1e-4 of 4,096 elements), two are not
    small = np.zeros(4096)
    small[9] = 5e-5
    assert compare_outputs(small, np.zeros(4096)).isolated_only
    small[10] = 5e-5
    assert not compare_outputs(small, np.zeros(4096)).isolated_only


def test_structure_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="2 output leaves, the reference 1"):
        compare_outputs((np.zeros(2), np.zeros(2)), (np.zeros(2),))
    with pytest.raises(ValueError, match=r"shape \(3,\), the reference's \(2,\)"):
        compare_outputs(np.zeros(3), np.zeros(2))
