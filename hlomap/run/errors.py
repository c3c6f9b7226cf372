"""The runner's errors: a user can cause every one of them, and each message says why."""

from __future__ import annotations

__all__ = ["RunError", "SplitError"]


class RunError(ValueError):
    """A plan, step or batch the runner cannot run as asked (the message names the value and
    where it came from)."""


class SplitError(RunError):
    """A train step that cannot be split into pipeline stages (no marked gradient, several, a
    loss that is not a scalar, an update that mixes the state of two stages...)."""
