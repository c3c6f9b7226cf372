"""What `hlomap zoo list` shows: the zoo's models in a table."""

from __future__ import annotations

from typing import Any, Sequence

from hlomap.report.units import human_count

__all__ = ["format_zoo"]


def format_zoo(entries: Sequence[Any]) -> Any:
    """A rich table of `api.ZooEntry`s: name, family, parameter count, description."""
    from rich.table import Table

    table = Table(title="hlomap model zoo", show_edge=False)
    table.add_column("name")
    table.add_column("family")
    table.add_column("parameters", justify="right")
    table.add_column("description")
    for entry in entries:
        table.add_row(entry.name, entry.family, human_count(entry.parameters), entry.description)
    return table
