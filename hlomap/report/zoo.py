"""What `hlomap zoo list` shows: the zoo's models in a table."""

from __future__ import annotations

from typing import Any, Sequence

from hlomap.report.units import human_count

__all__ = ["format_zoo"]


def format_zoo(entries: Sequence[Any]) -> Any:
    """A rich table of `api.ZooEntry`s: name, family, parameter count, compute dtype, description."""
    from rich.table import Table

    table = Table(title="hlomap model zoo", show_edge=False,
                  caption="params and optimizer state are float32; zoo:NAME:float32 or zoo:NAME:bfloat16 "
                          "picks the compute dtype")
    table.add_column("name")
    table.add_column("family")
    table.add_column("parameters", justify="right")
    table.add_column("compute")
    table.add_column("description")
    for entry in entries:
        table.add_row(entry.name, entry.family, human_count(entry.parameters), entry.compute_dtype,
                      entry.description)
    return table
