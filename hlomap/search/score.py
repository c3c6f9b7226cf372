"""How every search compares plans: a `Score`, maximized, with a tie-break.

The tasks decide what a score means (Auto-MAP's dim-counting reward, a speedup under the cost
model, the ideal pipeline latency over a plan's latency); the drivers only compare `key`s, so
one driver serves every task.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Score", "WORST"]


class Score(NamedTuple):
    """A plan's score. Compare with `key`: value first, then the tie-break.

    conflict_free: the plan is a plan at all (a sharding episode that conflicted is not);
      only conflict-free plans can become a search's best.
    fits: the plan fits in device memory (an overflowing plan scores below every fitting one).
    step_time, memory: what the cost model says (seconds, peak bytes per device), when known.
    """

    value: float
    tiebreak: float = 0.0
    conflict_free: bool = True
    fits: bool = True
    step_time: float | None = None
    memory: float | None = None

    @property
    def key(self) -> tuple[float, float]:
        # rounded so that sums of the same rewards taken in another order compare equal
        return (round(self.value, 9), self.tiebreak)

    def to_json(self) -> dict[str, object]:
        return {k: v for k, v in self._asdict().items() if v is not None}


WORST = Score(float("-inf"), float("-inf"), False, False)
