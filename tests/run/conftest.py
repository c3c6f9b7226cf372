"""Fixtures of the runner's tests: zoo steps with their capture, HLO chain and real arguments."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import pytest


class ZooCase(NamedTuple):
    model: Any  # hlomap.zoo.ZooModel
    cap: Any  # Capture of its train step
    chain: Any  # StepChain (pivots the explorer cuts at)
    args: tuple[Any, ...]  # example (params, opt_state, batch), seed 0


@pytest.fixture(scope="session")
def zoo_case(cap_of: Callable[[str], Any]) -> Callable[[str], ZooCase]:
    """zoo name -> ZooCase (memoized for the session)."""
    from hlomap import zoo
    from tests.run.helpers import chain_of

    cache: dict[str, ZooCase] = {}

    def get(name: str) -> ZooCase:
        if name not in cache:
            cap = cap_of(name)
            model = zoo.get(name)
            cache[name] = ZooCase(model, cap, chain_of(cap), tuple(model.example_args(seed=0)))
        return cache[name]

    return get
