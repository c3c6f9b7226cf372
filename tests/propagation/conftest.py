"""Shared fixtures: captured zoo steps and their factor graphs, built once per session."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def zoo_capture():
    """name -> Capture of the zoo entry's train step (memoized)."""
    import hlomap
    from hlomap import zoo

    cache: dict[str, Any] = {}

    def get(name: str):
        if name not in cache:
            entry = zoo.get(name)
            cache[name] = hlomap.capture(entry.train_step(), *entry.abstract_args())
        return cache[name]

    return get


@pytest.fixture(scope="session")
def zoo_graph(zoo_capture):
    """name -> FactorGraph of the zoo entry's train step (memoized)."""
    from hlomap.propagation import FactorGraph

    cache: dict[str, Any] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = FactorGraph.from_capture(zoo_capture(name))
        return cache[name]

    return get
