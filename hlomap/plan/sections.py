"""The sections of a plan file, each a frozen dataclass with one `from_json` / `to_json`: the
source, per-parameter specs, sharded groups, the placement and the pipeline.

The pipeline section is the one stage-plan model of a plan file: stages, each with its devices,
the layers it runs, optionally its own data x model mesh and the PartitionSpec of every plan
parameter inside it (a joint plan's); microbatches; the schedule (`DEFAULT_SCHEDULE` when the file
names none); `repeats` V for a circular schedule (logical stage k runs on the devices of stage
k mod S); the cuts as HLO instructions; and what the explorer that wrote it records for
re-pricing (the block profile of a cut plan, the layer names of a joint plan).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Collection, Mapping, Sequence

import numpy as np

from hlomap.cost.pipeline.stages import DEFAULT_SCHEDULE, Schedule
from hlomap.hlo.fingerprint import ModuleSignature, describe_signature_difference
from hlomap.plan.errors import PlanError

if TYPE_CHECKING:
    from hlomap.hlo.capture import Capture

__all__ = ["GroupAssignment", "MeasuredCandidate", "Measurement", "ParameterSpec", "Pipeline", "PipelineCut",
           "PipelineKind", "PipelineStage", "Placement", "PlanSource", "Recompute", "Spec", "StateSharding", "spec_from_json",
           "spec_to_json"]


class Recompute(str, enum.Enum):
    """What a pipeline stage keeps of a microbatch's forward pass for its backward pass.

    NONE: every activation the backward reads (the default). SELECTIVE: the stage's inputs and
    the outputs of its matrix multiplications (`jax.checkpoint` around the stage with
    `jax.checkpoint_policies.dots_saveable`); the backward pass runs the rest of the forward again
    (the elementwise work, cheap next to the matmuls). FULL: only the stage's inputs; the backward
    pass runs the stage's forward again first (`jax.checkpoint` with nothing saveable): one more
    forward per microbatch, and of the stage's activations only one microbatch's at a time.
    A stage that lists `recompute_cuts` is checkpointed piece by piece between them instead of as
    a whole (the joint planner cuts between transformer blocks): it keeps every piece's input (and
    matmul outputs), and the backward runs one piece's forward again at a time.
    """

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"

#: A PartitionSpec as data: per dim, None (replicated) or the mesh axes splitting it.
Spec = tuple[tuple[str, ...] | None, ...]


def spec_to_json(spec: Spec) -> list[Any]:
    """JSON form of a spec: an axis name for one axis, a list for several, null for none."""
    return [None if s is None else (s[0] if len(s) == 1 else list(s)) for s in spec]


def spec_from_json(entries: Any, where: str) -> Spec:
    """A spec from its JSON form (the inverse of `spec_to_json`); PlanError naming `where`."""
    if not isinstance(entries, Sequence) or isinstance(entries, str):
        raise PlanError(f"{where}: a spec is a list with one entry per dim, got {entries!r}")
    out: list[tuple[str, ...] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
        elif isinstance(entry, str):
            out.append((entry,))
        elif isinstance(entry, Sequence) and all(isinstance(a, str) for a in entry):
            out.append(tuple(entry) or None)
        else:
            raise PlanError(f"{where}: spec entry {entry!r} is not null, a mesh axis name or a list of them")
    return tuple(out)


@dataclass(frozen=True)
class PlanSource:
    """The module a plan was made for. `fingerprint` and `signature` (plans written before they
    existed have neither) identify it by structure, so a dumped HLO text and the lowered step
    match; `sha256` is the text fingerprint older plans are recognised by."""

    kind: str  # the Capture's source: "jax:<fn>", a SOURCE such as "zoo:gpt-tiny", or an HLO file path
    sha256: str  # of the HLO text without debug sections and metadata (`hlo.capture.module_fingerprint`)
    fingerprint: str = ""  # `hlo.fingerprint.structure_fingerprint`
    signature: ModuleSignature | None = None

    @classmethod
    def of(cls, cap: Capture) -> PlanSource:
        return cls(cap.source, cap.text_sha256, cap.structure_sha256, cap.signature)

    def mismatch(self, cap: Capture) -> str | None:
        """None when `cap` is the module this plan was made for (by structure when the plan
        records it, else by text), otherwise what differs, as far as the plan records it."""
        if self.fingerprint:
            if cap.structure_sha256 == self.fingerprint:
                return None
        elif not self.sha256 or cap.text_sha256 == self.sha256:
            return None
        if self.signature is not None:
            return describe_signature_difference(self.signature, cap.signature)
        return f"HLO text sha256 {self.sha256[:12]}... vs {cap.text_sha256[:12]}..."

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "sha256": self.sha256}
        if self.fingerprint:
            out["fingerprint"] = self.fingerprint
        if self.signature is not None:
            out["entry_parameters"] = list(self.signature.entry_parameters)
            out["instructions"] = self.signature.instructions
        return out

    @classmethod
    def from_json(cls, data: Any, where: str = "source") -> PlanSource:
        if not isinstance(data, Mapping) or not isinstance(data.get("kind"), str) \
                or not isinstance(data.get("sha256"), str):
            raise PlanError(f"{where}: expected an object with 'kind' and 'sha256' strings, got {data!r}")
        signature = None
        if data.get("entry_parameters") is not None:
            entry = data["entry_parameters"]
            if not isinstance(entry, list) or not all(isinstance(s, str) for s in entry):
                raise PlanError(f"{where}: entry_parameters is a list of HLO shapes, got {entry!r}")
            signature = ModuleSignature(tuple(entry), _int(data.get("instructions", 0), f"{where}: instructions"))
        return cls(data["kind"], data["sha256"], str(data.get("fingerprint", "")), signature)


@dataclass(frozen=True)
class ParameterSpec:
    """The sharding of one entry parameter: for each dim, None or the mesh axes splitting it."""

    index: int
    path: str
    shape: tuple[int, ...]
    spec: tuple[tuple[str, ...] | None, ...]

    def __post_init__(self) -> None:
        if len(self.spec) > len(self.shape):
            raise PlanError(f"parameter {self.path!r} has shape {list(self.shape)} (rank {len(self.shape)}) but its "
                            f"spec {spec_to_json(self.spec)} has {len(self.spec)} entries: a spec gives at most one "
                            "entry per dim")

    def partition_spec(self) -> Any:
        from jax.sharding import PartitionSpec

        entries = [None if s is None else (s[0] if len(s) == 1 else tuple(s)) for s in self.spec]
        while entries and entries[-1] is None:
            entries.pop()
        return PartitionSpec(*entries)

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "path": self.path, "shape": list(self.shape), "spec": spec_to_json(self.spec)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ParameterSpec:
        return cls(int(data["index"]), str(data["path"]), tuple(int(d) for d in data["shape"]),
                   spec_from_json(data["spec"], f"parameter {data.get('path')!r}"))


@dataclass(frozen=True)
class GroupAssignment:
    """A sharded linkage group: its id in the factor graph, axes, size and trainable members."""

    id: int
    axes: tuple[str, ...]
    size: int
    trainable: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "axes": list(self.axes), "size": self.size, "trainable": list(self.trainable)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GroupAssignment:
        return cls(int(data["id"]), tuple(data["axes"]), int(data["size"]), tuple(data.get("trainable", ())))


@dataclass(frozen=True)
class Placement:
    """The physical device of each logical position of a plan (see the module docstring)."""

    devices: tuple[int, ...]
    cluster: str = ""
    solver: str = ""
    step_seconds: float | None = None
    identity_step_seconds: float | None = None

    def __post_init__(self) -> None:
        devices = tuple(self.devices)
        if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in devices):
            raise PlanError(f"placement devices must be non-negative integers, got {list(devices)}")
        if len(set(devices)) != len(devices):
            twice = sorted({d for d in devices if devices.count(d) > 1})
            raise PlanError(f"placement puts two logical positions on device(s) {twice}")
        object.__setattr__(self, "devices", tuple(int(d) for d in devices))

    def to_json(self) -> dict[str, Any]:
        return {"devices": list(self.devices), "cluster": self.cluster, "solver": self.solver,
                "step_seconds": self.step_seconds, "identity_step_seconds": self.identity_step_seconds}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "placement") -> Placement:
        if not isinstance(data, Mapping) or not isinstance(data.get("devices"), list):
            raise PlanError(f"{where}: expected an object with a 'devices' list, got {data!r}")

        def seconds(key: str) -> float | None:
            value = data.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise PlanError(f"{where}: field {key!r}: expected a number or null, got {value!r}")
            return None if value is None else float(value)

        try:
            return cls(tuple(data["devices"]), str(data.get("cluster", "")), str(data.get("solver", "")),
                       seconds("step_seconds"), seconds("identity_step_seconds"))
        except PlanError as err:
            raise PlanError(f"{where}: {err}") from None



@dataclass(frozen=True)
class StateSharding:
    """Optimizer-state leaves split over the mesh `axes` (ZeRO-1), and trainable parameters where it
    lists them (FSDP / ZeRO-3): `dims` pairs (index, dim), the dim of entry parameter `index`
    that the axes split on top of the parameter's own spec.

    JSON: {"axes": [str], "parameters": [{"index": int, "dim": int}]}. Optional in a plan file;
    plans written before it existed load unchanged."""

    axes: tuple[str, ...]
    dims: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not self.axes:
            raise PlanError("state_sharding names no mesh axes")
        object.__setattr__(self, "axes", tuple(str(a) for a in self.axes))
        pairs = dict(self.dims.items() if isinstance(self.dims, Mapping) else self.dims)
        object.__setattr__(self, "dims", tuple(sorted((int(k), int(v)) for k, v in pairs.items())))

    @property
    def dim_of(self) -> dict[int, int]:
        return dict(self.dims)

    def splits_any(self, indices: Collection[int]) -> bool:
        """Whether any of the entry parameters `indices` is split (with the trainable parameters'
        indices: whether this is FSDP / ZeRO-3 rather than ZeRO-1)."""
        return any(index in indices for index, _ in self.dims)

    def spec_of(self, parameter: ParameterSpec) -> Spec:
        """`parameter`'s spec with this section's split added (its own spec when not listed)."""
        dim = self.dim_of.get(parameter.index)
        if dim is None:
            return parameter.spec
        spec = list(parameter.spec) + [None] * (len(parameter.shape) - len(parameter.spec))
        spec[dim] = tuple(spec[dim] or ()) + self.axes
        return tuple(spec)

    def check(self, parameters: Sequence[ParameterSpec], mesh: Mapping[str, int]) -> None:
        """PlanError naming the parameter, dim and axes when the split cannot be applied."""
        unknown = [a for a in self.axes if a not in mesh]
        if unknown:
            raise PlanError(f"state_sharding: axes {unknown} are not in the plan's mesh {dict(mesh)}")
        ways = math.prod(mesh[a] for a in self.axes)
        by_index = {p.index: p for p in parameters}
        for index, dim in self.dims:
            p = by_index.get(index)
            if p is None:
                raise PlanError(f"state_sharding: parameter {index} is not in the plan ({len(parameters)} parameters)")
            if not 0 <= dim < len(p.shape):
                raise PlanError(f"state_sharding: {p.path!r} has rank {len(p.shape)}; it has no dim {dim}")
            own = p.spec[dim] if dim < len(p.spec) and p.spec[dim] is not None else ()
            if set(own) & set(self.axes):
                raise PlanError(f"state_sharding: {p.path!r} dim {dim} is already split on {list(own)}")
            pieces = ways * math.prod(mesh.get(a, 1) for a in own)
            if p.shape[dim] % pieces:
                raise PlanError(f"state_sharding: {p.path!r} dim {dim} has size {p.shape[dim]}, which does not "
                                f"split into {pieces} equal pieces")

    def to_json(self) -> dict[str, Any]:
        return {"axes": list(self.axes),
                "parameters": [{"index": index, "dim": dim} for index, dim in self.dims]}

    @classmethod
    def from_json(cls, data: Any, where: str = "state_sharding") -> StateSharding:
        if not isinstance(data, Mapping) or not isinstance(data.get("axes"), list) \
                or not isinstance(data.get("parameters"), list):
            raise PlanError(f"{where}: expected an object with an 'axes' list and a 'parameters' list, got {data!r}")
        dims: dict[int, int] = {}
        for k, entry in enumerate(data["parameters"]):
            if not isinstance(entry, Mapping):
                raise PlanError(f"{where}: parameters[{k}]: expected {{'index': int, 'dim': int}}, got {entry!r}")
            index = _int(entry.get("index"), f"{where}: parameters[{k}].index")
            dims[index] = _int(entry.get("dim"), f"{where}: parameters[{k}].dim")
        try:
            return cls(tuple(str(a) for a in data["axes"]), tuple(dims.items()))
        except PlanError as err:
            raise PlanError(f"{where}: {err}") from None


class PipelineKind(enum.Enum):
    """Which explorer's stages a pipeline section holds. CUTS: replicated stages over device
    groups (`hlomap explore --task pipeline`, or written by hand); JOINT: stages each with its own
    data x model mesh and specs (`--task auto`)."""

    CUTS = "cuts"
    JOINT = "joint"


def _int(value: Any, where: str, *, least: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise PlanError(f"{where}: expected a whole number >= {least}, got {value!r}")
    return int(value)


def _number(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanError(f"{where}: expected a number or null, got {value!r}")
    return float(value)


def _ints(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise PlanError(f"{where}: expected a list of whole numbers, got {value!r}")
    return tuple(_int(v, f"{where}[{i}]") for i, v in enumerate(value))


def _runs(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, Sequence) or isinstance(value, str) or not value or not all(
            isinstance(run, Sequence) and not isinstance(run, str) and len(run) == 2
            and all(isinstance(name, str) for name in run) for run in value):
        raise PlanError(f"{where}: downset is a non-empty list of [first, last] HLO instruction names, got {value!r}")
    return tuple((str(first), str(last)) for first, last in value)


@dataclass(frozen=True)
class PipelineCut:
    """One cut between stages: the HLO instruction it follows, with its layer scope and source
    line (what the runner maps to the loss function's jaxpr), and the chain position.

    downset: when the stages before the cut are not a prefix of the forward chain (a cut at a
    downset of a branching step's layer DAG, `tasks.pipeline.step_dag`), the runs of chain
    instructions [first, last] (inclusive, in chain order) they hold; `instruction` is then the
    last instruction of the stage before the cut in the plan's layer order. Empty: every chain
    instruction up to `instruction`."""

    instruction: str
    layer: str = ""
    scope: str = ""
    source: str | None = None
    pivot: int | None = None
    crossing_bytes: float | None = None
    downset: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pivot": self.pivot, "instruction": self.instruction, "layer": self.layer,
                               "scope": self.scope, "source": self.source}
        if self.crossing_bytes is not None:
            out["crossing_bytes"] = self.crossing_bytes
        if self.downset:
            out["downset"] = [list(run) for run in self.downset]
        return out

    @classmethod
    def from_json(cls, data: Any, where: str) -> PipelineCut:
        if not isinstance(data, Mapping) or not isinstance(data.get("instruction"), str):
            raise PlanError(f"{where}: a cut is an object with an 'instruction' name, got {data!r}")
        pivot = data.get("pivot")
        return cls(data["instruction"], str(data.get("layer", "")), str(data.get("scope", "")),
                   None if data.get("source") is None else str(data["source"]),
                   None if pivot is None else _int(pivot, f"{where}: pivot"),
                   _number(data.get("crossing_bytes"), f"{where}: crossing_bytes"),
                   () if data.get("downset") is None else _runs(data["downset"], where))


@dataclass(frozen=True)
class PipelineStage:
    """One stage: its plan device ids; the layers [start, stop) it runs, in the explorer's layer
    units (None when the cuts alone say it); its own mesh over those devices and the spec of
    every plan parameter on it (empty / None: the plan's top-level mesh and parameters, else one
    data axis over the devices); and the explorer's figures for it."""

    devices: tuple[int, ...]
    layers: tuple[int, int] | None = None
    mesh: tuple[tuple[str, int], ...] = ()
    specs: tuple[Spec, ...] | None = None
    inner_plan: str | None = None  # which sharding plan a joint stage runs ("expert", "searched")
    seconds_per_microbatch: float | None = None
    memory_bytes: float | None = None
    device_memory_bytes: float | None = None
    recompute: Recompute = Recompute.NONE
    #: Mesh axes splitting the stage's optimizer state (ZeRO-1; its `specs` split those leaves so)
    state_axes: tuple[str, ...] = ()
    #: The stage's trainable parameters stay split over `state_axes` too (FSDP; its `specs` say so)
    shard_parameters: bool = False
    #: Where a recomputing stage is checkpointed piece by piece: the cuts between its pieces (in
    #: forward order, inside the stage); empty: it is checkpointed as a whole
    recompute_cuts: tuple[PipelineCut, ...] = ()
    #: The stage's gradients are split over `state_axes` (ZeRO-2; its parameters stay as `specs`
    #: says): `gradient_specs` gives each plan parameter's gradient spec (the split added)
    shard_gradients: bool = False
    gradient_specs: tuple[Spec, ...] | None = None

    def __post_init__(self) -> None:
        if not self.devices:
            raise PlanError("a stage lists no devices")
        if self.shard_gradients and (not self.state_axes or self.gradient_specs is None):
            raise PlanError("the stage splits its gradients (shard_gradients) but names no state_axes to split them "
                            "over or no gradient_specs")
        if self.gradient_specs is not None and not self.shard_gradients:
            raise PlanError("the stage lists gradient_specs but does not split its gradients (shard_gradients)")
        if self.shard_gradients and self.shard_parameters:
            raise PlanError("shard_parameters splits the stage's gradients already; shard_gradients is for a stage "
                            "that keeps its parameters whole")
        if self.gradient_specs is not None and self.specs is not None and len(self.gradient_specs) != len(self.specs):
            raise PlanError(f"the stage has {len(self.gradient_specs)} gradient_specs for {len(self.specs)} specs")
        if self.recompute_cuts and self.recompute is Recompute.NONE:
            raise PlanError("the stage lists recompute_cuts but does not recompute (no \"recompute\")")
        if self.shard_parameters and not self.state_axes:
            raise PlanError("the stage splits its parameters (shard_parameters) but names no state_axes to split "
                            "them over")
        unknown = [a for a in self.state_axes if a not in dict(self.mesh)]
        if unknown:
            raise PlanError(f"the stage splits its optimizer state over {unknown}, which its mesh "
                            f"{dict(self.mesh)} does not have")
        if self.mesh and math.prod(size for _, size in self.mesh) != len(self.devices):
            count = len(self.devices)
            raise PlanError(f"the stage has {count} device{'s' if count != 1 else ''} but its mesh {dict(self.mesh)} "
                            f"has {math.prod(size for _, size in self.mesh)}")
        if self.layers is not None and not 0 <= self.layers[0] < self.layers[1]:
            raise PlanError(f"the stage's layers {list(self.layers)} are not a range [start, stop) with start < stop")

    @property
    def replication(self) -> int:
        """How many copies of the stage's work run side by side: its mesh's `data` axis, or every
        device of a stage without a mesh of its own (a replicated stage; in a plan with a
        top-level mesh such a stage runs that mesh instead, which the runner resolves)."""
        return dict(self.mesh).get("data", 1) if self.mesh else len(self.devices)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.layers is not None:
            out["layers"] = list(self.layers)
        out["devices"] = list(self.devices)
        out["replication"] = self.replication
        if self.mesh:
            out["mesh"] = dict(self.mesh)
        if self.inner_plan is not None:
            out["plan"] = self.inner_plan
        if self.recompute is not Recompute.NONE:
            out["recompute"] = self.recompute.value
        if self.recompute_cuts:
            out["recompute_cuts"] = [c.to_json() for c in self.recompute_cuts]
        if self.state_axes:
            out["state_axes"] = list(self.state_axes)
        if self.shard_parameters:
            out["shard_parameters"] = True
        if self.shard_gradients:
            out["shard_gradients"] = True
        if self.specs is not None:
            out["specs"] = [spec_to_json(s) for s in self.specs]
        if self.gradient_specs is not None:
            out["gradient_specs"] = [spec_to_json(s) for s in self.gradient_specs]
        for key in ("seconds_per_microbatch", "memory_bytes", "device_memory_bytes"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_json(cls, data: Any, where: str) -> PipelineStage:
        if not isinstance(data, Mapping):
            raise PlanError(f"{where}: a stage is an object with a 'devices' list, got {data!r}")
        devices = _ints(data.get("devices"), f"{where}: devices")
        if len(set(devices)) != len(devices):
            raise PlanError(f"{where}: devices {list(devices)} list a device twice")
        layers = data.get("layers")
        if layers is not None:
            bounds = _ints(layers, f"{where}: layers")
            if len(bounds) != 2:
                raise PlanError(f"{where}: layers is [start, stop], got {layers!r}")
            layers = (bounds[0], bounds[1])
        mesh_json = data.get("mesh") or {}
        if not isinstance(mesh_json, Mapping):
            raise PlanError(f"{where}: mesh is an object {{axis: size}}, got {mesh_json!r}")
        mesh = tuple((str(k), _int(v, f"{where}: mesh axis {k!r}", least=1)) for k, v in mesh_json.items())
        specs, gradient_specs = data.get("specs"), data.get("gradient_specs")
        if specs is not None:
            if not isinstance(specs, Sequence) or isinstance(specs, str):
                raise PlanError(f"{where}: specs is a list with one spec per plan parameter, got {specs!r}")
            specs = tuple(spec_from_json(s, f"{where}: specs[{i}]") for i, s in enumerate(specs))
        if gradient_specs is not None:
            if not isinstance(gradient_specs, Sequence) or isinstance(gradient_specs, str):
                raise PlanError(f"{where}: gradient_specs is a list with one spec per plan parameter, got "
                                f"{gradient_specs!r}")
            gradient_specs = tuple(spec_from_json(s, f"{where}: gradient_specs[{i}]")
                                   for i, s in enumerate(gradient_specs))
        try:
            recompute = Recompute(data.get("recompute", Recompute.NONE.value))
        except ValueError:
            raise PlanError(f"{where}: recompute {data.get('recompute')!r}: expected "
                            f"{' or '.join(r.value for r in Recompute)}") from None
        state_axes = data.get("state_axes", [])
        if not isinstance(state_axes, Sequence) or isinstance(state_axes, str) or not all(
                isinstance(a, str) for a in state_axes):
            raise PlanError(f"{where}: state_axes is a list of mesh axis names, got {state_axes!r}")
        shard_parameters, shard_gradients = data.get("shard_parameters", False), data.get("shard_gradients", False)
        for key, flag in (("shard_parameters", shard_parameters), ("shard_gradients", shard_gradients)):
            if not isinstance(flag, bool):
                raise PlanError(f"{where}: {key} is true or false, got {flag!r}")
        recompute_cuts = data.get("recompute_cuts", ())
        if not isinstance(recompute_cuts, Sequence) or isinstance(recompute_cuts, str):
            raise PlanError(f"{where}: recompute_cuts is a list of cuts, got {recompute_cuts!r}")
        try:
            stage = cls(devices, layers, mesh, specs, None if data.get("plan") is None else str(data["plan"]),
                        _number(data.get("seconds_per_microbatch"), f"{where}: seconds_per_microbatch"),
                        _number(data.get("memory_bytes"), f"{where}: memory_bytes"),
                        _number(data.get("device_memory_bytes"), f"{where}: device_memory_bytes"), recompute,
                        tuple(state_axes), shard_parameters,
                        tuple(PipelineCut.from_json(c, f"{where}: recompute cut {i}")
                              for i, c in enumerate(recompute_cuts)), shard_gradients, gradient_specs)
        except PlanError as err:
            raise PlanError(f"{where}: {err}") from None
        given = data.get("replication")
        if given is not None and given != stage.replication:
            raise PlanError(f"{where}: replication {given!r} disagrees with the stage's "
                            f"{'mesh ' + str(dict(mesh)) if mesh else str(len(devices)) + ' devices'} "
                            f"(replication {stage.replication})")
        return stage


def _check_joint_mesh(stage: int, mesh: Any, where: str = "pipeline") -> None:
    """A joint stage's mesh names the axes data and model, nothing else (its replication and
    specs are read from them)."""
    if not isinstance(mesh, Mapping):
        return
    odd = sorted(str(axis) for axis in set(mesh) - {"data", "model"})
    if odd:
        raise PlanError(f"{where}: stage {stage}: mesh axis {odd[0]!r}: a joint stage's mesh has the axes data and model "
                        f"(got {dict(mesh)})")


def _check_stage_layers(stages: Sequence[PipelineStage], n_layers: int | None) -> None:
    """Stages that give their `layers` give them all, in order and without a gap or an overlap,
    from layer 0 (to the last of `n_layers` where the section names its layers): the joint
    planner reprices a plan from them, so an edited range must not pass unnoticed."""
    ranges = [stage.layers for stage in stages if stage.layers is not None]
    if not ranges:
        return
    listed = [list(stage.layers) if stage.layers is not None else None for stage in stages]
    if len(ranges) != len(stages):
        raise PlanError(f"stage layers {listed}: give every stage's [start, stop) or none")
    start = 0
    for k, (first, stop) in enumerate(ranges):
        if first != start or stop <= first:
            raise PlanError(f"stage {k} has layers [{first}, {stop}), but stages run consecutive, non-empty ranges "
                            f"of layers from 0: it must start at {start} and stop after that (stage layers {listed})")
        start = stop
    if n_layers is not None and start != n_layers:
        raise PlanError(f"the stages run layers [0, {start}) but the pipeline names {n_layers} layers "
                        f"(stage layers {listed})")


def _check_layers_follow_cuts(stages: Sequence[PipelineStage], cuts: Sequence[PipelineCut], repeats: int) -> None:
    """In a cuts pipeline the cuts decide where each stage starts (the runner splits the step at
    their instructions); its `layers` only restate it. A stage after a prefix cut at chain position
    p starts at layer p + 1: an edited range that disagrees would change nothing, so it is refused."""
    if repeats != 1 or len(cuts) != len(stages) - 1:
        return
    for k, (stage, cut) in enumerate(zip(stages[1:], cuts), start=1):
        if stage.layers is None or cut.pivot is None or cut.downset:
            continue
        if stage.layers[0] != cut.pivot + 1:
            raise PlanError(f"stage {k} starts at layer {stage.layers[0]}, but the cut before it follows layer "
                            f"{cut.pivot} ({cut.instruction}): the cuts decide where stages split (the step is "
                            f"split at their instructions), so stage {k} starts at layer {cut.pivot + 1}")


@dataclass(frozen=True)
class Pipeline:
    """A plan's pipeline section (module docstring). `block_profile` stays JSON here: its reader
    (`tasks.pipeline.block_profile.PlanProfile`) sits above the plan."""

    stages: tuple[PipelineStage, ...]
    microbatches: int = 1
    schedule: Schedule = DEFAULT_SCHEDULE
    repeats: int = 1
    cuts: tuple[PipelineCut, ...] = ()
    kind: PipelineKind = PipelineKind.CUTS
    device_cuts: tuple[int, ...] | None = None
    on_node_boundaries: bool | None = None
    layer_names: tuple[str, ...] = ()
    block_profile: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.stages:
            raise PlanError("the pipeline section has no stages")
        if self.microbatches < 1:
            raise PlanError(f"the pipeline has {self.microbatches} microbatches; it needs at least 1")
        if self.repeats < 1:
            raise PlanError(f"the pipeline's repeats is {self.repeats}; it needs at least 1")
        _check_stage_layers(self.stages, len(self.layer_names) or None)
        if self.kind is PipelineKind.CUTS:
            _check_layers_follow_cuts(self.stages, self.cuts, self.repeats)
        if self.kind is PipelineKind.JOINT:
            for k, stage in enumerate(self.stages):
                _check_joint_mesh(k, dict(stage.mesh))
        used = [d for stage in self.stages for d in stage.devices]
        if len(set(used)) != len(used):
            twice = sorted({d for d in used if used.count(d) > 1})
            raise PlanError(f"device(s) {twice} are in two stages (stage devices "
                            f"{[list(s.devices) for s in self.stages]})")

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    def stage_devices(self) -> tuple[tuple[int, ...], ...]:
        return tuple(stage.devices for stage in self.stages)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.kind is not PipelineKind.CUTS:
            out["kind"] = self.kind.value
        out |= {"stages": [s.to_json() for s in self.stages], "microbatches": self.microbatches,
                "schedule": self.schedule.value}
        if self.repeats != 1:
            out["repeats"] = self.repeats
        out["cuts"] = [c.to_json() for c in self.cuts]
        if self.device_cuts is not None:
            out["device_cuts"] = list(self.device_cuts)
        if self.on_node_boundaries is not None:
            out["on_node_boundaries"] = self.on_node_boundaries
        if self.layer_names:
            out["layer_names"] = list(self.layer_names)
        if self.block_profile is not None:
            out["block_profile"] = dict(self.block_profile)
        return out

    @classmethod
    def from_json(cls, data: Any, where: str = "pipeline") -> Pipeline:
        """Read a pipeline section; PlanError naming the field and `where` when it is malformed.
        A section without a schedule gets `DEFAULT_SCHEDULE`; without a kind, CUTS."""
        if not isinstance(data, Mapping):
            raise PlanError(f"{where}: expected an object with 'stages', got {data!r}")
        stages = data.get("stages")
        if not isinstance(stages, Sequence) or isinstance(stages, str) or not stages:
            raise PlanError(f"{where}: the pipeline section has no stages (expected a non-empty 'stages' list)")
        try:
            kind = PipelineKind(data.get("kind", PipelineKind.CUTS.value))
        except ValueError:
            raise PlanError(f"{where}: unknown pipeline kind {data.get('kind')!r}; expected "
                            f"{' or '.join(k.value for k in PipelineKind)}") from None
        if kind is PipelineKind.JOINT:  # before each stage checks its replication against its mesh
            for k, stage in enumerate(stages):
                _check_joint_mesh(k, stage.get("mesh") if isinstance(stage, Mapping) else None, where)
        try:
            schedule = Schedule(data.get("schedule", DEFAULT_SCHEDULE.value))
        except ValueError:
            raise PlanError(f"{where}: unknown pipeline schedule {data.get('schedule')!r}; expected "
                            f"{' or '.join(s.value for s in Schedule)}") from None
        cuts = data.get("cuts", ())
        if not isinstance(cuts, Sequence) or isinstance(cuts, str):
            raise PlanError(f"{where}: cuts is a list, got {cuts!r}")
        device_cuts = data.get("device_cuts")
        on_boundaries = data.get("on_node_boundaries")
        if on_boundaries is not None and not isinstance(on_boundaries, bool):
            raise PlanError(f"{where}: on_node_boundaries is true, false or null, got {on_boundaries!r}")
        block_profile = data.get("block_profile")
        if block_profile is not None and not isinstance(block_profile, Mapping):
            raise PlanError(f"{where}: block_profile is an object, got {type(block_profile).__name__}")
        try:
            return cls(
                stages=tuple(PipelineStage.from_json(s, f"{where}: stage {i}") for i, s in enumerate(stages)),
                microbatches=_int(data.get("microbatches", 1), f"{where}: microbatches", least=1),
                schedule=schedule,
                repeats=_int(data.get("repeats", 1), f"{where}: repeats", least=1),
                cuts=tuple(PipelineCut.from_json(c, f"{where}: cut {i}") for i, c in enumerate(cuts)),
                kind=kind,
                device_cuts=None if device_cuts is None else _ints(device_cuts, f"{where}: device_cuts"),
                on_node_boundaries=on_boundaries,
                layer_names=tuple(str(n) for n in data.get("layer_names") or ()),
                block_profile=block_profile,
            )
        except PlanError as err:
            text = str(err)
            raise PlanError(text if text.startswith(where) else f"{where}: {text}") from None


# ---------------------------------------------------------------------------------------------
# The measured section: the candidates a measured selection timed on the present devices
# ---------------------------------------------------------------------------------------------


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise PlanError(f"{where}: expected a string, got {value!r}")
    return value


@dataclass(frozen=True)
class MeasuredCandidate:
    """One candidate plan a measured selection considered: its name and family ("spmd",
    "pipeline", "joint"), the cost model's step seconds, and the median and interquartile range
    of its measured round medians (None with `error` when it failed to compile or run)."""

    name: str
    family: str
    predicted_seconds: float | None
    median_seconds: float | None = None
    iqr_seconds: float | None = None
    rounds: int = 0
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "family": self.family, "predicted_seconds": self.predicted_seconds,
                               "median_seconds": self.median_seconds, "iqr_seconds": self.iqr_seconds,
                               "rounds": self.rounds}
        if self.error is not None:
            out["error"] = self.error
        return out

    @classmethod
    def from_json(cls, data: Any, where: str) -> MeasuredCandidate:
        if not isinstance(data, Mapping):
            raise PlanError(f"{where}: a measured candidate is an object with a 'name', got {data!r}")
        error = data.get("error")
        return cls(_text(data.get("name"), f"{where}: name"), _text(data.get("family", ""), f"{where}: family"),
                   _number(data.get("predicted_seconds"), f"{where}: predicted_seconds"),
                   _number(data.get("median_seconds"), f"{where}: median_seconds"),
                   _number(data.get("iqr_seconds"), f"{where}: iqr_seconds"),
                   _int(data.get("rounds", 0), f"{where}: rounds"),
                   None if error is None else _text(error, f"{where}: error"))


@dataclass(frozen=True)
class Measurement:
    """A plan's `measured` section: every candidate timed (in the order they were listed), the
    one chosen (the measured fastest), and the conditions: the devices and platform they ran
    on, the machine's 1/5/15-minute load averages when timing ended, and the wall seconds the
    measuring took (compiles included). Optional: plans without it load unchanged."""

    candidates: tuple[MeasuredCandidate, ...]
    chosen: str
    devices: int
    platform: str
    load_average: tuple[float, float, float] = (0.0, 0.0, 0.0)
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.chosen not in {c.name for c in self.candidates}:
            raise PlanError(f"the measured section chooses {self.chosen!r}, which is none of its candidates "
                            f"({', '.join(c.name for c in self.candidates)})")

    def candidate(self, name: str) -> MeasuredCandidate:
        return next(c for c in self.candidates if c.name == name)

    def to_json(self) -> dict[str, Any]:
        return {"chosen": self.chosen, "devices": self.devices, "platform": self.platform,
                "load_average": list(self.load_average), "seconds": self.seconds,
                "candidates": [c.to_json() for c in self.candidates]}

    @classmethod
    def from_json(cls, data: Any, where: str = "measured") -> Measurement:
        if not isinstance(data, Mapping):
            raise PlanError(f"{where}: expected an object with 'candidates' and 'chosen', got {data!r}")
        candidates = data.get("candidates")
        if not isinstance(candidates, Sequence) or isinstance(candidates, str) or not candidates:
            raise PlanError(f"{where}: expected a non-empty 'candidates' list, got {candidates!r}")
        load = data.get("load_average", (0.0, 0.0, 0.0))
        if not isinstance(load, Sequence) or isinstance(load, str) or len(load) != 3:
            raise PlanError(f"{where}: load_average is [1 min, 5 min, 15 min], got {load!r}")
        try:
            return cls(tuple(MeasuredCandidate.from_json(c, f"{where}: candidate {i}") for i, c in enumerate(candidates)),
                       _text(data.get("chosen"), f"{where}: chosen"), _int(data.get("devices", 0), f"{where}: devices"),
                       _text(data.get("platform", ""), f"{where}: platform"),
                       tuple(_number(x, f"{where}: load_average") or 0.0 for x in load),  # type: ignore[arg-type]
                       _number(data.get("seconds", 0.0), f"{where}: seconds") or 0.0)
        except PlanError as err:
            text = str(err)
            raise PlanError(text if text.startswith(where) else f"{where}: {text}") from None
