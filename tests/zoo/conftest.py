"""Fixtures shared by the zoo tests."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from tests.zoo.abstract_cache import abstract_with_allocation


@pytest.fixture(scope="session")
def abstract_args_of() -> Callable[[str], tuple[Any, Any, Any]]:
    """name -> the entry's abstract (params, opt_state, batch), computed once per session.
    Callers must not mutate the returned dicts."""
    return lambda name: abstract_with_allocation(name).args
