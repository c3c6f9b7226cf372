"""Small re-planning setups for the tests."""

from __future__ import annotations

from hlomap.tasks.replan.options import Workload, transformer_workload


def small_workload(seed: int = 0) -> Workload:
    """A 6-layer model (8 blocks) whose DP runs in a blink on 8 devices."""
    return transformer_workload(layers=6, hidden=1024, seq=1024, microbatch=2, microbatches=8, seed=seed)
