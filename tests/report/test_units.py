"""The shared number formats every report uses."""

from __future__ import annotations

import pytest

from hlomap.report.units import counted, human_bytes, human_seconds


@pytest.mark.parametrize(("n", "noun", "text"), [
    (1, "stage", "1 stage"), (4, "stage", "4 stages"), (0, "stage", "0 stages"),
    (1, "microbatch", "1 microbatch"), (8, "microbatch", "8 microbatches"), (2, "device", "2 devices"),
])
def test_counted_takes_the_noun_in_its_number(n: int, noun: str, text: str) -> None:
    assert counted(n, noun) == text


def test_units_scale_to_the_largest_unit_below_the_value() -> None:
    assert human_bytes(3 * 2**20) == "3.00 MiB"
    assert human_bytes(512) == "512 B"
    assert human_seconds(0.0125) == "12.50 ms"
    assert human_seconds(2e-9) == "2 ns"
