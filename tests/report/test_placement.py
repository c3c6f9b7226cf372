"""The placement reports' wording."""

from __future__ import annotations

from hlomap.plan import Placement
from hlomap.report.placement import placement_line


def test_a_placement_s_gain_over_the_identity_order_reads_in_words() -> None:
    placement = Placement((1, 0), cluster="torus:2x1", solver="greedy")
    assert placement_line(placement, 297e-6, 549e-6).endswith("(placed: 45.9% less time)")
    assert placement_line(placement, 600e-6, 500e-6).endswith("(placed: 20.0% more time)")
    assert placement_line(placement, 500e-6, 500e-6).endswith("(placed: the same)")
