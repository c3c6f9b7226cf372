"""What a measured selection shows: every timed candidate's predicted and measured step time,
the chosen one marked, and the conditions they were timed under."""

from __future__ import annotations

from typing import Any

from hlomap.plan import Measurement
from hlomap.report.units import human_seconds

__all__ = ["format_measurement", "measurement_summary"]


def _seconds(value: float | None) -> str:
    return "-" if value is None else human_seconds(value)


def measurement_summary(measurement: Measurement) -> str:
    """One line: what was chosen, on what, how long measuring took and the load it ran under."""
    load = ", ".join(f"{x:.2f}" for x in measurement.load_average)
    timed = sum(not c.failed for c in measurement.candidates)
    return (f"measured {timed} of {len(measurement.candidates)} candidates on {measurement.devices} "
            f"{measurement.platform} device(s) in {measurement.seconds:.1f} s (load average {load}): "
            f"chose {measurement.chosen}")


def format_measurement(measurement: Measurement) -> Any:
    """A rich table, one row per candidate: family, predicted and measured step (median, IQR,
    rounds), or the error of one that failed; the chosen row marked."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title="measured candidates", header_style="bold")
    for column, justify in (("", "left"), ("candidate", "left"), ("family", "left"), ("predicted", "right"),
                            ("measured", "right"), ("IQR", "right"), ("rounds", "right")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for c in measurement.candidates:
        mark = "*" if c.name == measurement.chosen else ""
        if c.failed:
            table.add_row(mark, c.name, c.family, _seconds(c.predicted_seconds), Text(f"failed: {c.error}", style="red"),
                          "", "")
            continue
        table.add_row(mark, c.name, c.family, _seconds(c.predicted_seconds), _seconds(c.median_seconds),
                      _seconds(c.iqr_seconds), str(c.rounds), style="bold green" if mark else None)
    return Group(table, Text(measurement_summary(measurement)))
