"""When a search stops."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Budget"]


@dataclass(frozen=True)
class Budget:
    """When a search stops: whichever limit comes first (None: no limit of that kind; with
    none, only drivers that end by themselves, exact and greedy, accept it).

    evaluations: complete plans scored (every episode, greedy candidate or enumerated plan);
    episodes: learning episodes of a learned driver (its greedy checks not counted);
    settle: a budgeted search (DQN, random) also stops once it has nothing left to find: its best
    plan reached the task's proven optimum, or it has scored every plan of a small space.
    """

    seconds: float | None = 60.0
    evaluations: int | None = None
    episodes: int | None = None
    settle: bool = True

    def __post_init__(self) -> None:
        for name in ("seconds", "evaluations", "episodes"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"budget {name} = {value!r} must be positive (or None for no limit)")

    @property
    def unlimited(self) -> bool:
        return self.seconds is None and self.evaluations is None and self.episodes is None

    def require_limit(self, driver: str) -> None:
        if self.unlimited:
            raise ValueError(f"the {driver} driver needs a budget in seconds, evaluations or episodes")
