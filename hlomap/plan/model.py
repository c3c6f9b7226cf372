"""`Plan`: a distributed execution plan as data — mesh, per-parameter PartitionSpecs, the groups
it shards, an optional pipeline and estimate — with versioned JSON and JAX sharding pytrees.

    plan = Plan.from_specs(cap, my_specs, mesh={"data": 2, "model": 4})   # raises PlanConflict
    plan = Plan.from_groups(cap, graph, plan_array, axes)                 # from an explorer
    jax.jit(step, in_shardings=plan.shardings(mesh))
    plan.save("plan.json"); Plan.load("plan.json").partition_specs(like=args)

JSON schema (version 1):
    {"version": 1, "source": {"kind": str, "sha256": str},
     "mesh": {"axes": {name: size}},
     "parameters": [{"index": int, "path": str, "shape": [int], "spec": [null | str | [str]]}],
     "groups": [{"id": int, "axes": [str], "size": int, "trainable": ["path:dim"]}],
     "pipeline": null | {"stages": [{"devices": [int], "layers": [int, int], "mesh": {name: size},
                                     "specs": [spec per parameter], ...}],
                         "microbatches": int, "schedule": "1f1b" | "gpipe", "cuts": [...], ...},
     "estimate": null | {...},
     "placement": null | {"devices": [int], "cluster": str, "solver": str,
                          "step_seconds": float | null, "identity_step_seconds": float | null},
     "measured": (optional) {"chosen": str, "devices": int, "platform": str, "load_average": [3 floats],
                             "seconds": float, "candidates": [{"name", "family", "predicted_seconds",
                             "median_seconds", "iqr_seconds", "rounds", "error"?}]},
     "state_sharding": (optional) {"axes": [str], "parameters": [{"index": int, "dim": int}]}}

The state-sharding section (ZeRO-1) splits the listed optimizer-state leaves further, along the
given dim, over the plan's data axes: `leaf_spec` / `partition_specs` place them so, while the
parameters' own specs (and `group_array`) stay those of the plan's linkage groups.

The placement section (optional: plans written before it existed load unchanged, and readers that
do not know it ignore it) says which physical device takes each logical position of the plan
(Parmesan's device mapping): `devices[i]` is the device id (an index into the cluster's devices,
or into `jax.devices()`) of logical position i. Logical positions run row-major over the mesh
axes for an SPMD plan, and stage by stage, in the order each stage of the pipeline section lists
its devices, for a pipeline plan. `cluster` names the cluster it was chosen for, `solver` how, and
the two times are the estimated step on that cluster with this order and with the identity order.
`Plan.device_order()` is the one function a runner needs: the mesh's device order. The
sections are typed (`hlomap.plan.sections`); the pipeline section's fields are documented there.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import tempfile
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from hlomap.plan.errors import PlanError
from hlomap.plan.sections import (
    GroupAssignment,
    Measurement,
    ParameterSpec,
    Pipeline,
    Placement,
    PlanSource,
    StateSharding,
    spec_to_json,
)
from hlomap.propagation.conflicts import REPLICATED, Conflict, ConflictChecker, MeshAxes, PlanConflict

if TYPE_CHECKING:
    from hlomap.hlo.capture import Capture
    from hlomap.propagation.graph import FactorGraph

log = logging.getLogger(__name__)

PLAN_VERSION = 1

__all__ = ["PLAN_VERSION", "Plan", "write_atomic", "write_problem"]

@dataclass(frozen=True)
class Plan:
    """A plan for one captured step on one mesh. `in_tree` (not serialized) is the step's argument
    treedef when the plan was made from a Capture; `partition_specs()` uses it."""

    mesh: tuple[tuple[str, int], ...]
    parameters: tuple[ParameterSpec, ...]
    groups: tuple[GroupAssignment, ...] = ()
    source: PlanSource = PlanSource("", "")
    #: The pipeline section (None: an SPMD plan). Its JSON form is accepted and read here.
    pipeline: Pipeline | None = None
    estimate: Mapping[str, Any] | None = None
    version: int = PLAN_VERSION
    in_tree: Any = field(default=None, compare=False, repr=False)
    #: How the plan was found (explorers: driver, reward mode, evaluations, seconds, seed, score).
    search: Mapping[str, Any] | None = None
    #: Which physical device takes each logical position (None: the identity order).
    placement: Placement | None = None
    #: The candidates a measured selection timed on the present devices (None: not measured).
    measured: Measurement | None = None
    #: Optimizer-state leaves split over the data axes, ZeRO-1, and parameters where it lists
    #: them, FSDP (None: every replica keeps it all).
    state_sharding: StateSharding | None = None

    def __repr__(self) -> str:
        """One line a notebook or a log can show (the generated one lists every parameter: tens of
        thousands of characters for a GPT): the kind, mesh or stages, and what else it carries."""
        parts = []
        if self.pipeline is not None:
            section = self.pipeline
            devices = sum(len(d) for d in section.stage_devices())
            chunks = f" x {section.repeats} chunks" if section.repeats > 1 else ""
            parts.append(f"{section.kind.value} pipeline of {section.n_stages} stages{chunks} on {devices} devices, "
                         f"M={section.microbatches}, {section.schedule.value}")
        else:
            sharded = sum(1 for p in self.parameters if any(s is not None for s in p.spec))
            parts.append(f"mesh {dict(self.mesh)}, {sharded} of {len(self.parameters)} parameters sharded")
        if self.state_sharding is not None:
            parts.append(f"{len(self.state_sharding.dims)} state leaves split over {','.join(self.state_sharding.axes)}")
        if self.placement is not None:
            parts.append("placed")
        if self.estimate and "step_seconds" in self.estimate:
            parts.append(f"estimated step {self.estimate['step_seconds'] * 1e3:.4g} ms")
        if self.measured is not None:
            parts.append("measured")
        source = f"for {self.source.kind}: " if self.source.kind else ""
        return f"Plan({source}{'; '.join(parts)})"

    def __post_init__(self) -> None:
        if self.pipeline is not None and not isinstance(self.pipeline, Pipeline):
            object.__setattr__(self, "pipeline", Pipeline.from_json(self.pipeline))
        if self.pipeline is not None:
            _check_stage_specs(self.pipeline, self.parameters)
        if self.state_sharding is not None:
            if self.pipeline is not None:
                raise PlanError("state_sharding applies to SPMD plans; a pipeline plan's stages say their own")
            self.state_sharding.check(self.parameters, self.mesh_shape)
        if self.placement is not None and len(self.placement.devices) != self.n_positions:
            raise PlanError(f"placement lists {len(self.placement.devices)} devices but the plan has "
                            f"{self.n_positions} logical positions ({self._positions_text()})")

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_specs(cls, cap: Capture, specs: Any, *, mesh: Mapping[str, int] | Any,
                   graph: FactorGraph | None = None, strict: bool = False) -> Plan:
        """Turn a user's PartitionSpec pytree (shaped like the step's arguments, or a prefix of
        it; None leaves mean replicated) into a plan.

        Raises PlanConflict naming the tensor, dims and instruction when the specs are
        inconsistent: two parameters whose dims must share one sharding are given different axes,
        or the resulting plan has a conflict (two dims of one tensor on one axis, a dim that
        cannot be split, a size not divisible by the axis size, a reshape violation). A parameter
        left replicated in a group that another parameter shards is resolved to the sharded
        choice (XLA slices it locally, for free) unless `strict=True`, which raises instead.
        PlanError names the parameter and dim of a spec on an axis `mesh` does not have. `mesh`
        may be a bare device count when the specs use one axis.
        """
        from hlomap.propagation.graph import FactorGraph

        graph = graph if graph is not None else FactorGraph.from_capture(cap)
        per_param = _flatten_specs(cap, specs)
        options = [opt for spec in per_param for opt in spec if opt is not None]
        if isinstance(mesh, int):  # a bare device count names the one axis the specs use
            named = sorted({axis for opt in options for axis in opt})
            if len(named) != 1:
                raise PlanError(f"mesh={mesh}: the specs use axes {named}; name the mesh's axes, e.g. "
                                f"{{{', '.join(repr(a) + ': 2' for a in named) or repr('data') + ': 8'}}}")
            mesh = {named[0]: mesh}
        axes = MeshAxes.from_mesh(mesh, extra=[o for o in options if len(o) > 1])
        for p, spec in zip(cap.parameters, per_param):
            for d, opt in enumerate(spec):
                unknown = [axis for axis in opt or () if axis not in axes.names]
                if unknown:
                    raise PlanError(f"{p.path!r} dim {d} is split on mesh axis {unknown[0]!r}, which the mesh "
                                    f"{axes.mesh_shape} does not have")
        plan = np.full(graph.num_groups, REPLICATED, dtype=np.int8)
        owner: dict[int, tuple[int, int]] = {}
        for p, spec in zip(cap.parameters, per_param):
            groups = graph.parameter_groups(p.index)
            for d, opt in enumerate(spec):
                if opt is None:
                    continue
                o = axes.index(opt)
                g = groups[d]
                if plan[g] >= 0 and plan[g] != o:
                    q, qd = owner[g]
                    other = cap.parameters[q]
                    raise PlanConflict(
                        f"inconsistent specs: {p.path!r} dim {d} is split on {axes.describe(o)} but "
                        f"{other.path!r} dim {qd} is split on {axes.describe(int(plan[g]))}; the two dims are "
                        f"linked {_linked_through(graph, (q, qd), (p.index, d))}, so they must share one "
                        f"sharding. {RESHARD_CHOICE}")
                plan[g] = o
                owner.setdefault(g, (p.index, d))
        if strict:
            for p, spec in zip(cap.parameters, per_param):
                for d, g in enumerate(graph.parameter_groups(p.index)):
                    given = spec[d] if d < len(spec) else None
                    if given is None and plan[g] >= 0 and p.shape.dims[d] > 1:
                        q, qd = owner[g]
                        raise PlanConflict(
                            f"inconsistent specs: {p.path!r} dim {d} is replicated but "
                            f"{cap.parameters[q].path!r} dim {qd}, linked to it "
                            f"{_linked_through(graph, (q, qd), (p.index, d))}, is split on "
                            f"{axes.describe(int(plan[g]))}")
        conflicts = ConflictChecker(graph, axes).explain(plan, limit=10)
        if conflicts:
            lines = [_explain_spec_conflict(cap, graph, owner, c) for c in conflicts]
            across = any(len({owner[g][0] for g in c.groups if g in owner}) > 1 for c in conflicts)
            raise PlanConflict(f"your specs conflict ({len(conflicts)}):\n" + "\n".join(f"  - {x}" for x in lines)
                               + (f"\n{RESHARD_CHOICE}" if across else ""), conflicts)
        return cls.from_groups(cap, graph, plan, axes)

    @classmethod
    def from_groups(cls, cap: Capture, graph: FactorGraph, plan: np.ndarray, axes: MeshAxes | Mapping[str, int],
                    *, check: bool = True) -> Plan:
        """A plan from a plan array over `graph`'s groups (what explorers produce). Raises
        PlanConflict when `check` and the array has conflicts."""
        axes = axes if isinstance(axes, MeshAxes) else MeshAxes.from_mesh(axes)
        plan = np.asarray(plan)
        if check:
            conflicts = ConflictChecker(graph, axes).explain(plan)
            if conflicts:
                raise PlanConflict(_conflict_message(conflicts), conflicts)
        params = []
        for p in cap.parameters:
            groups = graph.parameter_groups(p.index)
            spec = tuple(None if plan[g] < 0 else axes.options[int(plan[g])] for g in groups)
            params.append(ParameterSpec(p.index, p.path, tuple(p.shape.dims), spec))
        members: dict[int, list[str]] = {}
        for t in graph.trainable_dims:
            members.setdefault(t.group, []).append(f"{t.path}:{t.dim}")
        groups = tuple(
            GroupAssignment(int(g), axes.options[int(plan[g])], int(graph.group_sizes[g]), tuple(members.get(int(g), ())))
            for g in np.flatnonzero(plan >= 0)
        )
        return cls(mesh=tuple(axes.mesh_shape.items()), parameters=tuple(params), groups=groups,
                   source=PlanSource.of(cap), in_tree=cap.in_tree)

    # -- views ----------------------------------------------------------------------------------
    @property
    def mesh_shape(self) -> dict[str, int]:
        return dict(self.mesh)

    def logical_stage_devices(self) -> tuple[tuple[int, ...], ...]:
        """Each pipeline stage's devices as its section lists them (empty for an SPMD plan)."""
        if self.pipeline is None:
            return ()
        return self.pipeline.stage_devices()

    def logical_devices(self) -> tuple[int, ...]:
        """The logical positions: 0..n-1 over the mesh (row-major), or the pipeline's stage
        devices stage by stage."""
        if self.pipeline is not None:
            return tuple(d for stage in self.logical_stage_devices() for d in stage)
        return tuple(range(math.prod(size for _, size in self.mesh)))

    @property
    def n_positions(self) -> int:
        return len(self.logical_devices())

    def device_order(self) -> tuple[int, ...]:
        """The physical device id of each logical position: the placement's, else the logical
        positions themselves. A runner builds its mesh from it, e.g. for an SPMD plan
        `Mesh(np.asarray(jax.devices())[list(plan.device_order())].reshape(shape), names)`; for a
        pipeline plan stage s runs on `plan.stage_devices()[s]`."""
        return self.placement.devices if self.placement is not None else self.logical_devices()

    def physical_devices(self) -> dict[int, int]:
        """Plan device id -> physical device id: what a runner indexes when it picks a stage's or
        the mesh's devices by the ids the plan names (the identity without a placement)."""
        return dict(zip(self.logical_devices(), self.device_order()))

    def stage_devices(self) -> tuple[tuple[int, ...], ...]:
        """Each pipeline stage's physical devices, in `device_order` (empty for an SPMD plan)."""
        order = iter(self.device_order())
        return tuple(tuple(next(order) for _ in stage) for stage in self.logical_stage_devices())

    def _positions_text(self) -> str:
        if self.pipeline is not None:
            return "stages of " + "+".join(str(len(s)) for s in self.logical_stage_devices()) + " devices"
        return f"mesh {self.mesh_shape}"

    def group_array(self, graph: FactorGraph, axes: MeshAxes | None = None) -> np.ndarray:
        """This plan as an array over `graph`'s groups (the graph must be of the same module)."""
        axes = axes or MeshAxes.from_mesh(self.mesh_shape, extra=[g.axes for g in self.groups])
        plan = np.full(graph.num_groups, REPLICATED, dtype=np.int8)
        for ga in self.groups:
            if ga.id >= graph.num_groups:
                raise ValueError(f"plan group {ga.id} does not exist in {graph.module.name} "
                                 f"({graph.num_groups} groups); was the plan made for another module?")
            plan[ga.id] = axes.index(ga.axes)
        for p in self.parameters:
            for g, s in zip(graph.parameter_groups(p.index), p.spec):
                if s is not None:
                    plan[g] = axes.index(s)
        return plan

    def spec_disagreements(self, graph: FactorGraph, axes: MeshAxes | None = None) -> list[str]:
        """Parameter dims whose spec differs from the sharding `group_array` gives their linkage
        group (the groups section and the other parameters' specs): a spec edited by hand on one
        leaf of a group. The runner places each leaf as its own spec says; the estimate prices the
        group as one, so such a plan is priced as `group_array` reads it. In words, one per dim."""
        axes = axes or MeshAxes.from_mesh(self.mesh_shape, extra=[g.axes for g in self.groups])
        array = self.group_array(graph, axes)
        out = []
        for p in self.parameters:
            for d, (g, s) in enumerate(zip(graph.parameter_groups(p.index), p.spec)):
                wanted = REPLICATED if s is None else axes.index(s)
                if array[g] != wanted:
                    priced = "replicated" if array[g] == REPLICATED else f"split on {'x'.join(axes.options[array[g]])}"
                    given = "replicated" if s is None else f"split on {'x'.join(s)}"
                    out.append(f"{p.path or p.name!r} dim {d} is {given}, but dims linked to it are {priced}")
        return out

    def partition_specs(self, like: Any = None) -> Any:
        """PartitionSpec pytree shaped like the step's arguments (a tuple, one entry per argument).

        Uses the captured treedef when there is one, else the structure of `like` (e.g. the
        arguments), else nested dicts rebuilt from the pytree paths (optax NamedTuples come back
        as tuples then: pass `like` for those).
        """
        import jax

        specs = [self.leaf_spec(p) for p in sorted(self.parameters, key=lambda p: p.index)]
        if like is not None:
            treedef = jax.tree_util.tree_structure(like)
            if treedef.num_leaves != len(specs):
                raise ValueError(f"`like` has {treedef.num_leaves} leaves; the plan has {len(specs)} parameters")
            return jax.tree_util.tree_unflatten(treedef, specs)
        if self.in_tree is not None:
            return jax.tree_util.tree_unflatten(self.in_tree, specs)
        return _tree_from_paths([(p.path, s) for p, s in zip(sorted(self.parameters, key=lambda p: p.index), specs)])

    def leaf_spec(self, parameter: ParameterSpec) -> Any:
        """The PartitionSpec `parameter` is placed with: its own spec, split further over the
        state sharding's axes when it is an optimizer-state leaf that the plan shards (ZeRO-1)."""
        if self.state_sharding is None:
            return parameter.partition_spec()
        return dataclasses.replace(parameter, spec=self.state_sharding.spec_of(parameter)).partition_spec()

    def with_sharded_state(self, graph: FactorGraph, *, parameters: bool = False) -> Plan:
        """This plan with its optimizer state split over its data axes (ZeRO-1, `hlomap.cost.zero`):
        the mesh axes that split the batch and no trainable parameter; with `parameters` the
        trainable parameters stored split there too (FSDP / ZeRO-3, `zero.parameter_shards`). Its
        estimate is dropped (the caller re-prices it). PlanError when the plan has no such axis or
        is a pipeline plan."""
        from hlomap.cost.sharding import ShardedGraph
        from hlomap.cost.zero import parameter_shards, state_axes, state_shards

        if self.pipeline is not None:
            raise PlanError("sharding the optimizer state applies to SPMD plans, not to pipeline plans")
        axes = MeshAxes.from_mesh(self.mesh_shape, extra=[g.axes for g in self.groups])
        sg = ShardedGraph.build(graph, self.group_array(graph, axes), axes)
        names = state_axes(sg)
        if not names:
            raise PlanError(f"the plan on mesh {self.mesh_shape} splits the batch over no axis that leaves the "
                            "parameters replicated, so there are no data replicas to split the optimizer state over")
        shards = state_shards(sg, names)
        if parameters:
            shards = shards + parameter_shards(sg, shards)
        return dataclasses.replace(self, state_sharding=StateSharding(names, tuple((s.parameter, s.dim) for s in shards)),
                                   estimate=None)

    def sharded_state(self) -> Any:
        """The state sharding as the cost model takes it (`hlomap.cost.estimate.ShardedState`), or None."""
        if self.state_sharding is None:
            return None
        from hlomap.cost.estimate import ShardedState
        from hlomap.cost.zero import StateShard

        return ShardedState(self.state_sharding.axes,
                            tuple(StateShard(index, dim) for index, dim in self.state_sharding.dims))

    def shardings(self, mesh: Any, like: Any = None) -> Any:
        """NamedSharding pytree for `jax.jit(in_shardings=...)` on `mesh` (a jax Mesh whose axis
        sizes match the plan's)."""
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        shape = dict(mesh.shape)
        for name, size in self.mesh:
            if shape.get(name) != size:
                raise ValueError(f"mesh axis {name!r} has size {shape.get(name)} but the plan was made for {size} "
                                 f"(plan mesh {self.mesh_shape}, given {shape})")
        return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), self.partition_specs(like),
                                      is_leaf=lambda x: isinstance(x, PartitionSpec))

    # -- JSON -----------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "source": self.source.to_json(),
            "mesh": {"axes": dict(self.mesh)},
            "parameters": [p.to_json() for p in self.parameters],
            "groups": [g.to_json() for g in self.groups],
            "pipeline": self.pipeline.to_json() if self.pipeline is not None else None,
            "estimate": dict(self.estimate) if self.estimate is not None else None,
            **({"search": dict(self.search)} if self.search is not None else {}),
            "placement": self.placement.to_json() if self.placement is not None else None,
            **({"measured": self.measured.to_json()} if self.measured is not None else {}),
            **({"state_sharding": self.state_sharding.to_json()} if self.state_sharding is not None else {}),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "<json>") -> Plan:
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: expected a plan (a JSON object), got a JSON {type(data).__name__}")
        version = data.get("version")
        if version is None and "devices" in data and ("calibration" in data or "bandwidth" in data):
            raise ValueError(f"{where}: a cluster file, not a plan (give it to --cluster; hlomap explore writes plans)")
        if "version" in data and version != PLAN_VERSION:  # another hlomap's plan: its fields may differ too
            raise ValueError(f"{where}: plan version {version!r} is not supported (expected {PLAN_VERSION})")
        missing = [key for key in ("version", "mesh", "parameters", "source") if key not in data]
        if missing:
            raise ValueError(f"{where}: missing field(s) {missing} (is this a plan hlomap explore wrote?)")
        if not isinstance(data["mesh"], Mapping) or not isinstance(data["mesh"].get("axes"), Mapping):
            raise ValueError(f"{where}: field 'mesh': expected an object with 'axes' (name: size), got "
                             f"{data['mesh']!r}")
        if not isinstance(data["parameters"], list):
            raise ValueError(f"{where}: field 'parameters': expected a list, got {type(data['parameters']).__name__}")
        for axis, size in data["mesh"]["axes"].items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise PlanError(f"{where}: mesh axis {axis!r} has size {size!r}; a mesh axis has a whole number of "
                                "devices, at least 1")
        try:
            return cls(
                mesh=tuple((str(k), int(v)) for k, v in data["mesh"]["axes"].items()),
                parameters=tuple(ParameterSpec.from_json(p) for p in data["parameters"]),
                groups=tuple(GroupAssignment.from_json(g) for g in data.get("groups", ())),
                source=PlanSource.from_json(data["source"], where=f"{where}: source"),
                pipeline=(None if data.get("pipeline") is None
                          else Pipeline.from_json(data["pipeline"], where=f"{where}: pipeline")),
                estimate=data.get("estimate"),
                search=data.get("search"),
                placement=(None if data.get("placement") is None
                           else Placement.from_json(data["placement"], where=f"{where}: placement")),
                measured=(None if data.get("measured") is None
                          else Measurement.from_json(data["measured"], where=f"{where}: measured")),
                state_sharding=(None if data.get("state_sharding") is None
                                else StateSharding.from_json(data["state_sharding"], where=f"{where}: state_sharding")),
            )
        except PlanError as exc:
            raise PlanError(f"{where}: {exc}" if not str(exc).startswith(where) else str(exc)) from None
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: malformed plan JSON: {exc!r}") from exc

    def save(self, path: str | PathLike[str]) -> None:
        """Write the plan as JSON, atomically (a search saving its best plan so far is never
        caught half-written), with the permissions of a newly created file."""
        write_atomic(Path(path), json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | PathLike[str], *, cap: Capture | None = None, mesh: Any = None) -> Plan:
        """Read a plan; with `cap` / `mesh`, also check it was made for them (`check_compatible`)
        and take the step's argument structure from `cap`, so `partition_specs()` is shaped like
        the step's arguments (optax's empty states included) rather than rebuilt from paths."""
        plan = cls.from_json(read_plan_json(path), where=str(path))
        plan.check_specs(where=str(path))
        plan.check_compatible(cap, mesh, where=str(path))
        if cap is not None and cap.in_tree is not None:
            plan = dataclasses.replace(plan, in_tree=cap.in_tree)
        return plan

    def check_specs(self, *, where: str = "plan") -> None:
        """Raise PlanError (a ValueError) naming the parameter and dim when a spec cannot apply to
        the plan's own mesh: an axis the mesh does not have, an axis used twice, or a dim whose size
        the axes' sizes do not divide. What `jax.jit` would only find after tracing and compiling."""
        sizes = self.mesh_shape
        for p in self.parameters:
            used: dict[str, int] = {}
            for d, axes in enumerate(p.spec):
                for axis in axes or ():
                    if axis not in sizes:
                        raise PlanError(f"{where}: parameter {p.path!r} dim {d} is split on mesh axis {axis!r}, "
                                        f"which the plan's mesh {sizes} does not have")
                    if axis in used:
                        raise PlanError(f"{where}: parameter {p.path!r} uses mesh axis {axis!r} twice "
                                        f"(dims {used[axis]} and {d})")
                    used[axis] = d
                ways = math.prod(sizes[a] for a in axes or ())
                if d < len(p.shape) and p.shape[d] % ways:
                    raise PlanError(f"{where}: parameter {p.path!r} dim {d} has size {p.shape[d]}, which its "
                                    f"split over {'x'.join(axes or ())} ({ways} ways) does not divide")

    def check_compatible(self, cap: Capture | None = None, mesh: Any = None, *, where: str = "plan") -> None:
        """Raise ValueError, saying what differs, when the plan was made for another module
        (`PlanSource.mismatch`: the same step as a dumped HLO text or lowered from JAX matches) or
        another mesh (`mesh`: a {name: size} mapping or a jax Mesh)."""
        difference = None if cap is None else self.source.mismatch(cap)
        if difference is not None:
            raise ValueError(
                f"{where} was made for another module than {cap.source} ({difference}; the plan's module first): "
                "the step, its argument shapes or the JAX version changed: explore again for this module")
        if mesh is not None:
            shape = {str(k): int(v) for k, v in (dict(mesh.shape) if hasattr(mesh, "axis_names") else dict(mesh)).items()}
            if shape != self.mesh_shape:
                raise ValueError(f"{where} was made for mesh {self.mesh_shape}, not {shape}; explore again for this "
                                 f"mesh or pass the plan's mesh")


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _check_stage_specs(pipeline: Pipeline, parameters: Sequence[ParameterSpec]) -> None:
    """A stage's own specs give one spec per plan parameter, in order, none longer than the
    parameter's rank; PlanError naming the stage, parameter, shape and spec otherwise."""
    for s, stage in enumerate(pipeline.stages):
        if stage.specs is None:
            continue
        if len(stage.specs) != len(parameters):
            raise PlanError(f"pipeline stage {s}: 'specs' has {len(stage.specs)} entries; the plan has "
                            f"{len(parameters)} parameters and a stage gives one spec for each, in order")
        for p, spec in zip(parameters, stage.specs):
            if len(spec) > len(p.shape):
                raise PlanError(f"pipeline stage {s}: parameter {p.path!r} has shape {list(p.shape)} (rank "
                                f"{len(p.shape)}) but its spec {spec_to_json(spec)} has {len(spec)} entries")


#: What hlomap does where XLA would reshard, said once in every message about conflicting specs.
RESHARD_CHOICE = (
    "XLA would accept such specs and insert a reshard (an all-gather or all-to-all) where the "
    "linked tensors meet; hlomap plans keep one sharding per linkage group (Auto-MAP's "
    "conflict-free plans, whose communication the cost model prices), so it rejects them: give "
    "the linked dims the same split.")


def _dim_of(graph: FactorGraph, parameter: int, dim: int) -> int:
    return int(graph.parameter_dims(parameter)[dim])


def _linked_through(graph: FactorGraph, a: tuple[int, int], b: tuple[int, int]) -> str:
    """`through dot.3 [layers_0/attn/dot_general] (gpt.py:40) -> add.5 ...`: the instructions
    that tie parameter `a`'s dim to parameter `b`'s (the forward pass's where possible)."""
    from hlomap.hlo.source_info import layer_name

    path = graph.link_path(_dim_of(graph, *a), _dim_of(graph, *b))
    if not path:
        return "through the computation"
    steps = []
    for node in path[:8]:
        inst = graph.nodes[node].instruction
        scope = layer_name(inst.metadata)
        steps.append(f"{inst.name}" + (f" [{scope}]" if scope else ""))
    where = next((graph.source_of(graph.nodes[n].instruction) for n in path
                  if graph.source_of(graph.nodes[n].instruction)), None)
    more = f" -> ... ({len(path) - 8} more)" if len(path) > 8 else ""
    return "through " + " -> ".join(steps) + more + (f" ({where})" if where else "")


def _explain_spec_conflict(cap: Capture, graph: FactorGraph, owner: Mapping[int, tuple[int, int]],
                           conflict: Conflict) -> str:
    """A conflict in terms of what the user wrote: which spec put the axis on each group, and
    through which instructions that reaches the tensor where the conflict appears."""
    writers = [(g, owner[g]) for g in conflict.groups if g in owner]
    if not writers:
        return str(conflict)
    return f"{conflict.kind.value}: {_in_user_terms(cap, graph, writers, conflict)}"


def _in_user_terms(cap: Capture, graph: FactorGraph, writers: Sequence[tuple[int, tuple[int, int]]],
                   conflict: Conflict) -> str:
    named = "; ".join(f"your spec splits {cap.parameters[q].path!r} dim {d} on {conflict.axis}"
                      for _, (q, d) in writers)
    distinct = {q for _, (q, _) in writers}
    target = next((p for p in cap.parameters if p.path == conflict.tensor), None)
    if conflict.kind.value == "same_axis" and len(writers) == 2 and len(distinct) == 1 \
            and target is not None and target.index in distinct:
        return (f"{named.split(';')[0]} and dim {writers[1][1][1]} too: a PartitionSpec can use mesh axis "
                f"{conflict.axis} for one dim only")
    if conflict.kind.value != "same_axis":
        return f"{named}, but {conflict}"
    links = []
    if target is not None:
        for g, (q, d) in writers:
            dims = [i for i, tg in enumerate(graph.parameter_groups(target.index)) if tg == g]
            if dims and (q, d) != (target.index, dims[0]):
                links.append(f"{cap.parameters[q].path!r} dim {d} is linked to {target.path!r} dim {dims[0]} "
                             f"{_linked_through(graph, (q, d), (target.index, dims[0]))}")
    where = f"; {'; '.join(links)}" if links else ""
    return (f"{named}; so {conflict.tensor!r} would have dims {list(conflict.dims)} both on {conflict.axis} "
            f"(at {conflict.instruction}){where}")


def write_problem(directory: Path) -> str | None:
    """Why no file can be created in `directory`, or None when one can. Probed by creating (and
    removing) a file, because permission bits do not tell: root passes every `access` check, yet
    cannot create a file in /sys or /proc."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".hlomap-", suffix=".probe"):
            pass
    except OSError as err:
        return err.strerror or str(err)
    return None


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder and a rename; the
    file gets the mode open() would give it (0666 less the umask), not mkstemp's 0600."""
    umask = os.umask(0)
    os.umask(umask)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _conflict_message(conflicts: Sequence[Conflict]) -> str:
    head = f"plan has {len(conflicts)} conflict(s):"
    lines = [f"  - {c}" for c in conflicts[:10]]
    if len(conflicts) > 10:
        lines.append(f"  ... and {len(conflicts) - 10} more")
    return "\n".join([head, *lines])


def _normalize_entry(entry: Any) -> tuple[str, ...] | None:
    if entry is None:
        return None
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry) or None


def read_plan_json(path: str | PathLike[str]) -> Any:
    """The JSON of a plan file; PlanError naming the file (and the line and column of broken
    JSON) when it is not text or not JSON."""
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError as err:
        raise PlanError(f"{path}: not a plan file (binary data at byte {err.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise PlanError(f"{path}:{err.lineno}:{err.colno}: not a plan JSON file: {err.msg}") from None


def _pytree_mismatch(error: ValueError) -> str:
    """JAX's many-line pytree mismatch in one line: where, and which keys differ (when it says)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    after = {line: lines[i + 1] for i, line in enumerate(lines[:-1])}
    where = next((after[line] for line in lines if line.endswith("key path")), "").replace("tree_map tree", "")
    keys = next((after[line] for line in lines if "symmetric difference" in line), "")
    at = f"at {where.strip() or 'the top'}"
    if keys:
        return f"{at}: keys {', '.join(sorted(keys.split()))} are in one and not the other (give every key a spec; None " \
               "replicates)"
    return f"{at}: {lines[0].removesuffix(' at key path') if lines else error}"


def _flatten_specs(cap: Capture, specs: Any) -> list[tuple[tuple[str, ...] | None, ...]]:
    """One tuple of per-dim axis names per entry parameter, from a spec pytree that is the
    arguments' structure or a prefix of it (a spec at an inner node applies to every leaf)."""
    import jax
    from jax.sharding import PartitionSpec

    def is_leaf(x: Any) -> bool:
        return x is None or isinstance(x, PartitionSpec)

    if cap.args is None:
        flat = jax.tree_util.tree_leaves(specs, is_leaf=is_leaf)
        if len(flat) != len(cap.parameters):
            raise ValueError(f"{len(flat)} specs for {len(cap.parameters)} parameters of a bare module")
    else:
        args = tuple(cap.args)
        specs = tuple(specs) if isinstance(specs, list) else specs
        try:
            expanded = jax.tree_util.tree_map(
                lambda s, sub: jax.tree_util.tree_map(lambda _: s, sub), specs, args, is_leaf=is_leaf)
        except ValueError as exc:
            raise PlanError(f"spec pytree does not match the step's arguments {_pytree_mismatch(exc)}") from exc
        flat = jax.tree_util.tree_leaves(expanded, is_leaf=is_leaf)
    out = []
    for p, s in zip(cap.parameters, flat):
        entries = () if s is None else tuple(_normalize_entry(e) for e in s)
        if len(entries) > p.shape.rank:
            raise PlanConflict(f"spec {s} for {p.path!r} has {len(entries)} entries but the parameter has rank "
                               f"{p.shape.rank} (shape {p.shape})")
        out.append(entries + (None,) * (p.shape.rank - len(entries)))
    return out


def _tree_from_paths(items: Sequence[tuple[str, Any]]) -> Any:
    root: dict[str, Any] = {}
    order: list[str] = []
    for path, value in items:
        parts = path.split("/")
        if parts[0] not in root:
            order.append(parts[0])
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value

    def fix(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        keys = list(node)
        if keys and all(k.isdigit() for k in keys) and sorted(int(k) for k in keys) == list(range(len(keys))):
            return tuple(fix(node[str(i)]) for i in range(len(keys)))
        return {k: fix(v) for k, v in node.items()}

    return tuple(fix(root[k]) for k in order)

