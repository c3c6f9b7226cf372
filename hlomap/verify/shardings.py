"""XLA as the oracle of propagation: compile a step with a plan's in_shardings
(`verify.compile.compile_plan` with an XLA dump), read the shardings XLA's own propagation
(shardy) chose, and compare them with the ones the factor graph derives.

    report, numerics = check_plan_shardings(cap, plan, mesh, workdir, example_args=args, reference=outputs)
    report.agreement(ShardingCategory.INTERMEDIATE), report.disagreements, numerics.ok

How the comparison is aligned: XLA's `before_spmd-partitioning` module is the same program after a
few cleanup passes (call inlining, simplification), so instruction names and counts differ from
the captured module. We therefore build a factor graph of XLA's module itself, give it the plan's
entry-parameter specs (parameters keep their numbers), derive every tensor's sharding from the
groups, and compare instruction by instruction with the `sharding=` attributes there. Shardings
are compared semantically: each is reduced to the tile coordinates of every device, per dim.
"""

from __future__ import annotations

import contextlib
import enum
import glob
import logging
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from hlomap.hlo.ir import Module
from hlomap.propagation.conflicts import MeshAxes
from hlomap.propagation.graph import FactorGraph
from hlomap.propagation.plans import dims_spec
from hlomap.verify.compile import compile_plan
from hlomap.verify.numerics import OutputComparison, compare_outputs

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from hlomap.hlo.capture import Capture
    from hlomap.plan import Plan

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# HLO sharding text -> per-device tile coordinates
# ---------------------------------------------------------------------------------------------


class ShardingParseError(ValueError):
    pass


def split_tuple_sharding(text: str) -> list[str]:
    """`{{a}, {b}}` -> ["{a}", "{b}"]; a non-tuple sharding -> [text]."""
    text = text.strip()
    if not text.startswith("{{"):
        return [text]
    inner = text[1:-1]
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(inner):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                parts.append(inner[start: i + 1])
    return parts


_DEVICES_RE = re.compile(r"devices=\[([\d,]+)\](?:<=\[([\d,]+)\](?:T\(([\d,]+)\))?|([\d,]+))")
_LAST_DIMS_RE = re.compile(r"last_tile_dims=\{([^}]*)\}")


def tile_coordinates(text: str, rank: int, num_devices: int) -> np.ndarray | None:
    """`[num_devices, rank]` tile index of every device along every dim, for one array sharding.

    Replicated -> all zeros. Returns None for shardings that are not a tiling (maximal, manual).
    """
    text = text.strip()
    if "replicated" in text and "devices=" not in text:
        return np.zeros((num_devices, rank), dtype=np.int64)
    if "maximal" in text or text.strip("{} ") == "manual":
        return None
    m = _DEVICES_RE.search(text)
    if m is None:
        raise ShardingParseError(f"cannot parse sharding {text!r}")
    tile = [int(x) for x in m.group(1).split(",")]
    if m.group(4) is not None:
        ids = np.asarray([int(x) for x in m.group(4).split(",")], dtype=np.int64)
    else:
        reshape = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(int(np.prod(reshape))).reshape(reshape)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        ids = ids.ravel()
    ids = ids.reshape(tile)
    extra = 0
    if "last_tile_dim_replicate" in text:
        extra = 1
    else:
        lm = _LAST_DIMS_RE.search(text)
        if lm:
            extra = len([x for x in lm.group(1).split(",") if x.strip()])
    data_rank = len(tile) - extra
    if data_rank != rank:
        raise ShardingParseError(f"sharding {text!r} tiles {data_rank} dims but the array has rank {rank}")
    coords = np.zeros((num_devices, rank), dtype=np.int64)
    for index in np.ndindex(*tile):
        d = int(ids[index])
        if d < num_devices:
            coords[d] = index[:rank]
    return coords


def spec_coordinates(spec: Sequence[tuple[str, ...] | None], mesh_names: Sequence[str],
                     mesh_devices: np.ndarray) -> np.ndarray:
    """The tile coordinates a PartitionSpec-like spec gives on a mesh (`mesh_devices`: device
    ids laid out in the mesh's shape, as `jax.sharding.Mesh.device_ids`)."""
    num_devices = mesh_devices.size
    coords = np.zeros((num_devices, len(spec)), dtype=np.int64)
    shape = dict(zip(mesh_names, mesh_devices.shape))
    for pos in np.ndindex(*mesh_devices.shape):
        where = dict(zip(mesh_names, pos))
        d = int(mesh_devices[pos])
        for k, axes in enumerate(spec):
            index = 0
            for a in axes or ():
                index = index * shape[a] + where[a]
            coords[d, k] = index
    return coords


# ---------------------------------------------------------------------------------------------
# ShardingComparison
# ---------------------------------------------------------------------------------------------


class ShardingCategory(enum.Enum):
    PARAMETER = "parameter"
    OUTPUT = "output"
    INTERMEDIATE = "intermediate"
    #: outputs as derived on the *captured* module's graph (not XLA's), against XLA's root
    CAPTURED_OUTPUT = "output (captured module)"
    #: the results of the captured module's `call`s (nested jits), derived on its graph, against
    #: the instructions XLA inlined them into
    CALL_OUTPUT = "call output (captured module)"


class Verdict(enum.Enum):
    MATCH = "match"
    XLA_SHARDS_MORE = "xla shards a dim we replicate"
    WE_SHARD_MORE = "we shard a dim xla replicates"
    DIFFERENT_AXIS = "both shard, on different axes"
    NOT_TILED = "xla sharding is not a tiling (maximal/manual)"


@dataclass(frozen=True)
class ShardingComparison:
    category: ShardingCategory
    instruction: str
    computation: str
    leaf: int
    opcode: str
    shape: tuple[int, ...]
    ours: tuple[tuple[str, ...] | None, ...]
    xla: str
    verdict: Verdict
    free: bool  # constant-derived (free to materialize in any sharding)
    op_name: str | None = None


@dataclass
class OracleReport:
    """All per-tensor comparisons of one compiled plan."""

    comparisons: list[ShardingComparison] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def of(self, category: ShardingCategory, *, include_free: bool = True) -> list[ShardingComparison]:
        return [c for c in self.comparisons if c.category is category and (include_free or not c.free)]

    def agreement(self, category: ShardingCategory, *, include_free: bool = True) -> float:
        items = self.of(category, include_free=include_free)
        return sum(c.verdict is Verdict.MATCH for c in items) / len(items) if items else 1.0

    @property
    def disagreements(self) -> list[ShardingComparison]:
        return [c for c in self.comparisons if c.verdict is not Verdict.MATCH]

    def kinds(self) -> Counter[tuple[str, str, str]]:
        """Disagreements counted by (category, verdict, opcode)."""
        return Counter((c.category.value, c.verdict.value, c.opcode) for c in self.disagreements)

    def summary(self) -> str:
        parts = []
        for cat in ShardingCategory:
            items = self.of(cat)
            if items:
                parts.append(f"{cat.value}: {self.agreement(cat):.1%} of {len(items)}")
        strict = self.of(ShardingCategory.INTERMEDIATE, include_free=False)
        if strict:
            parts.append(f"intermediate (not constant-derived): "
                         f"{self.agreement(ShardingCategory.INTERMEDIATE, include_free=False):.1%} of {len(strict)}")
        return "; ".join(parts)


def _verdict(ours: np.ndarray, xla: np.ndarray | None) -> Verdict:
    if xla is None:
        return Verdict.NOT_TILED
    if np.array_equal(ours, xla):
        return Verdict.MATCH
    ours_split = ours.max(axis=0) > 0 if len(ours) else np.zeros(0, bool)
    xla_split = xla.max(axis=0) > 0 if len(xla) else np.zeros(0, bool)
    if (xla_split & ~ours_split).any() and not (ours_split & ~xla_split).any():
        return Verdict.XLA_SHARDS_MORE
    if (ours_split & ~xla_split).any() and not (xla_split & ~ours_split).any():
        return Verdict.WE_SHARD_MORE
    return Verdict.DIFFERENT_AXIS


def compare_module(xla_module: Module, parameter_specs: Sequence[Sequence[tuple[str, ...] | None]],
                   mesh_names: Sequence[str], mesh_devices: np.ndarray,
                   graph: FactorGraph | None = None) -> OracleReport:
    """Compare XLA's shardings in `xla_module` (the before_spmd-partitioning module) with the ones
    derived from the factor graph of that module when entry parameter i has
    `parameter_specs[i]` (per dim: None or mesh axes)."""
    graph = graph if graph is not None else FactorGraph.build(xla_module)
    report = OracleReport()
    axes = MeshAxes.from_mesh(dict(zip(mesh_names, mesh_devices.shape)),
                              extra=[s for spec in parameter_specs for s in spec if s is not None and len(s) > 1])
    plan = np.full(graph.num_groups, -1, dtype=np.int64)
    for i, spec in enumerate(parameter_specs):
        if i >= len(graph.entry_parameter_tensors):
            break
        groups = graph.group_of_dim[graph.parameter_dims(i)]
        for g, s in zip(groups, spec):
            if s is None:
                continue
            o = axes.index(s)
            if plan[g] >= 0 and plan[g] != o:
                report.notes.append(f"parameter {i} dim spec {s} disagrees with another parameter in group {g} "
                                    f"of XLA's module; kept {axes.options[plan[g]]}")
                continue
            plan[g] = o
    num_devices = mesh_devices.size
    entry = xla_module.entry_name
    root = xla_module.entry.root.name
    cache: dict[tuple[Any, ...], np.ndarray] = {}
    free = _free_tensors(graph)
    for node_id, node in enumerate(graph.nodes):
        inst = node.instruction
        text = inst.sharding
        if inst.opcode in ("constant",) and text is None:
            continue
        if node.computation != entry and text is None:
            continue  # scalar combiners and the like carry no sharding
        leaf_texts = split_tuple_sharding(text) if text is not None else None
        for k, t in enumerate(graph.result_tensors(node_id)):
            rank = int(graph.tensor_rank[t])
            if rank == 0:
                continue
            dims = graph.tensor_dims(t)
            spec = dims_spec(plan[graph.sharding_group_of_dim[dims]], axes)
            key = spec
            ours = cache.get(key)
            if ours is None:
                ours = cache[key] = spec_coordinates(spec, mesh_names, mesh_devices)
            if leaf_texts is None:
                xla_text = "{replicated}"
            elif k < len(leaf_texts):
                xla_text = leaf_texts[k]
            else:
                xla_text = leaf_texts[-1]
            try:
                xla = tile_coordinates(xla_text, rank, num_devices)
            except ShardingParseError as exc:
                report.notes.append(f"{inst.name}: {exc}")
                continue
            if node.computation == entry and inst.opcode == "parameter":
                category = ShardingCategory.PARAMETER
            elif node.computation == entry and inst.name == root:
                category = ShardingCategory.OUTPUT
            else:
                category = ShardingCategory.INTERMEDIATE
            md = inst.metadata
            report.comparisons.append(ShardingComparison(
                category, inst.name, node.computation, k, inst.opcode, tuple(int(x) for x in graph.dim_size[dims]),
                spec, xla_text, _verdict(ours, xla), bool(free[t]), md.op_name if md else None))
    return report


def _free_tensors(graph: FactorGraph) -> np.ndarray:
    return np.asarray(graph.tensor_free, dtype=bool)


def compare_captured_outputs(report: OracleReport, xla_module: Module, graph: FactorGraph, plan_array: np.ndarray,
                             axes: MeshAxes, mesh_names: Sequence[str], mesh_devices: np.ndarray) -> None:
    """Add the captured module's derived output shardings, compared with XLA's root sharding."""
    from hlomap.propagation.plans import tensor_options

    root = xla_module.entry.root
    texts = split_tuple_sharding(root.sharding) if root.sharding else None
    options = tensor_options(graph, plan_array)
    for k, t in enumerate(graph.output_tensors):
        rank = int(graph.tensor_rank[t])
        if rank == 0:
            continue
        dims = graph.tensor_dims(t)
        spec = dims_spec(options[dims], axes)
        text = "{replicated}" if texts is None else texts[min(k, len(texts) - 1)]
        ours = spec_coordinates(spec, mesh_names, mesh_devices)
        xla = tile_coordinates(text, rank, mesh_devices.size)
        report.comparisons.append(ShardingComparison(
            ShardingCategory.CAPTURED_OUTPUT, graph.tensor_name(t), graph.module.entry_name, k, "output",
            tuple(int(x) for x in graph.dim_size[dims]), spec, text, _verdict(ours, xla), bool(graph.tensor_free[t])))


def _joined(prefix: str, op_name: str) -> str:
    return f"{prefix}/{op_name}" if prefix and op_name else prefix or op_name


def _call_prefixes(graph: FactorGraph) -> list[str | None]:
    """Per instance of a computation: the op_name path its instructions' op_names continue (the
    full op_names of the `call`s that reached it: a called computation's metadata is relative to
    its call site, and XLA's inliner joins the two); "" for the entry, None for an instance
    reached through another kind of call (a loop body, a reduction's combiner)."""
    prefixes: list[str | None] = []
    for instance in graph.instances:
        if instance.parent < 0:
            prefixes.append("")
            continue
        parent = prefixes[instance.parent]
        site = graph.nodes[graph.node_of(graph.instances[instance.parent].computation, instance.call_site,
                                         instance.parent)].instruction
        md = site.metadata
        prefixes.append(None if parent is None or site.opcode != "call" or md is None or not md.op_name
                        else _joined(parent, md.op_name))
    return prefixes


def compare_call_outputs(report: OracleReport, xla_module: Module, graph: FactorGraph, plan_array: np.ndarray,
                         axes: MeshAxes, mesh_names: Sequence[str], mesh_devices: np.ndarray) -> None:
    """Add the captured module's derived shardings of the results of every `call` (a nested jit:
    `jnp.where`, `one_hot`, `log_softmax`), each compared with XLA's sharding of the instruction
    it became when XLA inlined the call: those whose op_name is the result's full op_name (the
    call sites' and the callee's root's) and whose shape is the result's (several where XLA kept
    copies, such as a broadcast per use). A result with no such instruction, or several that XLA
    sharded differently, is left out; a note counts them."""
    from hlomap.propagation.plans import tensor_options

    options = tensor_options(graph, plan_array)
    xla_by_name: dict[tuple[str, tuple[int, ...]], list[Any]] = {}
    for _, inst in xla_module.instructions():
        if inst.metadata is not None and inst.metadata.op_name and not inst.shape.is_tuple:
            xla_by_name.setdefault((inst.metadata.op_name, tuple(inst.shape.dims)), []).append(inst)
    prefixes = _call_prefixes(graph)
    unmatched = 0
    for node_id, node in enumerate(graph.nodes):
        call = node.instruction
        prefix = prefixes[node.instance]
        if call.opcode != "call" or prefix is None or call.metadata is None or not call.metadata.op_name:
            continue
        callee = graph.module.computation(call.called_computations[0])
        root = callee.root
        results = ([callee.by_name[o] for o in root.operands] if root.opcode == "tuple" else [root])
        tensors = graph.result_tensors(node_id)
        if len(results) != len(tensors):
            unmatched += len(tensors)
            continue
        for k, (t, result) in enumerate(zip(tensors, results)):
            rank = int(graph.tensor_rank[t])
            if rank == 0:
                continue
            full = _joined(_joined(prefix, call.metadata.op_name), result.metadata.op_name if result.metadata else "")
            found = xla_by_name.get((full, tuple(int(x) for x in graph.dim_size[graph.tensor_dims(t)])), [])
            tiles = [tile_coordinates(inst.sharding, rank, mesh_devices.size) if inst.sharding else None
                     for inst in found]
            if not found or any(x is None for x in tiles) or any(not np.array_equal(x, tiles[0]) for x in tiles[1:]):
                unmatched += 1  # none, or several that XLA sharded differently
                continue
            dims = graph.tensor_dims(t)
            spec = dims_spec(options[dims], axes)
            text = found[0].sharding
            ours = spec_coordinates(spec, mesh_names, mesh_devices)
            xla = tiles[0]
            report.comparisons.append(ShardingComparison(
                ShardingCategory.CALL_OUTPUT, f"{call.name}#{k} ({', '.join(i.name for i in found)})", node.computation,
                k, "call",
                tuple(int(x) for x in graph.dim_size[dims]), spec, text, _verdict(ours, xla), bool(graph.tensor_free[t]),
                full))
    if unmatched:
        report.notes.append(f"{unmatched} call result(s) have no instruction of their op_name and shape in XLA's "
                            "module, or several sharded differently; not compared")


# ---------------------------------------------------------------------------------------------
# Checking a plan
# ---------------------------------------------------------------------------------------------


def propagated_module(dump_dir: str) -> Module:
    """XLA's module just before SPMD partitioning, from a `compile_plan(..., dump_dir=...)`: the
    step after propagation, every instruction carrying the sharding XLA chose for it."""
    from hlomap.hlo.parser import parse

    found = sorted(glob.glob(os.path.join(dump_dir, "*before_spmd-partitioning*")))
    if not found:
        raise FileNotFoundError(f"XLA wrote no *before_spmd-partitioning* dump under {dump_dir}; "
                                f"files: {sorted(os.listdir(dump_dir))[:10]}")
    with open(found[-1]) as f:
        return parse(f.read(), filename=found[-1])


def check_plan_shardings(cap: Capture, plan: Plan, mesh: Mesh | None, workdir: str, *,
                         example_args: Sequence[Any] | None = None, reference: Any = None, float64: bool = False,
                         graph: FactorGraph | None = None) -> tuple[OracleReport, OutputComparison | None]:
    """Compile the captured step with the plan's in_shardings on `mesh` (None: the plan's mesh of
    the host devices) once: compare XLA's propagated shardings with ours (see the module
    docstring) and, when `example_args` and the unsharded step's outputs (`reference`) are given,
    run it and compare the results (`numerics.compare_outputs`). With the captured module's
    `graph`, its derived output shardings are compared with XLA's too.

    With `float64=True` (and float64 `example_args` / `reference`, see
    `numerics.reference_outputs`) the step is compiled and run in double precision: partitioning
    changes the order of floating-point sums, and Adam's first step divides a gradient by its own
    magnitude, which turns the rounding of a near-zero gradient in float32 into errors above 1e-5.
    In float64 that rounding is far below the tolerance, so a mismatch means a partitioning
    error. Shardings do not depend on the element type.
    """
    import jax

    with jax.enable_x64(True) if float64 else contextlib.nullcontext():
        args = example_args if example_args is not None else cap.args
        compiled = compile_plan(cap.step, args, plan, mesh=mesh, dump_dir=workdir)
        module = propagated_module(workdir)
        specs = [p.spec for p in sorted(plan.parameters, key=lambda p: p.index)]
        names, devices = tuple(compiled.mesh.axis_names), np.asarray(compiled.mesh.device_ids)
        report = compare_module(module, specs, names, devices)
        if graph is not None:
            axes = MeshAxes.from_mesh(plan.mesh_shape, extra=[g.axes for g in plan.groups])
            array = plan.group_array(graph, axes)
            compare_captured_outputs(report, module, graph, array, axes, names, devices)
            compare_call_outputs(report, module, graph, array, axes, names, devices)
        numerics = None
        if example_args is not None and reference is not None:
            numerics = compare_outputs(compiled.compiled(*compiled.place(example_args)), reference)
    return report, numerics
