"""Shared fixtures: captured zoo steps, factor graphs and 1-D / 2-D mesh axes, built once."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from hlomap.propagation.conflicts import MeshAxes


@pytest.fixture(scope="session")
def cap_of() -> Callable[[str], Any]:
    """zoo name -> Capture (memoized for the session)."""
    from hlomap.source import load_source

    cache: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in cache:
            cache[name] = load_source(f"zoo:{name}")
        return cache[name]

    return get


@pytest.fixture(scope="session")
def graph_of(cap_of: Callable[[str], Any]) -> Callable[[str], Any]:
    """zoo name -> FactorGraph (memoized for the session)."""
    from hlomap.propagation.graph import FactorGraph

    cache: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in cache:
            cache[name] = FactorGraph.from_capture(cap_of(name))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def axes8() -> MeshAxes:
    return MeshAxes.from_mesh({"model": 8})


@pytest.fixture(scope="session")
def axes2x4() -> MeshAxes:
    return MeshAxes.from_mesh({"data": 2, "model": 4})
