"""Built-in plans (data parallel, Megatron, both) derived from roles and the factor graph, and
`resolve_plan`: one (plan array, mesh axes, name) from a Plan, a built-in plan's name or an array."""

from __future__ import annotations

import enum
import math
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from hlomap.plan.errors import PlanError
from hlomap.propagation.conflicts import ConflictChecker, MeshAxes, PlanConflict

if TYPE_CHECKING:
    from hlomap.propagation.graph import FactorGraph

__all__ = ["DATA_AXIS", "DEFAULT_DEVICES", "MODEL_AXIS", "ReferencePlan", "parse_mesh_text", "reference_plan",
           "resolve_plan"]


class ReferencePlan(enum.Enum):
    """Built-in plans, derived from roles and the factor graph (`hlomap.propagation.plans`)."""

    DP = "dp"  # batch of every data input split over the whole mesh
    MEGATRON = "megatron"  # Megatron tensor parallelism over the whole mesh
    HYBRID = "dp+megatron"  # batch on the data axis, Megatron on the model axis


#: Devices a reference plan spans when no mesh is given (one 8-GPU server).
DEFAULT_DEVICES = 8
#: Mesh axis names the reference plans look for first; otherwise the first / last axis.
DATA_AXIS = "data"
MODEL_AXIS = "model"


def parse_mesh_text(text: str) -> int | dict[str, int]:
    """The CLI's --mesh: `"8"` -> 8 (the axis is named by the task or plan: data for dp, model for
    megatron); `"data=2,model=4"` -> {"data": 2, "model": 4}."""
    text = text.strip()
    if text.isdigit():
        if int(text) < 1:
            raise PlanError(f"mesh {text!r}: the device count must be positive")
        return int(text)
    out: dict[str, int] = {}
    for part in text.split(","):
        name, sep, size = part.partition("=")
        if sep and name.strip() and size.strip().isdigit() and int(size) < 1:
            raise PlanError(f"mesh {text!r}: axis {name.strip()!r} has size {int(size)}; sizes must be positive")
        if not sep or not name.strip() or not size.strip().isdigit():
            raise PlanError(f"mesh {text!r}: expected N or NAME=SIZE[,NAME=SIZE...], got {part!r}")
        if name.strip() in out:
            raise PlanError(f"mesh {text!r}: axis {name.strip()!r} given twice")
        out[name.strip()] = int(size)
    return out


def _reference_mesh(kind: ReferencePlan, mesh: Mapping[str, int] | MeshAxes | int | None) -> dict[str, int]:
    """Name a bare device count after the plan kind (8 -> {"data": 8} for dp); no mesh means
    `DEFAULT_DEVICES`."""
    if mesh is None and kind is ReferencePlan.HYBRID:
        raise PlanError(f"plan {kind.value!r} needs its mesh: two named axes, e.g. {DATA_AXIS}=2,{MODEL_AXIS}=4 "
                         "(--mesh on the command line)")
    if mesh is None:
        mesh = DEFAULT_DEVICES
    if isinstance(mesh, int):
        n = mesh
        if kind is ReferencePlan.HYBRID:
            raise PlanError(f"plan {kind.value!r} needs two named mesh axes, e.g. {DATA_AXIS}=2,{MODEL_AXIS}=4; "
                             f"got {n}")
        return {DATA_AXIS if kind is ReferencePlan.DP else MODEL_AXIS: n}
    if isinstance(mesh, MeshAxes):
        return mesh.mesh_shape
    return {str(k): int(v) for k, v in mesh.items()}


def reference_plan(graph: FactorGraph, kind: ReferencePlan | str,
                   mesh: Mapping[str, int] | MeshAxes | int | None) -> tuple[np.ndarray, MeshAxes]:
    """The plan array of a built-in plan. dp and megatron use every mesh axis together (an axis
    option such as ("data", "model") when the mesh has two); dp+megatron splits the batch on the
    `data` axis (else the first) and runs Megatron on the `model` axis (else the last).
    Raises PlanError when the graph lacks what the plan needs (data inputs for dp, trainable
    parameters for megatron: a bare HLO dump needs roles)."""
    try:
        return _reference_plan(graph, ReferencePlan(kind), mesh)
    except PlanError:
        raise
    except ValueError as err:
        raise PlanError(f"plan {ReferencePlan(kind).value!r}: {err}") from None


def _reference_plan(graph: FactorGraph, kind: ReferencePlan,
                    mesh: Mapping[str, int] | MeshAxes | int | None) -> tuple[np.ndarray, MeshAxes]:
    from hlomap.propagation import plans

    shape = _reference_mesh(kind, mesh)
    names = tuple(shape)
    if kind is ReferencePlan.HYBRID:
        if len(names) < 2:
            raise PlanError(f"plan {kind.value!r} needs two mesh axes; mesh {shape} has {len(names)}")
        data = DATA_AXIS if DATA_AXIS in names else names[0]
        model = MODEL_AXIS if MODEL_AXIS in names else names[-1]
        if data == model:
            raise PlanError(f"plan {kind.value!r}: cannot tell the data axis from the model axis in {shape}")
        axes = MeshAxes.from_mesh(shape)
        plan = plans.combine(plans.data_parallel_plan(graph, data, axes), plans.megatron_plan(graph, model, axes))
        return plan, axes
    axes = MeshAxes.from_mesh(shape, extra=[names] if len(names) > 1 else ())
    if kind is ReferencePlan.DP:
        return plans.data_parallel_plan(graph, names, axes), axes
    return plans.megatron_plan(graph, names, axes), axes


def resolve_plan(graph: FactorGraph, plan: Any, mesh: Mapping[str, int] | MeshAxes | int | None
                 ) -> tuple[np.ndarray, MeshAxes, str]:
    """(plan array, mesh axes, a name for reports) from a Plan, a reference-plan name, or a plan
    array with its mesh. Raises PlanConflict when the array has conflicts."""
    name: str
    if isinstance(plan, (str, ReferencePlan)):
        key = plan.value if isinstance(plan, ReferencePlan) else plan.strip().lower()
        key = {"hybrid": ReferencePlan.HYBRID.value, "dp-megatron": ReferencePlan.HYBRID.value}.get(key, key)
        try:
            kind = ReferencePlan(key)
        except ValueError:
            raise PlanError(f"unknown plan {plan!r}; built-in plans are "
                             f"{', '.join(k.value for k in ReferencePlan)} (or pass a Plan or a plan array)") from None
        array, axes = reference_plan(graph, kind, mesh)
        name = kind.value
    elif hasattr(plan, "group_array") and hasattr(plan, "mesh_shape"):
        shape = plan.mesh_shape
        given = mesh.mesh_shape if isinstance(mesh, MeshAxes) else dict(mesh) if isinstance(mesh, Mapping) else None
        if (given and given != shape) or (isinstance(mesh, int) and mesh != math.prod(shape.values())):
            raise PlanError(f"the plan was made for mesh {shape}, not {given or mesh}")
        axes = MeshAxes.from_mesh(shape, extra=[g.axes for g in plan.groups]
                                  + [s for p in plan.parameters for s in p.spec if s is not None and len(s) > 1])
        array = plan.group_array(graph, axes)
        name = "plan"
    else:
        if mesh is None or isinstance(mesh, int):
            raise PlanError("a plan array needs its mesh as a {name: size} mapping (or a MeshAxes)")
        axes = mesh if isinstance(mesh, MeshAxes) else MeshAxes.from_mesh(mesh)
        array = np.asarray(plan)
        name = "plan"
    conflicts = ConflictChecker(graph, axes).explain(array, limit=5)
    if conflicts:
        raise PlanConflict(f"plan {name!r} has conflicts:\n" + "\n".join(f"  - {c}" for c in conflicts), conflicts)
    return array, axes, name
