"""Search problems over the search drivers: sharding (opp, adp, hybrid), pipeline cuts, the joint
pipeline x tensor x data task, device placement and re-planning.

`Task` names what an explorer decides; it is the one enum of tasks, shared by the API, the
decorator and the sharding explorers (which take only its sharding subset, `sharding_task`).
"""

from __future__ import annotations

import enum

__all__ = ["SHARDING_TASKS", "Task", "sharding_task"]


class Task(str, enum.Enum):
    """What the search decides (`hlomap.api.explore`'s task)."""

    OPP = "opp"  # tensor parallelism of the trainable variables
    ADP = "adp"  # data parallelism of the inputs
    HYBRID = "hybrid"  # both, on a data x model mesh
    PIPELINE = "pipeline"  # stage cuts
    AUTO = "auto"  # stages x data x model, jointly

    @property
    def plans_its_mesh(self) -> bool:
        """The pipeline and joint planners choose the meshes themselves: the mesh says only how
        many devices they get."""
        return self in (Task.PIPELINE, Task.AUTO)

    def __str__(self) -> str:
        return self.value


#: The tasks one sharding plan over a single mesh answers (Auto-MAP sections 3.2-3.4).
SHARDING_TASKS = frozenset({Task.OPP, Task.ADP, Task.HYBRID})


def sharding_task(task: Task | str) -> Task:
    """`task` as one of the sharding explorers' tasks; a clear error for anything else (the
    pipeline and joint tasks have explorers of their own)."""
    try:
        parsed = Task(task)
    except ValueError:
        raise ValueError(f"unknown task {task!r}; the tasks are {', '.join(t.value for t in Task)}") from None
    if parsed not in SHARDING_TASKS:
        names = ", ".join(sorted(t.value for t in SHARDING_TASKS))
        raise ValueError(f"task {parsed.value!r} is not a sharding task ({names}); "
                         f"explore it with its own explorer (hlomap.api.explore(..., task={parsed.value!r}))")
    return parsed
