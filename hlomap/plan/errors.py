"""The plan package's error: a plan, plan file, built-in plan name or mesh that cannot be used."""

from __future__ import annotations

__all__ = ["PlanError"]


class PlanError(ValueError):
    """A plan, built-in plan name or mesh that cannot be resolved (the message says why and where)."""
